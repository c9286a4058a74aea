"""The TTFT policy (kvsvc.routing.ttft, §12): predicted TTFT = queued prefill time +
prefill time of the uncached tokens, with CAR's hit terms (Device, Host-only weighted, minimum
over DP ranks, 0 for missing/unsynchronized/stale ranks), ``--default_prefill_tokens_per_s``
without profiling data, the queue estimate combining the router's own pending prefills with
the last report's ``waiting_requests_num``, ties rotating, D as CAR. Exact numbers: with no
profiling data and 10000 tokens/s, 1000 tokens take 100 ms."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from kvsvc.cluster.model import InstanceType, LoadMetrics, ProfilingData
from kvsvc.errors import ConfigError
from kvsvc.routing.observer import RequestInfo
from kvsvc.routing.policy import REASON_MISSING, REASON_STALE, REASON_UNSYNCHRONIZED
from kvsvc.routing.request_metrics import PendingPrefill, RequestMetricsLedger
from kvsvc.routing.ttft import TtftPolicy, queued_ms
from kvsvc.streams.state import StreamId
from tests.unit.test_policy import NOW, REPORTED_AT, inst, match, snap

N = 1000
TOKENS = list(range(N))
DEC = InstanceType.DECODE


def p_scores(d) -> dict[str, tuple[float, float, float]]:
    """P name -> (queued ms, own prefill ms, predicted TTFT ms)."""
    return {c.name: (round(c.estimated_prefill_ms, 6), round(c.predicted_prefill_ms, 6),
                     round(c.predicted_ttft_ms, 6)) for c in d.candidates if c.side == "P"}


def test_cache_hits_are_weighed_in_time_against_the_queue():
    policy = TtftPolicy(RequestMetricsLedger())
    cached_busy = inst("a:1", waiting=3)
    idle = inst("b:1")
    m = [match("a:1", dev=800), match("b:1")]
    d = policy.choose(TOKENS, snap(cached_busy, idle), m, now=NOW)
    # a: 3 queued x 100 ms (a full prefill of this size) + 200 uncached tokens = 320 ms.
    assert p_scores(d) == {"a:1": (300.0, 20.0, 320.0), "b:1": (0.0, 100.0, 100.0)}
    assert d.prefill.name == "b:1"
    d = policy.choose(TOKENS, snap(inst("a:1", waiting=0), idle), m, now=NOW)
    assert d.prefill.name == "a:1" and p_scores(d)["a:1"] == (0.0, 20.0, 20.0)
    assert d.prefill_estimates_ms == {"a:1": 20.0, "b:1": 100.0}
    assert {c.name: c.score for c in d.candidates} == {"a:1": 20.0, "b:1": 100.0}


@pytest.mark.parametrize("ranks, m, identities, own, reason", [
    (1, [match("a:1", host=800)], None, 60.0, None),          # 1000 - 0.5 * 800
    (1, [match("a:1", dev=200, host=400)], None, 60.0, None),  # 1000 - 200 - 0.5 * 400
    (2, [match("a:1", dev=800)], None, 100.0, REASON_MISSING),
    (1, [match("a:1", dev=800, sync=False)], None, 100.0, REASON_UNSYNCHRONIZED),
    (1, [match("a:1", dev=800)], {StreamId("a:1", 0): "old"}, 100.0, REASON_STALE),
    (2, [match("a:1", dev=800), match("a:1", dev=300, rank=1)], None, 70.0, None),
])
def test_uncached_tokens_use_cars_hit_terms(ranks, m, identities, own, reason):
    d = TtftPolicy(RequestMetricsLedger()).choose(TOKENS, snap(inst("a:1", dp=ranks)), m,
                                                   identities, now=NOW)
    (c,) = d.candidates
    assert c.predicted_prefill_ms == pytest.approx(own)
    assert reason in {r.reason for r in c.ranks}


def test_queue_is_the_report_plus_own_pending_prefills_sent_after_it():
    before = PendingPrefill(REPORTED_AT - 0.5, 50.0)   # inside the report: not added again
    after = PendingPrefill(REPORTED_AT + 1.0, 30.0)    # not seen by any report yet
    assert queued_ms(inst("a:1", waiting=0), (before, after), 100.0) == 30.0
    assert queued_ms(inst("a:1", waiting=4), (before, after), 100.0) == 190.0  # 4 x 40 + 30
    assert queued_ms(inst("a:1", waiting=1), (before,), 100.0) == 50.0   # 1 x 50
    assert queued_ms(inst("a:1", waiting=2), (), 100.0) == 200.0   # the report alone
    assert queued_ms(inst("a:1", load=False), (after,), 100.0) == 30.0


def test_dispatches_through_the_ledger_move_the_next_choice():
    ledger = RequestMetricsLedger()
    policy = TtftPolicy(ledger)
    s = snap(inst("a:1"), inst("b:1"))
    m = [match("a:1", dev=500), match("b:1")]
    d = policy.choose(TOKENS, s, m, now=NOW)
    assert d.prefill.name == "a:1"                 # 50 ms against 100 ms
    infos = [RequestInfo(i, "a:1", "", N, d.prefill_estimates_ms["a:1"],
                         dispatched_at=REPORTED_AT + 1.0) for i in (1, 2)]
    for info in infos:
        ledger.on_dispatch(info)
    d = policy.choose(TOKENS, s, m, now=NOW)
    assert p_scores(d)["a:1"] == (100.0, 50.0, 150.0)
    assert d.prefill.name == "b:1"
    ledger.on_first_token(infos[0])                # one left: 50 + 50 ms ties with b
    d = policy.choose(TOKENS, s, m, now=NOW)
    assert p_scores(d)["a:1"] == (50.0, 50.0, 100.0)
    assert {c.name for c in d.candidates if c.tied} == {"a:1", "b:1"}


def test_profiling_data_is_used_and_bad_data_falls_back_with_one_warning(caplog):
    fitted = dataclasses.replace(inst("a:1"), profiling=ProfilingData(
        ttft=tuple((n, 10.0 + 0.1 * n) for n in (0, 1000, 2000, 4000))))
    broken = dataclasses.replace(inst("b:1"), profiling=ProfilingData(
        ttft=((100, 5.0),), problems=("ttft_profiling_data: 2 of 3 points dropped (item 0: "
                                      "['x', 1] ...)",)))
    policy = TtftPolicy(RequestMetricsLedger(), default_prefill_tokens_per_s=20000)
    with caplog.at_level(logging.WARNING, logger="kvsvc.routing.predictor"):
        for _ in range(2):
            d = policy.choose(TOKENS, snap(fitted, broken), [match("a:1", dev=800)], now=NOW)
    assert p_scores(d) == {"a:1": (0.0, 30.0, 30.0), "b:1": (0.0, 50.0, 50.0)}
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("instance b:1: profiling data unusable (ttft_profiling_data: 2 of 3")
    assert "ttft_profiling_data: 1 valid points, the fit needs 3" in line
    assert line.endswith("TTFT assumes 20000 tokens/s there (--default_prefill_tokens_per_s, "
                         "§12)")


def test_negative_fitted_prediction_counts_zero():
    dips = dataclasses.replace(inst("a:1"), profiling=ProfilingData(
        ttft=((0, -50.0), (1000, 50.0), (2000, 150.0))))
    d = TtftPolicy(RequestMetricsLedger()).choose(TOKENS, snap(dips), [match("a:1", dev=1000)],
                                                  now=NOW)
    assert d.candidates[0].predicted_prefill_ms == 0.0


def test_a_fit_that_does_not_grow_falls_back_and_cannot_take_every_request(caplog):
    """A decreasing fit (1000 ms at 100 tokens, 1 ms at 300) predicts 0 or less for longer
    prompts; kept as it is, its instance would win every decision whatever its queue."""
    falling = dataclasses.replace(
        inst("a:1", waiting=100000),
        profiling=ProfilingData(ttft=((100, 1000.0), (200, 500.0), (300, 1.0))))
    idle = inst("b:1", waiting=0)
    policy = TtftPolicy(RequestMetricsLedger(), default_prefill_tokens_per_s=20000)
    with caplog.at_level(logging.WARNING, logger="kvsvc.routing.predictor"):
        d = policy.choose(TOKENS, snap(falling, idle), [], now=NOW)
    assert d.prefill is not None and d.prefill.name == "b:1"
    # a:1 is priced at the default rate: 1000 tokens / 20000 per s = 50 ms per prefill.
    assert p_scores(d)["a:1"] == (100000 * 50.0, 50.0, 100000 * 50.0 + 50.0)
    (line,) = [r.getMessage() for r in caplog.records if "instance a:1" in r.getMessage()]
    assert "ttft_profiling_data: the fit" in line and "does not grow with the prompt" in line


def test_ties_rotate_and_decode_is_chosen_as_car():
    policy = TtftPolicy(RequestMetricsLedger())
    s = snap(inst("a:1", InstanceType.PREFILL), inst("b:1", InstanceType.PREFILL),
             inst("d1:1", DEC, usage=0.5), inst("d2:1", DEC, usage=0.1))
    picks = [policy.choose(TOKENS, s, [], now=NOW) for _ in range(4)]
    assert [d.prefill.name for d in picks] == ["a:1", "b:1", "a:1", "b:1"]
    assert {d.decode.name for d in picks} == {"d2:1"}
    d_side = {c.name: c.score for c in picks[0].candidates if c.side == "D"}
    assert d_side == {"d1:1": 0.5, "d2:1": 0.1}


def test_stale_load_report_is_not_a_candidate_and_bad_rate_refuses():
    old = dataclasses.replace(inst("a:1"), load=LoadMetrics(0, 0.0, NOW - 60.0))
    d = TtftPolicy(RequestMetricsLedger()).choose(TOKENS, snap(old), [], now=NOW)
    assert d.prefill is None and "a:1" in d.excluded
    for bad in (0, -1.0, float("nan"), 1e10, True):
        with pytest.raises(ConfigError) as err:
            TtftPolicy(RequestMetricsLedger(), default_prefill_tokens_per_s=bad)
        assert err.value.field == "--default_prefill_tokens_per_s"
