"""Issue 3, benchmark 3 (query in process) and benchmark 7 (idle cost).

Benchmark 3: 128 synchronized streams of 2,048 blocks each, loaded by real snapshots (§7) from
a server process; a 16,384-token prompt (128 blocks) fully resident on stream 0, its first half
on streams 1..16, absent elsewhere. ``Directory.query(prompt)`` and ``prompt_keys(prompt)``
(the prompt's content keys alone) are timed alternately, one call each per round, so both see
the same machine state; p50 and p99 are compared.

Benchmark 7: 128 connected streams whose engines are silent (empty state), CPU time of this
whole process (every thread, ZMQ I/O threads included; ``getrusage``) over the idle window,
as a share of one core. Periodic resyncs (§6, default every 30 s) stay on: they are part of
what an idle service does.
"""

from __future__ import annotations

import gc
import resource
import threading
import time

from kvsvc.directory import Directory
from kvsvc.index.keys import prompt_keys

from ._common import (
    BLOCK_SIZE,
    HASH_SEED,
    Result,
    StreamServer,
    all_synchronized,
    chain_events,
    directory_config,
    make_streams,
    percentile,
    snapshot_payloads,
    token_pool,
    wait_until,
)

N_STREAMS = 128
BLOCKS_PER_STREAM = 2048
PROMPT_TOKENS = 16_384


def _filler(pool: list[int], n_blocks: int) -> list[dict]:
    """``n_blocks`` blocks unrelated to the prompt, as independent 16-block chains."""
    out = []
    for c in range(0, n_blocks, 16):
        k = min(16, n_blocks - c)
        out += chain_events(pool[c * BLOCK_SIZE:(c + k) * BLOCK_SIZE], 1_000_000 + c)
    return out


def bench_query(rounds: int = 3000) -> Result:
    """Benchmark 3."""
    res = Result(3, "query, in process", "p50 <= 1.5 x key time, p99 <= 3 x key time")
    pool = token_pool(PROMPT_TOKENS + BLOCKS_PER_STREAM * BLOCK_SIZE, seed=5)
    prompt, rest = pool[:PROMPT_TOKENS], pool[PROMPT_TOKENS:]
    n_prompt = PROMPT_TOKENS // BLOCK_SIZE
    full = snapshot_payloads(chain_events(prompt, 1) + _filler(rest, BLOCKS_PER_STREAM - n_prompt))
    half = snapshot_payloads(chain_events(prompt[:PROMPT_TOKENS // 2], 1)
                             + _filler(rest, BLOCKS_PER_STREAM - n_prompt // 2))
    none = snapshot_payloads(_filler(rest, BLOCKS_PER_STREAM))
    streams = make_streams(N_STREAMS)
    for i, s in enumerate(streams):
        s.snapshot = full if i == 0 else half if i <= 16 else none
    server = StreamServer(streams)
    directory = None
    try:
        server.start()
        directory = Directory(directory_config(streams, resync_interval_ms=600_000))
        directory.start()
        wait_until(lambda: all_synchronized(directory), 120, "128 snapshots", interval_s=0.05)
        matches = directory.query(prompt)
        hits = [m.device_hit_tokens for m in matches]
        expect = [PROMPT_TOKENS] + [PROMPT_TOKENS // 2] * 16 + [0] * (N_STREAMS - 17)
        if hits != expect or any(m.device_blocks != BLOCKS_PER_STREAM for m in matches):
            raise AssertionError("query answers are not the expected ones")
        key_t, query_t = [], []
        clock = time.perf_counter
        for _ in range(50):  # warm-up
            prompt_keys(prompt, BLOCK_SIZE, HASH_SEED)
            directory.query(prompt)
        for _ in range(rounds):
            t0 = clock()
            prompt_keys(prompt, BLOCK_SIZE, HASH_SEED)
            t1 = clock()
            directory.query(prompt)
            t2 = clock()
            key_t.append(t1 - t0)
            query_t.append(t2 - t1)
    finally:
        if directory is not None:
            directory.close()
        server.close()
    k50, k99 = percentile(key_t, 50), percentile(key_t, 99)
    q50, q99 = percentile(query_t, 50), percentile(query_t, 99)
    res.ratios["p50"] = (q50 / k50, 1.5, True)
    res.ratios["p99"] = (q99 / k99, 3.0, True)
    res.figures += [
        f"{N_STREAMS} streams x {BLOCKS_PER_STREAM} blocks; prompt {PROMPT_TOKENS} tokens: "
        f"full hit on 1 stream, half on 16; {rounds} rounds",
        f"query p50 {q50 * 1e6:.0f} us, p99 {q99 * 1e6:.0f} us; keys alone p50 "
        f"{k50 * 1e6:.0f} us, p99 {k99 * 1e6:.0f} us",
        f"per-stream cost beyond the keys (p50): {(q50 - k50) / N_STREAMS * 1e6:.2f} us",
    ]
    return res


def bench_idle(seconds: float = 60.0) -> Result:
    """Benchmark 7."""
    res = Result(7, "idle cost", "< 2% of one core")
    streams = make_streams(N_STREAMS)
    server = StreamServer(streams)
    directory = None
    try:
        server.start()
        directory = Directory(directory_config(streams))
        directory.start()
        wait_until(lambda: all_synchronized(directory), 60, "128 empty snapshots", interval_s=0.05)
        wait_until(lambda: server.subscriptions >= N_STREAMS, 30, "subscriptions", 0.05)
        gc.collect()
        r0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        threading.Event().wait(seconds)  # the measurement window itself; nothing to poll
        r1, w1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        statuses = directory.statuses()
        if not all(st.state.value == "synchronized" and st.error is None for st in statuses):
            raise AssertionError("a stream left synchronized while idle")
        resyncs = sum(1 for _ in statuses)  # every stream resyncs every 30 s
    finally:
        if directory is not None:
            directory.close()
        server.close()
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    share = cpu / (w1 - w0)
    res.ratios["cpu share / 2%"] = (share / 0.02, 1.0, True)
    res.figures += [
        f"{N_STREAMS} connected silent streams, {w1 - w0:.1f} s: {cpu:.3f} s CPU "
        f"(user {r1.ru_utime - r0.ru_utime:.3f} s, system {r1.ru_stime - r0.ru_stime:.3f} s) "
        f"= {share * 100:.2f}% of one core",
        f"includes about {resyncs * int(seconds // 30)} periodic resync snapshots (empty)",
    ]
    return res
