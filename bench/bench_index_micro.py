"""Scratch measurements for the index (not a test): bytes per resident block and apply speed.

Run: ``python bench/bench_index_micro.py [--blocks 1000000]``.

* memory: tracemalloc over a :class:`TierIndex` holding ``--blocks`` Device blocks stored as
  16-block events with random 64-bit engine hashes. Reported with the engine-hash int objects
  (they are created by the decoder but kept alive by the engine map) and without them.
* speed: ``BlockStored`` events of 16 blocks x 128 tokens, pre-decoded, applied to a fresh
  index; compared with ``ormsgpack.unpackb`` of the same events, one wire batch per event.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
import tracemalloc
from pathlib import Path

import ormsgpack

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvsvc.events import DEVICE, BlockStored  # noqa: E402
from kvsvc.index.tier_index import TierIndex  # noqa: E402

BLOCKS_PER_EVENT = 16


def measure_memory(n_blocks: int) -> None:
    """Print tracemalloc bytes per block for ``n_blocks`` resident blocks."""
    rng = random.Random(1)
    block_size = 4  # memory does not depend on the block size; keeps token lists small
    index = TierIndex(block_size, 1024, n_blocks + 1)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    hash_bytes = 0
    parent = None
    for start in range(0, n_blocks, BLOCKS_PER_EVENT):
        n = min(BLOCKS_PER_EVENT, n_blocks - start)
        hashes = [rng.getrandbits(64) for _ in range(n)]
        hash_bytes += sum(sys.getsizeof(h) for h in hashes)
        tokens = [rng.randrange(50000) for _ in range(n * block_size)]
        # Alternate new roots and continuations of the previous event (live-delta shape).
        index.apply([BlockStored(hashes, parent, tokens, block_size, DEVICE)])
        parent = hashes[-1] if start % (2 * BLOCKS_PER_EVENT) == 0 else None
    del hashes, tokens, parent
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert index.device_blocks == n_blocks and index.entries == n_blocks
    print(f"memory: {n_blocks} blocks, {used / n_blocks:.1f} B/block including engine-hash ints, "
          f"{(used - hash_bytes) / n_blocks:.1f} B/block without them "
          f"(sys.getsizeof of a hash int {hash_bytes / n_blocks:.0f} B)")


def measure_speed(n_events: int = 3000, block_size: int = 128, vocab: int = 150_000) -> None:
    """Print apply and decode times for 16 x ``block_size``-token ``BlockStored`` events, each
    in its own one-event wire batch (the live-delta shape)."""
    rng = random.Random(2)
    payloads = []
    events = []
    for _ in range(n_events):
        hashes = [rng.getrandbits(64) for _ in range(BLOCKS_PER_EVENT)]
        tokens = [rng.randrange(vocab) for _ in range(BLOCKS_PER_EVENT * block_size)]
        payloads.append(ormsgpack.packb([time.time(), [{
            "type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
            "token_ids": tokens, "block_size": block_size, "lora_id": None, "medium": "gpu"}], 0]))
        events.append(BlockStored(hashes, None, tokens, block_size, DEVICE))

    def decode_all() -> None:
        for payload in payloads:
            ormsgpack.unpackb(payload)

    best_decode = min(_timed(decode_all) for _ in range(5))
    best_apply = float("inf")
    for _ in range(5):
        index = TierIndex(block_size, 1024, n_events * BLOCKS_PER_EVENT)

        def apply_all() -> None:
            for event in events:
                index.apply((event,))

        best_apply = min(best_apply, _timed(apply_all))
    per_decode = best_decode / n_events * 1e6
    per_apply = best_apply / n_events * 1e6
    blocks = n_events * BLOCKS_PER_EVENT
    print(f"speed (vocab {vocab}): decode {per_decode:.1f} us/event, apply {per_apply:.1f} "
          f"us/event ({blocks / best_apply:,.0f} blocks/s, {n_events / best_apply:,.0f} "
          f"events/s); decode+apply = {per_decode / (per_decode + per_apply):.2f} x decode rate")


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--events", type=int, default=3000)
    args = parser.parse_args()
    measure_speed(args.events)
    measure_speed(args.events, vocab=2**31)
    measure_memory(args.blocks)


if __name__ == "__main__":
    main()
