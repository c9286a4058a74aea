"""SLO_AWARE (kvsvc.routing.slo) reproduces xllm-service @73d5e00 decision by decision: each case
names the source function and the condition it exercises (``instance_mgr.cpp``
``select_instance_pair_on_slo``, ``flip_prefill_to_decode``, ``flip_decode_to_prefill``,
``update_request_metrics``, ``get_next_instance_pair``; ``slo_aware_policy.cpp``). Predictors are
fitted from exact profiling points (offset by 0.5 ms so the source's truncation to whole ms is
stable); request metrics are set through the real ledger's observer calls."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from dataclasses import dataclass, field
from typing import Optional

import pytest

from kvsvc.cluster.model import Instance, InstanceType, ProfilingData
from kvsvc.errors import ConfigError
from kvsvc.settings import load_service_settings
from kvsvc.routing.observer import RequestInfo
from kvsvc.routing.request_metrics import NO_REQUESTS, RequestMetricsLedger
from kvsvc.routing.slo import SloAware, f32, to_ms, trunc_div
from tests.support.policy import NOW, inst, snap

P, DEC, MIX, DEF = (InstanceType.PREFILL, InstanceType.DECODE, InstanceType.MIX,
                    InstanceType.DEFAULT)
N = 100   # prompt tokens of the routed request
TOKENS = list(range(N))
_ids = itertools.count(1)


def ttft_points(c0: float, c1: float, c2: float = 0.0) -> tuple[tuple[int, float], ...]:
    return tuple((n, c0 + c1 * n + c2 * n * n) for n in (0, 100, 200, 400))


def tpot_points(d0: float, d1: float = 0.0, d2: float = 0.0
                ) -> tuple[tuple[int, int, float], ...]:
    return tuple((length, b, d0 + d1 * b + d2 * b * (length - 1))
                 for length, b in ((1, 1), (11, 2), (21, 1), (5, 4)))


def node(name: str, type_: InstanceType, *, role: Optional[InstanceType] = None,
         tpot: tuple[float, float, float] = (0.5, 0.0, 0.0),
         ttft: tuple[float, float, float] = (0.5, 1.0, 0.0)) -> Instance:
    """An instance whose TTFT is ``trunc(0.5 + n)`` = n ms and whose TPOT follows ``tpot``."""
    return dataclasses.replace(inst(name, type_, role=role), profiling=ProfilingData(
        ttft=ttft_points(*ttft), tpot=tpot_points(*tpot)))


def set_prefill_ms(ledger: RequestMetricsLedger, name: str, ms: float) -> RequestInfo:
    """Make ``name``'s estimated_prefill_time ``ms`` (one request in prefill there)."""
    info = RequestInfo(next(_ids), name, "", 0, ms)
    ledger.on_dispatch(info)
    return info


def set_decode(ledger: RequestMetricsLedger, name: str, requests: int, tokens: int) -> None:
    """Give D ``name`` ``requests`` decode requests holding ``tokens`` tokens in all."""
    for i in range(requests):
        ledger.on_dispatch(RequestInfo(next(_ids), "elsewhere:1", name,
                                       tokens if i == 0 else 0))


@dataclass
class Case:
    id: str
    source: str                 # the source function and condition exercised
    p: dict[str, int]           # P name -> estimated_prefill_time (ms)
    d: dict[str, tuple[int, int]]   # D name -> (predicted TPOT ms, estimated_prefill_time ms)
    want_p: str
    want_d: str
    target_ttft: int = 1000
    target_tpot: int = 50
    p_types: dict[str, InstanceType] = field(default_factory=dict)


CASES = [
    Case("p-lowest", "select_instance_pair_on_slo: P = the lowest estimated_prefill_time",
         {"p1:1": 300, "p2:1": 100, "p3:1": 200}, {"d1:1": (10, 0)}, "p2:1", "d1:1"),
    Case("p-tie-first", "select_instance_pair_on_slo: prefill_time < min (strict): a tie "
         "keeps the first in prefill_index_", {"p1:1": 100, "p2:1": 100}, {"d1:1": (10, 0)},
         "p1:1", "d1:1"),
    Case("d-first-meeting-target", "select_instance_pair_on_slo: estimated_tpot <= "
         "FLAGS_target_tpot && target empty: the first D meeting it, not the lowest",
         {"p1:1": 0}, {"d1:1": (40, 0), "d2:1": (10, 0)}, "p1:1", "d1:1"),
    Case("d-equal-target-meets", "select_instance_pair_on_slo: <= includes the target",
         {"p1:1": 0}, {"d1:1": (50, 0), "d2:1": (10, 0)}, "p1:1", "d1:1"),
    Case("d-none-meets-lowest", "select_instance_pair_on_slo: no D meets the target: "
         "min_decode_instance (first of the lowest)", {"p1:1": 0},
         {"d1:1": (70, 0), "d2:1": (60, 0), "d3:1": (60, 0)}, "p1:1", "d2:1"),
    Case("redirect", "select_instance_pair_on_slo: min_prefill_time > target_ttft && target "
         "!= min_decode && min_tpot < target_tpot*(|D|-1)/|D| && min_decode's "
         "estimated_prefill_time < min_prefill_time: prefill on min_decode_instance",
         {"p1:1": 1500}, {"d1:1": (40, 0), "d2:1": (10, 0)}, "d2:1", "d1:1"),
    Case("redirect-min-over-p", "select_instance_pair_on_slo: the redirect compares the "
         "lowest P's time", {"p1:1": 1200, "p2:1": 1100}, {"d1:1": (40, 0), "d2:1": (10, 0)},
         "d2:1", "d1:1"),
    Case("no-redirect-at-target", "select_instance_pair_on_slo: min_prefill_time > "
         "target_ttft is strict", {"p1:1": 1000}, {"d1:1": (40, 0), "d2:1": (10, 0)},
         "p1:1", "d1:1"),
    Case("no-redirect-target-is-min", "select_instance_pair_on_slo: target_decode_instance "
         "== min_decode_instance", {"p1:1": 1500}, {"d1:1": (10, 0), "d2:1": (40, 0)},
         "p1:1", "d1:1"),
    Case("no-redirect-tpot-at-threshold", "select_instance_pair_on_slo: min_estimated_tpot "
         "< target_tpot * (|D|-1)/|D| is strict (25 < 50 * 0.5 false)", {"p1:1": 1500},
         {"d1:1": (40, 0), "d2:1": (25, 0)}, "p1:1", "d1:1"),
    Case("no-redirect-busy-decode", "select_instance_pair_on_slo: min_decode's own "
         "estimated_prefill_time must be below min_prefill_time", {"p1:1": 1500},
         {"d1:1": (40, 0), "d2:1": (10, 1500)}, "p1:1", "d1:1"),
    Case("redirect-three-d", "select_instance_pair_on_slo: tpot_threshold (3-1)/3: "
         "39 < 60 * 2/3", {"p1:1": 1500}, {"d1:1": (50, 0), "d2:1": (55, 0), "d3:1": (39, 0)},
         "d3:1", "d1:1", target_tpot=60),
    Case("no-redirect-three-d", "select_instance_pair_on_slo: 40 < 60 * 2/3 (float) false",
         {"p1:1": 1500}, {"d1:1": (50, 0), "d2:1": (55, 0), "d3:1": (40, 0)},
         "p1:1", "d1:1", target_tpot=60),
    Case("target-ttft-zero", "select_instance_pair_on_slo: --target_ttft 0 (the source "
         "accepts >= 0): any positive estimate is over it", {"p1:1": 1},
         {"d1:1": (40, 0), "d2:1": (10, 0)}, "d2:1", "d1:1", target_ttft=0),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_select_instance_pair_on_slo(case: Case):
    ledger = RequestMetricsLedger()
    policy = SloAware(ledger, case.target_ttft, case.target_tpot)
    instances = [node(n, case.p_types.get(n, P)) for n in case.p]
    instances += [node(n, DEC, tpot=(tpot + 0.5, 0.0, 0.0)) for n, (tpot, _) in case.d.items()]
    for name, ms in case.p.items():
        if ms:
            set_prefill_ms(ledger, name, ms)
    for name, (_, ms) in case.d.items():
        if ms:
            set_prefill_ms(ledger, name, ms)
    d = policy.choose(TOKENS, snap(*instances), None, now=NOW)
    assert (d.prefill.name, d.decode.name) == (case.want_p, case.want_d), case.source
    # The request's estimated_ttft on the chosen P: trunc(predict_ttft(100)) = 100 ms.
    assert d.prefill_estimates_ms[case.want_p] == 100.0
    by = {(c.side, c.name): c for c in d.candidates}
    for name, (tpot, _) in case.d.items():
        assert by[("D", name)].predicted_tpot_ms == tpot
    for name, ms in case.p.items():
        c = by[("P", name)]
        assert (c.estimated_prefill_ms, c.predicted_prefill_ms, c.predicted_ttft_ms) == (
            ms, 100.0, ms + 100.0)
    assert d.prefill_ranking[0].name == case.want_p


def test_tpot_prediction_adds_the_request_to_the_decode_metrics():
    """select_instance_pair_on_slo: predict_tpot(decode_token_num + |token_ids|,
    decode_request_num + 1)."""
    ledger = RequestMetricsLedger()
    policy = SloAware(ledger, target_tpot_ms=50)
    # d1: tpot = 0.5 + total tokens; d2: tpot = 0.5 + 10 * batch.
    d1 = node("d1:1", DEC, tpot=(0.5, 0.0, 1.0))
    d2 = node("d2:1", DEC, tpot=(0.5, 10.0, 0.0))
    s = snap(node("p1:1", P), d1, d2)
    set_decode(ledger, "d1:1", 2, 30)      # 30 + 20 prompt tokens = 50: meets 50
    set_decode(ledger, "d2:1", 4, 0)       # batch 5: 50.5 -> 50: meets 50 too (second)
    d = policy.choose(list(range(20)), s, None, now=NOW)
    assert d.decode.name == "d1:1"
    assert {c.name: c.predicted_tpot_ms for c in d.candidates if c.side == "D"} == {
        "d1:1": 50.0, "d2:1": 50.0}
    ledger.on_dispatch(RequestInfo(next(_ids), "elsewhere:1", "d1:1", 1))  # 51 now
    d = policy.choose(list(range(20)), s, None, now=NOW)
    assert d.decode.name == "d2:1"


def test_flip_prefill_to_decode_reorders_the_prefill_index_only():
    """select_instance_pair_on_slo: no D meets the target and (avg_prefill_time <
    target_ttft*(|P|-1)/|P| or |D| < |P|) -> flip_prefill_to_decode(P); a PREFILL instance is
    swapped out of prefill_index_ and appended again by add_instance_to_index."""
    ledger = RequestMetricsLedger()
    policy = SloAware(ledger)
    s = snap(node("p1:1", P), node("p2:1", P), node("p3:1", P),
             node("d1:1", DEC, tpot=(80.5, 0, 0)))
    d = policy.choose(TOKENS, s, None, now=NOW)
    assert (d.prefill.name, d.decode.name) == ("p1:1", "d1:1")
    assert policy.index_order() == (("p3:1", "p2:1", "p1:1"), ("d1:1",))
    # The reordered index decides the next tie (all three at 0 ms): p3 first now.
    assert policy.choose(TOKENS, s, None, now=NOW).prefill.name == "p3:1"


@pytest.mark.parametrize("p_ms, d_tpot, n_d, flips, why", [
    ((0, 0), 80, 2, True, "avg 0 < 1000 * 1/2"),
    ((900, 1300), 80, 2, False, "avg 1100 >= 500 and |D| == |P|"),
    ((900, 1300), 80, 1, True, "|D| 1 < |P| 2"),
    ((0, 0), 40, 2, False, "a D meets the target: no flip"),
])
def test_flip_prefill_to_decode_conditions(p_ms, d_tpot, n_d, flips, why):
    """select_instance_pair_on_slo: the flip condition, case by case."""
    ledger = RequestMetricsLedger()
    policy = SloAware(ledger)
    for name, ms in zip(("p1:1", "p2:1"), p_ms):
        if ms:
            set_prefill_ms(ledger, name, ms)
    ds = [node(f"d{i}:1", DEC, tpot=(d_tpot + 0.5, 0, 0)) for i in range(1, n_d + 1)]
    d = policy.choose(TOKENS, snap(node("p1:1", P), node("p2:1", P), *ds), None, now=NOW)
    assert d.prefill.name == "p1:1"
    p_index = policy.index_order()[0]
    assert (p_index == ("p2:1", "p1:1")) is flips, why


def test_flip_prefill_to_decode_needs_two_prefills_and_keeps_a_mix_in_prefill():
    """flip_prefill_to_decode: count_schedulable_instances(prefill_index_) <= 1 returns; a MIX
    re-added while decode_index_ is not empty takes PREFILL again (add_instance_to_index), so
    at 73d5e00 this flip never changes a role."""
    ledger = RequestMetricsLedger()
    policy = SloAware(ledger)
    slow_d = node("d1:1", DEC, tpot=(80.5, 0, 0))
    d = policy.choose(TOKENS, snap(node("p1:1", P), slow_d), None, now=NOW)
    assert policy.index_order() == (("p1:1",), ("d1:1",))
    mixed = snap(node("m1:1", MIX, role=P), node("p2:1", P), slow_d)
    d = policy.choose(TOKENS, mixed, None, now=NOW)
    assert d.prefill.name == "m1:1"
    assert policy.index_order() == (("p2:1", "m1:1"), ("d1:1",))
    d = policy.choose(TOKENS, mixed, None, now=NOW)
    assert {c.name for c in d.candidates if c.side == "P"} == {"m1:1", "p2:1"}


def end_of_decode(ledger: RequestMetricsLedger, decode: str) -> None:
    """One request whose D is ``decode`` runs to its end (SCHEDULE .. FINISH_DECODE)."""
    info = RequestInfo(next(_ids), "p1:1", decode, 10, 10.0)
    ledger.on_dispatch(info)
    ledger.on_first_token(info)
    ledger.on_token(info)
    ledger.on_end(info, None)


def test_flip_decode_to_prefill_turns_an_idle_mix_decode_into_a_prefill(caplog):
    """update_request_metrics: decode_request_num == 0 after FINISH_DECODE ->
    flip_decode_to_prefill(D): with more than one D, a MIX leaves decode_index_ and is re-added
    as PREFILL (decode_index_ not empty); the role is this process's, nothing is written."""
    ledger = RequestMetricsLedger()
    policy = SloAware(ledger)
    s = snap(node("p1:1", P), node("m1:1", MIX, role=DEC), node("d2:1", DEC))
    policy.choose(TOKENS, s, None, now=NOW)
    assert policy.index_order() == (("p1:1",), ("d2:1", "m1:1"))
    with caplog.at_level(logging.INFO, logger="kvsvc.routing.slo"):
        end_of_decode(ledger, "m1:1")
    assert [r.getMessage() for r in caplog.records] == [
        "SLO_AWARE: m1:1 (MIX) flips DECODE -> PREFILL"]
    assert policy.index_order() == (("p1:1", "m1:1"), ("d2:1",))
    d = policy.choose(TOKENS, s, None, now=NOW)
    assert {c.name for c in d.candidates if c.side == "P"} == {"p1:1", "m1:1"}
    assert {c.name for c in d.candidates if c.side == "D"} == {"d2:1"}
    # The registry moving the MIX itself (here: to PREFILL) ends the override: its rule wins;
    # a new incarnation starts from the registry's role too.
    moved = snap(node("p1:1", P), node("m1:1", MIX, role=P), node("d2:1", DEC))
    policy.choose(TOKENS, moved, None, now=NOW)
    assert policy._roles == {}


def test_flip_decode_to_prefill_conditions():
    """flip_decode_to_prefill: only with count_schedulable_instances(decode_index_) > 1; a
    DECODE instance is re-added to decode_index_ (order only); nothing while requests remain."""
    ledger = RequestMetricsLedger()
    policy = SloAware(ledger)
    one = snap(node("p1:1", P), node("m1:1", MIX, role=DEC))
    policy.choose(TOKENS, one, None, now=NOW)
    end_of_decode(ledger, "m1:1")
    assert policy.index_order() == (("p1:1",), ("m1:1",))
    two = snap(node("p1:1", P), node("d1:1", DEC), node("d2:1", DEC), node("d3:1", DEC))
    policy.choose(TOKENS, two, None, now=NOW)
    set_decode(ledger, "d1:1", 1, 5)          # still one request after the next end
    end_of_decode(ledger, "d1:1")
    assert policy.index_order()[1] == ("d1:1", "d2:1", "d3:1")
    end_of_decode(ledger, "d2:1")             # idle: swapped out, appended again
    assert policy.index_order()[1] == ("d1:1", "d3:1", "d2:1")


def test_requests_without_token_ids_rotate_round_robin():
    """slo_aware_policy.cpp: token_ids empty -> get_next_instance_pair (RR on both sides)."""
    ledger = RequestMetricsLedger()
    policy = SloAware(ledger)
    set_prefill_ms(ledger, "p1:1", 5000)   # ignored by round robin
    s = snap(node("p1:1", P), node("p2:1", P), node("d1:1", DEC), node("d2:1", DEC),
             node("d3:1", DEC))
    pairs = [(d.prefill.name, d.decode.name) for d in
             (policy.choose(None if i % 2 else [], s, None, now=NOW) for i in range(4))]
    assert pairs == [("p1:1", "d1:1"), ("p2:1", "d2:1"), ("p1:1", "d3:1"), ("p2:1", "d1:1")]
    d = policy.choose(None, s, None, now=NOW)
    assert d.prefill_estimates_ms == {}


def test_default_alone_takes_the_lowest_estimate_where_the_source_fails():
    """select_instance_pair_on_slo returns false with no decode instance ("No decode instance
    found!"); kvsvc lets DEFAULT serve alone (§11) with the P rule, no redirect, no flip."""
    ledger = RequestMetricsLedger()
    policy = SloAware(ledger)
    set_prefill_ms(ledger, "a:1", 2000)
    s = snap(node("a:1", DEF), node("b:1", DEF))
    d = policy.choose(TOKENS, s, None, now=NOW)
    assert (d.prefill.name, d.decode) == ("b:1", None)
    assert [i.name for i in d.prefill_ranking] == ["b:1", "a:1"]
    assert policy.index_order() == (("a:1", "b:1"), ())


def test_no_profiling_data_predicts_zero_everywhere():
    """time_predictor.cpp: empty profiling data -> zero coefficients, every prediction 0: the
    first D meets any target and every estimated_ttft is 0."""
    ledger = RequestMetricsLedger()
    policy = SloAware(ledger, target_tpot_ms=0)
    bare = [inst("p1:1", P), inst("d1:1", DEC), inst("d2:1", DEC)]
    d = policy.choose(TOKENS, snap(*bare), None, now=NOW)
    assert (d.prefill.name, d.decode.name) == ("p1:1", "d1:1")
    assert d.prefill_estimates_ms == {"p1:1": 0.0}


def test_ledger_follows_update_request_metrics_and_never_double_counts_a_cancel():
    """update_request_metrics: SCHEDULE / FINISH_PREFILL / GENERATE / FINISH_DECODE / CANCEL
    on the P's and D's RequestMetrics; a CANCEL after FINISH_PREFILL undoes the decode part
    only (the source would subtract the prefill part a second time)."""
    ledger = RequestMetricsLedger()
    info = RequestInfo(next(_ids), "p:1", "d:1", 40, 123.0)
    ledger.on_dispatch(info)
    s = ledger.snapshot()
    assert s.of("p:1").to_json() == {"prefill_request_num": 1, "prefill_token_num": 40,
                                     "estimated_prefill_ms": 123.0, "decode_request_num": 0,
                                     "decode_token_num": 0}
    assert (s.of("d:1").decode_request_num, s.of("d:1").decode_token_num) == (1, 40)
    ledger.on_first_token(info)
    ledger.on_token(info)
    ledger.on_token(info)
    s = ledger.snapshot()
    assert s.of("p:1").prefill_request_num == 0 and s.of("p:1").estimated_prefill_ms == 0
    assert s.of("d:1").decode_token_num == 43
    ledger.on_cancel(info, "client went away")
    ledger.on_cancel(info, "again")   # only the first end counts
    s = ledger.snapshot()
    assert (s.of("p:1"), s.of("d:1")) == (NO_REQUESTS, NO_REQUESTS)


def test_source_arithmetic_helpers():
    """int64_t truncation toward zero, C integer division, float thresholds."""
    assert (to_ms(49.999), to_ms(-2.7), to_ms(float("nan"))) == (49, -2, 0)
    assert (trunc_div(7, 2), trunc_div(-7, 2)) == (3, -3)
    assert f32(2.0 / 3.0) == 0.6666666865348816


def test_targets_out_of_range_refuse_naming_the_flag():
    # Checked once, by the settings table; SloAware takes what it is given.
    for kwargs, flag in (({"target_ttft": -1}, "--target_ttft"),
                         ({"target_tpot": 600_001}, "--target_tpot")):
        with pytest.raises(ConfigError) as err:
            load_service_settings(**kwargs)
        assert err.value.field == flag
    slo = SloAware(RequestMetricsLedger(), target_ttft_ms=3_600_000, target_tpot_ms=0)
    assert (slo.target_ttft_ms, slo.target_tpot_ms) == (3_600_000, 0)
