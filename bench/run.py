"""The benchmark suite: ``python -m bench.run`` (or ``make bench``).

Runs benchmarks 1..12 one after another in this process (publishers and engines in child
processes), prints a table of ratios against the targets plus the absolute figures, and writes
``bench/RESULTS.md`` with the machine it ran on and the analysis of every unmet target
(:data:`ANALYSIS`, written from the profiles taken while building the suite).

Benchmarks 1..7 are issue 3's, 8 issue 6's, 9..12 issue 12's history mode (§7h): 9 and 10 the
issue's two measures (:mod:`bench.history_replay`), 11 the live path's digest cost
(:mod:`bench.history_live`), 12 a rebuild under request load (:mod:`bench.history_load`).

``--only 1,3`` runs a subset; ``--idle-seconds`` shortens benchmark 7 (the issue's 60 s is the
default); ``--small`` runs 9..12 at a tenth of their sizes to check that they run (nothing is
written then); ``--b12-loads`` / ``--b12-variants`` / ``--b12-rounds`` widen benchmark 12;
``--no-write`` leaves RESULTS.md alone. A full run writes the whole file; ``--only`` with any
of 9..12 rewrites only those benchmarks' parts of its history section. Whole suite: about 6
minutes on 2 quiet cores (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):  # ``python bench/run.py``
    # Drop bench/ itself from the path (its module names must not shadow anything).
    sys.path[0] = str(Path(__file__).resolve().parent.parent)
    __package__ = "bench"

from bench._common import Result, machine_info  # noqa: E402
from bench.history_live import bench_history_live  # noqa: E402
from bench.history_load import bench_rebuild_under_load  # noqa: E402
from bench.history_replay import bench_catch_up_vs_rebuild, bench_rebuild_10k  # noqa: E402
from bench.http_load import bench_http  # noqa: E402
from bench.ingest import bench_ingest_many, bench_ingest_one  # noqa: E402
from bench.load_recovering import bench_load_recovering  # noqa: E402
from bench.memory import bench_memory  # noqa: E402
from bench.query import bench_idle, bench_query  # noqa: E402
from bench.snapshot import bench_snapshot  # noqa: E402

log = logging.getLogger(__name__)

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"

#: Per benchmark: profile-backed explanation, what was tried, the next step. Printed into
#: RESULTS.md under each benchmark (measured facts, not targets).
ANALYSIS: dict[int, str] = {
    1: """\
Where the stream thread's time goes (py-spy, 6,800 samples of this benchmark): `ormsgpack.unpackb`
45%, freeing what it built 11% (the raw decode pays both), `pack_tokens` 9.5% (one
`array.fromlist` over 2,048 ids: the §4 byte form, converted once), ZMQ receive 8%, the index
14% (content keys 5.5%, the store and remove loops 8.5%), decoder checks 4%, stream state 3%.
Same payloads without sockets, counted in instructions (callgrind, not disturbed by other load):
the subscriber's `_on_live` takes 497k instructions per message against 302k for the raw
decode (0.61x); it took 565k before this session's changes (0.54x). Built this session: ids
packed once by the decoder (`array.fromlist`: 136k instructions per 2,048 ids against 179k for
`struct.pack(*ids)`, which first builds an argument tuple, and 193k for `array("I", ids)`) and
hashed by the index as they are (it packed and checked them again); event and frame dataclasses
`slots` but not `frozen` (a frozen `__init__` costs 0.6 us more per object, 2-3 per message);
live frames received as `memoryview`s with the frame's `more` flag (`recv_multipart` asks the
socket for `RCVMORE` after every frame and copies each: 3.1 us against 1.9 us per message);
plain-text `BlockStored` events skip the optional-field type checks; the publisher of this
benchmark wakes within 1 ms of "go" (it polled every 50 ms: up to 4% of the measured time).
Ceiling: the stream thread's CPU per message (figure above) against the raw decode gives
0.54-0.58x even with a core of its own; the ~2,048 Python ints per stored event are made by
`ormsgpack` and converted back to 4-byte ids by `fromlist` (~3 ns each), and the rest is ZMQ
receive, XXH3 chaining of 16 blocks and the dict updates, each a few percent. Measured on a
quiet machine: 0.52-0.55x (0.48x before this session). A later pass with a callgrind harness
(bench 1's payloads through a real subscriber, no sockets): `_on_live` 502-504k instructions
per message against 292k for the raw decode; of the ~210k beyond it, ~67k are `fromlist`
(~65 per id), ~48k the bytecode of the decoder, `chain_keys` and the index loops, the rest a
percent or less each. Tried and reverted: building the index's maps in bulk (`dict(zip())`,
`isdisjoint`, `update`: 86.5k against 83.6k, slower than the loop of 16), passing the decoded
hash list through unchecked when it holds only plain ints (-0.7%). Next steps would need code
outside Python: a decoder that writes token ids straight into packed bytes (no Python int per
id).""",
    2: """\
Same per-message costs as benchmark 1. Built this session: stream threads drain their live
sockets one at a time (a lock the directory shares among its subscribers). pyzmq releases the
GIL around every frame it receives, and with 16 busy stream threads each release handed the
GIL to another stream thread and back: a context switch per frame, 137 us of CPU per message
against 36 us in turns (0.19-0.22x before, 0.49-0.51x after, on a quiet machine). What is left
is benchmark 1's ceiling plus 4 publisher processes and their ZMQ I/O threads sharing the 2
cores with this process.""",
    3: """\
Built: each stream publishes, under its lock on every state change, a pair (live resident-key
dict, shared zero-hit answer); a query probes the prompt's first key without the lock and
returns the shared answer when it is absent (~70 ns per such stream), and computes hits only
under the lock. While an index is prefix-closed (no block has left it since its snapshot),
the walk bisects (~7 lookups for 128 blocks instead of up to 128, ~40 ns each);
the directory resolves each stream's match function once per stream-set view; `StreamMatch`
is a non-frozen slots dataclass (0.13 us instead of 0.7 us to build). Measured before: p50
~4.0x. Remaining cost per query beyond the keys: ~8 us for 111 zero-hit streams, ~25 us for
17 hit streams (lock, bisection, answer). Under eviction (a block has left the index since
the last snapshot or periodic resync) the walk is linear again: about 1.9x for this prompt,
the lookups themselves (~40 ns each, 1,152 of them) being the floor. Exact hole tracking
would need a parent link per block, a dict slot over the 160-byte budget of benchmark 5.
p99 depends on other load on the 2 cores: with other test suites running during this run both
p99s rose to the millisecond range (keys alone 169-854 us) and the p99 ratio varied from 2.0x
to 6.2x over four runs of the same code; p50 stayed at 1.37-1.40x. On a quiet machine p99
was 1.4-2.3x.""",
    4: """\
Built: the query reads its body with one `wsgi.input.read(Content-Length)` (werkzeug's limited
stream copied it three times; chunked or oversized bodies still take werkzeug's path, so 413
and 400 are unchanged); the ids are packed once and handed to the directory as an
`array("I")`, which `pack_tokens` takes as is; the boolean precheck looks for the words
`true`/`false` only when a `u`/`l` byte is present (one memchr, ~0.3 us, against ~30 us). A/B
with the previous code in one window: 0.44x and 0.57x before, 0.58x and 0.68x after; worker
CPU per request beyond the trivial request 348 / 264 us before, 232 / 180 us after.
Ceiling: the trivial request costs the worker ~260 us of CPU (gunicorn parse and write,
Flask, GIL hand-overs between the worker's threads), and on 2 cores the worker is the
bottleneck (wrk takes the other core), so the ratio is about trivial CPU / query CPU. 0.7x
needs the query's own work under ~110 us; it is ~120 us in process: `orjson.loads` of the
4,096 ids ~60 us (40 us of it creating and freeing one Python int per id), packing 14 us, keys
7.5 us, the 16-stream match and its JSON 12 us, the body read. No stdlib or installed module
turns decimal text into packed ids without a Python int per id. A lean WSGI path in front of
Flask was not built: both endpoints would go through it, removing the same ~40 us from both
and lowering the ratio. Next step outside this endpoint's code: an optional binary body
(packed little-endian u32 ids) would remove the parse; that is a §10 extension.""",
    6: """\
Load = time from add_stream to synchronized minus the engine's own encoding time (the sim
encodes the whole reply before the first message; measured by a bare DEALER fetch of the same
snapshot). The build must not hold the GIL for long (benchmark 8): `ormsgpack.unpackb` of one
1 MiB reply message holds it for 5-9 ms, so the directory decodes large messages in ~16 kB
groups of events (`msgpack`'s skip finds the event boundaries, ~0.7 us per event; `ormsgpack`
parses each group) and sleeps 20 us after every 0.3 ms of work (timer slack 1 ns while
building) so that a waiting request thread takes the GIL. Side by side with the previous
split (each event's end found by packing it again, ~+35% decode CPU, and 60-80 us yields;
2.02x in the last quiet full run): 1.05-1.26x against 1.97-2.05x on an otherwise quiet machine,
1.17-1.46x against 1.83-2.07x with other load at ~4.5 on the 2 cores (whole-message decode, before
benchmark 8: 1.20-1.25x).
The build's CPU, measured alone: 2.35 s against 3.45 s before; raw decode + keys 2.2 s. What
is left is the yields (~8,000, ~35 us each), the query thread, and the ZMQ receive of 177 MiB;
a ratio above 1.5x means other processes took the build thread's core.""",
    7: """\
Each stream thread used to wake every 100 ms to check its stop event (3.2% of a core for 128
streams). Now `close()` wakes it through an inproc PULL the thread owns, so the poll sleeps
until the next deadline (attempt timeout, retry, periodic resync), at most 5 s.""",
}

BENCHES = {
    1: lambda a: bench_ingest_one(),
    2: lambda a: bench_ingest_many(),
    3: lambda a: bench_query(),
    4: lambda a: bench_http(),
    5: lambda a: bench_memory(),
    6: lambda a: bench_snapshot(),
    7: lambda a: bench_idle(a.idle_seconds),
    8: lambda a: bench_load_recovering(),  # issue 6
    # Issue 12; ``--small``: a tenth of the sizes, one round each (a check that they run).
    9: lambda a: (bench_catch_up_vs_rebuild(625, 2, 4) if a.small
                  else bench_catch_up_vs_rebuild()),
    10: lambda a: bench_rebuild_10k(1_000, 1, 1) if a.small else bench_rebuild_10k(),
    11: lambda a: bench_history_live(200, 400) if a.small else bench_history_live(),
    12: lambda a: bench_rebuild_under_load(1_000 if a.small else 10_000,
                                           a.b12_loads.split(","), a.b12_variants.split(","),
                                           a.b12_rounds),
}


def _table(results: list[Result]) -> list[str]:
    rows = ["| # | benchmark | target | measured ratio(s) | met |", "|---|---|---|---|---|"]
    for r in results:
        met = {True: "yes", False: "**no**", None: "n/a"}[r.met]
        rows.append(f"| {r.number} | {r.name} | {r.target} | {r.ratio_text()} | {met} |")
    return rows


#: Issue 12's benchmarks: their part of RESULTS.md is one section, each benchmark's own block
#: rewritten by the runs that measure it (``--only 9,10`` keeps 11 and 12).
HISTORY_BENCHES = (9, 10, 11, 12)
HISTORY_BEGIN, HISTORY_END = "<!-- history:begin -->", "<!-- history:end -->"
#: Hand-written figures moved out of the docs, kept as they are by every rewrite.
NOTES_MARKERS = ("<!-- notes:begin -->", "<!-- notes:end -->")
#: Hand-written figures of earlier runs, kept as they are by every rewrite.
EARLIER_BEGIN, EARLIER_END = "<!-- history-earlier:begin -->", "<!-- history-earlier:end -->"
HISTORY_INTRO = """\
## History mode (issue 12, §7h): benchmarks 9-12

`python -m bench.run --only 9,10,11,12` (`--small` for a quick check at a tenth of the sizes).
9 and 10 are the issue's two measures (`bench/history_replay.py`, a forked vLLM-style
publisher whose publishing loop answers history requests), 11 the digest's cost on the live
path (`bench/history_live.py`, in process), 12 a 10,000-batch rebuild under request load and
where its time goes (`bench/history_load.py`). Each block below is from the run named in it."""


def _section(text: str, begin: str, end: str) -> str:
    """The part of ``text`` from ``begin`` to ``end`` (markers included), or empty."""
    if begin in text and end in text:
        return text[text.index(begin):text.index(end) + len(end)]
    return ""


def _bench_markers(n: int) -> tuple[str, str]:
    return f"<!-- history:{n}:begin -->", f"<!-- history:{n}:end -->"


def history_block(r: Result, machine: dict[str, str]) -> str:
    """Benchmark ``r``'s block of the history section, between its markers."""
    begin, end = _bench_markers(r.number)
    met = {True: "met", False: "**not met**", None: "n/a"}[r.met]
    lines = [begin, f"### {r.number}. {r.name}", "",
             f"Run {machine.get('date', '?')} (`{machine.get('command', 'python -m bench.run')}`, "
             f"{machine.get('cores', '?')} cores, load average "
             f"{machine.get('load average', '?')}). Target: {r.target}. Result: "
             f"{r.ratio_text()}: {met}.", ""]
    lines += [f"- {f}" for f in r.figures]
    lines += [f"- {n}" for n in r.notes]
    lines.append(end)
    return "\n".join(lines)


def history_section(results: list[Result], machine: dict[str, str], old: str) -> str:
    """RESULTS.md's issue-12 section: this run's blocks of benchmarks 9..12, the blocks of
    ``old`` (the current file's text) for those not run, then the earlier runs' figures."""
    ran = {r.number: r for r in results if r.number in HISTORY_BENCHES and r.skipped is None}
    parts = [HISTORY_BEGIN, HISTORY_INTRO]
    for n in HISTORY_BENCHES:
        block = history_block(ran[n], machine) if n in ran else _section(old, *_bench_markers(n))
        if block:
            parts.append(block)
    earlier = _section(old, EARLIER_BEGIN, EARLIER_END)
    if earlier:
        parts.append(earlier)
    parts.append(HISTORY_END)
    return "\n\n".join(parts)


def write_history_section(results: list[Result], machine: dict[str, str]) -> None:
    """Replace (or append) the issue-12 section of ``bench/RESULTS.md``; the rest is kept."""
    old = RESULTS.read_text() if RESULTS.exists() else ""
    new = history_section(results, machine, old)
    current = _section(old, HISTORY_BEGIN, HISTORY_END)
    if current:
        text = old.replace(current, new)
    else:  # before the routing section, which stays last
        begin = "<!-- routing:begin -->"
        text = (old.replace(begin, new + "\n\n" + begin) if begin in old
                else old.rstrip("\n") + "\n\n" + new + "\n")
    RESULTS.write_text(text)


def write_results(results: list[Result], machine: dict[str, str], wall_s: float) -> None:
    """Write ``bench/RESULTS.md``."""
    lines = ["# kvsvc benchmark results (issues 3, 6 and 12)", "",
             "Written by `python -m bench.run`; every ratio is measured side by side in this "
             "one run.", "", "## Machine", ""]
    lines += [f"- {k}: {v}" for k, v in machine.items()]
    lines += [f"- suite wall time: {wall_s:.0f} s", "", "## Summary", ""]
    lines += _table(results)
    lines += ["", "## Details", ""]
    for r in results:
        if r.number in HISTORY_BENCHES:  # in their own section below
            continue
        lines += [f"### {r.number}. {r.name}", "", f"Target: {r.target}. Result: "
                  f"{r.ratio_text()}.", ""]
        lines += [f"- {f}" for f in r.figures]
        lines += [f"- {n}" for n in r.notes]
        if r.number in ANALYSIS and r.met is not True:
            lines += ["", ANALYSIS[r.number]]
        lines.append("")
    old = RESULTS.read_text() if RESULTS.exists() else ""
    # Issue 12's section: this run's blocks, the earlier ones kept.
    lines += [history_section(results, machine, old), ""]
    # Keep the routing section `kvsvc bench-routing` writes (kvsvc.testbed.bench_routing) and
    # the hand-written notes between the notes markers.
    for begin, end in (("<!-- routing:begin -->", "<!-- routing:end -->"), NOTES_MARKERS):
        if begin in old and end in old:
            lines += [old[old.index(begin):old.index(end) + len(end)], ""]
    RESULTS.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    """Run the suite. :returns: 0 when every benchmark ran (targets met or not), 1 otherwise."""
    parser = argparse.ArgumentParser(description="kvsvc benchmark suite (issues 3, 6, 12)")
    parser.add_argument("--only", default="", help="comma-separated benchmark numbers")
    parser.add_argument("--idle-seconds", type=float, default=60.0,
                        help="benchmark 7 window (issue: 60)")
    parser.add_argument("--no-write", action="store_true", help="do not write RESULTS.md")
    parser.add_argument("--small", action="store_true",
                        help="benchmarks 9-12 at a tenth of their sizes (writes nothing)")
    parser.add_argument("--b12-loads", default="http", help="benchmark 12's loads, of "
                        "none,spin,http")
    parser.add_argument("--b12-variants", default="adaptive",
                        help="benchmark 12's pacing variants, of before,adaptive,switch")
    parser.add_argument("--b12-rounds", type=int, default=1, help="benchmark 12's rounds")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    wanted = [int(x) for x in args.only.split(",") if x] or sorted(BENCHES)
    machine = machine_info()
    machine["command"] = " ".join(["python -m bench.run", *(sys.argv[1:] if argv is None
                                                             else argv)])
    print("machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()), flush=True)
    results: list[Result] = []
    failed = False
    t0 = time.perf_counter()
    for n in wanted:
        t = time.perf_counter()
        try:
            r = BENCHES[n](args)
        except Exception as exc:  # noqa: BLE001 - report and go on with the other benchmarks
            traceback.print_exc()
            r = Result(n, f"benchmark {n}", "", skipped=f"failed: {exc}")
            failed = True
        if n == 7 and args.idle_seconds != 60.0:
            r.notes.append(f"idle window shortened to {args.idle_seconds:g} s (issue: 60 s)")
        results.append(r)
        print(f"[{n}] {r.name}: {r.ratio_text()}  ({time.perf_counter() - t:.0f} s)", flush=True)
        for f in r.figures:
            print(f"      {f}", flush=True)
    wall = time.perf_counter() - t0
    print()
    print("\n".join(_table(results)))
    print(f"\nsuite wall time {wall:.0f} s")
    if args.small:
        args.no_write = True  # a tenth of the sizes: figures not to keep
    if not args.no_write and not args.only:
        write_results(results, machine, wall)
        print(f"wrote {RESULTS}")
    elif not args.no_write and any(r.number in HISTORY_BENCHES and r.skipped is None
                                   for r in results):
        write_history_section(results, machine)
        print(f"wrote the history section of {RESULTS}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
