"""JSON Schemas for tools: checking values against them, and deriving them from type hints.

Two well-kept libraries do the work; we write neither a validator nor a schema
generator:

* ``jsonschema`` checks a value against a schema someone wrote (every draft,
  with the path of the failing part), for capabilities and for tools declared
  with an explicit schema.
* ``pydantic`` derives a tool's schemas from its function's type hints, as the
  MCP SDK's FastMCP does, and converts arguments and results with them (a tool
  taking a model gets the model; a tool returning one has it turned into plain
  data). Arguments are first checked against the derived schema with
  ``jsonschema``, with no coercion: pydantic's lax mode would take ``"4"`` for an
  integer, which the advertised schema refuses.

A checker returns the first problem of a value as text naming its path
(``arguments.limit: 'x' is not of type 'integer'``), or None when it is valid.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.core.jsonutil import is_json_value

#: A checker: ``check(value)`` is None when valid, else the first problem.
Checker = Callable[[Any], str | None]


def schema_checker(schema: Any, where: str = "payload") -> Checker | None:
    """A checker of ``schema`` (None when the schema constrains nothing).

    Raises LocalError(INVALID_ARGUMENT) when ``schema`` is not a valid JSON Schema.
    """
    if schema is None or schema is True or (isinstance(schema, dict) and not schema):
        return None
    import jsonschema  # loaded only by agents that declare schemas
    import referencing.exceptions  # jsonschema's own dependency

    if not isinstance(schema, dict | bool):
        raise LocalError(
            ErrorCode.INVALID_ARGUMENT,
            f"invalid schema: a {type(schema).__name__}, not an object or a boolean",
        )
    declared = schema.get("$schema") if isinstance(schema, dict) else None
    if declared is not None and not isinstance(declared, str):
        raise LocalError(ErrorCode.INVALID_ARGUMENT, "invalid schema: $schema is not a URI")
    latest = jsonschema.Draft202012Validator
    cls = jsonschema.validators.validator_for(schema, default=latest)
    draft = str(cls.META_SCHEMA.get("$id", cls.META_SCHEMA.get("id")))
    if declared is not None and draft.rstrip("#") != declared.rstrip("#"):
        # An unknown draft is refused, not validated as the latest one with a warning.
        raise LocalError(
            ErrorCode.INVALID_ARGUMENT, f"invalid schema: unknown $schema {declared[:100]!r}"
        )
    try:
        cls.check_schema(schema)  # type: ignore[arg-type]  # the stubs forget boolean schemas
    except jsonschema.SchemaError as exc:
        raise LocalError(ErrorCode.INVALID_ARGUMENT, f"invalid schema: {exc.message}") from None
    validator = cls(schema)

    def first_problem(instance: Any) -> str | None:
        try:
            error = jsonschema.exceptions.best_match(validator.iter_errors(instance))
        except RecursionError:
            # A $ref cycle that checks nothing between its steps: the value cannot be
            # checked, so it is refused (the schema's defect, told to whoever sent it).
            return f"{where}: cannot be checked: the schema's $refs loop"
        except referencing.exceptions.Unresolvable as exc:
            return f"{where}: cannot be checked: the schema has an unresolvable $ref ({exc})"
        if error is None:
            return None
        return f"{where}{_path(error.absolute_path)}: {error.message}"

    return first_problem


def _path(parts: typing.Iterable[Any]) -> str:
    return "".join(f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in parts)


@dataclass(frozen=True, slots=True)
class Conversion:
    """How values pass one side of a tool: the schema advertised, and ``convert(value)``
    returning ``(converted value, None)`` or ``(None, first problem)``."""

    schema: Any
    convert: Callable[[Any], tuple[Any, str | None]]
    #: A JSON type (str, int or bool) whose values, of exactly that type, pass unchanged
    #: and need no conversion, or None. Tested before ``convert`` by whoever calls it.
    plain: type | None = None


def _plain(value: Any) -> tuple[Any, str | None]:
    return value, None


def explicit(schema: Any, where: str) -> Conversion:
    """Values checked against a schema someone wrote, passed on unchanged."""
    check = schema_checker(schema, where)
    if check is None:
        return Conversion(schema, _plain)

    def convert(value: Any) -> tuple[Any, str | None]:
        problem = check(value)
        return (None, problem) if problem else (value, None)

    return Conversion(schema, convert)


def derived_arguments(
    function: Callable[..., Any], *, skip: Callable[[Any], bool]
) -> tuple[Conversion, list[str]]:
    """The arguments of ``function`` as one JSON object: its schema from the type hints,
    and a conversion that validates the object and returns the keyword arguments.
    Parameters whose annotation ``skip`` accepts are left out (the node supplies them);
    they are returned by name.

    Raises LocalError(INVALID_ARGUMENT) for ``*args`` or ``**kwargs``.
    """
    import pydantic
    import typing_extensions  # pydantic's own dependency; its TypedDict suits pydantic on 3.11

    hints = typing.get_type_hints(function, include_extras=True)
    fields: dict[str, Any] = {}
    defaults: dict[str, Any] = {}
    skipped: list[str] = []
    for name, parameter in inspect.signature(function).parameters.items():
        annotation = hints.get(name, Any)
        if skip(annotation):
            skipped.append(name)
            continue
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise LocalError(
                ErrorCode.INVALID_ARGUMENT,
                f"{function.__qualname__}: a tool's parameters are named (no *args, **kwargs)",
            )
        if parameter.default is parameter.empty:
            fields[name] = annotation
        else:
            fields[name] = typing_extensions.NotRequired[annotation]
            defaults[name] = parameter.default
    # A TypedDict, not a model: parameter names such as "json" or "schema" would
    # shadow a model's own attributes.
    typed: Any = typing_extensions.TypedDict(f"{function.__name__}_arguments", fields)  # type: ignore[misc]
    adapter = pydantic.TypeAdapter(pydantic.with_config(pydantic.ConfigDict(extra="forbid"))(typed))
    schema = adapter.json_schema()
    for name, default in defaults.items():
        if is_json_value(default):
            schema["properties"][name]["default"] = default

    # pydantic-core's validator itself: the adapter's method only passes its defaults on,
    # through a frame with eight keywords, on every call.
    validate = adapter.validator.validate_python
    # What pydantic admits is held to the advertised schema too, as a peer reading it
    # expects: pydantic alone coerces ("4" for an integer, 1 for a boolean).
    check = schema_checker(schema, "arguments")

    def convert(value: Any) -> tuple[Any, str | None]:
        arguments = {} if value is None else value
        try:
            converted = validate(arguments)
        except pydantic.ValidationError as exc:
            return None, _first_pydantic_problem(exc, "arguments")
        problem = check(arguments) if check is not None else None
        return (None, problem) if problem is not None else (converted, None)

    return Conversion(schema, convert), skipped


def derived_result(function: Callable[..., Any]) -> Conversion | None:
    """The result of ``function`` from its return annotation (None when it has none, or
    it is ``None`` or ``Any``): validated, then turned into plain JSON data."""
    import pydantic
    import pydantic_core

    annotation = typing.get_type_hints(function, include_extras=True).get("return")
    if annotation is None or annotation is type(None) or annotation is Any:
        return None
    adapter = pydantic.TypeAdapter(annotation)
    schema = adapter.json_schema(mode="serialization")
    # A result of exactly a plain JSON type it is declared as needs neither validation
    # nor conversion (bool is not taken for int here: type() is exact).
    plain = annotation if annotation in (int, str, float, bool) else None

    def convert(value: Any) -> tuple[Any, str | None]:
        if plain is not None and type(value) is plain:
            return value, None
        try:
            return adapter.dump_python(adapter.validate_python(value), mode="json"), None
        except pydantic.ValidationError as exc:
            return None, _first_pydantic_problem(exc, "result")
        except pydantic_core.PydanticSerializationError as exc:
            return None, f"result: {exc}"

    # Not a float: NaN and the infinities are floats that are not JSON data.
    return Conversion(schema, convert, plain if plain is not float else None)


def _first_pydantic_problem(exc: Any, where: str) -> str:
    error = exc.errors(include_url=False)[0]
    return f"{where}{_path(error['loc'])}: {error['msg']}"


__all__ = [
    "Checker",
    "Conversion",
    "derived_arguments",
    "derived_result",
    "explicit",
    "schema_checker",
]
