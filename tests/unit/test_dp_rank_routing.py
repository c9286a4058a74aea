"""§15 DP-rank routing as pure functions: CAR and TTFT score (instance, rank) pairs of the
backends that honour ``X-data-parallel-rank`` with that rank's own hits and load, other
backends keep §11's minimum over ranks, the decision carries the chosen rank, the proxy sends
it and counts it in flight per rank, and the cache audit compares with that rank."""

from __future__ import annotations

from types import MappingProxyType
from typing import Optional

import pytest

from kvsvc.cluster.model import (
    Instance,
    InstanceState,
    InstanceType,
    LoadMetrics,
    RankLoad,
    RegistrySnapshot,
)
from kvsvc.routing.cache_audit import prediction
from kvsvc.routing.in_flight import InFlight, rank_waiting_estimate
from kvsvc.routing.policy import CacheAware, rank_routed
from kvsvc.routing.policies import make_policy
from kvsvc.routing.request_metrics import PendingPrefill
from kvsvc.routing.ttft import TtftPolicy, queued_ms
from kvsvc.streams.state import StreamMatch

TOKENS = list(range(1000))
AT = 1.0
NOW = AT + 1.0


def inst(name: str, backend: str = "vllm", dp: int = 2, waiting: int = 0,
         ranks: tuple[RankLoad, ...] = ()) -> Instance:
    return Instance(name=name, type=InstanceType.DEFAULT, role=InstanceType.DEFAULT,
                    incarnation_id=f"inc-{name}", register_ts_ms=None, dp_size=dp,
                    backend_type=backend, rpc_address=None, state=InstanceState.ACTIVE,
                    load=LoadMetrics(waiting, 0.0, AT, ranks, "scrape"))


def snap(*instances: Instance) -> RegistrySnapshot:
    return RegistrySnapshot(MappingProxyType({i.name: i for i in instances}), True, False, 1)


def match(name: str, rank: int, dev: int) -> StreamMatch:
    return StreamMatch(name, rank, True, 3, dev, 0, 10, 0, None)


def test_rank_routed_only_for_backends_that_honour_the_header():
    assert rank_routed(inst("a:1", "vllm"), True) and rank_routed(inst("a:1", "sglang"), True)
    assert not rank_routed(inst("a:1", "xllm"), True)
    assert not rank_routed(inst("a:1", "vllm"), False)


def test_car_scores_each_rank_and_picks_the_rank_holding_the_prefix():
    # The prefix is resident on rank 1 only: §11's minimum makes it worth 0 (issue 20).
    s = snap(inst("a:1"), inst("b:1"))
    matches = [match("a:1", 0, 0), match("a:1", 1, 512), match("b:1", 0, 0), match("b:1", 1, 0)]
    d = CacheAware(1.0, dp_rank_routing=True).choose(TOKENS, s, matches, now=NOW)
    assert (d.prefill.name, d.prefill_rank) == ("a:1", 1)
    best = d.candidates[0]
    assert (best.name, best.dp_rank, best.hit_ratio) == ("a:1", 1, pytest.approx(0.512))
    assert [r.dp_rank for r in best.ranks] == [1]
    # Four P candidates, one per pair; the ranking names each instance once.
    assert sorted((c.name, c.dp_rank) for c in d.candidates) == [
        ("a:1", 0), ("a:1", 1), ("b:1", 0), ("b:1", 1)]
    assert [i.name for i in d.prefill_ranking] == ["a:1", "b:1"]
    assert d.to_json()["prefill_dp_rank"] == 1
    # The audit compares with the chosen rank: 512 predicted, not the minimum 0.
    pred = prediction(d, "a:1")
    assert pred is not None and pred.predicted_tokens == 512


def test_min_rule_when_off_or_for_other_backends():
    matches = [match("a:1", 0, 0), match("a:1", 1, 512)]
    off = CacheAware(1.0, dp_rank_routing=False).choose(TOKENS, snap(inst("a:1")), matches,
                                                        now=NOW)
    assert off.prefill_rank is None and off.prefill_ranks == {}
    assert off.candidates[0].dp_rank is None and off.candidates[0].hit_ratio == 0.0
    xllm = CacheAware(1.0).choose(TOKENS, snap(inst("a:1", "xllm")), matches, now=NOW)
    assert xllm.prefill_rank is None and xllm.candidates[0].hit_ratio == 0.0
    pred = prediction(off, "a:1")
    assert pred is not None and (pred.predicted_tokens, pred.best_rank_tokens) == (0, 512)


def test_car_queue_term_uses_the_ranks_own_reported_queue():
    # Equal hits on both ranks; rank 0 has 6 queued, rank 1 none: rank 1 wins.
    a = inst("a:1", waiting=6, ranks=(RankLoad(0, 6, 0.5), RankLoad(1, 0, 0.1)))
    matches = [match("a:1", 0, 256), match("a:1", 1, 256)]
    d = CacheAware(0.5).choose(TOKENS, snap(a), matches, now=NOW)
    assert d.prefill_rank == 1
    by_rank = {c.dp_rank: c for c in d.candidates}
    assert (by_rank[0].queue_cost, by_rank[1].queue_cost) == (1.0, 0.0)
    assert (by_rank[0].waiting_requests_num, by_rank[0].gpu_cache_usage_perc) == (6, 0.5)
    assert (by_rank[1].waiting_requests_num, by_rank[1].gpu_cache_usage_perc) == (0, 0.1)


def test_rank_waiting_estimate_shares_an_instance_queue_and_counts_rank_dispatches():
    ledger = InFlight(clock=lambda: AT + 0.5)  # dispatched after the report
    a = inst("a:1", waiting=4)   # no per-rank values: 2 per rank
    assert rank_waiting_estimate(a, 0, ledger.snapshot()) == 2.0
    ledger.begin(["a:1"], ("a:1", 1))
    ledger.begin(["a:1"], ("a:1", 1))
    snapshot = ledger.snapshot()
    assert (snapshot.rank_total("a:1", 1), snapshot.rank_total("a:1", 0)) == (2, 0)
    assert rank_waiting_estimate(a, 1, snapshot) == 4.0
    empty = inst("b:1", waiting=0, ranks=(RankLoad(0, 0, 0.0), RankLoad(1, 0, 0.0)))
    ledger.begin(["b:1"], ("b:1", 0))
    # After a report of an empty queue the first new request is admitted, not queued.
    assert rank_waiting_estimate(empty, 0, ledger.snapshot()) == 0.0


def test_in_flight_release_drops_the_rank_count_once():
    ledger = InFlight(clock=lambda: AT)
    d = ledger.begin(["a:1"], ("a:1", 1))
    assert ledger.snapshot().rank_total("a:1", 1) == 1
    assert d.release() and not d.release()
    assert ledger.snapshot().rank_total("a:1", 1) == 0 and ledger.counts() == {}


def test_ttft_scores_pairs_with_their_rank_pending_prefills():
    # Rank 0 holds the prefix but has a long own prefill pending; rank 1 is idle with no hit.
    a = inst("a:1", dp=2, ranks=(RankLoad(0, 0, 0.0), RankLoad(1, 0, 0.0)))
    policy = TtftPolicy(default_prefill_tokens_per_s=10000.0)
    matches = [match("a:1", 0, 1000), match("a:1", 1, 0)]
    d = policy.choose(TOKENS, snap(a), matches, now=NOW)
    # No backlog: rank 0 (all cached, ~0 ms) beats rank 1 (1000 tokens, 100 ms).
    assert d.prefill_rank == 0
    by_rank = {c.dp_rank: c for c in d.candidates}
    assert by_rank[1].predicted_prefill_ms == pytest.approx(100.0)
    assert by_rank[0].predicted_prefill_ms == pytest.approx(0.0)
    assert d.prefill_estimates_ms["a:1"] == pytest.approx(0.0)


def test_queued_ms_takes_the_ranks_reported_queue():
    a = inst("a:1", waiting=9, ranks=(RankLoad(0, 1, 0.0), RankLoad(1, 8, 0.0)))
    # No own requests: foreign = W of the rank, each priced at the full prefill (10 ms).
    assert queued_ms(a, (), 10.0, (), NOW, dp_rank=0) == pytest.approx(10.0)
    assert queued_ms(a, (), 10.0, (), NOW, dp_rank=1) == pytest.approx(80.0)
    assert queued_ms(a, (), 10.0, (), NOW) == pytest.approx(90.0)
    shared = inst("b:1", waiting=6)
    assert queued_ms(shared, (), 10.0, (), NOW, dp_rank=1) == pytest.approx(30.0)
    pending = (PendingPrefill(AT + 0.9, 500.0, True, 1),)
    assert queued_ms(a, pending, 10.0, (), NOW, dp_rank=1) > 0.0


def test_make_policy_passes_the_flag():
    assert make_policy("CAR", dp_rank_routing=False).dp_rank_routing is False  # type: ignore[attr-defined]
    assert make_policy("TTFT").dp_rank_routing is True  # type: ignore[attr-defined]


def _decision_rank(policy_on: bool, backend: str) -> Optional[int]:
    matches = [match("a:1", 0, 0), match("a:1", 1, 640)]
    return CacheAware(1.0, dp_rank_routing=policy_on).choose(
        TOKENS, snap(inst("a:1", backend)), matches, now=NOW).prefill_rank


def test_sglang_gets_a_rank_and_single_rank_instances_none():
    assert _decision_rank(True, "sglang") == 1
    assert _decision_rank(True, "xllm") is None
    assert not rank_routed(inst("a:1", dp=1), True)
    d = CacheAware().choose(TOKENS, snap(inst("a:1", dp=1)), [match("a:1", 0, 128)], now=NOW)
    assert d.prefill_rank is None and d.candidates[0].hit_ratio == pytest.approx(0.128)
