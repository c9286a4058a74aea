"""Request-path cost of the routing overlays (§14 approximate index, §16 pending prefixes): a
short scratch measurement (not a test), figures printed, recorded in RESULTS.md "Overlays".

Run: ``python bench/bench_overlay.py [--blocks 110] [--streams 8] [--rounds 2000]``.

Each figure is the median over ``--rounds`` calls (microseconds), in one process:

* query: :meth:`Directory.query_prompt` of one prompt over ``--streams`` synchronized exact
  streams whose indexes hold the prompt's first half, with pending prefixes off, on with every
  pending set empty, and on with one stream holding the prompt's second half as pending; and
  over as many approximate indexes, each full (``approximate_blocks`` 65536 entries), one of
  them holding the whole prompt;
* dispatch: :meth:`Directory.record_dispatch` of the prompt into a full approximate index (a
  touch that renews the prompt's blocks), and into one that evicts as many as it adds (a new
  prompt each time);
* settle: a live batch of 16 stored blocks applied to a stream with pending blocks (the index
  collects the keys, the overlay drops them) against one without.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvsvc.config import KvEventsConfig  # noqa: E402
from kvsvc.directory import Directory, OverlayLimits  # noqa: E402
from kvsvc.events import DEVICE, BlockStored  # noqa: E402
from kvsvc.index.keys import prompt_keys  # noqa: E402
from kvsvc.index.tier_index import TierIndex  # noqa: E402
from kvsvc.streams.actions import ApplyEvents  # noqa: E402
from kvsvc.streams.state import StreamId  # noqa: E402

BS = 128
SEED = 1024
FULL = 65536


def median_us(fn: Callable[[], object], rounds: int) -> float:
    """Median wall time of one call, microseconds (after 50 warm-up calls)."""
    for _ in range(50):
        fn()
    samples = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1e6


def exact_directory(n_streams: int, pending: bool, ctx: zmq.Context,
                    prompt: list[int]) -> Directory:
    """``n_streams`` synchronized exact streams, each holding the prompt's first half."""
    streams = [{"instance_name": f"10.0.0.{i + 1}:8000", "block_size": BS,
                "endpoint": f"tcp://10.0.0.{i + 1}:18000",
                "replay_endpoint": f"tcp://10.0.0.{i + 1}:38000"} for i in range(n_streams)]
    cfg = KvEventsConfig.model_validate({"streams": streams})
    d = Directory(cfg, context=ctx, pending=OverlayLimits(15.0, FULL) if pending else None)
    half = len(prompt) // BS // 2 * BS
    for sid in d.stream_ids():
        serving = d.subscriber(sid)._serving  # type: ignore[union-attr]
        index = TierIndex(BS, SEED, 1 << 20)
        index.apply([BlockStored(list(range(1, half // BS + 1)), None, prompt[:half], BS,
                                 DEVICE)])
        serving.swap(index, sequence=0, resync=False, difference=0, live_events=(),
                     stats_base=())
    return d


def approximate_directory(n_streams: int, prompt: list[int]) -> Directory:
    """``n_streams`` full approximate indexes; the first one holds the whole prompt."""
    cfg = KvEventsConfig.model_validate({"discovery": {
        "backends": [], "approximate_backends": ["xllm"], "block_size": BS}})
    d = Directory(cfg)
    filler = list(range(10_000_000, 10_000_000 + FULL * BS))
    _, fill = d.query_prompt(filler[:FULL * BS])
    for i in range(n_streams):
        sid = StreamId(f"10.0.0.{i + 1}:8000", 0)
        d.add_approximate(sid, block_size=BS, hash_seed=SEED)
        d.record_dispatch(sid.instance_name, [(0, 0)], fill)
    _, pk = d.query_prompt(prompt)
    d.record_dispatch("10.0.0.1:8000", [(0, 0)], pk)
    return d


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=110,
                        help="full blocks of the prompt (110 x 128 = 14,080 tokens)")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args(argv)
    prompt = list(range(1000, 1000 + args.blocks * BS))
    n, rounds = args.streams, args.rounds
    ctx = zmq.Context()
    try:
        print(f"prompt {len(prompt)} tokens ({args.blocks} blocks of {BS}), {n} streams, "
              f"median of {rounds} calls")
        keys_us = median_us(lambda: prompt_keys(prompt, BS, SEED), rounds)
        print(f"  content keys alone: {keys_us:.1f} us")
        off = exact_directory(n, False, ctx, prompt)
        on = exact_directory(n, True, ctx, prompt)
        q_off = median_us(lambda: off.query_prompt(prompt), rounds)
        q_on_empty = median_us(lambda: on.query_prompt(prompt), rounds)
        _, pk = on.query_prompt(prompt)
        on.record_dispatch("10.0.0.1:8000", [(0, len(prompt) // BS // 2 * BS)], pk)
        (m, *_), _ = on.query_prompt(prompt)
        assert m.pending_hit_tokens == len(prompt) - len(prompt) // BS // 2 * BS, m
        q_on_hit = median_us(lambda: on.query_prompt(prompt), rounds)
        print(f"  query, exact streams: pending off {q_off:.1f} us; on, nothing pending "
              f"{q_on_empty:.1f} us ({q_on_empty / q_off:.2f}x); on, one stream with "
              f"{m.pending_hit_tokens // BS} pending blocks {q_on_hit:.1f} us "
              f"({q_on_hit / q_off:.2f}x)")
        approx = approximate_directory(n, prompt)
        (a, *_), _ = approx.query_prompt(prompt)
        assert a.device_hit_tokens == len(prompt), a
        q_approx = median_us(lambda: approx.query_prompt(prompt), rounds)
        miss = list(range(5_000_000, 5_000_000 + len(prompt)))
        q_approx_miss = median_us(lambda: approx.query_prompt(miss), rounds)
        print(f"  query, {n} full approximate indexes ({FULL} blocks each): one holding the "
              f"prompt {q_approx:.1f} us, none {q_approx_miss:.1f} us")
        _, pk = approx.query_prompt(prompt)
        renew = median_us(lambda: approx.record_dispatch("10.0.0.1:8000", [(0, 0)], pk),
                          rounds)
        fresh = [approx.query_prompt(list(range(20_000_000 + i * len(prompt),
                                                20_000_000 + (i + 1) * len(prompt))))[1]
                 for i in range(rounds + 50)]
        it = iter(fresh)
        evict = median_us(lambda: approx.record_dispatch("10.0.0.2:8000", [(0, 0)], next(it)),
                          rounds)
        print(f"  dispatch into a full approximate index: renewing the prompt {renew:.1f} us "
              f"({renew / args.blocks * 1000:.0f} ns/block); a new prompt evicting as many "
              f"{evict:.1f} us ({evict / args.blocks * 1000:.0f} ns/block)")
        # settle: 16 stored blocks per batch, on a stream with / without pending blocks.
        per_batch = 16
        tokens = list(range(3_000_000, 3_000_000 + per_batch * BS * (rounds + 60)))
        for label, pending in (("without pending", False), ("with pending", True)):
            d = exact_directory(1, pending, ctx, prompt)
            sid = d.stream_ids()[0]
            sub = d.subscriber(sid)
            serving = sub._serving  # type: ignore[union-attr]
            if pending:
                _, pk = d.query_prompt(tokens)
                d.record_dispatch(sid.instance_name, [(0, 0)], pk)
            state = {"seq": 1, "h": 10_000_000, "parent": None}

            def one_batch() -> None:
                s, h = state["seq"], state["h"]
                start = (s - 1) * per_batch * BS
                hashes = list(range(h, h + per_batch))
                serving.apply(ApplyEvents(s, [BlockStored(
                    hashes, state["parent"], tokens[start:start + per_batch * BS], BS,
                    DEVICE)]))
                state.update(seq=s + 1, h=h + per_batch, parent=hashes[-1])

            us = median_us(one_batch, rounds)
            print(f"  live batch of {per_batch} stored blocks {label}: {us:.1f} us"
                  + (f" (pending left {len(sub.pending)})" if pending else ""))
    finally:
        ctx.destroy(linger=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
