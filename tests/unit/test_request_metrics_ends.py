"""The request-metrics ledger's recent prefill ends (kvsvc.routing.request_metrics, what the
TTFT policy's queue replay starts from): a streamed request's first token and a cancel in
prefill are recorded with the clock's time, a non-streamed end is not (its prefill end is
unknown), the list is bounded per instance, and GENERATE tokens counted without the lock are
folded into the D's decode tokens by the snapshot."""

from __future__ import annotations

from kvsvc.routing.observer import RequestInfo
from kvsvc.routing.request_metrics import (
    RECENT_PREFILL_ENDS,
    PendingPrefill,
    PrefillEnd,
    RequestMetricsLedger,
)


class Clock:
    """A settable ``time.monotonic`` stand-in."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def info(attempt: int, sent: float, streamed: bool = True, decode: str = "") -> RequestInfo:
    return RequestInfo(attempt, "p:1", decode, 100, 40.0, "TTFT", dispatched_at=sent,
                       streamed=streamed)


def test_streamed_first_token_and_cancel_are_recorded_non_streamed_end_is_not():
    clock = Clock(10.0)
    ledger = RequestMetricsLedger(clock=clock)
    a, b, c = info(1, 9.0), info(2, 9.5), info(3, 9.6, streamed=False)
    for i in (a, b, c):
        ledger.on_dispatch(i)
    snap = ledger.snapshot()
    assert snap.pending_of("p:1") == (PendingPrefill(9.0, 40.0), PendingPrefill(9.5, 40.0),
                                      PendingPrefill(9.6, 40.0, streamed=False))
    assert snap.recent_of("p:1") == ()
    ledger.on_first_token(a)
    clock.now = 10.5
    ledger.on_cancel(b, "client went away")
    ledger.on_end(c, None)
    ledger.on_end(a, None)              # after its first token: nothing more is recorded
    snap = ledger.snapshot()
    assert snap.pending_of("p:1") == ()
    assert snap.recent_of("p:1") == (PrefillEnd(9.0, 10.0, 40.0, first_token=True),
                                     PrefillEnd(9.5, 10.5, 40.0, first_token=False))
    assert snap.recent_of("q:1") == ()


def test_recent_ends_are_bounded_per_instance_and_oldest_first():
    clock = Clock(0.0)
    ledger = RequestMetricsLedger(clock=clock)
    total = RECENT_PREFILL_ENDS + 10
    for k in range(total):
        clock.now = float(k) + 0.5
        req = info(k + 1, float(k))
        ledger.on_dispatch(req)
        ledger.on_first_token(req)
    ends = ledger.snapshot().recent_of("p:1")
    assert len(ends) == RECENT_PREFILL_ENDS
    assert [e.dispatched_at for e in ends] == [float(k) for k in range(10, total)]


def test_generate_tokens_fold_into_the_decode_count_and_leave_with_the_request():
    ledger = RequestMetricsLedger(clock=Clock(1.0))
    req = info(1, 0.5, decode="d:1")
    ledger.on_dispatch(req)
    ledger.on_first_token(req)
    for _ in range(5):
        ledger.on_token(req)
    assert ledger.snapshot().of("d:1").decode_token_num == 100 + 1 + 5
    ledger.on_end(req, None)
    ledger.on_token(req)                # a late event after the end counts nothing
    assert ledger.snapshot().of("d:1").decode_token_num == 0
