"""The local control socket of a running node.

A Unix stream socket (``control.sock`` in the data directory, mode 0600, so
only the node's owner may use it) carrying JSON lines: one request object per
line, one response object per line.

Requests: ``{"op": "status"}``, ``{"op": "find", "capability": C}``,
``{"op": "send", "from": AGENT or null, "to": TARGET, "type": TYPE,
"payload": JSON, "capability": bool, "timeout": seconds}``.
Responses: ``{"ok": true, "result": ...}`` or ``{"ok": false, "error":
{"code", "message", "details"}}``. A line over 1 MiB closes the connection,
and so does waiting ``idle_timeout`` (120 s) for the next request: a client
that connects and says nothing does not hold a connection and its task forever.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from p2pnode.core.boundary import FailureBoundary, describe
from p2pnode.core.envelope import MessageType
from p2pnode.core.errors import ErrorCode, LocalError, P2PError
from p2pnode.core.jsonutil import is_json_value, loads_untrusted
from p2pnode.transport.localsocket import listen_owner_only

logger = logging.getLogger("p2pnode.control")

CONTROL_SOCKET_NAME = "control.sock"
MAX_LINE = 1024 * 1024
#: Seconds a control connection may wait between requests before it is closed.
CONTROL_IDLE_TIMEOUT = 120.0

Op = Callable[[dict[str, Any]], Awaitable[Any]]


async def _read_line(stream: trio.abc.Stream, buffer: bytearray) -> bytes | None:
    while b"\n" not in buffer:
        if len(buffer) > MAX_LINE:
            raise LocalError(ErrorCode.MESSAGE_TOO_LARGE, "control line too long")
        chunk = await stream.receive_some(65536)
        if not chunk:
            return None
        buffer.extend(chunk)
    line, _, rest = bytes(buffer).partition(b"\n")
    buffer[:] = rest
    return line


def _encode(obj: Any) -> bytes:
    return (json.dumps(obj, separators=(",", ":"), default=str) + "\n").encode()


class ControlServer:
    """Serves control requests with the given operations."""

    def __init__(
        self, path: Path, ops: dict[str, Op], *, idle_timeout: float = CONTROL_IDLE_TIMEOUT
    ) -> None:
        self.path = path
        self._ops = ops
        self._idle_timeout = idle_timeout
        #: Counts (and logs with a traceback) requests that failed unexpectedly.
        self.boundary = FailureBoundary(logger)

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen until cancelled; reports readiness once the socket accepts connections."""
        listener = listen_owner_only(self.path)
        try:
            task_status.started()
            await trio.serve_listeners(self._handle, [listener])
        finally:
            self.path.unlink(missing_ok=True)

    async def _handle(self, stream: trio.abc.Stream) -> None:
        buffer = bytearray()
        async with stream:
            try:
                while True:
                    line = None
                    with trio.move_on_after(self._idle_timeout):
                        line = await _read_line(stream, buffer)
                    if line is None:  # end of stream, or idle too long
                        return
                    reply = await self._dispatch_watched(stream, buffer, line)
                    if reply is None:  # the client left: nobody to answer
                        return
                    await stream.send_all(self._encode_reply(reply))
            except (trio.BrokenResourceError, trio.ClosedResourceError, LocalError):
                return

    async def _dispatch_watched(
        self, stream: trio.abc.Stream, buffer: bytearray, line: bytes
    ) -> dict[str, Any] | None:
        """:meth:`_dispatch` ``line``, cancelled when the client closes its end meanwhile
        (Ctrl-C on the command line): a request it was making is then given up, and
        its owner told (node.md "Cancel"). None when cancelled so. What the client
        sends meanwhile is kept in ``buffer`` for the next request."""
        reply: dict[str, Any] | None = None
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                while True:
                    try:
                        data = await stream.receive_some()
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        data = b""
                    if not data:
                        nursery.cancel_scope.cancel()
                        return
                    buffer.extend(data)
                    if len(buffer) > MAX_LINE:
                        return  # read no more: the next _read_line refuses the line

            nursery.start_soon(watch)
            reply = await self._dispatch(line)
            nursery.cancel_scope.cancel()
        return reply

    def _encode_reply(self, reply: dict[str, Any]) -> bytes:
        try:
            return _encode(reply)
        except Exception as exc:  # a result JSON cannot carry (say, a map with int keys)
            self.boundary.contain("control", "control reply", exc)
            failed = LocalError(ErrorCode.INPUT_FAILED, f"unencodable reply: {describe(exc)}")
            return _encode({"ok": False, "error": failed.to_dict()})

    async def _dispatch(self, line: bytes) -> dict[str, Any]:
        """One request's failure boundary: whatever it raises becomes its error reply."""
        try:
            try:
                request = loads_untrusted(line, MAX_LINE)
            except ValueError as exc:
                raise LocalError(ErrorCode.INVALID_ARGUMENT, f"bad request: {exc}") from None
            if not isinstance(request, dict):
                raise LocalError(ErrorCode.INVALID_ARGUMENT, "a request is a JSON object")
            op = self._ops.get(str(request.get("op")))
            if op is None:
                raise LocalError(ErrorCode.INVALID_ARGUMENT, f"unknown op {request.get('op')!r}")
            return {"ok": True, "result": await op(request)}
        except P2PError as exc:
            return {"ok": False, "error": exc.to_dict()}
        except (ValueError, KeyError, TypeError) as exc:
            # An op read a field of the wrong type or a missing one: the caller's mistake.
            error = LocalError(ErrorCode.INVALID_ARGUMENT, f"bad request: {describe(exc)}")
            return {"ok": False, "error": error.to_dict()}
        except Exception as exc:
            self.boundary.contain("control", "control request", exc)
            failed = LocalError(ErrorCode.INPUT_FAILED, f"the request failed: {describe(exc)}")
            return {"ok": False, "error": failed.to_dict()}


async def control_call(path: Path, request: dict[str, Any]) -> Any:
    """Send one request to a node's control socket; return its result.

    Raises LocalError(CONFIG_ERROR) when no node listens there, and a
    P2PError with the node's code when the node answers with an error.
    Callers bound the wait with ``trio.fail_after``.
    """
    try:
        stream = await trio.open_unix_socket(str(path))
        async with stream:
            await stream.send_all(_encode(request))
            line = await _read_line(stream, bytearray())
    except OSError as exc:
        raise LocalError(
            ErrorCode.CONFIG_ERROR, f"no node answers on {path} ({exc}); is `p2pnode run` running?"
        ) from exc
    if line is None:
        raise LocalError(ErrorCode.CHANNEL_CLOSED, "the node closed the control connection")
    try:
        response = loads_untrusted(line, MAX_LINE)
    except ValueError as exc:
        raise LocalError(ErrorCode.INTERNAL, f"unreadable reply from the node: {exc}") from None
    if not isinstance(response, dict):
        raise LocalError(ErrorCode.INTERNAL, "unreadable reply from the node: not an object")
    if not response.get("ok"):
        error = response.get("error", {})
        code = error.get("code", "INTERNAL")
        raise LocalError(
            ErrorCode(code) if code in ErrorCode.__members__ else ErrorCode.INTERNAL,
            str(error.get("message", "")),
            **(error.get("details") or {}),
        )
    return response.get("result")


def parse_message_type(text: str) -> MessageType:
    try:
        return MessageType(text)
    except ValueError:
        raise LocalError(ErrorCode.INVALID_ARGUMENT, f"unknown message type {text!r}") from None


def check_payload(payload: Any) -> Any:
    if not is_json_value(payload):
        raise LocalError(ErrorCode.INVALID_ARGUMENT, "payload must be JSON data")
    return payload
