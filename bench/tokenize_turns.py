"""Tokenization of a growing conversation, whole text against the segment token cache (issue 22
item 3), on the testbed's byte-level BPE and its ChatML template, as the router renders it.

Each turn adds a user message and an assistant answer; the prompt of turn k renders every
earlier turn again. Timed per turn, side by side in one run: ``tokenizers`` on the whole
rendered text, and :class:`kvsvc.routing.token_cache.SegmentTokenCache` (which reuses the
earlier turns' segments). Both give the same ids (checked). Prints one line per size and the
speed-up; ``--json`` for RESULTS.md.

    python -m bench.tokenize_turns [--turns 20] [--words 150] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvsvc.routing.prompt import PromptTokenizer  # noqa: E402
from kvsvc.testbed.tokenizer import CHAT_TEMPLATE, build_tokenizer  # noqa: E402

_WORDS = ("the cache of each model keeps a prefix of blocks and the router reads which "
          "instance holds the longest one before it sends a request there").split()


def message(turn: int, words: int, role: str) -> dict:
    body = " ".join(_WORDS[(turn * 7 + i) % len(_WORDS)] + (str(i) if i % 11 == 0 else "")
                    for i in range(words))
    return {"role": role, "content": f"turn {turn}: {body}"}


def run(turns: int, words: int, repeat: int) -> dict:
    tok = build_tokenizer()
    plain = PromptTokenizer(tok, CHAT_TEMPLATE)
    cached = PromptTokenizer(tok, CHAT_TEMPLATE, cache_tokens=1 << 20)
    whole_us: list[float] = []
    cache_us: list[float] = []
    tokens = 0
    for _ in range(repeat):
        # Cold for each repetition; the ids are compared here, not by the cache's own check.
        cached.cache = type(cached.cache)(tok, 1 << 20, verify_first=0)
        messages: list[dict] = []
        for t in range(turns):
            messages.append(message(t, words, "user"))
            text = plain.render_chat(messages)
            t0 = time.perf_counter()
            ids = list(tok.encode(text, add_special_tokens=False).ids)
            t1 = time.perf_counter()
            got = cached.cache.encode(text, False)
            t2 = time.perf_counter()
            assert got == ids, "the cache must give the whole text's ids"
            whole_us.append((t1 - t0) * 1e6)
            cache_us.append((t2 - t1) * 1e6)
            tokens = len(ids)
            messages.append(message(t, words, "assistant"))
    last = slice(-repeat * max(1, turns // 4), None)  # the longest quarter of the turns
    out = {"turns": turns, "words_per_message": words, "last_prompt_tokens": tokens,
           "whole_us_median": statistics.median(whole_us),
           "cache_us_median": statistics.median(cache_us),
           "whole_us_long": statistics.median(sorted(whole_us)[last]),
           "cache_us_long": statistics.median(sorted(cache_us)[last]),
           "stats": vars(cached.cache.stats())}
    out["speedup_median"] = out["whole_us_median"] / out["cache_us_median"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--words", type=int, default=150)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    out = run(args.turns, args.words, args.repeat)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{args.turns} turns of {args.words} words, last prompt {out['last_prompt_tokens']} "
              f"tokens: whole {out['whole_us_median']:.0f} us, cache "
              f"{out['cache_us_median']:.0f} us per prompt (median), x{out['speedup_median']:.1f}"
              f"; longest quarter: whole {out['whole_us_long']:.0f} us, cache "
              f"{out['cache_us_long']:.0f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
