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
from kvsvc.settings import (
    DEFAULT_TTFT_HOST_HIT_WEIGHT,
    DEFAULT_TTFT_WORK_WEIGHT,
    load_service_settings,
)
from kvsvc.routing.observer import RequestInfo
from kvsvc.routing.policy import REASON_MISSING, REASON_STALE, REASON_UNSYNCHRONIZED
from kvsvc.routing.request_metrics import PendingPrefill, PrefillEnd, RequestMetricsLedger
from kvsvc.routing.ttft import TtftPolicy, own_backlog_ms, queued_ms
from kvsvc.streams.state import StreamId
from tests.support.policy import NOW, REPORTED_AT, inst, match, snap

N = 1000
TOKENS = list(range(N))
DEC = InstanceType.DECODE


def p_scores(d) -> dict[str, tuple[float, float, float]]:
    """P name -> (queued ms, own prefill ms, predicted TTFT ms)."""
    return {c.name: (round(c.estimated_prefill_ms, 6), round(c.predicted_prefill_ms, 6),
                     round(c.predicted_ttft_ms, 6)) for c in d.candidates if c.side == "P"}


def test_cache_hits_are_weighed_in_time_against_the_queue():
    policy = TtftPolicy(RequestMetricsLedger(), work_weight=0.0)  # §12's predicted TTFT alone
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


def test_the_default_work_term_keeps_a_long_prefix_unless_the_move_saves_six_times_it():
    """D29: by default a candidate pays 6x the prefill it recomputes beyond the best-cached
    candidate's; the predicted TTFT shown is still the request's own."""
    policy = TtftPolicy(RequestMetricsLedger())
    assert policy.work_weight == DEFAULT_TTFT_WORK_WEIGHT == 6.0
    idle = inst("b:1")
    m = [match("a:1", dev=800), match("b:1")]
    # a: 5 queued x 100 ms + 20 ms = 520; b: 100 + 6 x (100 - 20) = 580: a keeps the prefix.
    d = policy.choose(TOKENS, snap(inst("a:1", waiting=5), idle), m, now=NOW)
    assert d.prefill.name == "a:1"
    assert {c.name: round(c.score, 6) for c in d.candidates} == {"a:1": 520.0, "b:1": 580.0}
    assert p_scores(d) == {"a:1": (500.0, 20.0, 520.0), "b:1": (0.0, 100.0, 100.0)}
    # A queue ahead worth more than the move's sixfold recompute still moves it: 6 x 100.
    d = policy.choose(TOKENS, snap(inst("a:1", waiting=6), idle), m, now=NOW)
    assert d.prefill.name == "b:1"
    assert {c.name: round(c.score, 6) for c in d.candidates} == {"a:1": 620.0, "b:1": 580.0}
    # Nothing cached anywhere: no work term, the lowest predicted TTFT (the shorter queue).
    d = policy.choose(TOKENS, snap(inst("a:1", waiting=1), idle),
                      [match("a:1"), match("b:1")], now=NOW)
    assert d.prefill.name == "b:1"
    assert {c.name: round(c.score, 6) for c in d.candidates} == {"a:1": 200.0, "b:1": 100.0}


@pytest.mark.parametrize("ranks, m, identities, own, reason", [
    (1, [match("a:1", host=800)], None, 60.0, None),          # 1000 - 0.5 * 800
    (1, [match("a:1", dev=200, host=400)], None, 60.0, None),  # 1000 - 200 - 0.5 * 400
    (2, [match("a:1", dev=800)], None, 100.0, REASON_MISSING),
    (1, [match("a:1", dev=800, sync=False)], None, 100.0, REASON_UNSYNCHRONIZED),
    (1, [match("a:1", dev=800)], {StreamId("a:1", 0): "old"}, 100.0, REASON_STALE),
    (2, [match("a:1", dev=800), match("a:1", dev=300, rank=1)], None, 70.0, None),
])
def test_uncached_tokens_use_cars_hit_terms(ranks, m, identities, own, reason):
    d = TtftPolicy(RequestMetricsLedger(), host_hit_weight=0.5).choose(
        TOKENS, snap(inst("a:1", dp=ranks)), m, identities, now=NOW)
    (c,) = d.candidates
    assert c.predicted_prefill_ms == pytest.approx(own)
    assert reason in {r.reason for r in c.ranks}


def test_a_host_only_prefix_is_priced_by_the_time_its_load_saves():
    """D30: TTFT's own Host weight (default 0.95), not CAR's 0.5: 800 Host-only tokens of 1000
    leave 240 to compute, so the Host-cached engine with 60 ms queued beats an idle cold one
    (§12 with CAR's 0.5 would price 600 tokens: 120 ms against 100)."""
    policy = TtftPolicy(RequestMetricsLedger(), work_weight=0.0)
    assert policy.host_hit_weight == DEFAULT_TTFT_HOST_HIT_WEIGHT == 0.95
    assert load_service_settings().ttft_host_hit_weight == 0.95
    assert load_service_settings().car_host_hit_weight == 0.5   # CAR's stays §11's
    m = [match("a:1", host=800), match("b:1")]
    s = snap(inst("a:1"), inst("b:1"))
    ledger = RequestMetricsLedger(clock=lambda: NOW)
    ledger.on_dispatch(RequestInfo(1, "a:1", "", N, 60.0, "TTFT", dispatched_at=NOW))
    policy = TtftPolicy(ledger, work_weight=0.0)
    d = policy.choose(TOKENS, s, m, now=NOW)
    assert d.prefill.name == "a:1"
    assert p_scores(d)["a:1"] == (60.0, 24.0, 84.0)
    d = TtftPolicy(ledger, host_hit_weight=0.5, work_weight=0.0).choose(TOKENS, s, m, now=NOW)
    assert d.prefill.name == "b:1" and p_scores(d)["a:1"] == (60.0, 60.0, 120.0)


def test_own_backlog_replays_the_pending_prefills_one_at_a_time():
    t = REPORTED_AT + 1.0
    first, second = PendingPrefill(t, 50.0), PendingPrefill(t + 0.01, 30.0)
    # first runs t..t+0.05, second waits for it: t+0.05..t+0.08; 60 ms remain at t+0.02.
    assert own_backlog_ms((first, second), (), t + 0.02) == pytest.approx(60.0)
    # The last first token relayed (t+0.03) frees the lane: second runs t+0.03..t+0.06.
    done = PrefillEnd(t - 0.1, t + 0.03, 40.0, first_token=True)
    cancelled = PrefillEnd(t, t + 0.035, 40.0, first_token=False)  # not a free lane
    assert own_backlog_ms((second,), (done, cancelled), t + 0.04) == pytest.approx(20.0)
    # A streamed request past its predicted end is still running: it ends now at the earliest.
    late = t + 1.0
    assert own_backlog_ms((first,), (), late) == 0.0
    assert own_backlog_ms((first, PendingPrefill(late - 0.01, 30.0)), (), late) == \
        pytest.approx(30.0)                         # the next one waits for it
    # A non-streamed one past its predicted end is decoding: it holds nothing back.
    quiet = PendingPrefill(t, 50.0, streamed=False)
    assert own_backlog_ms((quiet, PendingPrefill(late - 0.01, 30.0)), (), late) == \
        pytest.approx(20.0)
    assert own_backlog_ms((quiet,), (), t + 0.01) == pytest.approx(40.0)
    # ... and the ones behind it wait for its predicted end, not for their own dispatch.
    three = (quiet, PendingPrefill(t, 50.0, streamed=False), PendingPrefill(t, 50.0, False))
    assert own_backlog_ms(three, (), t + 0.06) == pytest.approx(90.0)   # 2nd to +0.10, 3rd +0.15
    assert own_backlog_ms(three, (), t + 0.12) == pytest.approx(30.0)


def test_report_adds_only_the_requests_that_are_not_the_routers():
    now = REPORTED_AT + 0.01
    own = PendingPrefill(REPORTED_AT - 0.5, 50.0)      # in prefill at the report, still is
    # Alone with nothing of the router's: W requests of a full prefill of this size (100 ms).
    assert queued_ms(inst("a:1", waiting=2), (), 100.0, (), now) == 200.0
    # One own request in prefill at the report was the one prefilling (W does not count it):
    # the 2 waiting are foreign, priced at the mean of the own predictions (50 ms); own is
    # past its predicted end, so it ends now at the earliest (no backlog).
    assert queued_ms(inst("a:1", waiting=2), (own,), 100.0, (), now) == pytest.approx(100.0)
    # Three own requests in prefill at the report (one ended after it): two of W are the
    # router's own, one is foreign; the own backlog is the two still pending.
    ended = PrefillEnd(REPORTED_AT - 0.6, REPORTED_AT + 0.005, 20.0, first_token=True)
    own2 = PendingPrefill(REPORTED_AT - 0.4, 30.0)
    q = queued_ms(inst("a:1", waiting=3), (own, own2), 100.0, (ended,), now)
    backlog = own_backlog_ms((own, own2), (ended,), now)
    assert backlog == pytest.approx(75.0)   # own from +0.005 to +0.055, own2 to +0.085
    assert q == pytest.approx(backlog + 1 * (50.0 + 30.0 + 20.0) / 3)
    # A report that has seen no more than the router's own adds nothing.
    assert queued_ms(inst("a:1", waiting=1), (own, own2), 100.0, (ended,), now) == \
        pytest.approx(backlog)
    # Requests sent after the report are not in it: no correction, only the backlog.
    after = PendingPrefill(REPORTED_AT + 0.002, 30.0)
    assert queued_ms(inst("a:1", waiting=0), (after,), 100.0, (), now) == pytest.approx(22.0)
    assert queued_ms(inst("a:1", load=False), (after,), 100.0, (), now) == pytest.approx(22.0)


def test_dispatches_through_the_ledger_move_the_next_choice():
    ledger = RequestMetricsLedger(clock=lambda: NOW)
    policy = TtftPolicy(ledger, work_weight=0.0)  # §12's predicted TTFT alone
    s = snap(inst("a:1"), inst("b:1"))
    m = [match("a:1", dev=500), match("b:1")]
    d = policy.choose(TOKENS, s, m, now=NOW)
    assert d.prefill.name == "a:1"                 # 50 ms against 100 ms
    infos = [RequestInfo(i, "a:1", "", N, d.prefill_estimates_ms["a:1"], dispatched_at=NOW)
             for i in (1, 2)]
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
    # The rate's range is checked once, by the settings table.
    for bad in (0, -1.0, float("nan"), 1e10):
        with pytest.raises(ConfigError) as err:
            load_service_settings(default_prefill_tokens_per_s=bad)
        assert err.value.field == "--default_prefill_tokens_per_s"
