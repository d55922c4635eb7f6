"""MCP's stdio transport for ``p2pnode mcp serve``, without a thread per line.

The SDK's ``stdio_server`` reads stdin and writes stdout through
``anyio.wrap_file``: a worker thread for every line read and two (write,
flush) for every line written, which is a good part of a stdio round trip.
When both are pipes or sockets (what an MCP client gives the server it
launches), :func:`pipe_stdio` reads and writes them as trio streams
(``trio.lowlevel.FdStream``: the event loop polls them) instead; on anything
else (a terminal, a file) it is the SDK's ``stdio_server``.

As the SDK's transport does, it serves duplicates of fds 0 and 1 and points
fd 0 at the null device and fd 1 at stderr, so that stray output of the
process (a ``print``, a child process) cannot corrupt the protocol.
Messages are JSON-RPC, one per line, UTF-8 (MCP's stdio transport). A line
that is no JSON-RPC message is answered here, as JSON-RPC 2.0 §5.1 asks
(:func:`malformed_reply`): ``-32700`` (parse error, ``id`` null) when it is
not JSON, ``-32600`` (invalid request, with the line's ``id`` when it has a
string or integer one, else null) when it is JSON but no message (a
``jsonrpc`` other than ``"2.0"``, no ``method``, a batch array). Reading goes
on with the next line. (The SDK's own transport, used when stdin or stdout is
not a pipe, hands such a line to the server as an exception.)
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import mcp_types as types
import sniffio
import trio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from mcp.server.stdio import stdio_server
from mcp.shared.message import SessionMessage

#: A line longer than this (bytes) ends the session: no MCP message is near it.
MAX_LINE = 64 * 1024 * 1024
#: Longest id (characters) echoed in the error answering a malformed line; past it, null.
MAX_ECHOED_ID = 1024

Streams = tuple[
    MemoryObjectReceiveStream[SessionMessage | Exception], MemoryObjectSendStream[SessionMessage]
]


def message_untrusted(line: bytes) -> types.JSONRPCMessage | None:
    """The JSON-RPC message of one line; None when it is none (answered with
    :func:`malformed_reply`). A notification whose line carries an ``id`` is none
    either: the SDK's model ignores the key, JSON-RPC makes it an invalid request."""
    try:
        message = types.jsonrpc_message_adapter.validate_json(line, by_name=False)
    except ValueError:
        return None
    if isinstance(message, types.JSONRPCNotification):
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):
            return None
        if not isinstance(obj, dict) or "id" in obj:
            return None
    return message


def malformed_reply(line: bytes) -> types.JSONRPCError:
    """The error answering ``line``, which is no JSON-RPC message (module docstring).
    Never raises."""
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError):  # not UTF-8, not JSON, nested past the stack
        error = types.ErrorData(code=types.PARSE_ERROR, message="Parse error: not JSON")
        return types.JSONRPCError(jsonrpc="2.0", id=None, error=error)
    request_id = obj.get("id") if isinstance(obj, dict) else None
    if type(request_id) not in (str, int) or len(str(request_id)) > MAX_ECHOED_ID:
        request_id = None
    error = types.ErrorData(
        code=types.INVALID_REQUEST, message="Invalid Request: not a JSON-RPC 2.0 message"
    )
    return types.JSONRPCError(jsonrpc="2.0", id=request_id, error=error)


def _is_pipe(fd: int) -> bool:
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


@asynccontextmanager
async def pipe_stdio() -> AsyncIterator[Streams]:
    """The server's read and write streams on this process's stdin and stdout (see the
    module docstring). Needs trio when they are pipes."""
    if not (_is_pipe(0) and _is_pipe(1)) or sniffio.current_async_library() != "trio":
        async with stdio_server() as (read_stream, write_stream):
            yield read_stream, write_stream
        return
    wire_in = fcntl.fcntl(0, fcntl.F_DUPFD_CLOEXEC, 3)
    wire_out = fcntl.fcntl(1, fcntl.F_DUPFD_CLOEXEC, 3)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    stdin = trio.lowlevel.FdStream(wire_in)
    stdout = trio.lowlevel.FdStream(wire_out)
    read_send, read_receive = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    write_send, write_receive = anyio.create_memory_object_stream[SessionMessage](0)

    async def read_lines() -> None:
        async with read_send:
            pending = b""
            async for chunk in stdin:
                pending += chunk
                if b"\n" not in chunk:
                    if len(pending) > MAX_LINE:
                        return
                    continue
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if not line.strip():
                        continue
                    message = message_untrusted(line)
                    if message is None:
                        with contextlib.suppress(anyio.ClosedResourceError):
                            await write_send.send(SessionMessage(malformed_reply(line)))
                        continue
                    await read_send.send(SessionMessage(message))

    async def write_lines() -> None:
        async with write_receive:
            async for item in write_receive:
                line = item.message.model_dump_json(by_alias=True, exclude_unset=True)
                await stdout.send_all(line.encode() + b"\n")

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_lines)
            nursery.start_soon(write_lines)
            try:
                yield read_receive, write_send
            finally:
                nursery.cancel_scope.cancel()
    finally:
        # Closing restores the pipes' blocking mode; fds 0 and 1 stay diverted (the
        # wire was this transport's alone, and the process is done with it).
        with trio.CancelScope(shield=True):
            await stdin.aclose()
            await stdout.aclose()


__all__ = ["MAX_ECHOED_ID", "MAX_LINE", "malformed_reply", "message_untrusted", "pipe_stdio"]
