"""The simulated engine: block manager semantics (LRU, parents kept, Host offload, truth), the
byte-exact wire of live events and snapshots (§1, §2, §7) seen through raw pyzmq sockets, the
snapshot/live consistency rule, and every fault switch."""

from __future__ import annotations

import random
import time

import ormsgpack
import pytest
import zmq

from kvsvc.errors import LifecycleError
from kvsvc.events import DEVICE, HOST
from kvsvc.testbed.sim import NO_SEQ, SimEngine, chain_hash
from kvsvc.testbed.sim.block_manager import BlockManager
from kvsvc.testbed.sim.engine import encode_snapshot, pack_batch
from tests.support.util import wait_for
from tests.support.sim import BS, blocks, consecutive_ports, dealer, hashes, nothing_within, recv, subscriber

STORED_KEYS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
               "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"]
REMOVED_KEYS = ["type", "block_hashes", "medium", "group_idx"]


class Mirror:
    """What a consumer learns from the events: presence flags per engine hash (§5 without
    content keys), to check that the events describe the cache exactly."""

    def __init__(self) -> None:
        self.flags: dict[int, int] = {}

    def apply(self, events: list[dict]) -> None:
        for e in events:
            tier = DEVICE if e["medium"] == "gpu" else HOST
            for h in e["block_hashes"]:
                if e["type"] == "BlockStored":
                    if e["token_ids"] or h in self.flags:
                        self.flags[h] = self.flags.get(h, 0) | tier
                else:
                    if h in self.flags:
                        self.flags[h] &= ~tier
                        if not self.flags[h]:
                            del self.flags[h]


# ---- block manager ---------------------------------------------------------------------------

def test_chain_hash_is_xxh3_of_parent_and_tokens():
    import xxhash
    assert chain_hash(None, [1, 2]) == xxhash.xxh3_64_intdigest(b"\x01\0\0\0\x02\0\0\0")
    assert chain_hash(5, [1]) == xxhash.xxh3_64_intdigest(b"\x05" + b"\0" * 7 + b"\x01\0\0\0")
    assert chain_hash(None, [1, 2]) != chain_hash(0, [1, 2])


def test_store_walk_and_partial_block():
    bm = BlockManager(BS, device_blocks=8)
    ex = bm.execute(blocks(0, 10) + [99, 98])  # two full blocks and a partial one
    h = hashes(blocks(0, 10))
    assert ex.events == [{
        "type": "BlockStored", "block_hashes": h, "parent_block_hash": None,
        "token_ids": blocks(0, 10), "block_size": BS, "lora_id": None, "medium": "gpu",
        "lora_name": None, "extra_keys": None, "group_idx": None,
        "kv_cache_spec_kind": "full_attention"}]
    assert (ex.device_hit_tokens, ex.host_only_hit_tokens, ex.stored_blocks) == (0, 0, 2)
    assert bm.resident() == {h[0]: DEVICE, h[1]: DEVICE}
    assert bm.true_prefix(blocks(0, 10, 20)) == (8, 0)
    assert bm.true_prefix(blocks(0, 11)) == (4, 0)
    assert bm.true_prefix(blocks(1)) == (0, 0)
    ex2 = bm.execute(blocks(0, 10, 20))
    assert (ex2.device_hit_tokens, ex2.stored_blocks) == (8, 1)
    assert ex2.events[0]["parent_block_hash"] == h[1]
    assert ex2.events[0]["token_ids"] == blocks(20)
    assert bm.execute(blocks(0, 10)).events == []  # full hit changes nothing


def test_lru_eviction_keeps_parents_of_cached_children():
    bm = BlockManager(BS, device_blocks=4)
    bm.execute(blocks(0, 10, 20))      # A <- B <- C
    bm.execute(blocks(50))             # D
    a, b, c = hashes(blocks(0, 10, 20))
    d = hashes(blocks(50))[0]
    # Pool full (4). Touch the A chain so that D is the oldest leaf... D is evicted first.
    bm.execute(blocks(0, 10, 20))
    ex = bm.execute(blocks(60))        # E needs one slot
    e = hashes(blocks(60))[0]
    assert [ev["type"] for ev in ex.events] == ["BlockRemoved", "BlockStored"]
    assert ex.events[0]["block_hashes"] == [d] and ex.events[0]["medium"] == "gpu"
    # Next eviction: the LRU leaf of the A chain is C (never A or B while a child is cached).
    ex = bm.execute(blocks(70))
    assert ex.events[0]["block_hashes"] == [c]
    ex = bm.execute(blocks(80))
    assert ex.events[0]["block_hashes"] == [b]
    assert set(bm.resident()) == {a, e, hashes(blocks(70))[0], hashes(blocks(80))[0]}
    bm.check_invariants()


def test_host_offload_and_load_back():
    bm = BlockManager(BS, device_blocks=2, host_blocks=2)
    bm.execute(blocks(0, 10))
    a, b = hashes(blocks(0, 10))
    ex = bm.execute(blocks(50))
    d = hashes(blocks(50))[0]
    assert ex.events == [
        {"type": "BlockStored", "block_hashes": [b], "parent_block_hash": a, "token_ids": [],
         "block_size": BS, "lora_id": None, "medium": "cpu", "lora_name": None,
         "extra_keys": None, "group_idx": None, "kv_cache_spec_kind": "full_attention"},
        {"type": "BlockRemoved", "block_hashes": [b], "medium": "gpu", "group_idx": None},
        ex.events[2],
    ]
    assert ex.events[2]["block_hashes"] == [d]
    assert bm.resident() == {a: DEVICE, b: HOST, d: DEVICE}
    assert bm.true_prefix(blocks(0, 10, 20)) == (4, 4)
    # Host-only hit: B is loaded back (one Device store chained on A, with the new block C);
    # D is offloaded to make room, B's Host copy stays.
    ex = bm.execute(blocks(0, 10, 20))
    c = hashes(blocks(0, 10, 20))[2]
    assert (ex.device_hit_tokens, ex.host_only_hit_tokens, ex.stored_blocks) == (4, 4, 0)
    types = [(e["type"], e["medium"], e["block_hashes"]) for e in ex.events]
    assert types == [("BlockStored", "cpu", [d]), ("BlockRemoved", "gpu", [d]),
                     ("BlockStored", "gpu", [b])]
    assert ex.events[2]["parent_block_hash"] == a and ex.events[2]["token_ids"] == blocks(10)
    # C did not fit: A and B are pinned by the request and the pool holds 2.
    assert bm.resident() == {a: DEVICE, b: DEVICE | HOST, d: HOST}
    assert c not in bm.resident()
    bm.check_invariants()


def test_host_lru_eviction_publishes_cpu_removal():
    bm = BlockManager(BS, device_blocks=1, host_blocks=1)
    bm.execute(blocks(0))
    bm.execute(blocks(10))      # 0 offloaded
    ex = bm.execute(blocks(20))  # 10 offloaded: Host full, 0 removed from Host
    h0, h10, h20 = (hashes(blocks(x))[0] for x in (0, 10, 20))
    assert [(e["type"], e["medium"], e["block_hashes"]) for e in ex.events] == [
        ("BlockRemoved", "cpu", [h0]), ("BlockStored", "cpu", [h10]),
        ("BlockRemoved", "gpu", [h10]), ("BlockStored", "gpu", [h20])]
    assert bm.resident() == {h10: HOST, h20: DEVICE}


def test_request_larger_than_device_pool_stores_what_fits():
    bm = BlockManager(BS, device_blocks=3)
    ex = bm.execute(blocks(0, 10, 20, 30, 40))
    assert ex.stored_blocks == 3
    assert ex.events[0]["block_hashes"] == hashes(blocks(0, 10, 20))
    assert bm.true_prefix(blocks(0, 10, 20, 30, 40)) == (12, 0)


def test_events_describe_the_cache_exactly_and_snapshot_is_parents_first():
    rng = random.Random(7)
    bm = BlockManager(BS, device_blocks=12, host_blocks=10)
    mirror = Mirror()
    for _ in range(400):
        # Random prompts over a small tree of shared prefixes, with partial tails.
        n = rng.randint(1, 6)
        toks = [t for i in range(n) for t in blocks(rng.randint(0, 2) * 100 + i * 10)]
        toks += [7] * rng.randint(0, BS - 1)
        truth = bm.true_prefix(toks)
        ex = bm.execute(toks)
        assert (ex.device_hit_tokens, ex.host_only_hit_tokens) == truth
        mirror.apply(ex.events)
        assert mirror.flags == bm.resident()
        bm.check_invariants()
    snap = bm.snapshot()
    seen: set[int] = set()
    for b in snap:
        assert b.parent is None or b.parent in seen
        seen.add(b.hash)
    assert {b.hash: b.tiers for b in snap} == bm.resident()
    assert len(snap) == len(bm.resident()) > 12


# ---- encoding ---------------------------------------------------------------------------------

def test_pack_batch_equals_ormsgpack():
    evs = [{"type": "BlockRemoved", "block_hashes": [2**64 - 1], "medium": "gpu", "group_idx": None}]
    for n in (0, 1, 15, 16, 70000):
        lst = evs * n
        assert pack_batch(1.5, [ormsgpack.packb(e) for e in lst], 3) == ormsgpack.packb([1.5, lst, 3])


def test_encode_snapshot_splits_within_the_limit():
    bm = BlockManager(128, device_blocks=64, host_blocks=64)
    for i in range(12):
        bm.execute(list(range(i * 10000, i * 10000 + 128 * 8)))
    snap = bm.snapshot()
    assert len(snap) == 96 and sum(1 for b in snap if b.tiers == HOST) == 32
    payloads = encode_snapshot(snap, 128, 0, 16384, ts=2.0)
    events = []
    for p in payloads:
        assert len(p) + 8 <= 16384
        ts, evs, rank = ormsgpack.unpackb(p)
        assert (ts, rank) == (2.0, 0)
        events.extend(evs)
    assert len(payloads) == 5
    # Greedy: the next message's first event would not have fitted in the previous one.
    for prev, nxt in zip(payloads, payloads[1:]):
        first = ormsgpack.packb(ormsgpack.unpackb(nxt)[1][0])
        assert len(prev) + len(first) + 8 > 16384
    assert [e["block_hashes"][0] for e in events] == [b.hash for b in snap]
    assert all(len(e["token_ids"]) == 128 for e in events)
    assert [e["medium"] for e in events].count("cpu") == 32
    assert encode_snapshot([], 128, 1, 1024, ts=0.0) == [ormsgpack.packb([0.0, [], 1])]


# ---- live wire and snapshots ----------------------------------------------------------------

@pytest.fixture
def engine(zmq_ctx):
    base = consecutive_ports(2)
    rbase = consecutive_ports(2)
    eng = SimEngine("sim-a", base, rbase, dp_size=2, block_size=BS, device_blocks=4,
                    host_blocks=2, topic=b"kv", context=zmq_ctx)
    eng.start()
    yield eng
    eng.close()


def snapshot(d: zmq.Socket, start: int = 0, timeout_ms: int = 5000) -> tuple[int, list[list]]:
    """Request a snapshot; returns (watermark, [events of each data message])."""
    d.send_multipart([b"", start.to_bytes(8, "big")])
    wm, payloads = None, []
    while True:
        f = recv(d, timeout_ms)
        assert len(f) == 3 and f[0] == b"" and len(f[1]) == 8
        if f[1] == b"\xff" * 8 and f[2] == b"":
            return wm, payloads
        w = int.from_bytes(f[1], "big")
        assert wm in (None, w)
        wm = w
        payloads.append(ormsgpack.unpackb(f[2]))


def test_live_wire_is_byte_exact(engine, zmq_ctx):
    sub0 = subscriber(zmq_ctx, engine, 0)
    sub1 = subscriber(zmq_ctx, engine, 1)
    r0 = engine.execute(blocks(0, 10), rank=0)
    r1 = engine.execute(blocks(0, 10), rank=None)  # round robin starts at rank 0
    assert (r0.rank, r0.seq, r0.stored_blocks) == (0, 0, 2)
    assert (r1.rank, r1.seq) == (0, None)  # a full hit changes nothing: nothing published
    r2 = engine.execute(blocks(0, 10, 20), rank=None)
    assert (r2.rank, r2.seq, r2.device_hit_tokens, r2.stored_blocks) == (1, 0, 0, 3)
    f = recv(sub0)
    assert len(f) == 3 and f[0] == b"kv" and f[1] == b"\0" * 8
    ts, events, rank = ormsgpack.unpackb(f[2])
    assert isinstance(ts, float) and rank == 0
    assert f[2] == ormsgpack.packb([ts, events, 0])
    assert [list(e) for e in events] == [STORED_KEYS]
    assert events[0]["block_hashes"] == hashes(blocks(0, 10))
    f = recv(sub1)
    assert f[1] == b"\0" * 8 and ormsgpack.unpackb(f[2])[2] == 1
    engine.execute(blocks(30, 40, 50), rank=0)  # 5 blocks in a 4-block pool: one offload
    f = recv(sub0)
    assert int.from_bytes(f[1], "big") == 1
    evs = ormsgpack.unpackb(f[2])[1]
    assert [list(e) for e in evs] == [STORED_KEYS, REMOVED_KEYS, STORED_KEYS]
    assert [(e["type"], e["medium"]) for e in evs] == [
        ("BlockStored", "cpu"), ("BlockRemoved", "gpu"), ("BlockStored", "gpu")]
    assert engine.last_seq(0) == 1 and engine.last_seq(1) == 0
    assert engine.stats(0).published == 2
    sub0.close()
    sub1.close()


def test_snapshot_before_any_publish(engine, zmq_ctx):
    d = dealer(zmq_ctx, engine, 1)
    d.send_multipart([b"", (0).to_bytes(8, "big")])
    f1 = recv(d)
    f2 = recv(d)
    assert f1[:2] == [b"", b"\xff" * 8]
    ts, evs, rank = ormsgpack.unpackb(f1[2])
    assert (evs, rank) == ([], 1)
    assert f2 == [b"", b"\xff" * 8, b""]
    d.close()


def test_snapshot_matches_live_state_after_watermark(engine, zmq_ctx):
    sub = subscriber(zmq_ctx, engine, 0)
    d = dealer(zmq_ctx, engine, 0)
    live = Mirror()
    for i, starts in enumerate([(0, 10), (0, 10, 20), (50, 60), (0, 70), (80,)]):
        engine.execute(blocks(*starts), rank=0)
        f = recv(sub)
        assert int.from_bytes(f[1], "big") == i
        live.apply(ormsgpack.unpackb(f[2])[1])
    wm, payloads = snapshot(d, start=3)
    assert wm == 4 == engine.last_seq(0)
    snap = Mirror()
    order: list[int] = []
    for ts, evs, rank in payloads:
        assert rank == 0
        for e in evs:
            assert list(e) == STORED_KEYS and e["type"] == "BlockStored"
            if e["token_ids"]:
                assert e["parent_block_hash"] is None or e["parent_block_hash"] in order
                order.append(e["block_hashes"][0])
        snap.apply(evs)
    assert snap.flags == live.flags == engine.resident(0)
    assert len(snap.flags) == 6 and sorted(snap.flags.values()) == [1, 1, 1, 1, 2, 2]
    sub.close()
    d.close()


def test_snapshot_is_split_at_max_message_bytes(zmq_ctx):
    eng = SimEngine("sim-b", consecutive_ports(1), consecutive_ports(1), block_size=128,
                    device_blocks=64, context=zmq_ctx, max_snapshot_message_bytes=4096)
    eng.start()
    try:
        eng.execute(list(range(128 * 40)))
        d = dealer(zmq_ctx, eng, 0)
        d.send_multipart([b"", (0).to_bytes(8, "big")])
        sizes = []
        while True:
            f = recv(d)
            if f[1] == b"\xff" * 8:
                break
            sizes.append(len(f[1]) + len(f[2]))
        assert all(s <= 4096 for s in sizes)
        assert len(sizes) == 6 and sum(sizes) == 3590 + 4 * 3982 + 2850
        d.close()
    finally:
        eng.close()


# ---- faults -----------------------------------------------------------------------------------

def live_seqs(sub: zmq.Socket, n: int) -> list[int]:
    return [int.from_bytes(recv(sub)[1], "big") for _ in range(n)]


def test_drop_next_consumes_seqs(engine, zmq_ctx):
    sub = subscriber(zmq_ctx, engine, 0)
    engine.drop_next(0, 2)
    for i in range(4):
        engine.execute(blocks(100 * i), rank=0)
    assert live_seqs(sub, 2) == [2, 3]
    assert engine.last_seq(0) == 3
    s = engine.stats(0)
    assert (s.published, s.dropped) == (2, 2)
    sub.close()


def test_drop_probability_is_seeded(zmq_ctx):
    eng = SimEngine("sim-c", consecutive_ports(1), consecutive_ports(1), block_size=BS,
                    device_blocks=1000, context=zmq_ctx, seed=3)
    eng.start()
    try:
        sub = subscriber(zmq_ctx, eng, 0, b"")
        eng.set_drop_probability(0.25)
        rng = random.Random(3 * 1_000_003 + 0)
        expected = [i for i in range(40) if not rng.random() < 0.25]
        for i in range(40):
            eng.execute(blocks(10 * i), rank=0)
        assert live_seqs(sub, len(expected)) == expected
        assert eng.stats(0).dropped == 40 - len(expected) == 8
        with pytest.raises(ValueError):
            eng.set_drop_probability(1.5)
        sub.close()
    finally:
        eng.close()


def test_restart_is_a_new_process(engine, zmq_ctx):
    sub = subscriber(zmq_ctx, engine, 0)
    engine.execute(blocks(0, 10), rank=0)
    engine.execute(blocks(20), rank=0)
    assert live_seqs(sub, 2) == [0, 1]
    engine.restart(0)
    assert engine.resident(0) == {} and engine.last_seq(0) is None
    assert engine.stats(0).restarts == 1
    # A fresh subscriber (libzmq's XPUB does not report a reconnected SUB's subscription again,
    # so the old one cannot be waited for without publishing).
    sub.close()
    sub = subscriber(zmq_ctx, engine, 0)
    r = engine.execute(blocks(0, 10), rank=0)
    assert (r.seq, r.device_hit_tokens, r.stored_blocks) == (0, 0, 2)
    assert live_seqs(sub, 1) == [0]
    d = dealer(zmq_ctx, engine, 0)
    wm, payloads = snapshot(d)
    assert wm == 0 and len(payloads[0][1]) == 2
    d.close()
    sub.close()


def test_restart_publisher_keeps_cache(engine, zmq_ctx):
    sub = subscriber(zmq_ctx, engine, 0)
    engine.execute(blocks(0), rank=0)
    engine.execute(blocks(10), rank=0)
    assert live_seqs(sub, 2) == [0, 1]
    engine.restart_publisher(0)
    assert engine.last_seq(0) is None
    d = dealer(zmq_ctx, engine, 0)
    wm, payloads = snapshot(d)
    assert wm == NO_SEQ and len(payloads[0][1]) == 2
    r = engine.execute(blocks(20), rank=0)
    assert r.seq == 0 and live_seqs(sub, 1) == [0]
    assert len(engine.resident(0)) == 3
    d.close()
    sub.close()


def test_delayed_snapshot_does_not_block_live(engine, zmq_ctx):
    """Live batches published while a snapshot reply is delayed arrive before it. The delay
    (1.5 s) only has to outlast the test thread's two steps (it bounded them to 0.5 s of wall
    time before, which a loaded machine could exceed); the order is read from the sockets."""
    delay_s = 1.5
    sub = subscriber(zmq_ctx, engine, 0)
    d = dealer(zmq_ctx, engine, 0)
    engine.execute(blocks(0), rank=0)
    engine.delay_snapshots(0, delay_s)
    t0 = time.monotonic()
    d.send_multipart([b"", (0).to_bytes(8, "big")])
    wait_for(lambda: engine.stats(0).snapshots == 1, 5.0, what="snapshot request")
    engine.execute(blocks(10), rank=0)  # published while the reply waits
    assert live_seqs(sub, 2) == [0, 1]
    assert d.poll(0) == 0, "the delayed reply came before the live batches"
    f = recv(d)
    assert time.monotonic() - t0 >= delay_s
    assert int.from_bytes(f[1], "big") == 0  # the state when the request arrived
    assert len(ormsgpack.unpackb(f[2])[1]) == 1
    assert recv(d) == [b"", b"\xff" * 8, b""]
    d.close()
    sub.close()


def test_truncated_snapshot_has_no_end_marker(zmq_ctx):
    eng = SimEngine("sim-d", consecutive_ports(1), consecutive_ports(1), block_size=128,
                    device_blocks=64, context=zmq_ctx, max_snapshot_message_bytes=4096)
    eng.start()
    try:
        eng.execute(list(range(128 * 40)))
        eng.truncate_snapshots(0, 3)
        d = dealer(zmq_ctx, eng, 0)
        d.send_multipart([b"", (0).to_bytes(8, "big")])
        frames = [recv(d) for _ in range(3)]
        assert all(f[1] == b"\0" * 8 and f[2] for f in frames)
        assert nothing_within(d, 300)
        wm, payloads = snapshot(d)  # the next reply is whole again
        assert wm == 0 and len(payloads) == 6
        d.close()
    finally:
        eng.close()


@pytest.mark.parametrize("kind,frames,consumes", [
    ("two_frames", 2, False), ("four_frames", 4, False), ("short_seq", 3, False),
    ("bad_msgpack", 3, True), ("bad_event", 3, True)])
def test_malformed_messages(engine, zmq_ctx, kind, frames, consumes):
    sub = subscriber(zmq_ctx, engine, 1)
    engine.execute(blocks(0), rank=1)
    seq = engine.inject_malformed(1, kind)
    assert seq == (1 if consumes else None)
    engine.execute(blocks(10), rank=1)
    assert recv(sub)[1] == b"\0" * 8
    bad = recv(sub)
    assert len(bad) == frames and bad[0] == b"kv"
    if kind == "short_seq":
        assert len(bad[1]) == 4
    if kind == "bad_msgpack":
        assert bad[2] == b"\xc1"
        with pytest.raises(Exception):
            ormsgpack.unpackb(bad[2])
    if kind == "bad_event":
        assert ormsgpack.unpackb(bad[2])[1] == [{"type": "BlockMoved"}]
    nxt = recv(sub)
    assert int.from_bytes(nxt[1], "big") == (2 if consumes else 1)
    assert engine.stats(1).malformed == 1
    with pytest.raises(ValueError):
        engine.inject_malformed(1, "nonsense")
    sub.close()


def test_port_taken_fails_start(zmq_ctx):
    port = consecutive_ports(1)
    blocker = zmq_ctx.socket(zmq.PUB)
    blocker.bind(f"tcp://127.0.0.1:{port}")
    eng = SimEngine("sim-e", port, consecutive_ports(1), context=zmq_ctx)
    try:
        with pytest.raises(LifecycleError):
            eng.start()
        with pytest.raises(LifecycleError):
            eng.execute([1, 2, 3])
    finally:
        eng.close()
        blocker.close()


# ---- kvsvc sim ----------------------------------------------------------------------------------

def test_sim_cli_replays_a_trace_and_stops(zmq_ctx):
    import argparse
    import threading

    from kvsvc.testbed.sim import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    port = consecutive_ports(2)
    replay = consecutive_ports(2)
    args = parser.parse_args([
        "--port", str(port), "--dp", "2", "--event-port-offset", "0",
        "--replay-port-offset", str(replay - port), "--device-blocks", "64", "--host-blocks", "64",
        "--trace", "conversation", "--requests", "4", "--interval-ms", "0", "--log-level", "warning"])
    stop = threading.Event()
    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(cli.run(args, stop)), name="sim-cli-test")
    t.start()
    try:
        d = zmq_ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(f"tcp://127.0.0.1:{replay + 1}")  # rank 1's replay port

        def replayed() -> bool:
            wm, payloads = snapshot(d, timeout_ms=5000)
            return wm == 1 and sum(len(p[1]) for p in payloads) > 0

        # Requests 0..3 round robin over 2 ranks: rank 1 publishes seqs 0 and 1.
        wait_for(replayed, 10.0, interval_s=0.05, what="trace replayed on dp1")
        d.close()
    finally:
        stop.set()
        t.join(10.0)
    assert not t.is_alive() and result == [0]


# ---- the thread contract (kvsvc.lifecycle.BackgroundThread) of every testbed thread owner -----

def _threads(prefix: str) -> list[str]:
    import threading

    return [t.name for t in threading.enumerate() if t.name.startswith(prefix)]


def test_engine_start_and_close_are_idempotent(zmq_ctx):
    from tests.support.util import free_port

    base = consecutive_ports(4)
    eng = SimEngine("life", base, base + 2, dp_size=2, block_size=BS, context=zmq_ctx,
                    http_port=free_port())
    eng.close()                                  # before start: nothing to stop
    eng.start()
    eng.start()                                  # already running: no second set of threads
    assert sorted(_threads("sim-")) == ["sim-http-life", "sim-life/dp0", "sim-life/dp1"]
    assert eng.execute(blocks(0), 1).seq == 0
    eng.close()
    eng.close()
    assert _threads("sim-") == []
    with pytest.raises(LifecycleError, match="not running"):
        eng.execute(blocks(0), 0)


def test_health_server_contract_and_close_bounded_by_a_stuck_connection():
    import socket

    import requests

    from kvsvc.testbed.sim.health import HealthServer
    from tests.support.util import free_port

    port = free_port()
    hs = HealthServer("127.0.0.1", port, "hs")
    hs.close()                                   # before start: nothing to stop
    hs.start()
    assert hs.running and _threads("sim-http-") == ["sim-http-hs"]
    with pytest.raises(LifecycleError, match="already started"):
        hs.start()
    assert requests.get(f"http://127.0.0.1:{port}/health", timeout=5.0).json() == {"status": "ok"}
    # A client that never finishes its request line holds its connection thread, so the
    # server's thread (which joins its connection threads last) cannot end in time.
    sock = socket.create_connection(("127.0.0.1", port), timeout=5.0)
    try:
        sock.sendall(b"GET /hea")
        wait_for(lambda: _threads("sim-http-conn-"), what="connection thread")
        with pytest.raises(LifecycleError, match="sim-http-hs: did not stop"):
            hs.close(timeout_s=0.2)
        assert hs.running
        sock.shutdown(socket.SHUT_WR)            # the request ends: the handler answers, exits
        hs.close()
    finally:
        sock.close()
    assert not hs.running and _threads("sim-http-") == []
    hs.close()                                   # closed twice: nothing more


def test_registration_contract_and_close_bounded_by_a_silent_etcd():
    import socket

    from kvsvc.testbed.sim.registration import EtcdRegistration, Load

    # A listening socket that never answers: every etcd request waits its whole timeout.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    try:
        reg = EtcdRegistration(f"127.0.0.1:{silent.getsockname()[1]}", "127.0.0.1:1", 1,
                               lambda: Load(0, 0.0), etcd_timeout_s=1.0)
        reg.close()                              # before start: nothing to stop
        with pytest.raises(LifecycleError, match="not running"):
            reg.reincarnate()
        reg.start()
        assert _threads("sim-etcd-") == ["sim-etcd-127.0.0.1:1"]
        with pytest.raises(LifecycleError, match="already started"):
            reg.start()
        with pytest.raises(LifecycleError, match="did not stop"):
            reg.close(timeout_s=0.1)             # the thread is inside a 1 s etcd request
        reg.close()
        reg.close()
        assert not reg.running and _threads("sim-etcd-") == []
        assert reg.stats().registrations == 0
    finally:
        silent.close()
