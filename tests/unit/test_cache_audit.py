"""Predicted vs actual cached tokens (kvsvc.routing.cache_audit): the prediction a decision
holds for its P, the diff, the one-block tolerance, each cause of a larger miss, the counters,
the histogram and the recent records. No sockets: the rule is a pure function."""

from __future__ import annotations

from typing import Optional

import pytest

from kvsvc.config import KvEventsConfig
from kvsvc.routing.cache_audit import (
    CAUSE_EVICTED,
    CAUSE_INDEX_DISABLED,
    CAUSE_NOT_TOKENIZED,
    CAUSE_OTHER_RANK,
    CAUSE_STORED,
    CAUSE_SUBSET,
    CAUSE_TOKENIZER,
    CAUSE_UNSYNCHRONIZED,
    DIFF_BUCKETS_TOKENS,
    OUTCOME_OVER,
    OUTCOME_UNDER,
    OUTCOME_WITHIN,
    CacheAudit,
    Prediction,
    audit,
    block_sizes,
    prediction,
    usage_tokens,
)
from kvsvc.routing.observer import RequestInfo
from kvsvc.routing.policy import (
    REASON_INDEX_DISABLED,
    REASON_MISSING,
    REASON_NO_TOKENS,
    REASON_STALE,
    REASON_UNSYNCHRONIZED,
    CandidateScore,
    Decision,
    RankHit,
)

BS = 16


def rank(r: int, dev: int, host: int = 0, reason: Optional[str] = None) -> RankHit:
    return RankHit(r, dev, host, 0.0, reason)


def decision(ranks: tuple[RankHit, ...], input_tokens: int = 100, name: str = "p:1",
             policy: str = "CAR") -> Decision:
    cands = (CandidateScore(name, "P", ranks, 0.5, 0.0, 0.25, False, 0, 0.0),
             CandidateScore("d:1", "D", (), None, 0.0, 0.0, False, 0, 0.0))
    return Decision(policy, None, None, cands, (), input_tokens)


def pred(ranks: tuple[RankHit, ...], input_tokens: int = 100, subset: bool = False
         ) -> Prediction:
    p = prediction(decision(ranks, input_tokens), "p:1")
    assert p is not None
    return Prediction(p.instance, p.predicted_tokens, p.best_rank_tokens, p.input_tokens,
                      p.rank_reasons, subset)


def test_prediction_is_device_plus_host_only_min_over_ranks():
    p = prediction(decision((rank(0, 64, 16), rank(1, 48, 0))), "p:1")
    assert p == Prediction("p:1", 48, 80, 100, (None, None), False)
    assert p.exact
    # Not a P candidate, a D, RR's empty ranks, no decision: nothing predicted.
    assert prediction(decision((rank(0, 64),)), "other:1") is None
    assert prediction(decision((rank(0, 64),)), "d:1") is None
    assert prediction(decision(()), "p:1") is None
    assert prediction(None, "p:1") is None


@pytest.mark.parametrize("ranks, input_tokens, subset, actual, engine_prompt, diff, outcome, "
                         "cause", [
    # Exact hits and misses within one block (the engine recomputing the last block).
    ((rank(0, 64),), 100, False, 64, 100, 0, OUTCOME_WITHIN, None),
    ((rank(0, 64),), 100, False, 48, 100, -16, OUTCOME_WITHIN, None),
    ((rank(0, 64),), 100, False, 80, 100, 16, OUTCOME_WITHIN, None),
    # Beyond one block, by cause, in the order they are tried.
    ((rank(0, 0, reason=REASON_NO_TOKENS),), 0, False, 64, 100, 64, OUTCOME_UNDER,
     CAUSE_NOT_TOKENIZED),
    ((rank(0, 0, reason=REASON_INDEX_DISABLED),), 100, False, 64, 100, 64, OUTCOME_UNDER,
     CAUSE_INDEX_DISABLED),
    ((rank(0, 64),), 100, False, 32, 97, -32, OUTCOME_OVER, CAUSE_TOKENIZER),
    ((rank(0, 0, reason=REASON_UNSYNCHRONIZED),), 100, False, 64, 100, 64, OUTCOME_UNDER,
     CAUSE_UNSYNCHRONIZED),
    ((rank(0, 64), rank(1, 0, reason=REASON_MISSING)), 100, False, 64, 100, 64,
     OUTCOME_UNDER, CAUSE_UNSYNCHRONIZED),
    ((rank(0, 0, reason=REASON_STALE),), 100, False, 48, None, 48, OUTCOME_UNDER,
     CAUSE_UNSYNCHRONIZED),
    ((rank(0, 16),), 100, True, 64, 100, 48, OUTCOME_UNDER, CAUSE_SUBSET),
    ((rank(0, 64),), 100, False, 16, 100, -48, OUTCOME_OVER, CAUSE_EVICTED),
    ((rank(0, 16), rank(1, 64)), 100, False, 64, 100, 48, OUTCOME_UNDER, CAUSE_OTHER_RANK),
    ((rank(0, 16), rank(1, 32)), 100, False, 96, 100, 80, OUTCOME_UNDER, CAUSE_STORED),
    ((rank(0, 16),), 100, False, 64, 100, 48, OUTCOME_UNDER, CAUSE_STORED),
])
def test_audit_classifies_the_difference(ranks, input_tokens, subset, actual, engine_prompt,
                                         diff, outcome, cause):
    rec = audit(pred(ranks, input_tokens, subset), actual, engine_prompt, BS, "CAR", at=5.0)
    assert (rec.diff, rec.outcome, rec.cause) == (diff, outcome, cause)
    assert rec.actual == actual and rec.predicted == actual - diff
    assert rec.exact == (not subset and all(r.reason is None for r in ranks))


def test_usage_tokens_reads_only_non_negative_ints():
    assert usage_tokens({"prompt_tokens": 40,
                         "prompt_tokens_details": {"cached_tokens": 32}}) == (32, 40)
    assert usage_tokens({"prompt_tokens": 40}) == (None, 40)
    assert usage_tokens({"prompt_tokens_details": {"cached_tokens": -1}}) == (None, None)
    assert usage_tokens({"prompt_tokens_details": {"cached_tokens": "32"}}) == (None, None)
    assert usage_tokens({"prompt_tokens_details": None}) == (None, None)
    assert usage_tokens(None) == (None, None)


def test_block_size_per_instance_from_the_config():
    static = KvEventsConfig.model_validate({
        "streams": [{"instance_name": "10.0.0.1:8000", "block_size": 16,
                     "endpoint": "tcp://10.0.0.1:18000",
                     "replay_endpoint": "tcp://10.0.0.1:38000"}]})
    of = block_sizes(static)
    assert (of("10.0.0.1:8000"), of("10.0.0.2:8000")) == (16, 128)
    assert block_sizes(KvEventsConfig.model_validate({"discovery": {"block_size": 64}}))(
        "10.0.0.2:8000") == 64
    assert block_sizes(None)("x:1") == 128


def usage(cached: int, prompt: int = 100) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": 1, "total_tokens": prompt + 1,
            "prompt_tokens_details": {"cached_tokens": cached}}


def test_observer_counts_outcomes_causes_histogram_and_recent():
    a = CacheAudit(lambda name: BS, recent=3)
    exact = decision((rank(0, 64),))
    unsync = decision((rank(0, 0, reason=REASON_UNSYNCHRONIZED),))
    info = lambda d, i: RequestInfo(i, "p:1", "", d.input_tokens, policy="CAR", decision=d)  # noqa: E731
    a.on_dispatch(info(exact, 1))
    a.on_first_token(info(exact, 1))
    a.on_end(info(exact, 1), usage(64))          # diff 0
    a.on_end(info(exact, 2), usage(0))           # diff -64: evicted
    a.on_end(info(unsync, 3), usage(64))         # diff +64: unsynchronized
    a.on_end(info(exact, 4), {"prompt_tokens": 100})   # no cached_tokens
    a.on_end(info(decision(()), 5), usage(64))   # RR: no prediction
    a.on_cancel(info(exact, 6), "client went away")
    a.on_end(info(exact, 7), usage(48))          # diff -16: within
    snap = a.snapshot()
    assert snap.outcomes == {("p:1", OUTCOME_WITHIN): 2, ("p:1", OUTCOME_OVER): 1,
                             ("p:1", OUTCOME_UNDER): 1}
    assert snap.causes == {("p:1", CAUSE_EVICTED): 1, ("p:1", CAUSE_UNSYNCHRONIZED): 1}
    assert snap.unaudited == {"no_usage": 1, "no_prediction": 1}
    assert snap.audited == 4
    assert (snap.exact_audited, snap.exact_within) == (3, 2)
    assert (snap.diff_sum, snap.abs_error_sum) == (-16.0, 144)
    # le buckets: -64 in (-128, -1]... -> bound -1; 0 -> bound 0; -16 -> -1; +64 -> 128.
    expect = [0] * (len(DIFF_BUCKETS_TOKENS) + 1)
    expect[DIFF_BUCKETS_TOKENS.index(-1.0)] = 2
    expect[DIFF_BUCKETS_TOKENS.index(0.0)] = 1
    expect[DIFF_BUCKETS_TOKENS.index(128.0)] = 1
    assert list(snap.bucket_counts) == expect
    assert [r.diff for r in snap.recent] == [-64, 64, -16]   # the last 3, oldest first
    assert snap.recent[1].to_json() == {
        "instance": "p:1", "predicted": 0, "pending": 0, "actual": 64, "diff": 64, "outcome": "under",
        "cause": CAUSE_UNSYNCHRONIZED, "exact": False, "completeness": "none", "backend": "",
        "input_tokens": 100, "engine_prompt_tokens": 100, "policy": "CAR",
        "at": snap.recent[1].to_json()["at"]}
