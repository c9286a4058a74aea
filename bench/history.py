"""History-mode measures (issue 12, PROTOCOL.md §7h), side by side in one run:
``python -m bench.history``.

1. The ingest cost of the §7h anchor: the XXH3-64 digest of every live payload, against
   decoding the same payload (vLLM-sized batches: 16 blocks of 16 tokens), in process.
2. Time to synchronized from a 10,000-batch history (vLLM's default ``buffer_steps``) at 16
   blocks per batch, over real sockets (tests/publisher.py ``HistoryPublisher``), and the query
   latency p99 of another, synchronized stream while it runs against idle.
3. Catch-up after a gap of one batch against a full rebuild, at 100,000 resident blocks: the
   catch-up costs its missed batches, not the index size.

Nothing here is a test: figures are printed, ratios measured in the same run.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parent.parent)
    __package__ = "bench"

import zmq  # noqa: E402
from xxhash import xxh3_64_intdigest  # noqa: E402

from kvsvc.config import KvEventsConfig, ReplayMode, StreamConfig  # noqa: E402
from kvsvc.index.keys import prompt_keys  # noqa: E402
from kvsvc.streams.decoder import decode_batch  # noqa: E402
from kvsvc.streams.state import StreamState  # noqa: E402
from kvsvc.streams.subscriber import StreamSubscriber  # noqa: E402
from tests.publisher import HistoryPublisher, encode_batch, stored  # noqa: E402
from tests.util import free_ports, wait_for  # noqa: E402

BLOCK = 16          # vLLM's default block size
PER_BATCH = 16      # blocks per batch
SEED = 1024


def _chain_events(rng: random.Random, chain: int) -> list[dict]:
    """One batch: a root and 15 children (``PER_BATCH`` blocks), hashes from ``chain``."""
    base = chain * PER_BATCH
    tokens = [rng.randrange(150_000) for _ in range(BLOCK * PER_BATCH)]
    return [stored([base + i for i in range(PER_BATCH)], None, tokens, BLOCK, "GPU")]


def bench_digest(n: int = 2_000) -> None:
    rng = random.Random(1)
    payloads = [encode_batch(_chain_events(rng, i), 0, form="map") for i in range(n)]
    t = time.perf_counter()
    for p in payloads:
        decode_batch(p, 0, True)
    decode_s = time.perf_counter() - t
    t = time.perf_counter()
    for p in payloads:
        xxh3_64_intdigest(p)
    digest_s = time.perf_counter() - t
    print(f"1. digest: {digest_s / n * 1e6:.2f} us per live batch ({len(payloads[0])} bytes) "
          f"against {decode_s / n * 1e6:.1f} us to decode it: {digest_s / decode_s:.3f}x of "
          "the decode")


def bench_live_path(n: int = 4_000) -> None:
    """The stream thread's per-message work on the live path (frame, decode, rules, index),
    snapshot rules against history rules (digest and byte-hash option included), in process."""
    from kvsvc.streams.frame import encode_live, parse_live
    from kvsvc.streams.history import HistoryRecovery
    from kvsvc.streams.recovery import SnapshotRecovery
    from kvsvc.streams.serving import ServingState
    from kvsvc.streams.state import HistoryResult, SnapshotResult, StreamId
    from kvsvc.index.tier_index import TierIndex

    rng = random.Random(4)
    frames = [encode_live(b"", seq, encode_batch(_chain_events(rng, seq), 0, form="map"))
              for seq in range(n)]
    limits = KvEventsConfig()
    timings = {}
    for mode in (ReplayMode.SNAPSHOT, ReplayMode.HISTORY):
        cfg = StreamConfig(instance_name="10.0.0.1:8000", block_size=BLOCK,
                           endpoint="tcp://127.0.0.1:1", replay_endpoint="tcp://127.0.0.1:2",
                           hash_seed=SEED, replay_mode=mode)
        serving = ServingState(StreamId(cfg.instance_name, 0), BLOCK)
        history = mode is ReplayMode.HISTORY
        rules = (HistoryRecovery if history else SnapshotRecovery)(cfg, limits, serving)
        rules.start(0.0)
        rules.on_live_opened()
        rules.on_live_up(0.0)
        (request,) = rules.tick(0.0)
        rules.on_snapshot_opened(request.attempt, 0.0)
        index = TierIndex(BLOCK, SEED, limits.max_blocks_per_stream)
        if history:
            result = HistoryResult(False, True, index, None, None, None, True, {}, 0, 10)
        else:
            result = SnapshotResult(index=index, empty=True, watermark=None, messages=0,
                                    wire_bytes=10)
        rules.on_snapshot_complete(request.attempt, result, 0.0, 0.0)
        t = time.perf_counter()
        for f in frames:
            frame = parse_live(f, limits.max_message_bytes)
            batch = decode_batch(frame.payload, 0, history)
            rules.on_live_batch(frame.seq, batch, frame.wire_bytes, 1.0,
                                xxh3_64_intdigest(frame.payload) if history else 0)
        timings[mode] = (time.perf_counter() - t) / n
        assert serving.status().sequence == n - 1
    snap, hist = timings[ReplayMode.SNAPSHOT], timings[ReplayMode.HISTORY]
    print(f"1b. live path per message (frame, decode, rules, index; 16 blocks): snapshot mode "
          f"{snap * 1e6:.1f} us, history mode {hist * 1e6:.1f} us: {hist / snap:.3f}x")


def _subscriber(ctx: zmq.Context, pub: HistoryPublisher, name: str, **limits) -> StreamSubscriber:
    cfg = StreamConfig(instance_name=name, block_size=BLOCK, endpoint=pub.endpoint,
                       replay_endpoint=pub.replay_endpoint, hash_seed=SEED,
                       replay_mode=ReplayMode.HISTORY)
    sub = StreamSubscriber(cfg, KvEventsConfig(**limits), ctx)
    sub.start()
    return sub


def _synced(sub: StreamSubscriber, seq: int, timeout_s: float = 300.0) -> None:
    wait_for(lambda: (lambda st: st.state is StreamState.SYNCHRONIZED and st.sequence == seq)(
        sub.status()), timeout_s, interval_s=0.002, what=f"seq {seq}")


def _history(ctx: zmq.Context, batches: int) -> tuple[HistoryPublisher, list[int]]:
    ports = free_ports(2)
    pub = HistoryPublisher(ctx, ports[0], ports[1], buffer_steps=max(batches, 1)).start()
    rng = random.Random(2)
    first_tokens: list[int] = []
    for i in range(batches):
        events = _chain_events(rng, i)
        if i == 0:
            first_tokens = events[0]["token_ids"]
        pub.publish(events, live=False)
    return pub, first_tokens


def _p99(samples: list[float]) -> float:
    samples = sorted(samples)
    return samples[int(len(samples) * 0.99)] * 1e6 if samples else float("nan")


def _query_load(sub: StreamSubscriber, keys: list[int], stop: threading.Event,
                out: list[float]) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        sub.match(keys)
        out.append(time.perf_counter() - t)
        time.sleep(0.0005)


def bench_rebuild(ctx: zmq.Context, batches: int = 10_000) -> None:
    # Another stream, synchronized, serving queries the whole time.
    other_pub, other_tokens = _history(ctx, 50)
    other = _subscriber(ctx, other_pub, "10.0.0.2:8000")
    _synced(other, 49)
    keys = prompt_keys(other_tokens, BLOCK, SEED)
    idle: list[float] = []
    stop = threading.Event()
    thread = threading.Thread(target=_query_load, args=(other, keys, stop, idle))
    thread.start()
    time.sleep(1.0)
    stop.set()
    thread.join()
    pub, _ = _history(ctx, batches)
    busy: list[float] = []
    stop = threading.Event()
    thread = threading.Thread(target=_query_load, args=(other, keys, stop, busy))
    thread.start()
    started = time.monotonic()
    sub = _subscriber(ctx, pub, "10.0.0.1:8000")
    _synced(sub, batches - 1)
    elapsed = time.monotonic() - started
    stop.set()
    thread.join()
    st = sub.status()
    print(f"2. rebuild from a {batches:,}-batch history ({PER_BATCH} blocks per batch, "
          f"{st.device_blocks:,} blocks): synchronized in {elapsed:.2f} s; other stream's query "
          f"p99 {_p99(busy):.0f} us while it ran, {_p99(idle):.0f} us idle: "
          f"{_p99(busy) / _p99(idle):.2f}x")
    sub.close()
    pub.close()
    other.close()
    other_pub.close()


def bench_catch_up(ctx: zmq.Context, blocks: int = 100_000) -> None:
    batches = blocks // PER_BATCH
    pub, _ = _history(ctx, batches)
    started = time.monotonic()
    sub = _subscriber(ctx, pub, "10.0.0.1:8000")
    _synced(sub, batches - 1)
    rebuild_s = time.monotonic() - started
    pub.wait_subscribed()
    rng = random.Random(3)
    pub.publish(_chain_events(rng, batches), live=False)   # one batch lost
    started = time.monotonic()
    pub.publish(_chain_events(rng, batches + 1))
    _synced(sub, batches + 1)
    catch_up_s = time.monotonic() - started
    assert pub.requests == [0, batches - 1], pub.requests
    print(f"3. at {sub.status().device_blocks:,} resident blocks: catch-up after a gap of 1 "
          f"batch {catch_up_s * 1000:.1f} ms against a full rebuild {rebuild_s * 1000:.0f} ms: "
          f"{catch_up_s / rebuild_s:.4f}x")
    sub.close()
    pub.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=10_000)
    parser.add_argument("--blocks", type=int, default=100_000)
    args = parser.parse_args()
    bench_digest()
    bench_live_path()
    ctx = zmq.Context()
    try:
        bench_rebuild(ctx, args.batches)
        bench_catch_up(ctx, args.blocks)
    finally:
        ctx.term()


if __name__ == "__main__":
    main()
