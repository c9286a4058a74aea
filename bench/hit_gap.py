"""Where a bench-routing run placed requests away from their cached prefix (issue 22 item 2): a
scratch analysis of one run's ``answers.jsonl`` (not a test), figures printed.

Run: ``python bench/hit_gap.py RUN_DIR/answers.jsonl [--trace conversation]``.

Replays the run's placements (trace order: the answers file is) against an infinite cache per
engine (what a prefix-tree router like sglang-router's cache_aware assumes): a trace block
(512 tokens) is *available* on an engine once an earlier-sent request routed there held it.
Per request, ``best`` is the engine with the longest available prefix and ``chosen`` the one
the router picked; the lost tokens ``best - chosen`` are split by why:

- ``in flight``: the best engine's extra blocks came only from requests whose first token had
  not been relayed when this one was sent (the exact index could not know them yet: what
  pending prefixes, §16, are for);
- ``settled``: they were there before (the policy preferred another engine: a queue or load
  term outweighing the prefix, or the engine had evicted them).

Also: the engines' reported cached tokens, the infinite-cache reuse of the run's own
placement (an upper bound of what the placement allows), and per-case counts.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvsvc.testbed.traces import TRACE_BLOCK_TOKENS, load_trace  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("answers")
    parser.add_argument("--trace", default="conversation")
    args = parser.parse_args(argv)
    rows = [json.loads(line) for line in Path(args.answers).read_text().splitlines()]
    trace = load_trace(args.trace)[:len(rows)]
    # engine -> trace block id -> list of (sent_at, prefilled_at) of requests that held it
    held: dict[str, dict[int, list[tuple[float, float]]]] = defaultdict(dict)
    order = sorted(range(len(rows)), key=lambda i: (rows[i]["answer"] or {}).get("sent_at", 0))
    lost = {"in flight": 0, "settled": 0}
    cases = {"in flight": 0, "settled": 0}
    prompt = cached = placement_hit = best_hit = 0
    engines: set[str] = set()
    for i in order:
        a = rows[i]["answer"]
        if a is None:
            continue
        engines.add(a["engine"])
    for i in order:
        a = rows[i]["answer"]
        req = trace[i]
        if a is None or rows[i]["input_length"] != req.input_length:
            continue
        sent = a["sent_at"]
        prefilled = a["head_at"] if a["head_at"] > sent else sent + a["ttft_ms"] / 1000.0 / 5
        ids = req.hash_ids

        def prefix(engine: str, settled_only: bool) -> int:
            blocks = held[engine]
            k = 0
            for h in ids:
                seen = blocks.get(h)
                if not seen:
                    break
                if settled_only and not any(p <= sent for _, p in seen):
                    break
                k += 1
            return k

        avail = {e: prefix(e, False) for e in engines}
        chosen = avail.get(a["engine"], 0)
        best_engine = max(avail, key=lambda e: (avail[e], e == a["engine"]))
        best = avail[best_engine]

        def tokens(k: int) -> int:
            return req.input_length if k == len(ids) else TRACE_BLOCK_TOKENS * k

        prompt += req.input_length
        cached += a["cached_tokens"]
        placement_hit += tokens(chosen)
        best_hit += tokens(best)
        if best > chosen:
            settled = prefix(best_engine, True)
            kind = "settled" if settled > chosen else "in flight"
            lost[kind] += tokens(best) - tokens(chosen)
            cases[kind] += 1
        for h in ids:
            held[a["engine"]].setdefault(h, []).append((sent, prefilled))
    print(f"requests {len(rows)}, prompt tokens {prompt}")
    print(f"  engines' cached tokens {cached} ({cached / prompt:.1%} of prompt)")
    print(f"  infinite-cache reuse of this placement {placement_hit} ({placement_hit / prompt:.1%})"
          f"; of the best engine each time {best_hit} ({best_hit / prompt:.1%})")
    for kind in ("in flight", "settled"):
        print(f"  placed away from a longer prefix, {kind}: {cases[kind]} requests, "
              f"{lost[kind]} tokens ({lost[kind] / prompt:.1%} of prompt)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
