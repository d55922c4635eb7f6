"""A swarm's plan: its sub-tasks, their chunks in the swarm document, and the
aggregations of their results (docs/protocol/tasks.md §4.1).

Pure data and checks; :mod:`p2pnode.services.swarms.document` has the rest of the document.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from p2pnode.agent.task import Task, TaskError, valid_id
from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.core.jsonutil import dumps

#: Prefix of a swarm's document name (``swarm.<id>``).
DOC_PREFIX = "swarm."
#: Largest JSON text written in one register (the CRDT limit is 64 KiB).
CHUNK_CHARS = 48 * 1024
MAX_SUBTASKS = 10_000


def _sum(results: list[Any]) -> Any:
    if not all(isinstance(r, int | float) and not isinstance(r, bool) for r in results):
        raise LocalError(ErrorCode.INVALID_ARGUMENT, "sum: every result must be a number")
    return sum(results)


def _concat(results: list[Any]) -> Any:
    if all(isinstance(r, str) for r in results):
        return "".join(results)
    if all(isinstance(r, list) for r in results):
        return [item for r in results for item in r]
    raise LocalError(ErrorCode.INVALID_ARGUMENT, "concat: results must all be strings or lists")


#: Built-in aggregations of the results (in plan order) into the outcome (R8.6).
AGGREGATIONS: Mapping[str, Callable[[list[Any]], Any]] = {
    "list": list,
    "sum": _sum,
    "concat": _concat,
    "count": len,
}


def aggregate(name: str, ids: Sequence[str], results: list[Any]) -> Any:
    """The outcome of ``results`` (in plan order) by the aggregation ``name``; ``map``
    gives ``{sub-task id: result}``. Raises LocalError(INVALID_ARGUMENT)."""
    if name == "map":
        return dict(zip(ids, results, strict=True))
    function = AGGREGATIONS.get(name)
    if function is None:
        raise LocalError(ErrorCode.INVALID_ARGUMENT, f"unknown aggregation {name!r}")
    return function(results)


def doc_name(swarm: str) -> str:
    """The shared document of swarm ``swarm``."""
    return DOC_PREFIX + swarm


@dataclass(frozen=True, slots=True)
class SubTask:
    """One part of a swarm's task: an id unique in the plan, and the task itself."""

    id: str
    task: Task

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, **self.task.to_dict()}

    @classmethod
    def from_dict(cls, data: object, error: type[Exception] = TaskError) -> SubTask:
        if not isinstance(data, dict) or not valid_id(data.get("id")):
            raise _error(error, "sub-task: needs an id")
        body = {k: v for k, v in data.items() if k != "id"}
        body.setdefault("capabilities", [])
        body.setdefault("complexity", 1.0)
        try:
            return cls(data["id"], Task.from_dict_untrusted(body))
        except TaskError as exc:
            raise _error(error, f"sub-task {data['id']}: {exc.message}") from None


def _error(kind: type[Exception], message: str) -> Exception:
    if kind is LocalError:
        return LocalError(ErrorCode.INVALID_ARGUMENT, message)
    return TaskError(ErrorCode.MALFORMED_MESSAGE, message)


@dataclass(frozen=True, slots=True)
class Plan:
    """A swarm's task split into sub-tasks (see the module docstring).

    ``aggregate`` names a built-in aggregation (``list``, ``sum``, ``concat``,
    ``count``, ``map``); ``lease`` is the seconds a participant or coordinator
    holds its lease without renewing it. Raises LocalError(INVALID_ARGUMENT).
    """

    swarm: str
    description: str
    subtasks: tuple[SubTask, ...]
    aggregate: str = "list"
    lease: float = 10.0
    opener: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "subtasks", tuple(self.subtasks))
        problems = []
        if not valid_id(self.swarm) or len(DOC_PREFIX + self.swarm) > 123:
            problems.append("swarm: an id of at most 117 characters")
        if not 0 < len(self.subtasks) <= MAX_SUBTASKS:
            problems.append(f"subtasks: 1 to {MAX_SUBTASKS}")
        if len({s.id for s in self.subtasks}) != len(self.subtasks):
            problems.append("subtasks: ids must be distinct")
        if self.aggregate != "map" and self.aggregate not in AGGREGATIONS:
            problems.append(f"aggregate: one of {sorted([*AGGREGATIONS, 'map'])}")
        if not (isinstance(self.lease, int | float) and 0.05 <= self.lease <= 3600):
            problems.append("lease: 0.05 to 3600 seconds")
        if len(self.description) > 4096:
            problems.append("description: at most 4096 characters")
        if problems:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "; ".join(problems), problems=problems)

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(s.id for s in self.subtasks)

    @property
    def capabilities(self) -> frozenset[str]:
        """Every capability some sub-task needs."""
        return frozenset(c for s in self.subtasks for c in s.task.capabilities)

    @classmethod
    def from_json(cls, data: object, *, swarm: str, opener: str = "") -> Plan:
        """A plan from its JSON form (a ``swarm run`` file): ``{"description",
        "aggregate", "lease", "subtasks": [{"id", "description", "capabilities",
        "complexity", "input"}, ...]}``. Raises LocalError(INVALID_ARGUMENT)."""
        if not isinstance(data, dict) or not isinstance(data.get("subtasks"), list):
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "a plan is an object with subtasks")
        unknown = set(data) - {"description", "aggregate", "lease", "subtasks"}
        if unknown:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, f"plan: unknown fields {sorted(unknown)}")
        return cls(
            swarm,
            str(data.get("description", "")),
            tuple(SubTask.from_dict(s, LocalError) for s in data["subtasks"]),
            str(data.get("aggregate", "list")),
            float(data.get("lease", 10.0)),
            opener,
        )

    def chunks(self) -> list[tuple[str, str]]:
        """The plan as ``(key, JSON text)`` registers under ``plan``: ``meta`` and the
        sub-task chunks ``c0``, ``c1``, ..."""
        parts: list[list[dict[str, Any]]] = [[]]
        size = 0
        for sub in self.subtasks:
            entry = sub.to_dict()
            length = len(dumps(entry)) + 1
            if length > CHUNK_CHARS:
                raise LocalError(ErrorCode.INVALID_ARGUMENT, f"sub-task {sub.id} is too large")
            if size + length > CHUNK_CHARS:
                parts.append([])
                size = 0
            parts[-1].append(entry)
            size += length
        meta = {
            "swarm": self.swarm,
            "description": self.description,
            "aggregate": self.aggregate,
            "lease": self.lease,
            "opener": self.opener,
            "count": len(self.subtasks),
            "chunks": len(parts),
        }
        return [("meta", dumps(meta))] + [(f"c{i}", dumps(p)) for i, p in enumerate(parts)]

    @classmethod
    def from_doc_untrusted(cls, plan: object) -> Plan | None:
        """The plan held in a document's ``plan`` map; None while incomplete (its
        registers still on their way). Raises TaskError when it is malformed."""
        if not isinstance(plan, dict) or "meta" not in plan:
            return None
        meta = loads_register(plan["meta"])
        if not isinstance(meta, dict) or not isinstance(meta.get("chunks"), int):
            raise TaskError(ErrorCode.MALFORMED_MESSAGE, "plan meta is malformed")
        keys = [f"c{i}" for i in range(meta["chunks"])]
        if not all(k in plan for k in keys):
            return None
        subtasks: list[SubTask] = []
        for key in keys:
            part = loads_register(plan[key])
            if not isinstance(part, list):
                raise TaskError(ErrorCode.MALFORMED_MESSAGE, "plan chunk is malformed")
            subtasks.extend(SubTask.from_dict(s) for s in part)
        try:
            return cls(
                str(meta.get("swarm")),
                str(meta.get("description", "")),
                tuple(subtasks),
                str(meta.get("aggregate", "list")),
                float(meta.get("lease", 10.0)),
                str(meta.get("opener", "")),
            )
        except (LocalError, TypeError, ValueError) as exc:
            raise TaskError(ErrorCode.MALFORMED_MESSAGE, f"plan: {exc}") from None


def loads_register(text: object) -> Any:
    if not isinstance(text, str):
        raise TaskError(ErrorCode.MALFORMED_MESSAGE, "a swarm register holds JSON text")
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        raise TaskError(ErrorCode.MALFORMED_MESSAGE, "a swarm register holds bad JSON") from None


__all__ = [
    "AGGREGATIONS",
    "CHUNK_CHARS",
    "DOC_PREFIX",
    "MAX_SUBTASKS",
    "Plan",
    "SubTask",
    "aggregate",
    "doc_name",
    "loads_register",
]
