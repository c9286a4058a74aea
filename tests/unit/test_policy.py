"""§11 policies as pure functions of RegistrySnapshot / StreamMatch values: every formula case
with exact picks, ties rotating among the tied only, multi-DP minimum, candidates rules, RR."""

from __future__ import annotations

import dataclasses
import logging
import math

import pytest

from kvsvc.routing.policy import (
    EXCLUDED_NO_DECODE,
    EXCLUDED_NO_LOAD,
    EXCLUDED_NO_PREFILL,
    EXCLUDED_SUSPECT,
    REASON_INDEX_DISABLED,
    REASON_MISSING,
    REASON_NO_TOKENS,
    REASON_STALE,
    REASON_UNSYNCHRONIZED,
    CacheAware,
    RankHit,
    RoundRobin,
    candidate_pools,
)
from kvsvc.routing.policies import make_policy
from kvsvc.routing.slo import SloAware
from kvsvc.routing.ttft import TtftPolicy
from kvsvc.cluster.model import Instance, InstanceState
from kvsvc.streams.state import StreamId, StreamMatch
from tests.support.policy import D, DEC, MIX, NOW, P, TOKENS, inst, match, names, scores, snap


# -- hit ratio -----------------------------------------------------------------------------------

def test_hit_ratio_device_plus_weighted_host_over_input_tokens():
    policy = CacheAware(prefill_lambda=0.5, host_hit_weight=0.5)
    d = policy.choose(TOKENS, snap(inst("a:1"), inst("b:1")),
                      [match("a:1", dev=40, host=20), match("b:1", dev=10)], now=NOW)
    a, b = d.candidates
    # (40 + 0.5 * 20) / 100 = 0.5; score = 0.5 * (1 - 0.5) + 0.5 * 0 = 0.25.
    assert (a.name, a.hit_ratio, a.queue_cost, a.score, a.tied) == ("a:1", 0.5, 0.0, 0.25, False)
    assert a.ranks == (RankHit(0, 40, 20, 0.5, None),)
    assert (b.name, b.hit_ratio, b.score) == ("b:1", 0.1, 0.45)
    assert d.prefill.name == "a:1" and d.decode is None
    assert d.input_tokens == 100
    assert [i.name for i in d.prefill_ranking] == ["a:1", "b:1"]


def test_host_weight_scales_host_only_hits():
    for weight, expected in ((0.0, 0.0), (0.25, 0.25), (1.0, 1.0)):
        d = CacheAware(0.5, weight).choose(TOKENS, snap(inst("a:1")), [match("a:1", host=100)], now=NOW)
        assert d.candidates[0].hit_ratio == expected


def test_hit_ratio_clamped_to_one():
    d = CacheAware().choose(list(range(10)), snap(inst("a:1")), [match("a:1", dev=16, host=8)], now=NOW)
    assert d.candidates[0].hit_ratio == 1.0
    assert d.candidates[0].score == 0.0


def test_no_tokens_and_disabled_index_give_zero_hits():
    s = snap(inst("a:1"))
    d = CacheAware().choose(None, s, [match("a:1", dev=50)], now=NOW)
    assert d.candidates[0].ranks == (RankHit(0, 0, 0, 0.0, REASON_NO_TOKENS),)
    assert (d.candidates[0].hit_ratio, d.candidates[0].score, d.input_tokens) == (0.0, 0.5, 0)
    d = CacheAware().choose(TOKENS, s, None, now=NOW)
    assert d.candidates[0].ranks == (RankHit(0, 0, 0, 0.0, REASON_INDEX_DISABLED),)
    assert d.prefill.name == "a:1"


# -- queue cost and lambda -----------------------------------------------------------------------

def test_queue_cost_is_waiting_over_max_waiting():
    d = CacheAware(prefill_lambda=0.0).choose(
        TOKENS, snap(inst("a:1", waiting=10), inst("b:1", waiting=5), inst("c:1", waiting=0)),
        [], now=NOW)
    assert {c.name: c.queue_cost for c in d.candidates} == {"a:1": 1.0, "b:1": 0.5, "c:1": 0.0}
    assert [c.name for c in d.candidates] == ["c:1", "b:1", "a:1"]  # best first
    assert d.prefill.name == "c:1"


def test_all_idle_queues_give_zero_not_nan():
    d = CacheAware().choose(TOKENS, snap(inst("a:1"), inst("b:1")),
                            [match("a:1", dev=20), match("b:1")], now=NOW)
    for c in d.candidates:
        assert c.queue_cost == 0.0 and not math.isnan(c.score)
    assert scores(d) == {("P", "a:1"): 0.4, ("P", "b:1"): 0.5}
    assert d.prefill.name == "a:1"


@pytest.mark.parametrize("lam, winner, cached_score, cold_score", [
    (0.2, "cold:1", 0.8, 0.2),   # queue dominates: the idle cold instance wins
    (0.8, "cached:1", 0.2, 0.8),  # cache dominates: the overloaded cached instance wins
])
def test_overloaded_cached_against_idle_cold(lam, winner, cached_score, cold_score):
    s = snap(inst("cached:1", waiting=10), inst("cold:1", waiting=0))
    d = CacheAware(prefill_lambda=lam).choose(TOKENS, s, [match("cached:1", dev=100),
                                                          match("cold:1")], now=NOW)
    got = scores(d)
    assert got[("P", "cached:1")] == pytest.approx(cached_score, abs=1e-12)
    assert got[("P", "cold:1")] == pytest.approx(cold_score, abs=1e-12)
    assert d.prefill.name == winner


# -- ties ----------------------------------------------------------------------------------------

def test_ties_rotate_among_the_tied_only():
    policy = CacheAware()
    s = snap(inst("a:1"), inst("b:1"), inst("c:1"), inst("z:1", waiting=3))
    m = [match("a:1", dev=50), match("b:1", dev=50), match("c:1", dev=10), match("z:1", dev=50)]
    picks = [policy.choose(TOKENS, s, m, now=NOW) for _ in range(6)]
    assert names(picks) == ["a:1", "b:1", "a:1", "b:1", "a:1", "b:1"]
    tied = {c.name: c.tied for c in picks[0].candidates}
    assert tied == {"a:1": True, "b:1": True, "c:1": False, "z:1": False}
    # The ranking puts the other tie member next (the retry target), then by score.
    assert [i.name for i in picks[1].prefill_ranking] == ["b:1", "a:1", "c:1", "z:1"]


def test_scores_within_epsilon_tie_and_a_clear_winner_does_not_advance_the_counter():
    s = snap(inst("a:1"), inst("b:1"))
    m = [match("a:1", dev=50), match("b:1", dev=40)]
    # lambda 1e-9: scores 5e-10 and 6e-10, 1e-10 apart: a tie (§11: within 1e-9 of the minimum).
    policy = CacheAware(prefill_lambda=1e-9)
    d = policy.choose(TOKENS, s, m, now=NOW)
    assert [c.tied for c in d.candidates] == [True, True]
    assert scores(d)[("P", "b:1")] - scores(d)[("P", "a:1")] == pytest.approx(1e-10, rel=1e-6)
    assert [d.prefill.name] + [policy.choose(TOKENS, s, m, now=NOW).prefill.name
                               for _ in range(3)] == ["a:1", "b:1", "a:1", "b:1"]
    # lambda 1e-7: 1e-8 apart, not a tie; and such a choice does not move the tie counter.
    clear = CacheAware(prefill_lambda=1e-7)
    assert [clear.choose(TOKENS, s, m, now=NOW).prefill.name for _ in range(3)] == ["a:1"] * 3
    assert [c.tied for c in clear.choose(TOKENS, s, m, now=NOW).candidates] == [False, False]
    tie = [match("a:1", dev=50), match("b:1", dev=50)]
    assert [clear.choose(TOKENS, s, tie, now=NOW).prefill.name for _ in range(2)] == ["a:1", "b:1"]


def test_decode_ties_rotate_independently_of_prefill():
    policy = CacheAware()
    s = snap(inst("p:1", P), inst("d1:1", DEC, usage=0.25), inst("d2:1", DEC, usage=0.25),
             inst("d3:1", DEC, usage=0.5))
    picks = [policy.choose(TOKENS, s, [], now=NOW) for _ in range(4)]
    assert [(d.prefill.name, d.decode.name) for d in picks] == [
        ("p:1", "d1:1"), ("p:1", "d2:1"), ("p:1", "d1:1"), ("p:1", "d2:1")]


# -- D score -------------------------------------------------------------------------------------

def test_decode_score_usage_plus_queue_cost():
    s = snap(inst("p:1", P), inst("d1:1", DEC, usage=0.5, waiting=0),
             inst("d2:1", DEC, usage=0.125, waiting=4), inst("d3:1", DEC, usage=0.25, waiting=2))
    d = CacheAware().choose(TOKENS, s, [], now=NOW)
    got = {c.name: (c.queue_cost, c.score) for c in d.candidates if c.side == "D"}
    assert got == {"d1:1": (0.0, 0.5), "d2:1": (1.0, 1.125), "d3:1": (0.5, 0.75)}
    assert [c.name for c in d.candidates if c.side == "D"] == ["d1:1", "d3:1", "d2:1"]
    assert d.decode.name == "d1:1"


def test_decode_all_idle_is_usage_only():
    s = snap(inst("p:1", P), inst("d1:1", DEC, usage=0.75), inst("d2:1", DEC, usage=0.5))
    d = CacheAware().choose(TOKENS, s, [], now=NOW)
    assert {c.name: c.score for c in d.candidates if c.side == "D"} == {"d1:1": 0.75,
                                                                        "d2:1": 0.5}
    assert d.decode.name == "d2:1"


# -- multi-DP and stream validity ----------------------------------------------------------------

def test_multi_dp_hit_is_the_minimum_over_ranks():
    s = snap(inst("a:1", dp=2), inst("b:1"))
    d = CacheAware().choose(TOKENS, s, [match("a:1", dev=80), match("a:1", dev=40, rank=1),
                                        match("b:1", dev=30)], now=NOW)
    a = next(c for c in d.candidates if c.name == "a:1")
    assert a.ranks == (RankHit(0, 80, 0, 0.8, None), RankHit(1, 40, 0, 0.4, None))
    assert a.hit_ratio == 0.4
    assert d.prefill.name == "a:1"


@pytest.mark.parametrize("rank1, reason", [
    (None, REASON_MISSING),
    (StreamMatch("a:1", 1, False, None, 0, 0, 0, 0, "no snapshot yet"), REASON_UNSYNCHRONIZED),
])
def test_a_missing_or_unsynchronized_rank_gives_zero(rank1, reason):
    s = snap(inst("a:1", dp=2), inst("b:1"))
    m = [match("a:1", dev=80), match("b:1", dev=30)] + ([rank1] if rank1 else [])
    d = CacheAware().choose(TOKENS, s, m, now=NOW)
    a = next(c for c in d.candidates if c.name == "a:1")
    assert a.ranks[1] == RankHit(1, 0, 0, 0.0, reason)
    assert a.hit_ratio == 0.0
    assert d.prefill.name == "b:1"


def test_unsynchronized_single_rank_gives_zero():
    d = CacheAware().choose(TOKENS, snap(inst("a:1"), inst("b:1")),
                            [match("a:1", dev=90, sync=False), match("b:1", dev=10)], now=NOW)
    assert {c.name: c.hit_ratio for c in d.candidates} == {"a:1": 0.0, "b:1": 0.1}
    assert d.prefill.name == "b:1"


def test_stale_incarnation_gives_zero_and_current_counts():
    s = snap(inst("a:1", inc="new"), inst("b:1"), inst("c:1", inc="", ts=1700000000123))
    m = [match("a:1", dev=90), match("b:1", dev=10), match("c:1", dev=20)]
    identities = {StreamId("a:1", 0): "old", StreamId("b:1", 0): "inc-b:1",
                  StreamId("c:1", 0): "register_ts_ms:1700000000123"}
    d = CacheAware().choose(TOKENS, s, m, identities, now=NOW)
    got = {c.name: (c.hit_ratio, c.ranks[0].reason) for c in d.candidates}
    assert got == {"a:1": (0.0, REASON_STALE), "b:1": (0.1, None), "c:1": (0.2, None)}
    assert d.prefill.name == "c:1"
    # The same stream under the current identity counts; a static stream (None) is not checked.
    d = CacheAware().choose(TOKENS, s, m, {StreamId("a:1", 0): "new"}, now=NOW)
    assert d.prefill.name == "a:1" and d.candidates[0].hit_ratio == 0.9
    d = CacheAware().choose(TOKENS, s, m, {StreamId("a:1", 0): None}, now=NOW)
    assert d.candidates[0].hit_ratio == 0.9


# -- candidates ----------------------------------------------------------------------------------

def test_instance_without_load_report_is_never_chosen():
    policy = CacheAware(prefill_lambda=1.0)
    s = snap(inst("a:1", load=False), inst("b:1", waiting=50))
    m = [match("a:1", dev=100), match("b:1")]
    picks = [policy.choose(TOKENS, s, m, now=NOW) for _ in range(3)]
    assert names(picks) == ["b:1"] * 3
    assert [c.name for c in picks[0].candidates] == ["b:1"]
    d = policy.choose(TOKENS, snap(inst("a:1", load=False)), m, now=NOW)
    assert (d.prefill, d.decode, d.candidates, d.prefill_ranking) == (None, None, (), ())
    assert d.reason == "no schedulable instance with a current load report"


def test_suspect_excluded_lease_lost_kept():
    s = snap(inst("a:1", state=InstanceState.SUSPECT), inst("b:1", state=InstanceState.LEASE_LOST))
    d = CacheAware().choose(TOKENS, s, [match("a:1", dev=100), match("b:1")], now=NOW)
    assert [c.name for c in d.candidates] == ["b:1"]
    assert d.prefill.name == "b:1"


def test_only_default_serves_alone_without_decode():
    s = snap(inst("d:1", D), inst("p:1", P, waiting=0), inst("m:1", MIX, role=P))
    d = CacheAware().choose(TOKENS, s, [match("p:1", dev=100), match("m:1", dev=100)], now=NOW)
    assert [c.name for c in d.candidates] == ["d:1"]
    assert (d.prefill.name, d.decode) == ("d:1", None)
    d = CacheAware().choose(TOKENS, snap(inst("p:1", P)), [], now=NOW)
    assert d.prefill is None
    assert d.reason == "no decode instance and no DEFAULT instance to serve alone"


def test_pd_pairs_prefill_side_with_decode_side():
    s = snap(inst("d:1", D, waiting=4), inst("p:1", P), inst("m1:1", MIX, role=P, waiting=2),
             inst("m2:1", MIX, role=DEC, usage=0.25), inst("x:1", DEC, usage=0.5))
    d = CacheAware().choose(TOKENS, s, [match("m1:1", dev=60)], now=NOW)
    assert [(c.side, c.name) for c in d.candidates] == [
        ("P", "m1:1"), ("P", "p:1"), ("P", "d:1"), ("D", "m2:1"), ("D", "x:1")]
    # m1: 0.5 * 0.4 + 0.5 * 0.5 = 0.45; p: 0.5; d: 0.5 + 0.5 = 1.0.
    assert scores(d)[("P", "m1:1")] == pytest.approx(0.45, abs=1e-12)
    assert (d.prefill.name, d.decode.name) == ("m1:1", "m2:1")
    d = CacheAware().choose(TOKENS, snap(inst("x:1", DEC)), [], now=NOW)
    assert (d.prefill, d.reason) == (None, "no schedulable prefill instance")


def test_decision_json_shape():
    d = CacheAware().choose(TOKENS, snap(inst("a:1")), [match("a:1", dev=40, host=20)], now=NOW)
    assert d.to_json() == {
        "policy": "CAR", "prefill": "a:1", "prefill_dp_rank": None, "decode": None,
        "input_tokens": 100, "reason": None,
        "candidates": [{"name": "a:1", "side": "P", "dp_rank": None, "hit_ratio": 0.5,
                        "queue_cost": 0.0,
                        "score": 0.25, "tied": False, "waiting_requests_num": 0,
                        "gpu_cache_usage_perc": 0.0, "in_flight": 0,
                        "in_flight_after_report": 0,
                        # §12's predictions: SLO_AWARE and TTFT only.
                        "estimated_prefill_ms": None, "predicted_prefill_ms": None,
                        "predicted_ttft_ms": None, "predicted_tpot_ms": None,
                        "ranks": [{"dp_rank": 0, "device_hit_tokens": 40,
                                   "host_only_hit_tokens": 20, "pending_hit_tokens": 0, "hit_ratio": 0.5,
                                   "reason": None, "completeness": None}]}],
        "excluded": {}}


# -- RR ------------------------------------------------------------------------------------------

def test_round_robin_is_fair_per_side():
    policy = RoundRobin()
    s = snap(inst("p1:1", P), inst("p2:1", P), inst("p3:1", P), inst("d1:1", DEC),
             inst("d2:1", DEC), inst("z:1", P, load=False))
    picks = [policy.choose(TOKENS, s, None, now=NOW) for _ in range(6)]
    assert [(d.prefill.name, d.decode.name) for d in picks] == [
        ("p1:1", "d1:1"), ("p2:1", "d2:1"), ("p3:1", "d1:1"),
        ("p1:1", "d2:1"), ("p2:1", "d1:1"), ("p3:1", "d2:1")]
    assert [i.name for i in picks[1].prefill_ranking] == ["p2:1", "p3:1", "p1:1"]
    assert all(c.score is None and c.hit_ratio is None for c in picks[0].candidates)
    counts: dict[str, int] = {}
    for _ in range(30):
        name = policy.choose(TOKENS, s, None, now=NOW).prefill.name
        counts[name] = counts.get(name, 0) + 1
    assert counts == {"p1:1": 10, "p2:1": 10, "p3:1": 10}


def test_round_robin_without_candidate():
    d = RoundRobin().choose(TOKENS, snap(inst("a:1", state=InstanceState.SUSPECT)), None, now=NOW)
    assert (d.prefill, d.reason) == (None, "no schedulable instance with a current load report")


# -- load age (§11: current for max_load_age_s after it was received) ----------------------------

def reported(instance: Instance, received_at: float) -> Instance:
    """``instance`` with its load report received at ``received_at`` (monotonic s)."""
    assert instance.load is not None
    return dataclasses.replace(instance, load=dataclasses.replace(instance.load,
                                                                  received_at=received_at))


@pytest.mark.parametrize("policy", [CacheAware(max_load_age_s=10.0),
                                    RoundRobin(max_load_age_s=10.0)], ids=["CAR", "RR"])
def test_load_age_cut_at_exactly_max_load_age_s(policy):
    """Age == max_load_age_s is still current; the next float after it is not (both ends of
    the cut, both policies)."""
    s = snap(reported(inst("a:1"), 100.0), reported(inst("b:1", waiting=5), 105.0))
    at_limit = policy.choose(TOKENS, s, None, now=110.0)
    assert [c.name for c in at_limit.candidates] == ["a:1", "b:1"]
    assert at_limit.prefill.name == "a:1" and dict(at_limit.excluded) == {}
    past = policy.choose(TOKENS, s, None, now=math.nextafter(110.0, math.inf))
    assert [c.name for c in past.candidates] == ["b:1"]
    assert past.prefill.name == "b:1"
    assert dict(past.excluded) == {"a:1": "load report 10.0 s old (max_load_age_s 10)"}
    gone = policy.choose(TOKENS, s, None, now=115.5)
    assert gone.prefill is None
    assert gone.reason == "no schedulable instance with a current load report"
    assert gone.to_json()["excluded"] == {
        "a:1": "load report 15.5 s old (max_load_age_s 10)",
        "b:1": "load report 10.5 s old (max_load_age_s 10)"}


def test_load_age_limit_is_the_policys_setting():
    s = snap(reported(inst("a:1"), 0.0))
    assert CacheAware(max_load_age_s=2.5).choose(TOKENS, s, None, now=2.5).prefill.name == "a:1"
    assert CacheAware(max_load_age_s=2.5).choose(TOKENS, s, None, now=2.6).prefill is None
    assert make_policy("RR", max_load_age_s=60).choose(TOKENS, s, None, now=59.0).prefill
    # A report dated after ``now`` (a test's clock) has age <= 0: current.
    assert CacheAware(max_load_age_s=1.0).choose(TOKENS, s, None, now=-5.0).prefill.name == "a:1"


def test_every_instance_that_is_not_a_candidate_is_listed_with_why():
    s = snap(inst("d:1"), inst("s:1", state=InstanceState.SUSPECT), inst("n:1", load=False),
             reported(inst("o:1"), NOW - 12.34), inst("p:1", P),
             inst("m:1", MIX, role=P), inst("lost:1", state=InstanceState.LEASE_LOST))
    pools = candidate_pools(s, NOW, 10.0)
    assert [i.name for i in pools.prefill] == ["d:1", "lost:1"] and pools.decode == ()
    assert dict(pools.excluded) == {
        "m:1": f"role PREFILL: {EXCLUDED_NO_DECODE}",
        "n:1": EXCLUDED_NO_LOAD,
        "o:1": "load report 12.3 s old (max_load_age_s 10)",
        "p:1": f"role PREFILL: {EXCLUDED_NO_DECODE}",
        "s:1": EXCLUDED_SUSPECT}
    assert list(pools.excluded) == sorted(pools.excluded)
    # With a D side, PREFILL and DECODE are candidates (being on the D side is no exclusion).
    pd = candidate_pools(snap(inst("p:1", P), inst("x:1", DEC), inst("y:1", DEC, load=False)),
                         NOW, 10.0)
    assert ([i.name for i in pd.prefill], [i.name for i in pd.decode]) == (["p:1"], ["x:1"])
    assert dict(pd.excluded) == {"y:1": EXCLUDED_NO_LOAD}
    # A D side without a P: nothing serves, the decoders are listed.
    d_only = candidate_pools(snap(inst("x:1", DEC), inst("p:1", P, load=False)), NOW, 10.0)
    assert d_only.reason == "no schedulable prefill instance"
    assert dict(d_only.excluded) == {"p:1": EXCLUDED_NO_LOAD,
                                     "x:1": f"role DECODE: {EXCLUDED_NO_PREFILL}"}
    for policy in (CacheAware(), RoundRobin()):
        d = policy.choose(TOKENS, s, None, now=NOW)
        assert d.excluded == pools.excluded and d.to_json()["excluded"] == dict(pools.excluded)


def test_max_load_age_is_taken_as_given():
    # Its range is the settings table's (tests/unit/test_settings.py), checked once there.
    for ok in (0.001, 10, 3600):
        assert CacheAware(max_load_age_s=ok).max_load_age_s == float(ok)
        assert RoundRobin(max_load_age_s=ok).max_load_age_s == float(ok)
        assert make_policy("CAR", max_load_age_s=ok).max_load_age_s == float(ok)


# -- construction --------------------------------------------------------------------------------

def test_make_policy_names_and_ranges(caplog):
    assert isinstance(make_policy("RR"), RoundRobin)
    car = make_policy("CAR", 0.25, 0.75)
    assert (car.name, car.prefill_lambda, car.host_hit_weight) == ("CAR", 0.25, 0.75)
    slo = make_policy("SLO_AWARE", target_ttft_ms=800, target_tpot_ms=40)
    assert isinstance(slo, SloAware)
    assert (slo.name, slo.target_ttft_ms, slo.target_tpot_ms) == ("SLO_AWARE", 800, 40)
    # TTFT takes its own Host weight (D30); CAR's does not reach it.
    ttft = make_policy("TTFT", host_hit_weight=0.25, default_prefill_tokens_per_s=5000,
                       ttft_host_hit_weight=0.8, ttft_work_weight=2.0)
    assert isinstance(ttft, TtftPolicy)
    assert (ttft.name, ttft.host_hit_weight, ttft.default_prefill_tokens_per_s,
            ttft.work_weight) == ("TTFT", 0.8, 5000.0, 2.0)
    ttft = make_policy("TTFT")
    assert (ttft.host_hit_weight, ttft.work_weight) == (0.95, 6.0)   # D30, D29
    # An unknown name is a bug: the settings table admits only these (its ranges and names
    # are checked there once, tests/unit/test_settings.py).
    with pytest.raises(ValueError, match="LEAST_LOAD"):
        make_policy("LEAST_LOAD")
    # Building a policy warns about nothing: CAR without a KV index is the service's one
    # start-up line (tests/unit/test_cli_flags.py), not repeated by every build.
    with caplog.at_level(logging.WARNING, logger="kvsvc.routing"):
        make_policy("CAR")
        make_policy("RR")
        make_policy("SLO_AWARE")
        make_policy("TTFT")
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
