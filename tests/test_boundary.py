"""The failure boundary: what one input raises ends that input, and is accounted for."""

from __future__ import annotations

import logging

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from p2pnode.core.boundary import FailureBoundary, describe
from p2pnode.core.errors import ErrorCode, LocalError, RemoteError

log = logging.getLogger("test.boundary")


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_typed_and_unexpected_failures_are_contained_and_reported() -> None:
    reports: list[tuple[str, str, str]] = []
    boundary = FailureBoundary(log, lambda s, w, e: reports.append((s, w, type(e).__name__)))
    with boundary.guard("peer-a", "frame"):
        raise RemoteError(ErrorCode.MALFORMED_MESSAGE, "junk")
    with boundary.guard("peer-b", "frame"):
        raise TypeError("unhashable type: 'list'")
    with boundary.guard("peer-b", "frame"):
        pass
    boundary.contain("peer-c", "datagram", IndexError("list index out of range"))
    assert reports == [
        ("peer-a", "frame", "RemoteError"),
        ("peer-b", "frame", "TypeError"),
        ("peer-c", "datagram", "IndexError"),
    ]
    assert boundary.stats.typed == 1
    assert boundary.stats.unexpected == {"TypeError": 1, "IndexError": 1}
    assert boundary.stats.unexpected_total == 2


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), SystemExit(1)])
def test_base_exceptions_pass_through(exc: BaseException) -> None:
    boundary = FailureBoundary(log)
    with pytest.raises(type(exc)), boundary.guard("peer", "frame"):
        raise exc
    assert boundary.stats.typed == 0 and boundary.stats.unexpected_total == 0


async def test_cancellation_passes_through() -> None:
    boundary = FailureBoundary(log)
    with trio.move_on_after(0.01) as scope, boundary.guard("peer", "frame"):
        await trio.sleep_forever()
    assert scope.cancelled_caught
    assert boundary.stats.unexpected_total == 0


def test_tracebacks_are_logged_once_per_source_and_type_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    boundary = FailureBoundary(log, clock=clock, traceback_interval=60.0)
    with caplog.at_level(logging.ERROR, logger="test.boundary"):
        for _ in range(100):
            boundary.contain("evil", "frame", TypeError("poison"))
        boundary.contain("evil", "frame", KeyError("other type"))
        boundary.contain("other", "frame", TypeError("poison"))
        boundary.contain("evil", "frame", RemoteError(ErrorCode.INVALID_CARD, "typed"))
        assert len(caplog.records) == 3
        assert all(r.exc_info is not None for r in caplog.records)
        clock.now = 61.0
        boundary.contain("evil", "frame", TypeError("poison"))
        assert len(caplog.records) == 4
    assert boundary.stats.unexpected == {"TypeError": 102, "KeyError": 1}


def test_the_traceback_table_stays_bounded() -> None:
    boundary = FailureBoundary(log, clock=FakeClock())
    for i in range(10_000):
        boundary.contain(f"10.0.0.{i}:4000", "datagram", ValueError("x"))
    assert len(boundary._last_traceback) <= 1024
    assert boundary.stats.unexpected["ValueError"] == 10_000


def test_a_failing_report_does_not_escape(caplog: pytest.LogCaptureFixture) -> None:
    def report(source: str, what: str, exc: Exception) -> None:
        raise RuntimeError("observer broke")

    boundary = FailureBoundary(log, report)
    with caplog.at_level(logging.ERROR, logger="test.boundary"):
        boundary.contain("peer", "frame", TypeError("x"))
    assert any("failure report" in r.getMessage() for r in caplog.records)


@given(st.text(max_size=300))
def test_describe_is_one_line(message: str) -> None:
    for exc in (ValueError(message), LocalError(ErrorCode.TIMEOUT, message)):
        text = describe(exc)
        assert "\n" not in text
        assert text.startswith(("ValueError", "TIMEOUT"))


def test_a_second_listener_hears_every_later_failure() -> None:
    first: list[str] = []
    second: list[str] = []
    boundary = FailureBoundary(log, lambda s, w, e: first.append(s))
    boundary.contain("before", "datagram", ValueError("x"))
    boundary.also_report(lambda s, w, e: second.append(f"{s}:{w}:{type(e).__name__}"))
    boundary.contain("after", "card record", RemoteError(ErrorCode.INVALID_CARD, "bad"))
    assert first == ["before", "after"]
    assert second == ["after:card record:RemoteError"]
