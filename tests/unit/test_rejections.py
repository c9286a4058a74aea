"""The refused-heartbeat ledger (kvsvc.cluster.rejections, issue 13): episodes per sender, a
new WARNING when the reason changes, the size bound (the sender refused longest ago dropped
first), forgetting a sender that stopped, exact counts under concurrent refusals."""

from __future__ import annotations

import threading

import pytest

from kvsvc.cluster.rejections import HeartbeatRejections, RejectionReason

LOGGER = "kvsvc.cluster.rejections"


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def lines(caplog, level: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelname == level]


def test_an_episode_is_a_sender_and_a_reason_each_warned_once(caplog):
    """A sender whose token is sometimes missing, sometimes wrong: two WARNINGs, not one per
    refusal; the listing shows the reason it was refused for last; acceptance ends both."""
    caplog.set_level("INFO", logger=LOGGER)
    clock = Clock()
    ledger = HeartbeatRejections(clock=clock)
    for _ in range(3):
        ledger.rejected("a:1", RejectionReason.MISSING_TOKEN, claimed=True)
        clock.now += 1
        ledger.rejected("a:1", RejectionReason.TOKEN_MISMATCH, claimed=True)
        clock.now += 1
    clock.now += 5
    ledger.rejected("a:1", RejectionReason.UNKNOWN_INSTANCE)
    assert lines(caplog, "WARNING") == [
        "heartbeats from a sender that claims to be a:1 refused: missing X-Internal-Token: the "
        "sender sends no token but --internal_api_token is set; its load is not recorded",
        "heartbeats from a sender that claims to be a:1 refused: token mismatch: the sender's "
        "X-Internal-Token differs from --internal_api_token; its load is not recorded",
        "heartbeats from a:1 refused: unknown instance: registered under another "
        "--etcd_namespace, or not registered yet?; its load is not recorded"]
    (entry,) = ledger.current().values()
    assert (entry.reason, entry.count, entry.first_at, entry.claimed) == (
        RejectionReason.UNKNOWN_INSTANCE, 1, 61.0, False)
    assert len(ledger) == 3
    ledger.accepted("a:1")
    assert lines(caplog, "INFO") == [
        "heartbeats from a:1 accepted again, after 7 refused over 11.0 s (missing "
        "X-Internal-Token, token mismatch, unknown instance)"]
    assert len(ledger) == 0


def test_bounded_the_sender_refused_longest_ago_goes_first():
    clock = Clock()
    ledger = HeartbeatRejections(clock=clock, max_senders=2)
    for sender in ("a:1", "b:1"):
        ledger.rejected(sender, RejectionReason.TOKEN_MISMATCH)
        clock.now += 1
    ledger.rejected("a:1", RejectionReason.TOKEN_MISMATCH)   # a:1 is now the latest
    ledger.rejected("c:1", RejectionReason.TOKEN_MISMATCH)
    assert sorted(ledger.current()) == ["a:1", "c:1"]
    assert len(ledger) == 2


def test_a_sender_that_stopped_is_forgotten_with_one_info(caplog):
    caplog.set_level("INFO", logger=LOGGER)
    clock = Clock()
    ledger = HeartbeatRejections(clock=clock, forget_after_s=300.0)
    ledger.rejected("a:1", RejectionReason.STALE_INCARNATION, detail="incarnation 'x'")
    clock.now += 299.0
    assert list(ledger.to_json()) == ["a:1"]
    clock.now += 1.0
    assert ledger.to_json() == {}
    assert lines(caplog, "INFO") == [
        "heartbeats from a:1: none refused for 300 s (1 refused, stale incarnation); forgotten"]
    ledger.accepted("a:1")   # nothing to end any more: no second line
    assert len(lines(caplog, "INFO")) == 1


def test_concurrent_refusals_are_counted_exactly_and_warned_once(caplog):
    caplog.set_level("WARNING", logger=LOGGER)
    ledger = HeartbeatRejections()
    barrier = threading.Barrier(4)

    def refuse() -> None:
        barrier.wait()
        for _ in range(500):
            ledger.rejected("a:1", RejectionReason.TOKEN_MISMATCH)

    threads = [threading.Thread(target=refuse) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10.0)
    assert ledger.current()["a:1"].count == 2000
    assert len(lines(caplog, "WARNING")) == 1


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError):
        HeartbeatRejections(max_senders=0)
