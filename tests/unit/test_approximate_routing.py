"""The approximate index (§14) end to end without sockets: discovery plans one per (instance, DP
rank) of a backend in ``approximate_backends`` and follows the instance's lifecycle (new
incarnation: empty again; SUSPECT or gone: dropped), the dispatch recorder fills it from the
router's own decisions, CAR and TTFT use its hits like exact ones, and the audit counts its
answers per backend."""

from __future__ import annotations

from types import MappingProxyType
from typing import Optional

from kvsvc.clock import VirtualClock
from kvsvc.cluster.discovery import Discovery, plan_streams
from kvsvc.cluster.model import (
    Instance,
    InstanceState,
    InstanceType,
    LoadMetrics,
    RegistrySnapshot,
)
from kvsvc.config import KvEventsConfig
from kvsvc.directory import Directory
from kvsvc.routing.cache_audit import CAUSE_APPROXIMATE, CacheAudit
from kvsvc.routing.dispatch_record import DispatchRecorder, dispatch_ranks
from kvsvc.routing.observer import RequestInfo
from kvsvc.routing.policy import CacheAware, RoundRobin
from kvsvc.routing.ttft import TtftPolicy
from kvsvc.streams.state import Completeness, StreamId

BS = 4
T = InstanceType
CFG = KvEventsConfig.model_validate({"discovery": {
    "backends": ["vllm"], "approximate_backends": ["xllm"], "block_size": BS,
    "refresh_interval_ms": 50}})
DISC = CFG.discovery
REPORTED_AT = 1.0
NOW = 2.0


def inst(name: str, *, dp: int = 1, inc: str = "inc-1", backend: str = "xllm",
         state: InstanceState = InstanceState.ACTIVE, waiting: int = 0,
         type_: T = T.DEFAULT) -> Instance:
    return Instance(name=name, type=type_, role=type_, incarnation_id=inc, register_ts_ms=1000,
                    dp_size=dp, backend_type=backend, rpc_address=name, state=state,
                    load=LoadMetrics(waiting, 0.0, REPORTED_AT))


def snap(*instances: Instance) -> RegistrySnapshot:
    return RegistrySnapshot(MappingProxyType({i.name: i for i in instances}), True, True, 1)


class Source:
    """The registry as discovery reads it: only ``snapshot()``."""

    def __init__(self, *instances: Instance) -> None:
        self.value = snap(*instances)

    def snapshot(self) -> RegistrySnapshot:
        return self.value


def tokens(n_blocks: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n_blocks * BS)]


# -- discovery -------------------------------------------------------------------------------------

def test_plan_gives_approximate_indexes_per_rank_and_streams_to_the_others():
    p = plan_streams(snap(inst("10.0.0.1:8000", dp=2), inst("10.0.0.2:8000", backend="vllm"),
                          inst("10.0.0.3:8000", backend="sglang"),
                          inst("10.0.0.4:8000", type_=T.DECODE),
                          inst("10.0.0.5:8000", state=InstanceState.SUSPECT)), DISC, CFG)
    assert sorted(p.approximate) == [StreamId("10.0.0.1:8000", 0), StreamId("10.0.0.1:8000", 1)]
    a = p.approximate[StreamId("10.0.0.1:8000", 1)]
    assert (a.identity, a.dp_size, a.backend.value) == ("inc-1", 2, "xllm")
    assert sorted(p.streams) == [StreamId("10.0.0.2:8000", 0)]
    assert dict(p.other_backends) == {"10.0.0.3:8000": "sglang"}


def test_approximate_indexes_count_against_max_streams():
    limits = KvEventsConfig.model_validate({"max_streams": 2, "discovery": {
        "backends": [], "approximate_backends": ["xllm"]}})
    p = plan_streams(snap(inst("10.0.0.1:8000"), inst("10.0.0.2:8000", dp=2)),
                     limits.discovery, limits)
    assert sorted(p.approximate) == [StreamId("10.0.0.1:8000", 0)]
    assert p.excluded["10.0.0.2:8000"].startswith("max_streams=2 reached")


def test_discovery_follows_the_instances_lifecycle():
    source = Source(inst("10.0.0.1:8000"))
    clock = VirtualClock(1000.0)
    d = Directory(CFG, clock=clock)
    disc = Discovery(source, d, DISC, CFG)
    r = disc.refresh()
    sid = StreamId("10.0.0.1:8000", 0)
    assert r.added == (sid,) and d.approximate_ids() == [sid]
    assert d.identity(sid) == "inc-1" and d.approximate_backend(sid) == "xllm"
    _, pk = d.query_prompt(tokens(2))
    d.record_dispatch(sid.instance_name, [(0, 0)], pk)
    assert [m.device_hit_tokens for m in d.query(tokens(2))] == [2 * BS]
    # Same incarnation: kept with its blocks.
    r = disc.refresh()
    assert (r.kept, r.changed) == (1, False)
    assert [m.device_hit_tokens for m in d.query(tokens(2))] == [2 * BS]
    # A new incarnation: replaced, empty again (a restarted engine has an empty cache).
    source.value = snap(inst("10.0.0.1:8000", inc="inc-2"))
    r = disc.refresh()
    assert r.replaced == (sid,) and d.identity(sid) == "inc-2"
    assert [m.device_hit_tokens for m in d.query(tokens(2))] == [0]
    # An idle index expires on discovery's refresh (not only on its next dispatch).
    _, pk = d.query_prompt(tokens(3))
    d.record_dispatch(sid.instance_name, [(0, 0)], pk)
    assert d.overlay_stats()[sid][1].blocks == 3
    clock.advance(DISC.approximate_ttl_s)
    disc.refresh()
    assert d.overlay_stats()[sid][1].blocks == 0
    # SUSPECT: dropped.
    source.value = snap(inst("10.0.0.1:8000", inc="inc-2", state=InstanceState.SUSPECT))
    r = disc.refresh()
    assert r.removed == (sid,) and d.approximate_ids() == [] and d.query(tokens(2)) == []


# -- the recorder, the policies and the audit --------------------------------------------------------

def routed(directory: Directory, policy, snapshot: RegistrySnapshot, prompt: list[int]):
    """Decide like :meth:`kvsvc.routing.router.Router.decide` (with the keys)."""
    import dataclasses

    identities = {sid: directory.identity(sid) for sid in directory.stream_ids()}
    matches, pk = directory.query_prompt(prompt)
    decision = policy.choose(prompt, snapshot, matches, identities, now=NOW)
    return dataclasses.replace(decision, prompt=pk)


def dispatch(recorder: DispatchRecorder, decision, attempt: int = 1,
             dp_rank: Optional[int] = None) -> RequestInfo:
    info = RequestInfo(attempt, decision.prefill.name, "", decision.input_tokens,
                       policy=decision.policy, decision=decision, dp_rank=dp_rank)
    recorder.on_dispatch(info)
    return info


def cluster(*instances: Instance) -> tuple[Directory, RegistrySnapshot]:
    d = Directory(CFG)
    snapshot = snap(*instances)
    Discovery(Source(*instances), d, DISC, CFG).refresh()
    return d, snapshot


def test_car_follows_the_approximate_hits_of_its_own_routing():
    d, snapshot = cluster(inst("10.0.0.1:8000"), inst("10.0.0.2:8000"))
    recorder = DispatchRecorder(d)
    policy = CacheAware(prefill_lambda=0.5)
    prompt = tokens(8)
    first = routed(d, policy, snapshot, prompt)
    assert first.prefill is not None
    (cand,) = [c for c in first.candidates if c.name == first.prefill.name]
    assert (cand.ranks[0].device_hit_tokens, cand.ranks[0].completeness) == (0, "approximate")
    dispatch(recorder, first)
    # The same conversation again: the approximate hit takes it to the same instance.
    again = routed(d, policy, snapshot, prompt + tokens(2, base=500))
    assert again.prefill.name == first.prefill.name
    cand = again.prefill_candidate(first.prefill.name)
    assert cand is not None
    assert (cand.ranks[0].device_hit_tokens, cand.ranks[0].completeness) == (
        8 * BS, Completeness.APPROXIMATE.value)
    assert cand.hit_ratio == 8 / 10


def test_ttft_prices_approximate_hits_like_exact_ones():
    d, snapshot = cluster(inst("10.0.0.1:8000"), inst("10.0.0.2:8000"))
    policy = TtftPolicy(default_prefill_tokens_per_s=1000.0)
    prompt = tokens(10)
    first = routed(d, policy, snapshot, prompt)
    DispatchRecorder(d).on_dispatch(RequestInfo(1, first.prefill.name, "", 40,
                                                decision=first))
    again = routed(d, policy, snapshot, prompt)
    cand = again.prefill_candidate(first.prefill.name)
    other = [c for c in again.candidates if c.name != first.prefill.name][0]
    assert again.prefill.name == first.prefill.name
    assert cand.predicted_prefill_ms == 0.0 and other.predicted_prefill_ms == 40.0


def test_rr_decisions_are_recorded_on_every_rank_of_the_instance():
    d, snapshot = cluster(inst("10.0.0.1:8000", dp=2))
    decision = routed(d, RoundRobin(), snapshot, tokens(3))
    info = RequestInfo(1, "10.0.0.1:8000", "", 12, decision=decision)
    assert dispatch_ranks(decision, info) == [(0, 0), (1, 0)]
    DispatchRecorder(d).on_dispatch(info)
    assert [m.device_hit_tokens for m in d.query(tokens(3))] == [3 * BS, 3 * BS]


def test_a_request_sent_to_one_rank_is_recorded_on_that_rank_only():
    d, snapshot = cluster(inst("10.0.0.1:8000", dp=2))
    decision = routed(d, CacheAware(), snapshot, tokens(3))
    dispatch(DispatchRecorder(d), decision, dp_rank=1)
    assert [(m.dp_rank, m.device_hit_tokens) for m in d.query(tokens(3))] == [
        (0, 0), (1, 3 * BS)]


def test_a_decision_without_keys_records_nothing():
    d, snapshot = cluster(inst("10.0.0.1:8000"))
    matches = d.query(tokens(3))
    decision = CacheAware().choose(tokens(3), snapshot, matches, now=NOW)
    DispatchRecorder(d).on_dispatch(RequestInfo(1, "10.0.0.1:8000", "", 12,
                                                decision=decision))
    assert [m.device_hit_tokens for m in d.query(tokens(3))] == [0]


def test_audit_counts_approximate_predictions_per_backend():
    d, snapshot = cluster(inst("10.0.0.1:8000"))
    recorder = DispatchRecorder(d)
    audit = CacheAudit(lambda name: BS, backend_of=lambda name: "xllm")
    first = routed(d, CacheAware(), snapshot, tokens(5))
    info = dispatch(recorder, first)
    audit.on_end(info, {"prompt_tokens": 20, "prompt_tokens_details": {"cached_tokens": 0}})
    second = routed(d, CacheAware(), snapshot, tokens(5))
    info = dispatch(recorder, second, attempt=2)
    # The engine had evicted most of it: the approximation over-predicted by 3 blocks.
    audit.on_end(info, {"prompt_tokens": 20, "prompt_tokens_details": {"cached_tokens": 8}})
    snap_ = audit.snapshot()
    assert snap_.by_backend == {("xllm", "approximate", "within_block"): 1,
                                ("xllm", "approximate", "over"): 1}
    assert snap_.backend_abs_error == {("xllm", "approximate"): 12}
    assert snap_.recent[-1].cause == CAUSE_APPROXIMATE and not snap_.recent[-1].exact
    assert snap_.recent[-1].to_json()["completeness"] == "approximate"
    assert snap_.exact_audited == 0
