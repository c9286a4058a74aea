"""The directory (§10) with real StreamSubscribers against tests/support/publisher.py engines."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any, Sequence

import pytest

import kvsvc.directory as directory_module
from kvsvc.config import KvEventsConfig, StreamConfig, parse_kv_events_config
from kvsvc.directory import NOT_STARTED, Directory
from kvsvc.errors import ConfigError, LifecycleError
from kvsvc.streams.state import StreamId, StreamState
from tests.support.publisher import ProtocolPublisher, removed, stored
from tests.support.util import free_ports, wait_for

B4 = 4          # block size of most streams here
SEED = 1024     # default hash_seed


class Cluster:
    """Publishers (engines) and the matching §8 stream entries on loopback ports."""

    def __init__(self, ctx, stack: ExitStack) -> None:
        self.ctx = ctx
        self.stack = stack
        self.streams: list[dict[str, Any]] = []
        self.publishers: dict[StreamId, ProtocolPublisher] = {}

    def engine(self, instance: str, dp_rank: int = 0, block_size: int = B4,
               hash_seed: int = SEED, state: Sequence[dict] = ()) -> ProtocolPublisher:
        """A started engine whose snapshot holds ``state`` (no live batch published yet)."""
        event_port, replay_port = free_ports(2)
        pub = ProtocolPublisher(self.ctx, event_port, replay_port, dp_rank=dp_rank)
        pub.set_snapshot(state, watermark=None)
        pub.start()
        self.stack.callback(pub.close)
        self.publishers[StreamId(instance, dp_rank)] = pub
        self.streams.append(self.entry(instance, dp_rank, event_port, replay_port, block_size,
                                       hash_seed))
        return pub

    @staticmethod
    def entry(instance: str, dp_rank: int, event_port: int, replay_port: int, block_size: int,
              hash_seed: int) -> dict[str, Any]:
        return {"instance_name": instance, "dp_rank": dp_rank, "block_size": block_size,
                "hash_seed": hash_seed, "endpoint": f"tcp://127.0.0.1:{event_port}",
                "replay_endpoint": f"tcp://127.0.0.1:{replay_port}"}

    def config(self, **limits: Any) -> KvEventsConfig:
        return parse_kv_events_config({"streams": self.streams, "replay_timeout_ms": 500,
                                       **limits})


@pytest.fixture
def cluster(zmq_ctx):
    with ExitStack() as stack:
        yield Cluster(zmq_ctx, stack)


def started(directory: Directory, stack: ExitStack) -> Directory:
    directory.start(timeout_s=5.0)
    stack.callback(directory.close, 5.0)
    return directory


def wait_synced(directory: Directory) -> None:
    """Every stream synchronized."""
    wait_for(lambda: all(st.state is StreamState.SYNCHRONIZED for st in directory.statuses()),
             timeout_s=10, what="all streams synchronized")


def hits(directory: Directory, tokens: list[int]) -> dict[tuple[str, int], tuple[int, int]]:
    """(instance, rank) -> (device_hit_tokens, host_only_hit_tokens)."""
    return {(m.instance_name, m.dp_rank): (m.device_hit_tokens, m.host_only_hit_tokens)
            for m in directory.query(tokens)}


# -- construction, lifecycle, readiness ----------------------------------------------------------

def test_no_streams_is_ready_and_answers_nothing():
    d = Directory(parse_kv_events_config({"streams": []}))
    assert d.ready() is True
    with ExitStack() as stack:
        started(d, stack)
        assert d.query([1, 2, 3, 4]) == []
        assert d.statuses() == []
        assert d.ready() is True


def test_not_started_streams_answer_unsynchronized_in_name_order(cluster):
    for name in ("b:1", "a:1"):
        cluster.streams.append(Cluster.entry(name, 0, *free_ports(2), B4, SEED))
    cluster.streams.append(Cluster.entry("a:1", 1, *free_ports(2), B4, SEED))
    d = Directory(cluster.config())
    assert d.stream_ids() == [StreamId("a:1", 0), StreamId("a:1", 1), StreamId("b:1", 0)]
    matches = d.query(list(range(8)))
    assert [(m.instance_name, m.dp_rank, m.synchronized, m.device_hit_tokens, m.error)
            for m in matches] == [("a:1", 0, False, 0, NOT_STARTED),
                                  ("a:1", 1, False, 0, NOT_STARTED),
                                  ("b:1", 0, False, 0, NOT_STARTED)]
    assert d.ready() is False
    assert [st.state for st in d.statuses()] == [StreamState.UNSYNCHRONIZED] * 3


def test_ready_after_every_stream_synchronized_once(cluster):
    cluster.engine("a:1", state=[stored([1], None, [1, 2, 3, 4], B4)])
    late = cluster.engine("b:1")
    late.hold_replies()  # b:1 stays unsynchronized until released
    with ExitStack() as stack:
        d = started(Directory(cluster.config(), cluster.ctx), stack)
        wait_for(lambda: d.statuses()[0].synchronized_once, timeout_s=10, what="a:1 synced")
        assert d.ready() is False
        late.release_replies()
        wait_for(d.ready, timeout_s=10, what="directory ready")
        assert [st.synchronized_once for st in d.statuses()] == [True, True]


def test_owned_context_created_in_start_and_destroyed_in_close(cluster):
    cluster.engine("a:1", state=[stored([1], None, [1, 2, 3, 4], B4)])
    d = Directory(cluster.config())
    assert d.context is None
    with ExitStack() as stack:
        started(d, stack)
        assert d.context is not None
        wait_synced(d)
        assert hits(d, [1, 2, 3, 4]) == {("a:1", 0): (4, 0)}
        context = d.context
    assert d.context is None
    assert context.closed
    # Closed again: no effect.
    d.close()


def test_start_failure_closes_streams_already_started(cluster, monkeypatch):
    for name in ("a:1", "b:1", "c:1"):
        cluster.engine(name)
    d = Directory(cluster.config(), cluster.ctx)
    failing = d.subscriber(StreamId("c:1", 0))

    def fail(timeout_s: float = 5.0) -> None:
        raise LifecycleError("forced start failure")

    # Forcing the rare path: one stream's thread does not start in time.
    monkeypatch.setattr(failing, "start", fail)
    with pytest.raises(LifecycleError, match="forced start failure"):
        d.start(timeout_s=5.0)
    # a:1 and b:1 were started and closed again: the autouse leak check sees no thread left.
    assert [st.stream.instance_name for st in d.statuses()] == ["a:1", "b:1", "c:1"]
    d.close()  # not running: no effect


def test_start_twice_is_an_error(cluster):
    cluster.engine("a:1")
    with ExitStack() as stack:
        d = started(Directory(cluster.config(), cluster.ctx), stack)
        with pytest.raises(LifecycleError, match="already started"):
            d.start()


# -- queries -------------------------------------------------------------------------------------

def test_keys_computed_once_per_geometry(cluster, monkeypatch):
    tokens = list(range(100, 124))  # 24 tokens: 6 blocks of 4, 3 blocks of 8
    # Two streams share (4, 1024); one uses (8, 1024); one (4, 7): three geometries.
    cluster.engine("a:1", block_size=4, state=[stored([1, 2], None, tokens[:8], 4)])
    cluster.engine("b:1", block_size=4, state=[stored([1, 2, 3], None, tokens[:12], 4)])
    cluster.engine("c:1", block_size=8, state=[stored([1, 2], None, tokens[:16], 8)])
    cluster.engine("d:1", block_size=4, hash_seed=7, state=[stored([1], None, tokens[:4], 4)])
    calls: list[tuple[int, int, int]] = []
    packs: list[int] = []
    real_chain, real_pack = directory_module.chain_keys, directory_module.pack_tokens

    def counting_chain(packed, block_size, seed, parent_key=None):
        calls.append((len(packed), block_size, seed))
        return real_chain(packed, block_size, seed, parent_key)

    def counting_pack(token_ids):
        packs.append(len(token_ids))
        return real_pack(token_ids)

    with ExitStack() as stack:
        d = started(Directory(cluster.config(), cluster.ctx), stack)
        wait_synced(d)
        # Spies that call through: they only count how often the real functions run.
        monkeypatch.setattr(directory_module, "chain_keys", counting_chain)
        monkeypatch.setattr(directory_module, "pack_tokens", counting_pack)
        assert hits(d, tokens) == {("a:1", 0): (8, 0), ("b:1", 0): (12, 0),
                                   ("c:1", 0): (16, 0), ("d:1", 0): (4, 0)}
    assert packs == [24]
    assert sorted(calls) == [(96, 4, 7), (96, 4, 1024), (96, 8, 1024)]


def test_only_full_blocks_count_exact_tokens(cluster):
    cluster.engine("a:1", state=[stored([1, 2, 3], None, list(range(1, 13)), B4)])
    with ExitStack() as stack:
        d = started(Directory(cluster.config(), cluster.ctx), stack)
        wait_synced(d)
        assert hits(d, list(range(1, 11))) == {("a:1", 0): (8, 0)}   # 10 tokens: 2 full blocks
        assert hits(d, list(range(1, 14))) == {("a:1", 0): (12, 0)}  # all 3 blocks + 1 token
        assert hits(d, [1, 2, 3, 5]) == {("a:1", 0): (0, 0)}          # first block differs
        assert hits(d, [1, 2, 3]) == {("a:1", 0): (0, 0)}             # no full block
        m = d.query([])[0]
        assert (m.synchronized, m.device_hit_tokens, m.host_only_hit_tokens, m.device_blocks,
                m.host_blocks, m.error) == (True, 0, 0, 3, 0, None)


def test_dp_ranks_are_never_stitched(cluster):
    tokens = list(range(1, 13))
    # Rank 0 holds block 0 only; rank 1 holds blocks 0-2, then loses block 0 in a live
    # delta (removal never cascades, so it keeps blocks 1 and 2). Stitching would give rank
    # 0's block 0 + rank 1's blocks 1-2 = 12 tokens; each rank alone has 4 and 0.
    cluster.engine("a:1", dp_rank=0, state=[stored([10], None, tokens[:4], B4)])
    rank1 = cluster.engine("a:1", dp_rank=1, state=[stored([20, 21, 22], None, tokens, B4)])
    with ExitStack() as stack:
        d = started(Directory(cluster.config(), cluster.ctx), stack)
        wait_synced(d)
        assert hits(d, tokens) == {("a:1", 0): (4, 0), ("a:1", 1): (12, 0)}
        rank1.wait_subscribed()
        assert rank1.publish([removed([20], "gpu")]) == 0
        wait_for(lambda: d.statuses()[1].sequence == 0, timeout_s=10, what="rank 1 at seq 0")
        assert hits(d, tokens) == {("a:1", 0): (4, 0), ("a:1", 1): (0, 0)}
        blocks = {(m.dp_rank): (m.device_blocks, m.host_blocks) for m in d.query(tokens)}
        assert blocks == {0: (1, 0), 1: (2, 0)}


def test_host_of_another_instance_is_not_shared(cluster):
    tokens = list(range(1, 13))
    # a:1 has block 0 on Device; b:1 has blocks 0-2 on Host only. a:1's prefix is 4 tokens
    # (b:1's Host copy of blocks 1-2 is not a:1's), b:1's is 12 host-only tokens.
    cluster.engine("a:1", state=[stored([1], None, tokens[:4], B4)])
    cluster.engine("b:1", state=[stored([1, 2, 3], None, tokens, B4, medium="cpu")])
    with ExitStack() as stack:
        d = started(Directory(cluster.config(), cluster.ctx), stack)
        wait_synced(d)
        assert hits(d, tokens) == {("a:1", 0): (4, 0), ("b:1", 0): (0, 12)}
        m = {m.instance_name: m for m in d.query(tokens)}
        assert (m["a:1"].device_blocks, m["a:1"].host_blocks) == (1, 0)
        assert (m["b:1"].device_blocks, m["b:1"].host_blocks) == (0, 3)
        assert m["b:1"].reusable_prefix_tokens == 12


def test_device_then_host_only_split(cluster):
    tokens = list(range(1, 13))
    # Blocks 0-1 on Device, block 2 on Host only (it carries its tokens): 8 + 4.
    cluster.engine("a:1", state=[stored([1, 2], None, tokens[:8], B4, medium="gpu"),
                                 stored([3], 2, tokens[8:], B4, medium="cpu")])
    with ExitStack() as stack:
        d = started(Directory(cluster.config(), cluster.ctx), stack)
        wait_synced(d)
        assert hits(d, tokens) == {("a:1", 0): (8, 4)}


def test_bad_token_raises_value_error(cluster):
    cluster.engine("a:1")
    d = Directory(cluster.config(), cluster.ctx)
    with pytest.raises(ValueError):
        d.query([1, -1])
    with pytest.raises(ValueError):
        d.query([2**31])


# -- run-time changes ----------------------------------------------------------------------------

def test_add_and_remove_streams_at_run_time(cluster):
    cluster.engine("a:1", state=[stored([1], None, [1, 2, 3, 4], B4)])
    with ExitStack() as stack:
        d = started(Directory(cluster.config(), cluster.ctx), stack)
        wait_synced(d)
        event_port, replay_port = free_ports(2)
        pub = ProtocolPublisher(cluster.ctx, event_port, replay_port)
        pub.set_snapshot([stored([5, 6], None, [1, 2, 3, 4, 5, 6, 7, 8], B4)], watermark=None)
        pub.start()
        stack.callback(pub.close)
        cfg = StreamConfig(**Cluster.entry("0:1", 0, event_port, replay_port, B4, SEED))
        assert d.add_stream(cfg) == StreamId("0:1", 0)
        with pytest.raises(ConfigError):
            d.add_stream(cfg)
        assert d.stream_ids() == [StreamId("0:1", 0), StreamId("a:1", 0)]
        wait_synced(d)
        assert hits(d, list(range(1, 9))) == {("0:1", 0): (8, 0), ("a:1", 0): (4, 0)}
        assert d.remove_stream(StreamId("a:1", 0)) is True
        assert d.remove_stream(StreamId("a:1", 0)) is False
        assert hits(d, list(range(1, 9))) == {("0:1", 0): (8, 0)}
        assert len(d) == 1


def test_add_stream_before_start_is_started_with_the_rest(cluster):
    cluster.engine("a:1", state=[stored([1], None, [1, 2, 3, 4], B4)])
    d = Directory(parse_kv_events_config({"streams": [], "replay_timeout_ms": 500}))
    d.add_stream(StreamConfig(**cluster.streams[0]))
    assert [m.error for m in d.query([])] == [NOT_STARTED]
    with ExitStack() as stack:
        started(d, stack)
        wait_synced(d)
        assert hits(d, [1, 2, 3, 4]) == {("a:1", 0): (4, 0)}


def test_restart_after_close(cluster):
    cluster.engine("a:1", state=[stored([1], None, [1, 2, 3, 4], B4)])
    for context in (cluster.ctx, None):
        d = Directory(cluster.config(), context)
        for _ in range(2):
            with ExitStack() as stack:
                started(d, stack)
                wait_synced(d)
                assert hits(d, [1, 2, 3, 4]) == {("a:1", 0): (4, 0)}
            assert [m.synchronized for m in d.query([])] == [False]


def test_streams_take_turns_draining_live_batches(cluster):
    """Live batches are applied one stream thread at a time (the directory's live-turns lock:
    16 threads each dropping and retaking the GIL per frame thrashed it, 137 us of CPU per
    message against 36 in turns). Held elsewhere, no stream applies a batch; released, every
    stream catches up exactly."""
    pubs = [cluster.engine(f"t{i}:1") for i in range(3)]
    with ExitStack() as stack:
        d = started(Directory(cluster.config(), cluster.ctx), stack)
        wait_synced(d)
        subs = [d.subscriber(sid) for sid in d.stream_ids()]
        assert len(subs) == 3 and all(s.live_turns is d.live_turns for s in subs)

        def waiting_for_turn(sub) -> bool:
            return sub.debug_view().waiting_for_live_turn

        with d.live_turns:
            seqs = [pub.publish([stored([i + 1], None, [7, 8, 9, 10 + i], B4)])
                    for i, pub in enumerate(pubs)]
            # Each thread has its batch readable and waits for its turn; none applied it.
            wait_for(lambda: all(waiting_for_turn(s) for s in subs), timeout_s=10,
                     what="every stream thread waiting for its turn")
            assert [st.sequence for st in d.statuses()] == [None, None, None]
        wait_for(lambda: [st.sequence for st in d.statuses()] == seqs, timeout_s=10,
                 what="every stream applied its batch")
        assert [hits(d, [7, 8, 9, 10 + i])[(f"t{i}:1", 0)] for i in range(3)] == [(4, 0)] * 3
