"""Issue 3, benchmark 5: bytes per resident block, measured with ``tracemalloc``.

1,000,000 resident blocks over 64 per-stream :class:`~kvsvc.index.tier_index.TierIndex`
objects (15,625 each): in 16-block groups, half Device-only, a quarter Host-only (stored with
medium ``cpu`` and tokens) and a quarter on both tiers (stored on ``gpu``, then a tokenless
``cpu`` replica, §5). Events go through the real decoder (:func:`decode_batch`), so the
engine-hash ints the engine map keeps are the decoder's own objects. Traced memory is taken
after the decoded batches are dropped and a full GC: what stays is the indexes (content-key
ints, engine-hash ints, dict tables). Block size 16 keeps the generated payloads small; the
index keeps no tokens, so its memory does not depend on the block size.
"""

from __future__ import annotations

import gc
import random
import tracemalloc

from kvsvc.events import DEVICE, HOST
from kvsvc.index.tier_index import TierIndex
from kvsvc.streams.decoder import decode_batch

from ._common import HASH_SEED, Result, batch, stored_map, token_pool

N_BLOCKS = 1_000_000
N_STREAMS = 64
GROUP = 16
_BS = 16


def _payloads(rng: random.Random, pool: list[int], first: int, count: int) -> list[bytes]:
    """Payloads for global blocks ``[first, first + count)``; group kind = (g // 16) % 4."""
    out = []
    g = first
    end = first + count
    while g < end:
        n = min(GROUP - g % GROUP, end - g)
        kind = (g // GROUP) % 4
        hashes = [rng.getrandbits(64) for _ in range(n)]
        off = rng.randrange(len(pool) - n * _BS)
        # The first token is the global block number: no two roots share content (aliases
        # would make the counts inexact).
        tokens = [g] + pool[off + 1:off + n * _BS]
        if kind <= 1:
            out.append(batch([stored_map(hashes, None, tokens, _BS, "gpu")]))
        elif kind == 2:
            out.append(batch([stored_map(hashes, None, tokens, _BS, "cpu")]))
        else:
            out.append(batch([stored_map(hashes, None, tokens, _BS, "gpu"),
                              stored_map(hashes, None, [], 0, "cpu")]))
        g += n
    return out


def bench_memory() -> Result:
    """Benchmark 5."""
    res = Result(5, "memory", "<= 160 bytes per resident block")
    rng = random.Random(7)
    pool = token_pool(1 << 16, seed=7)
    per = N_BLOCKS // N_STREAMS
    payloads = [_payloads(rng, pool, s * per, per) for s in range(N_STREAMS)]
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        indexes = []
        for stream_payloads in payloads:
            index = TierIndex(_BS, HASH_SEED, 262_144)
            for p in stream_payloads:
                index.apply(decode_batch(p, 0).events)
            indexes.append(index)
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    device = sum(i.device_blocks for i in indexes)
    host = sum(i.host_blocks for i in indexes)
    entries = sum(i.entries for i in indexes)
    both = sum(1 for i in indexes for f in i.residency().values() if f == DEVICE | HOST)
    if (device, host, entries, both) != (750_000, 500_000, N_BLOCKS, 250_000):
        raise AssertionError(f"unexpected residency {device} {host} {entries} {both}")
    per_block = used / N_BLOCKS
    res.ratios["bytes/160"] = (per_block / 160, 1.0, True)
    res.figures += [
        f"{N_BLOCKS:,} blocks over {N_STREAMS} streams (500,000 Device-only, 250,000 Host-only,"
        f" 250,000 both; {entries:,} engine-map entries)",
        f"{used / 2**20:.1f} MiB traced = {per_block:.1f} bytes per resident block",
    ]
    return res
