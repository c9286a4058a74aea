"""The registry of requests waiting for Generations (§13): one answer per entry in order, unknown
ids and gone clients refused, failures raised to the reader, a bounded queue."""

from __future__ import annotations

import threading

import pytest

from kvsvc.errors import UpstreamError, UpstreamUnreachable
from kvsvc.routing.answers import GenOutput, Generation
from kvsvc.routing.generations import PendingRequests


def _gen(sid: str, text: str = "t", finished: bool = False) -> Generation:
    return Generation(sid, outputs=(GenOutput(0, text),), finished=finished)


def test_one_answer_per_entry_in_order_unknown_refused() -> None:
    reg = PendingRequests()
    a = reg.open("a", "p:1")
    reg.open("b", "p:1")
    answers = reg.deliver([_gen("a", "1"), _gen("zz"), _gen("b"), _gen("a", "2")])
    assert answers == [True, False, True, True]
    assert [g.outputs[0].text for g in (a.next(0), a.next(0))] == ["1", "2"]
    assert a.next(0) is None
    st = reg.stats()
    assert (st.open, st.delivered, st.refused_unknown) == (2, 3, 1)


def test_client_gone_makes_the_next_entry_false() -> None:
    reg = PendingRequests()
    req = reg.open("a", "p:1")
    assert reg.deliver([_gen("a")]) == [True]
    req.cancel()
    assert req.cancelled == "client went away"
    assert reg.deliver([_gen("a"), _gen("a")]) == [False, False]
    assert reg.stats().refused_cancelled == 2


def test_closed_request_is_unknown_afterwards() -> None:
    reg = PendingRequests()
    req = reg.open("a", "p:1")
    req.close()
    req.close()
    assert reg.get("a") is None
    assert reg.deliver([_gen("a")]) == [False]
    reg.open("a", "p:1")  # the id may be reused once closed


def test_duplicate_open_refused() -> None:
    reg = PendingRequests()
    reg.open("a", "p:1")
    with pytest.raises(ValueError):
        reg.open("a", "p:2")


def test_fail_raises_after_the_queued_entries() -> None:
    reg = PendingRequests()
    req = reg.open("a", "p:1", "d:1")
    reg.deliver([_gen("a", "1")])
    req.fail(UpstreamUnreachable("instance p:1 is SUSPECT"))
    req.fail(UpstreamUnreachable("second failure ignored"))
    assert req.next(0) is not None
    with pytest.raises(UpstreamUnreachable, match="SUSPECT"):
        req.next(1.0)
    assert reg.deliver([_gen("a")]) == [False]
    assert reg.on_instance("d:1") == [req] and reg.on_instance("x:1") == []


def test_bounded_queue_fails_the_request_and_refuses() -> None:
    reg = PendingRequests(max_queued=2)
    req = reg.open("a", "p:1")
    assert reg.deliver([_gen("a"), _gen("a"), _gen("a"), _gen("a")]) == [True, True, False,
                                                                          False]
    assert reg.stats().overflowed == 1
    req.next(0)
    req.next(0)
    with pytest.raises(UpstreamError, match="unread"):
        req.next(0)


def test_reader_wakes_on_delivery_from_another_thread() -> None:
    reg = PendingRequests()
    req = reg.open("a", "p:1")
    got: list[Generation] = []
    reader = threading.Thread(target=lambda: got.append(req.next(5.0)))  # type: ignore[arg-type]
    reader.start()
    assert reg.deliver([_gen("a", "x", finished=True)]) == [True]
    reader.join(5.0)
    assert not reader.is_alive()
    assert got[0].finished and got[0].outputs[0].text == "x"


def test_next_times_out_with_none() -> None:
    req = PendingRequests().open("a", "p:1")
    assert req.next(0.01) is None
    assert req.drain() == []


def _waiting_reader(req, got: list) -> threading.Thread:
    """A reader thread taking its entries once, holding the turn until released."""
    def run() -> None:
        entries = req.take(5.0)
        got.append((req.service_req_id, [g.outputs[0].text for g in entries], req._has_turn))
        req.release_turn()
    t = threading.Thread(target=run)
    t.start()
    return t


def _wait_until(cond, timeout_s: float = 5.0) -> None:
    """Spin until ``cond()`` (the unit tier refuses ``time.sleep``; the interpreter hands the
    lock to the other threads every switch interval meanwhile)."""
    import time
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"


def test_deferred_delivery_wakes_no_reader_until_asked_then_one_at_a_time() -> None:
    reg = PendingRequests()
    a, b = reg.open("a", "p:1"), reg.open("b", "p:1")
    got: list = []
    readers = [_waiting_reader(a, got), _waiting_reader(b, got)]
    _wait_until(lambda: a._waiting and b._waiting)
    answers, wake = reg.deliver_deferred([_gen("a", "1"), _gen("b", "2"), _gen("a", "3")])
    assert answers == [True, True, True]
    assert got == [] and a._waiting and b._waiting   # queued, nobody woken yet
    wake()
    for t in readers:
        t.join(5.0)
    # Both woken in turn, each with the turn, each with every entry queued for it.
    assert sorted(got) == [("a", ["1", "3"], True), ("b", ["2"], True)]
    assert reg._turn_taken is False and not reg._ready


def test_an_awake_reader_takes_its_entries_and_is_skipped_by_the_turn() -> None:
    reg = PendingRequests()
    a, b = reg.open("a", "p:1"), reg.open("b", "p:1")
    got: list = []
    reader = _waiting_reader(b, got)
    _wait_until(lambda: b._waiting)
    answers, wake = reg.deliver_deferred([_gen("a", "x"), _gen("b", "y")])
    assert answers == [True, True]
    assert [g.outputs[0].text for g in a.take(0)] == ["x"]   # a's reader was not waiting
    wake()
    reader.join(5.0)
    assert got == [("b", ["y"], True)]
    assert reg._turn_taken is False


def test_a_turn_holder_that_closes_passes_the_turn_on() -> None:
    reg = PendingRequests()
    a, b = reg.open("a", "p:1"), reg.open("b", "p:1")
    got: list = []
    holder: list = []

    def first() -> None:
        holder.append(a.take(5.0))
        a.close()   # ends without release_turn: close passes it

    t1 = threading.Thread(target=first)
    t1.start()
    t2 = _waiting_reader(b, got)
    _wait_until(lambda: a._waiting and b._waiting)
    reg.deliver([_gen("a"), _gen("b", "z")])
    t1.join(5.0)
    t2.join(5.0)
    assert got == [("b", ["z"], True)] and len(holder[0]) == 1
    assert reg._turn_taken is False


def test_a_failed_request_wakes_its_reader_without_the_turn() -> None:
    reg = PendingRequests()
    req = reg.open("a", "p:1")
    errors: list = []

    def run() -> None:
        try:
            req.take(5.0)
        except UpstreamError as exc:
            errors.append((exc, req._has_turn))

    t = threading.Thread(target=run)
    t.start()
    _wait_until(lambda: req._waiting)
    req.fail(UpstreamUnreachable("gone"))
    t.join(5.0)
    assert len(errors) == 1 and errors[0][1] is False
