"""A failure boundary per untrusted input.

Everything a peer or a local client sends is processed one input at a time:
one frame, one datagram, one DHT value read in a lookup, one gossip message,
one control request. Whatever processing that input raises ends only that
input. The project's typed errors (:class:`~p2pnode.core.errors.P2PError`) are the
expected way for bad input to end; any other exception is a defect in this
code, but it still must not stop the node: it is contained the same way,
counted apart, and logged with its traceback, at most once per source and
exception type every ``traceback_interval`` seconds, so a peer that keeps
sending the same poison cannot flood the log.

Cancellation (``trio.Cancelled``), ``KeyboardInterrupt`` and ``SystemExit``
are ``BaseException`` and pass through: they are not about the input.

Each boundary reports every contained failure to a callback (the node turns
it into a security event naming the source and the exception type; the DHT
counts and logs it) and keeps :class:`BoundaryStatistics`, which the fuzzer
reads to fail on any exception that is not a typed error.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from p2pnode.core.errors import P2PError

#: ``(source, what, exception)``: called once for every contained failure.
FailureReport = Callable[[str, str, Exception], None]

_MAX_TRACKED_SOURCES = 1024


@dataclass(slots=True)
class BoundaryStatistics:
    """What a boundary contained so far."""

    #: Inputs that ended in one of the project's typed errors.
    typed: int = 0
    #: Inputs that raised anything else, by exception type name (each one is a defect).
    unexpected: Counter[str] = field(default_factory=Counter)

    @property
    def unexpected_total(self) -> int:
        return sum(self.unexpected.values())


class FailureBoundary:
    """Contains any exception raised while one untrusted input is processed."""

    def __init__(
        self,
        logger: logging.Logger,
        report: FailureReport | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        traceback_interval: float = 60.0,
    ) -> None:
        self._logger = logger
        self._report = report
        self._also: list[FailureReport] = []
        self._clock = clock
        self._interval = traceback_interval
        self._last_traceback: dict[tuple[str, str], float] = {}
        self.stats = BoundaryStatistics()

    @contextmanager
    def guard(self, source: str, what: str) -> Iterator[None]:
        """Run the body for one input from ``source`` (``what`` names the input kind);
        any ``Exception`` it raises is contained (see :meth:`contain`)."""
        try:
            yield
        except Exception as exc:
            self.contain(source, what, exc)

    def contain(self, source: str, what: str, exc: Exception) -> None:
        """Account for ``exc``, raised while processing one input from ``source``.

        Hot paths call this from their own ``except Exception`` clause rather than
        entering :meth:`guard`, which costs a context manager per input.
        """
        if isinstance(exc, P2PError):
            self.stats.typed += 1
        else:
            name = type(exc).__name__
            self.stats.unexpected[name] += 1
            if self._traceback_due(source, name):
                self._logger.error(
                    "unexpected %s while processing %s from %s (contained; input dropped)",
                    name,
                    what,
                    source,
                    exc_info=exc,
                )
        self._deliver(source, what, exc)

    def also_report(self, report: FailureReport) -> None:
        """Send every later contained failure to ``report`` too (after the first one):
        a component's boundary reaching the owner's events, say."""
        self._also.append(report)

    def _deliver(self, source: str, what: str, exc: Exception) -> None:
        for report in ([self._report] if self._report is not None else []) + self._also:
            try:
                report(source, what, exc)
            except Exception:
                # The report is ours, not the input's: if it fails, say so and go on.
                self._logger.exception("failure report for %s from %s failed", what, source)

    def _traceback_due(self, source: str, name: str) -> bool:
        now = self._clock()
        key = (source, name)
        last = self._last_traceback.get(key)
        if last is not None and now - last < self._interval:
            return False
        if len(self._last_traceback) >= _MAX_TRACKED_SOURCES:
            # Forget the oldest entries: the table stays bounded under any number of sources.
            for old in list(self._last_traceback)[: _MAX_TRACKED_SOURCES // 4]:
                del self._last_traceback[old]
        self._last_traceback.pop(key, None)
        self._last_traceback[key] = now
        return True


def describe(exc: BaseException) -> str:
    """``TypeName: message`` (``CODE: message`` for a P2PError) on one short line, for
    events and refusals: a peer's text must not forge extra log lines."""
    if isinstance(exc, P2PError):
        head, text = str(exc.code), exc.message
    else:
        head, text = type(exc).__name__, str(exc)
    lines = text.splitlines()
    first = lines[0][:200] if lines else ""
    return f"{head}: {first}" if first else head
