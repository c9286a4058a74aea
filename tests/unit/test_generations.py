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
