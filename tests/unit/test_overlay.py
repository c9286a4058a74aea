"""Block overlays (kvsvc.index.overlay, §14 approximate index and §16 pending prefixes) without
sockets: TTL expiry with an injected clock, the LRU bound, prefix order under eviction,
settling by the stream's own events (stored, removed, AllBlocksCleared), and the directory's
approximate indexes and pending answers (never counted as exact)."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from kvsvc.clock import VirtualClock
from kvsvc.config import KvEventsConfig
from kvsvc.directory import ApproximateIndex, Directory, OverlayLimits
from kvsvc.events import DEVICE, HOST, AllBlocksCleared, BlockRemoved, BlockStored
from kvsvc.errors import ConfigError
from kvsvc.index.keys import prompt_keys
from kvsvc.index.changes import IndexChanges
from kvsvc.index.overlay import BlockOverlay, PromptKeys
from kvsvc.index.tier_index import TierIndex
from kvsvc.streams.actions import ApplyEvents
from kvsvc.streams.serving import ServingState
from kvsvc.streams.state import Completeness, StreamId

BS = 4
SEED = 1024


def tokens(n_blocks: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n_blocks * BS)]


def keys(n_blocks: int, base: int = 0) -> list[int]:
    return prompt_keys(tokens(n_blocks, base), BS, SEED)


# -- BlockOverlay ---------------------------------------------------------------------------------

def test_touch_then_match_counts_the_contiguous_prefix_only():
    ov = BlockOverlay(ttl_s=10, max_blocks=100)
    k = keys(6)
    assert ov.match(k, 0.0) == 0
    assert ov.touch(k[:4], 0.0) == 4
    assert ov.match(k, 1.0) == 4          # stops at the first block not held
    assert ov.match(k[:2], 1.0) == 2
    assert ov.match(k, 1.0, start=2) == 2  # a walk that starts later (pending after exact)
    other = keys(3, base=1000)
    assert ov.match(other, 1.0) == 0
    # A prompt whose first block differs shares nothing (content keys chain the prefix, §4).
    assert ov.match(keys(6, base=1), 1.0) == 0
    st = ov.stats()
    assert (st.blocks, st.touches, st.added, st.refreshed) == (4, 1, 4, 0)


def test_ttl_runs_from_the_last_use_and_a_touch_renews_it():
    ov = BlockOverlay(ttl_s=10, max_blocks=100)
    k = keys(3)
    ov.touch(k, 0.0)
    assert ov.match(k, 9.99) == 3
    ov.touch(k[:1], 5.0)                  # reuse of the first block only
    assert ov.match(k, 10.0) == 1         # blocks 1, 2: last used at 0, expired at 10
    assert ov.match(k, 14.99) == 1
    assert ov.match(k, 15.0) == 0
    assert ov.touch(keys(1, base=500), 15.0) == 1   # a touch sweeps what expired
    st = ov.stats()
    assert (st.blocks, st.expired, st.refreshed) == (1, 3, 1)


def test_a_query_does_not_renew_a_last_use():
    ov = BlockOverlay(ttl_s=10, max_blocks=100)
    k = keys(2)
    ov.touch(k, 0.0)
    for t in (3.0, 6.0, 9.0):
        assert ov.match(k, t) == 2
    assert ov.match(k, 10.0) == 0


def test_lru_bound_drops_the_least_recently_used_and_keeps_prefixes_whole():
    ov = BlockOverlay(ttl_s=100, max_blocks=5)
    a, b = keys(3, base=0), keys(3, base=1000)
    ov.touch(a, 0.0)
    ov.touch(b, 1.0)          # 6 blocks > 5: a's leaf goes first (its root is newer)
    assert len(ov) == 5
    assert ov.match(a, 2.0) == 2
    assert ov.match(b, 2.0) == 3
    ov.touch(a[:1], 3.0)      # a's root used again; a's second block (used at 0) is the oldest
    ov.touch(keys(1, base=2000), 4.0)
    assert (ov.match(a, 5.0), ov.match(b, 5.0)) == (1, 3)
    assert ov.stats().evicted == 2


def test_a_prompt_longer_than_the_bound_keeps_its_first_blocks():
    ov = BlockOverlay(ttl_s=100, max_blocks=4)
    k = keys(10)
    assert ov.touch(k, 0.0) == 10
    assert len(ov) == 4
    assert ov.match(k, 1.0) == 4


def test_touch_from_start_adds_only_the_blocks_after_it():
    ov = BlockOverlay(ttl_s=100, max_blocks=100)
    k = keys(5)
    assert ov.touch(k, 0.0, start=3) == 2
    assert ov.match(k, 1.0) == 0          # the walk from the root stops at once
    assert ov.match(k, 1.0, start=3) == 2
    assert ov.touch(k, 0.0, start=5) == 0


def test_discard_clear_and_settle():
    ov = BlockOverlay(ttl_s=100, max_blocks=100)
    k = keys(4)
    ov.touch(k, 0.0)
    assert ov.discard([k[0], 12345]) == 1
    assert ov.match(k, 1.0) == 0 and ov.match(k, 1.0, start=1) == 3
    assert ov.settle(IndexChanges(keys=[k[1]])) == 1
    assert ov.settle(IndexChanges(cleared=True)) == 2
    assert len(ov) == 0 and ov.stats().settled == 4
    ov.touch(k, 2.0)
    assert ov.clear() == 4


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="ttl_s"):
        BlockOverlay(ttl_s=0, max_blocks=1)
    with pytest.raises(ValueError, match="max_blocks"):
        BlockOverlay(ttl_s=1, max_blocks=0)


# -- the index collects what settles pending blocks ------------------------------------------------

def stored(hashes: list[int], toks: list[int], parent=None, tier: int = DEVICE) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=toks,
                       block_size=BS, tier=tier)


def test_tier_index_collects_stored_removed_and_cleared_keys():
    index = TierIndex(BS, SEED, 1000)
    k = keys(3)
    changes = IndexChanges()
    index.apply([stored([1, 2, 3], tokens(3))], changes=changes)
    assert changes.keys == k and not changes.cleared
    changes.reset()
    index.apply([BlockRemoved(block_hashes=[3, 99], tier=DEVICE)], changes=changes)
    assert changes.keys == [k[2]]        # the unknown hash names nothing
    changes.reset()
    index.apply([AllBlocksCleared(HOST)], changes=changes)
    assert not changes.cleared           # Host only: pending (Device-to-be) blocks stay
    index.apply([AllBlocksCleared(None)], changes=changes)
    assert changes.cleared
    # Without a collector nothing is kept (the index's own state is unchanged by the option).
    index.apply([stored([1], tokens(1))])
    assert index.match(k) == (1, 0)


def serving_with_pending(ttl_s: float = 10.0) -> tuple[ServingState, BlockOverlay]:
    state = ServingState(StreamId("10.0.0.1:8000", 0), BS)
    pending = BlockOverlay(ttl_s, 1000)
    state.pending = pending
    state.swap(TierIndex(BS, SEED, 1000), sequence=None, resync=False, difference=0,
               live_events=(), stats_base=())
    return state, pending


def test_live_batches_settle_the_streams_pending_blocks():
    state, pending = serving_with_pending()
    k = keys(4)
    pending.touch(k, 0.0)
    assert state.apply(ApplyEvents(0, [stored([1, 2], tokens(2))])) is None
    # Stored: exact now, no longer pending; the rest stays pending after the exact prefix.
    m = state.match(k)
    assert (m.device_hit_tokens, m.completeness) == (2 * BS, Completeness.EXACT)
    assert pending.match(k, 1.0) == 0 and pending.match(k, 1.0, start=2) == 2
    # A removal of a stored block leaves nothing pending behind it.
    pending.touch(k, 1.0, start=1)   # re-dispatched while block 1 looked missing
    state.apply(ApplyEvents(1, [BlockRemoved(block_hashes=[2], tier=DEVICE)]))
    assert pending.match(k, 2.0, start=1) == 0
    # AllBlocksCleared covers every pending block.
    pending.touch(k, 2.0, start=1)
    state.apply(ApplyEvents(2, [AllBlocksCleared(None)]))
    assert len(pending) == 0


def test_an_empty_pending_set_settles_nothing_and_the_collector_is_reused():
    state, pending = serving_with_pending()
    assert state.apply(ApplyEvents(0, [stored([1, 2], tokens(2))])) is None
    assert pending.stats().settled == 0 and state._changes.keys == []


# -- the directory: approximate indexes and pending answers ----------------------------------------

def approx_config(ttl_s: int = 60, blocks: int = 100) -> KvEventsConfig:
    return KvEventsConfig.model_validate({"discovery": {
        "backends": [], "approximate_backends": ["xllm"], "block_size": BS,
        "approximate_ttl_s": ttl_s, "approximate_blocks": blocks}})


def test_directory_answers_an_approximate_index_as_approximate_and_synchronized():
    clock = VirtualClock(100.0)
    d = Directory(approx_config(), clock=clock)
    sid = StreamId("10.0.0.1:8000", 0)
    d.add_approximate(sid, block_size=BS, hash_seed=SEED, identity="inc-1", backend="xllm")
    assert d.stream_ids() == [sid] and d.approximate_ids() == [sid]
    assert d.identity(sid) == "inc-1" and d.approximate_backend(sid) == "xllm"
    assert d.statuses() == [] and d.ready()    # not a stream: nothing to synchronize
    prompt = tokens(3) + [7, 7]                # 3 full blocks and a partial one
    (m,), pk = d.query_prompt(prompt)
    assert (m.synchronized, m.completeness, m.device_hit_tokens, m.error) == (
        True, Completeness.APPROXIMATE, 0, None)
    assert m.to_json()["completeness"] == "approximate"
    assert d.record_dispatch(sid.instance_name, [(0, 0)], pk) == 3
    (m,) = d.query(prompt)
    assert (m.device_hit_tokens, m.host_only_hit_tokens, m.device_blocks, m.sequence,
            m.pending_hit_tokens) == (3 * BS, 0, 3, None, 0)
    # A longer prompt with the same prefix hits the prefix; TTL after the last use.
    (m,) = d.query(tokens(5))
    assert m.device_hit_tokens == 3 * BS
    clock.advance(60)
    (m,) = d.query(prompt)
    assert m.device_hit_tokens == 0
    (kind, st), = d.overlay_stats().values()
    assert (kind, st.touches, st.added) == ("approximate", 1, 3)


def test_directory_approximate_lru_bound_and_removal():
    clock = VirtualClock(100.0)
    d = Directory(approx_config(blocks=4), clock=clock)
    sid = StreamId("10.0.0.1:8000", 0)
    d.add_approximate(sid, block_size=BS, hash_seed=SEED)
    with pytest.raises(ConfigError):
        d.add_approximate(sid, block_size=BS, hash_seed=SEED)
    _, pk = d.query_prompt(tokens(3))
    d.record_dispatch(sid.instance_name, [(0, 0)], pk)
    clock.advance(1)
    _, pk2 = d.query_prompt(tokens(3, base=1000))
    d.record_dispatch(sid.instance_name, [(0, 0)], pk2)
    assert [m.device_hit_tokens for m in d.query(tokens(3))] == [BS]   # LRU kept its root
    assert [m.device_hit_tokens for m in d.query(tokens(3, base=1000))] == [3 * BS]
    assert d.remove_stream(sid) and d.query(tokens(3)) == [] and d.identity(sid) is None
    assert not d.remove_stream(sid)
    # Unknown instances and ranks are ignored.
    assert d.record_dispatch("10.0.0.9:1", [(0, 0)], pk) == 0


def test_record_dispatch_uses_the_keys_of_the_index_geometry():
    d = Directory(approx_config())
    sid = StreamId("10.0.0.1:8000", 0)
    d.add_approximate(sid, block_size=BS, hash_seed=SEED)
    other = PromptKeys(MappingProxyType({(BS * 2, SEED): [1, 2]}))
    assert d.record_dispatch(sid.instance_name, [(0, 0)], other) == 0


def static_stream(port: int = 18000) -> dict:
    return {"instance_name": "10.0.0.1:8000", "block_size": BS,
            "endpoint": f"tcp://10.0.0.1:{port}", "replay_endpoint": f"tcp://10.0.0.1:{port + 1}"}


def test_pending_hits_come_after_the_exact_prefix_and_never_inside_device_hits():
    import zmq

    clock = VirtualClock(100.0)
    ctx = zmq.Context()
    try:
        cfg = KvEventsConfig.model_validate({"streams": [static_stream()]})
        d = Directory(cfg, context=ctx, pending=OverlayLimits(2.0, 100), clock=clock)
        sid = StreamId("10.0.0.1:8000", 0)
        sub = d.subscriber(sid)
        assert sub is not None and sub.pending is not None
        serving = sub._serving
        serving.swap(TierIndex(BS, SEED, 1000), sequence=None, resync=False, difference=0,
                     live_events=(), stats_base=())
        serving.apply(ApplyEvents(0, [stored([1], tokens(1))]))
        prompt = tokens(4)
        (m,), pk = d.query_prompt(prompt)
        assert (m.device_hit_tokens, m.pending_hit_tokens) == (BS, 0)
        d.record_dispatch(sid.instance_name, [(0, m.reusable_prefix_tokens)], pk)
        (m,) = d.query(prompt)
        assert (m.device_hit_tokens, m.pending_hit_tokens, m.completeness) == (
            BS, 3 * BS, Completeness.EXACT)
        assert m.to_json()["pending_hit_tokens"] == 3 * BS
        # Its events arrive: exact, not pending.
        serving.apply(ApplyEvents(1, [stored([2, 3], prompt[BS:3 * BS], parent=1)]))
        (m,) = d.query(prompt)
        assert (m.device_hit_tokens, m.pending_hit_tokens) == (3 * BS, BS)
        # The TTL passes: nothing pending is left to count.
        clock.advance(2.0)
        (m,) = d.query(prompt)
        assert (m.device_hit_tokens, m.pending_hit_tokens) == (3 * BS, 0)
        # An unsynchronized stream answers no pending hit.
        d.record_dispatch(sid.instance_name, [(0, 3 * BS)], pk)
        serving.invalidate("test")
        (m,) = d.query(prompt)
        assert (m.synchronized, m.device_hit_tokens, m.pending_hit_tokens) == (False, 0, 0)
        assert ("pending" in {kind for kind, _ in d.overlay_stats().values()})
    finally:
        ctx.destroy(linger=0)


def test_directory_without_pending_settings_has_no_pending_overlays():
    import zmq

    ctx = zmq.Context()
    try:
        cfg = KvEventsConfig.model_validate({"streams": [static_stream()]})
        d = Directory(cfg, context=ctx)
        sub = d.subscriber(StreamId("10.0.0.1:8000", 0))
        assert sub is not None and sub.pending is None and d.overlay_stats() == {}
    finally:
        ctx.destroy(linger=0)


def test_approximate_index_matcher_is_exactly_the_overlay_walk():
    ov = BlockOverlay(10, 100)
    approx = ApproximateIndex(StreamId("a:1", 1), ov, BS, SEED, "xllm")
    k = keys(2)
    ov.touch(k, 0.0)
    m = approx.match(k, 1.0)
    assert (m.instance_name, m.dp_rank, m.device_hit_tokens, m.host_only_hit_tokens,
            m.device_blocks, m.host_blocks) == ("a:1", 1, 2 * BS, 0, 2, 0)
