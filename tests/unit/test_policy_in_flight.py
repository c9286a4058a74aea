"""CAR with the router's own load (kvsvc.routing.in_flight.InFlight, D22 in docs/decisions.md):
waiting = reported waiting + requests in flight dispatched after the load report (the first of
them admitted, not queued, after a report of an empty queue). Exact counts and exact picks; the
clock is a test counter so "after the report" is exact."""

from __future__ import annotations

import dataclasses
import itertools
import threading

import pytest

from kvsvc.routing.in_flight import NO_IN_FLIGHT, InFlight, InFlightSnapshot, waiting_estimate
from kvsvc.routing.policy import CacheAware, RoundRobin
from kvsvc.cluster.model import InstanceType, LoadMetrics
from tests.support.policy import TOKENS, inst, match, names, scores, snap

#: The requests' time: loads reported at test_policy.REPORTED_AT (1.0) and at 10.0 are both current (max 10 s).
NOW = 10.0


def ticking(start: float = 2.0):
    """A clock returning start, start + 1, ... (every dispatch after test_policy.REPORTED_AT)."""
    return itertools.count(start).__next__


# -- the ledger ----------------------------------------------------------------------------------

def test_begin_counts_each_name_once_and_release_counts_exactly_once():
    ledger = InFlight(ticking())
    one = ledger.begin(["p:1", "d:1", "p:1"])
    two = ledger.begin(["p:1"])
    assert one.names == ("p:1", "d:1")
    assert ledger.counts() == {"p:1": 2, "d:1": 1}
    assert one.release() is True
    assert one.release() is False
    assert ledger.counts() == {"p:1": 1}
    assert two.release() is True
    assert ledger.counts() == {}


def test_snapshot_keeps_dispatch_times_in_order_and_counts_strictly_after():
    ledger = InFlight(ticking(1.0))
    d = [ledger.begin(["a:1"]) for _ in range(4)]  # times 1, 2, 3, 4
    d[1].release()
    snapshot = ledger.snapshot()
    assert snapshot.dispatched_at == {"a:1": (1.0, 3.0, 4.0)}
    assert [snapshot.after("a:1", t) for t in (0.0, 1.0, 2.0, 3.0, 4.0)] == [3, 2, 2, 1, 0]
    assert (snapshot.total("a:1"), snapshot.total("b:1"), snapshot.after("b:1", 0.0)) == (3, 0, 0)
    d[0].release()
    assert snapshot.total("a:1") == 3  # a snapshot is a copy
    assert ledger.snapshot().dispatched_at == {"a:1": (3.0, 4.0)}


def test_concurrent_begin_and_release_end_at_zero():
    ledger = InFlight()

    def work() -> None:
        for _ in range(500):
            ledger.begin(["a:1", "b:1"]).release()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30.0)
    assert ledger.counts() == {}


def test_waiting_estimate_adds_only_dispatches_after_the_report():
    i = inst("a:1", waiting=3)
    ledger = InFlight(iter([0.5, 0.9, 1.5, 2.0]).__next__)
    for _ in range(4):
        ledger.begin(["a:1"])
    # Two were sent before the report (it already holds them, queued or admitted), two after.
    assert waiting_estimate(i, ledger.snapshot()) == 3 + 2
    assert waiting_estimate(i, NO_IN_FLIGHT) == 3
    assert waiting_estimate(inst("b:1", load=False), ledger.snapshot()) == 0


def test_after_a_report_of_an_empty_queue_the_first_new_request_is_admitted_not_queued():
    ledger = InFlight(ticking())
    empty = inst("a:1", waiting=0)
    assert waiting_estimate(empty, ledger.snapshot()) == 0
    got = []
    for _ in range(3):
        ledger.begin(["a:1"])
        got.append(waiting_estimate(empty, ledger.snapshot()))
    assert got == [0, 1, 2]


def test_a_newer_report_absorbs_earlier_dispatches():
    ledger = InFlight(ticking())
    ledger.begin(["a:1"])
    ledger.begin(["a:1"])
    stale = inst("a:1")
    fresh = dataclasses.replace(stale, load=LoadMetrics(1, 0.0, 10.0))  # reported at 10.0
    assert waiting_estimate(stale, ledger.snapshot()) == 1  # empty queue: one admitted
    assert waiting_estimate(fresh, ledger.snapshot()) == 1


# -- CAR picks -----------------------------------------------------------------------------------

def burst_cluster():
    """a holds 80 of the 100 prompt tokens, b and c nothing; every reported queue is 0."""
    return snap(inst("a:1"), inst("b:1"), inst("c:1")), [match("a:1", dev=80)]


def test_without_in_flight_a_burst_piles_onto_the_cached_instance():
    s, m = burst_cluster()
    policy = CacheAware(0.5)
    assert names(policy.choose(TOKENS, s, m, now=NOW) for _ in range(6)) == ["a:1"] * 6


def test_in_flight_moves_a_burst_off_the_cached_instance_at_lambda_half():
    s, m = burst_cluster()
    policy = CacheAware(0.5)
    ledger = InFlight(ticking())
    picks, dispatches = [], []
    for _ in range(7):
        d = policy.choose(TOKENS, s, m, None, ledger.snapshot(), now=NOW)
        picks.append(d.prefill.name)
        dispatches.append(ledger.begin([d.prefill.name]))
    # Every report showed an empty queue, so an instance's first new request is admitted and
    # only later ones wait. 1, 2: a (0.1; its first request is not waiting). 3: a's second
    # waits and is the maximum: a 0.6 against b and c at 0.5, tied: b. 4: b's first is
    # admitted, the tie rotates: c. 5: b again (tie). 6: c, the only one at 0. 7: all wait 1:
    # a 0.6 against 1.0.
    assert picks == ["a:1", "a:1", "b:1", "c:1", "b:1", "c:1", "a:1"]
    d = policy.choose(TOKENS, s, m, None, ledger.snapshot(), now=NOW)
    # a: 3 in flight, 2 waiting (the maximum); b, c: 2 in flight, 1 waiting.
    assert scores(d) == pytest.approx({("P", "a:1"): 0.1 + 0.5, ("P", "b:1"): 0.5 + 0.5 / 2,
                                       ("P", "c:1"): 0.5 + 0.5 / 2}, abs=1e-12)
    assert [(c.name, c.waiting_requests_num, c.in_flight, c.in_flight_after_report)
            for c in d.candidates] == [("a:1", 0, 3, 3), ("b:1", 0, 2, 2), ("c:1", 0, 2, 2)]
    # Finished requests stop counting: back to the cached instance.
    for one in dispatches:
        one.release()
    assert names(policy.choose(TOKENS, s, m, None, ledger.snapshot(), now=NOW) for _ in range(2)) == [
        "a:1", "a:1"]


def test_nothing_in_flight_is_section_11_exactly():
    s = snap(inst("a:1", waiting=2), inst("b:1", waiting=4), inst("c:1"))
    m = [match("a:1", dev=50), match("c:1", dev=10)]
    plain = CacheAware(0.5).choose(TOKENS, s, m, now=NOW)
    empty = CacheAware(0.5).choose(TOKENS, s, m, None, InFlight().snapshot(), now=NOW)
    assert empty == plain
    assert scores(plain) == pytest.approx({("P", "a:1"): 0.25 + 0.25, ("P", "b:1"): 0.5 + 0.5,
                                           ("P", "c:1"): 0.45}, abs=1e-12)


def test_decode_side_counts_in_flight_too():
    s = snap(inst("p:1", InstanceType.PREFILL), inst("d1:1", InstanceType.DECODE),
             inst("d2:1", InstanceType.DECODE))
    ledger = InFlight(ticking())
    ledger.begin(["p:1", "d1:1"])
    ledger.begin(["p:1", "d1:1"])  # the second one waits
    d = CacheAware(0.5).choose(TOKENS, s, [], None, ledger.snapshot(), now=NOW)
    assert (d.prefill.name, d.decode.name) == ("p:1", "d2:1")
    assert scores(d)[("D", "d1:1")] == 1.0 and scores(d)[("D", "d2:1")] == 0.0


def test_round_robin_shows_in_flight_but_ignores_it():
    s = snap(inst("a:1"), inst("b:1"))
    ledger = InFlight(ticking())
    ledger.begin(["a:1"])
    policy = RoundRobin()
    picks = [policy.choose(TOKENS, s, None, None, ledger.snapshot(), now=NOW) for _ in range(2)]
    assert names(picks) == ["a:1", "b:1"]
    assert [(c.name, c.in_flight, c.in_flight_after_report) for c in picks[0].candidates] == [
        ("a:1", 1, 1), ("b:1", 0, 0)]


def test_empty_snapshot_constant_is_empty():
    assert NO_IN_FLIGHT == InFlightSnapshot()
    assert NO_IN_FLIGHT.after("a:1", 0.0) == 0
