"""Log output of a node: plain text or JSON lines on a stream.

The node's components log on loggers under ``p2pnode`` (events on
``p2pnode.events``, see :mod:`p2pnode.node.observability`);
:func:`configure_logging` sends them to stderr for the daemon.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import IO, Any

from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.node.heaptrace import return_large_blocks, start_from_env


class JsonLinesFormatter(logging.Formatter):
    """One JSON object per line: time (ISO 8601 UTC), level, logger, message, the
    ``event`` dict when the record carries one, and ``exc`` for exceptions."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        event = getattr(record, "event", None)
        if event is not None:
            out["event"] = event
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        # default=str: a foreign record may carry values JSON cannot encode.
        return json.dumps(out, ensure_ascii=False, default=str, separators=(",", ":"))


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_CONFIGURED = "_p2pnode_configured"


def configure_logging(
    level: str = "INFO", json_lines: bool = False, stream: IO[str] | None = None
) -> logging.Handler:
    """Send the ``p2pnode`` loggers to ``stream`` (stderr by default) as text or JSON
    lines, at ``level``. Calling again replaces the handler this function installed.
    Returns the handler. Raises LocalError(CONFIG_ERROR) for an unknown level name.

    A daemon's heap policy starts here too, once per process: large blocks handed back
    to the system when freed, and with ``P2PNODE_HEAP_TRACE`` set, heap growth reports
    (:mod:`p2pnode.node.heaptrace`).
    """
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise LocalError(ErrorCode.CONFIG_ERROR, f"unknown log level {level!r}")
    root = logging.getLogger("p2pnode")
    for old in [h for h in root.handlers if getattr(h, _CONFIGURED, False)]:
        root.removeHandler(old)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonLinesFormatter() if json_lines else logging.Formatter(TEXT_FORMAT))
    setattr(handler, _CONFIGURED, True)
    root.addHandler(handler)
    root.setLevel(numeric)
    if not getattr(root, _CONFIGURED, False):  # once per process, however often called
        setattr(root, _CONFIGURED, True)
        return_large_blocks()
        start_from_env()
    return handler
