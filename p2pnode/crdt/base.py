"""The base of the CRDT types: kinds, limits and the checks every type shares.

See :mod:`p2pnode.crdt.types` for the theory of operation.
"""

from __future__ import annotations

import abc
import enum
import math
from typing import Any, ClassVar

from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.crdt.clock import CRDTError
from p2pnode.crdt.dots import Dot, DotContext

#: Deepest nesting of ORMaps a decoded state may have.
MAX_MAP_DEPTH = 8
#: Longest map key / string set element / string register value accepted from peers.
MAX_KEY_LEN = 256
MAX_VALUE_LEN = 64 * 1024

Scalar = None | bool | int | float | str | bytes
Element = int | str | bytes


class Kind(enum.IntEnum):
    """Wire tag and conflict order of each CRDT type."""

    GCOUNTER = 1
    PNCOUNTER = 2
    LWW = 3
    ORSET = 4
    ORMAP = 5


def causal_join(s: set[Dot], s2: set[Dot], c: DotContext, c2: DotContext) -> set[Dot]:
    return (s & s2) | {d for d in s if d not in c2} | {d for d in s2 if d not in c}


def valid_str_untrusted(obj: object, limit: int, what: str) -> str:
    if not isinstance(obj, str) or len(obj) > limit:
        raise CRDTError(f"bad {what}: {obj!r:.80}")
    return obj


class CRDT(abc.ABC):
    """A mutable CRDT value owned by one document. Joins happen in place."""

    __slots__ = ()
    kind: ClassVar[Kind]

    @abc.abstractmethod
    def join(self, other: Any, ctx: DotContext, other_ctx: DotContext) -> None:
        """Join ``other`` (same kind) into self; ``other`` is not modified or aliased."""

    def join_bottom(self, other_ctx: DotContext) -> None:  # noqa: B027 - a no-op by default
        """Join the empty state of a peer whose context is ``other_ctx`` (drops removed dots)."""

    @abc.abstractmethod
    def value(self) -> Any:
        """The plain Python value."""

    @abc.abstractmethod
    def to_wire(self) -> Any:
        """Payload (without the kind tag) as canonical msgpack-ready data."""


def check_scalar(value: object) -> Scalar:
    if value is None or isinstance(value, bool | int | str | bytes):
        big = isinstance(value, int) and not -(2**63) <= value < 2**64
        if big:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "integer out of msgpack range")
        if isinstance(value, str) and len(value) > MAX_VALUE_LEN:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, f"string longer than {MAX_VALUE_LEN}")
        return value
    if isinstance(value, float) and not math.isnan(value):
        return value
    raise LocalError(ErrorCode.INVALID_ARGUMENT, f"register value must be a scalar: {value!r}")


def check_element(e: object) -> Element:
    # The same limits peers enforce, so nothing we produce is rejected downstream.
    if isinstance(e, bool) or not isinstance(e, int | str | bytes):
        raise LocalError(ErrorCode.INVALID_ARGUMENT, f"set elements are int/str/bytes: {e!r}")
    if isinstance(e, int) and not -(2**63) <= e < 2**64:
        raise LocalError(ErrorCode.INVALID_ARGUMENT, "set element out of msgpack range")
    if isinstance(e, str | bytes) and len(e) > MAX_KEY_LEN:
        raise LocalError(ErrorCode.INVALID_ARGUMENT, f"set element longer than {MAX_KEY_LEN}")
    return e
