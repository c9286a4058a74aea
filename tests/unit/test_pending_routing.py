"""Pending prefixes (§16) in routing, without sockets: CAR and TTFT add a rank's pending hits
through one hit term (TTFT prices them as available when the own prefill computing them ends),
the route explanation shows them apart from the exact hits, the dispatch recorder adds the
blocks after the exact prefix as pending, and the audit counts pending predictions apart
(never as exact)."""

from __future__ import annotations

import dataclasses

import pytest

from kvsvc.config import KvEventsConfig
from kvsvc.directory import Directory, OverlayLimits
from kvsvc.index.tier_index import TierIndex
from kvsvc.routing.cache_audit import CAUSE_EVICTED, CAUSE_PENDING, CacheAudit
from kvsvc.routing.dispatch_record import DispatchRecorder
from kvsvc.routing.observer import RequestInfo
from kvsvc.routing.policy import CacheAware, RankHit, hit_tokens
from kvsvc.routing.request_metrics import RequestMetricsLedger
from kvsvc.routing.ttft import TtftPolicy, pending_hit_tokens, uncached_tokens
from kvsvc.streams.state import StreamId, StreamMatch
from tests.support.policy import NOW, inst, match, snap

N = 1000
TOKENS = list(range(N))


def pending(m: StreamMatch, tokens: int) -> StreamMatch:
    return dataclasses.replace(m, pending_hit_tokens=tokens)


def test_the_hit_term_adds_pending_tokens_at_device_weight():
    r = RankHit(0, 100, 200, 0.0, None, "exact", 300)
    assert hit_tokens(r, 0.5) == 100 + 100 + 300
    assert hit_tokens(RankHit(0, 0, 0, 0.0, "unsynchronized", None, 0), 0.5) == 0
    assert uncached_tokens(N, (r,), 0.5) == N - 500
    # The minimum over ranks: the rank without the pending blocks decides.
    other = RankHit(1, 100, 200, 0.0, None, "exact", 0)
    assert uncached_tokens(N, (r, other), 0.5) == N - 200
    assert pending_hit_tokens((r, other)) == 0 and pending_hit_tokens((r,)) == 300


def test_car_counts_pending_hits_and_shows_them_apart():
    policy = CacheAware(prefill_lambda=0.5)
    m = [pending(match("a:1", dev=200), 600), match("b:1", dev=300)]
    d = policy.choose(TOKENS, snap(inst("a:1"), inst("b:1")), m, now=NOW)
    assert d.prefill.name == "a:1"
    (rank,) = d.prefill_candidate("a:1").ranks
    assert (rank.device_hit_tokens, rank.pending_hit_tokens, rank.hit_ratio) == (200, 600, 0.8)
    assert d.prefill_candidate("a:1").hit_ratio == 0.8
    assert rank.to_json()["pending_hit_tokens"] == 600
    assert rank.to_json()["device_hit_tokens"] == 200   # never inside the exact hits


def test_ttft_prices_pending_hits_as_available_when_the_own_prefill_ends():
    ledger = RequestMetricsLedger()
    # The own request that computes a:1's pending blocks: 100 ms of prefill, 20 ms done.
    ledger.on_dispatch(RequestInfo(1, "a:1", "", N, 100.0, "TTFT", dispatched_at=NOW - 0.02))
    policy = TtftPolicy(ledger)
    m = [pending(match("a:1"), 900), match("b:1")]
    d = policy.choose(TOKENS, snap(inst("a:1"), inst("b:1")), m, now=NOW)
    a, b = d.prefill_candidate("a:1"), d.prefill_candidate("b:1")
    # a: waits 80 ms for the pending prefill, then computes 100 tokens (10 ms); b: 100 ms cold.
    assert a.estimated_prefill_ms == pytest.approx(80.0)
    assert a.predicted_prefill_ms == pytest.approx(10.0)
    assert b.predicted_ttft_ms == pytest.approx(100.0)
    assert d.prefill.name == "a:1"
    # Without the pending hit a is 180 ms: b wins.
    d = policy.choose(TOKENS, snap(inst("a:1"), inst("b:1")), [match("a:1"), match("b:1")],
                      now=NOW)
    assert d.prefill.name == "b:1"


BS = 4
SEED = 1024


def exact_directory() -> tuple[Directory, object]:
    import zmq

    ctx = zmq.Context()
    cfg = KvEventsConfig.model_validate({"streams": [{
        "instance_name": "10.0.0.1:8000", "block_size": BS, "endpoint": "tcp://10.0.0.1:18000",
        "replay_endpoint": "tcp://10.0.0.1:38000"}]})
    d = Directory(cfg, context=ctx, pending=OverlayLimits(10.0, 1000))
    sub = d.subscriber(StreamId("10.0.0.1:8000", 0))
    sub._serving.swap(TierIndex(BS, SEED, 1000), sequence=None, resync=False, difference=0,
                      live_events=(), stats_base=())
    return d, ctx


def test_a_routed_prompt_becomes_pending_and_attracts_the_next_request_with_its_prefix():
    d, ctx = exact_directory()
    try:
        policy = CacheAware(prefill_lambda=0.5)
        snapshot = snap(inst("10.0.0.1:8000"), inst("10.0.0.2:8000"))
        prompt = list(range(8 * BS))
        matches, pk = d.query_prompt(prompt)
        first = dataclasses.replace(policy.choose(prompt, snapshot, matches, now=NOW),
                                    prompt=pk)
        # Sent to the instance with the stream (whichever the tie chose first).
        info = RequestInfo(1, "10.0.0.1:8000", "", len(prompt), decision=first)
        DispatchRecorder(d).on_dispatch(info)
        (m,) = d.query(prompt + [1, 2, 3, 4])
        assert (m.device_hit_tokens, m.pending_hit_tokens) == (0, 8 * BS)
        again = policy.choose(prompt + [1, 2, 3, 4], snapshot, d.query(prompt + [1, 2, 3, 4]),
                              now=NOW)
        assert again.prefill.name == "10.0.0.1:8000"
    finally:
        ctx.destroy(linger=0)


def decision_with(pending_tokens: int, exact_tokens: int):
    m = [pending(match("p:1", dev=exact_tokens), pending_tokens)]
    return CacheAware().choose(TOKENS, snap(inst("p:1")), m, now=NOW)


def usage(cached: int) -> dict:
    return {"prompt_tokens": N, "prompt_tokens_details": {"cached_tokens": cached}}


def test_audit_counts_pending_predictions_apart_and_names_their_misses():
    audit = CacheAudit(lambda name: 16, backend_of=lambda name: "vllm")
    d = decision_with(pending_tokens=400, exact_tokens=320)
    info = RequestInfo(1, "p:1", "", N, decision=d)
    audit.on_end(info, usage(720))           # the pending blocks were there: within
    audit.on_end(info, usage(320))           # only the exact part: pending not cached
    audit.on_end(info, usage(100))           # less than the exact part: evicted
    snap_ = audit.snapshot()
    assert [(r.predicted, r.pending, r.cause, r.exact, r.completeness) for r in snap_.recent] \
        == [(720, 400, None, False, "pending"), (720, 400, CAUSE_PENDING, False, "pending"),
            (720, 400, CAUSE_EVICTED, False, "pending")]
    assert snap_.exact_audited == 0
    assert snap_.by_backend == {("vllm", "pending", "within_block"): 1,
                                ("vllm", "pending", "over"): 2}
    assert snap_.recent[0].to_json()["pending"] == 400


def test_ttft_work_weight_counts_the_prefill_a_colder_candidate_adds():
    def choose(weight: float):
        ledger = RequestMetricsLedger()
        ledger.on_dispatch(RequestInfo(1, "a:1", "", N, 150.0, "TTFT", dispatched_at=NOW))
        policy = TtftPolicy(ledger, work_weight=weight)
        m = [match("a:1", dev=800), match("b:1")]
        return policy.choose(TOKENS, snap(inst("a:1"), inst("b:1")), m, now=NOW)

    # §12 alone: a waits 150 ms then computes 200 tokens (170 ms); b computes 1000 (100 ms).
    d = choose(0.0)
    assert d.prefill.name == "b:1"
    assert {c.name: round(c.score, 6) for c in d.candidates} == {"a:1": 170.0, "b:1": 100.0}
    # Weight 1: b's 80 ms of extra prefill (the prefix a holds, recomputed) count once more.
    d = choose(1.0)
    assert d.prefill.name == "a:1"
    assert {c.name: round(c.score, 6) for c in d.candidates} == {"a:1": 170.0, "b:1": 180.0}
    assert d.prefill_candidate("b:1").predicted_ttft_ms == pytest.approx(100.0)
