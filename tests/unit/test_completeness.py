"""``completeness`` (§7h, §10) as routing and ``/ready`` see it, without sockets: CAR uses a
subset stream's hits as they are (they are never more than the engine holds, §7h/§11), the
per-rank entries of ``/v1/internal/route`` say which kind each rank's hits came from, and a
``/ready`` stream entry shows it only while synchronized."""

from __future__ import annotations

import pytest

from kvsvc.config import ReplayMode
from kvsvc.http.health import stream_json
from kvsvc.routing.policy import (
    REASON_MISSING,
    REASON_NO_TOKENS,
    REASON_UNSYNCHRONIZED,
    CacheAware,
    RankHit,
    rank_hits,
)
from kvsvc.streams.state import Completeness, StreamId, StreamMatch, StreamState, StreamStatus
from tests.support.policy import NOW, TOKENS, inst, snap

EXACT, SUBSET = Completeness.EXACT, Completeness.SUBSET


def match(name: str, dev: int = 0, host: int = 0, rank: int = 0,
          completeness: Completeness = EXACT) -> StreamMatch:
    """A synchronized stream's answer, as ServingState gives it (completeness set)."""
    return StreamMatch(name, rank, True, 7, dev, host, 10, 5, None, completeness)


def unsynced(name: str, rank: int = 0) -> StreamMatch:
    return StreamMatch(name, rank, False, None, 0, 0, 0, 0, "sequence gap: expected 3, got 5")


def by_stream(*matches: StreamMatch) -> dict[tuple[str, int], StreamMatch]:
    return {(m.instance_name, m.dp_rank): m for m in matches}


def test_subset_hits_count_as_they_are_in_each_rank():
    a = inst("a:1", dp=3)
    ranks = rank_hits(a, TOKENS, by_stream(match("a:1", 40, 20, 0, SUBSET),
                                           match("a:1", 60, 0, 1, EXACT),
                                           unsynced("a:1", 2)), None, 0.5)
    assert ranks == (RankHit(0, 40, 20, 0.5, None, "subset"),
                     RankHit(1, 60, 0, 0.6, None, "exact"),
                     RankHit(2, 0, 0, 0.0, REASON_UNSYNCHRONIZED, None))
    assert [r.to_json() for r in ranks] == [
        {"dp_rank": 0, "device_hit_tokens": 40, "host_only_hit_tokens": 20, "pending_hit_tokens": 0, "hit_ratio": 0.5,
         "reason": None, "completeness": "subset"},
        {"dp_rank": 1, "device_hit_tokens": 60, "host_only_hit_tokens": 0, "pending_hit_tokens": 0, "hit_ratio": 0.6,
         "reason": None, "completeness": "exact"},
        {"dp_rank": 2, "device_hit_tokens": 0, "host_only_hit_tokens": 0, "pending_hit_tokens": 0, "hit_ratio": 0.0,
         "reason": "unsynchronized", "completeness": None}]


def test_completeness_is_null_where_no_hit_comes_from_an_index():
    a = inst("a:1", dp=2)
    assert rank_hits(a, TOKENS, by_stream(match("a:1", 8, 0, 0, SUBSET)), None, 0.5)[1] == (
        RankHit(1, 0, 0, 0.0, REASON_MISSING, None))
    # No tokens: the stream was asked and answered; its kind is known.
    assert rank_hits(a, [], by_stream(match("a:1", 0, 0, 0, SUBSET)), None, 0.5)[0] == (
        RankHit(0, 0, 0, 0.0, REASON_NO_TOKENS, "subset"))


def test_car_prefers_a_subset_stream_with_more_hits_over_an_exact_one_with_fewer():
    """§7h/§11: a subset's hits are resident blocks, so they weigh exactly like exact ones. Equal
    queues: the subset instance with 80 of 100 tokens beats the exact one with 30."""
    s = snap(inst("exact:1"), inst("subset:1"))
    d = CacheAware().choose(TOKENS, s, [match("exact:1", 30), match("subset:1", 80,
                                                                     completeness=SUBSET)],
                            now=NOW)
    assert d.prefill.name == "subset:1"
    by_name = {c.name: c for c in d.candidates}
    # 0.5 * (1 - 0.8) + 0.5 * 0 = 0.1 against 0.5 * (1 - 0.3) = 0.35.
    assert by_name["subset:1"].score == pytest.approx(0.1, abs=1e-12)
    assert by_name["exact:1"].score == pytest.approx(0.35, abs=1e-12)
    assert [r.completeness for r in by_name["subset:1"].ranks] == ["subset"]
    # The same hits from an exact stream give the same score: completeness does not weigh.
    d2 = CacheAware().choose(TOKENS, s, [match("exact:1", 30), match("subset:1", 80)], now=NOW)
    assert {c.name: c.score for c in d2.candidates} == {c.name: c.score for c in d.candidates}


def test_multi_rank_minimum_takes_subset_ranks_as_they_are():
    s = snap(inst("a:1", dp=2))
    d = CacheAware(host_hit_weight=0.0).choose(
        TOKENS, s, [match("a:1", 50, 0, 0, SUBSET), match("a:1", 70, 0, 1, EXACT)], now=NOW)
    (cand,) = d.candidates
    assert (cand.hit_ratio, [r.completeness for r in cand.ranks]) == (0.5, ["subset", "exact"])


def status(state: StreamState, completeness) -> StreamStatus:
    return StreamStatus(stream=StreamId("10.0.0.7:8000", 1), state=state,
                        error=None if state is StreamState.SYNCHRONIZED else "recovering",
                        sequence=41 if state is StreamState.SYNCHRONIZED else None,
                        device_blocks=12, host_blocks=3, entries=15, synchronized_once=True,
                        recoveries=2, resync_differences=1, completeness=completeness)


def test_ready_stream_entry_shows_completeness_only_while_synchronized():
    assert stream_json(status(StreamState.SYNCHRONIZED, SUBSET), ReplayMode.HISTORY) == {
        "instance_name": "10.0.0.7:8000", "dp_rank": 1, "state": "synchronized",
        "synchronized_once": True, "sequence": 41, "error": None, "device_blocks": 12,
        "host_blocks": 3, "recoveries": 2, "resync_differences": 1, "completeness": "subset",
        "replay_mode": "history"}
    assert stream_json(status(StreamState.SYNCHRONIZED, EXACT),
                       ReplayMode.SNAPSHOT)["completeness"] == "exact"
    for state in (StreamState.RECOVERING, StreamState.UNSYNCHRONIZED):
        entry = stream_json(status(state, SUBSET), None)
        assert (entry["state"], entry["completeness"], entry["replay_mode"]) == (
            state.value, None, None)
