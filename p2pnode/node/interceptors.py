"""The interceptors of a node's services: which service takes an envelope instead of
its addressed agent, by message type or by a marker key in a stream message's payload
(``Node.intercept_types``, ``Node.intercept_stream``)."""

from __future__ import annotations

from collections.abc import Iterable

from p2pnode.core.envelope import Envelope, MessageType
from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.node.router import Interceptor


class Interceptors:
    """Interceptors by message type and by stream marker; a type wins over a marker."""

    __slots__ = ("_by_marker", "_by_type")

    def __init__(self) -> None:
        self._by_marker: dict[str, Interceptor] = {}
        self._by_type: dict[MessageType, Interceptor] = {}

    def set_stream(self, marker: str, interceptor: Interceptor | None) -> None:
        """Take (or, with None, give back) stream messages whose payload has ``marker``."""
        if interceptor is None:
            self._by_marker.pop(marker, None)
        elif marker in self._by_marker:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, f"stream marker {marker!r} is taken")
        else:
            self._by_marker[marker] = interceptor

    def set_types(self, types: Iterable[MessageType], interceptor: Interceptor | None) -> None:
        """Take (or, with None, give back) every envelope of ``types``."""
        types = list(types)
        if interceptor is not None:
            taken = [t.value for t in types if t in self._by_type]
            if taken:
                raise LocalError(ErrorCode.INVALID_ARGUMENT, f"message types taken: {taken}")
        for type_ in types:
            if interceptor is None:
                self._by_type.pop(type_, None)
            else:
                self._by_type[type_] = interceptor

    def of(self, envelope: Envelope) -> Interceptor | None:
        """The interceptor that takes ``envelope``; None: its agent gets it."""
        if self._by_type:
            by_type = self._by_type.get(envelope.type)
            if by_type is not None:
                return by_type
        if envelope.type is not MessageType.STREAM_DATA or not isinstance(envelope.payload, dict):
            return None
        for marker, interceptor in self._by_marker.items():
            if marker in envelope.payload:
                return interceptor
        return None


__all__ = ["Interceptors"]
