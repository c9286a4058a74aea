"""The issue-3 benchmark suite: ``python -m bench.run`` (or ``make bench``).

Runs benchmarks 1..7 one after another in this process (publishers and engines in child
processes), prints a table of ratios against the targets plus the absolute figures, and writes
``bench/RESULTS.md`` with the machine it ran on and the analysis of every unmet target
(:data:`ANALYSIS`, written from the profiles taken while building the suite).

``--only 1,3`` runs a subset; ``--idle-seconds`` shortens benchmark 7 (the issue's 60 s is the
default); ``--no-write`` leaves RESULTS.md alone. Whole suite: about 3 minutes on 2 cores.
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
Profile (cProfile of the stream thread, 24,000 batches): `ormsgpack.unpackb` 0.45 s of 1.8 s
profiled; ZMQ receive (`recv_multipart` + `poll`, incl. enum flag conversions) 0.35 s; index
apply 0.47 s (`_stored` 0.27 s of which `chain_keys` 0.13 s, `_removed` 0.18 s);
`decode_batch` beyond unpackb 0.33 s (`_tokens` 0.12 s). Offline (same payloads, no sockets,
one thread) parse + decode + apply runs at 0.58x the raw decode rate, so the ceiling of this
design is below the 0.6x target before any socket work; the live path loses about 0.1-0.2x
more to ZMQ receive and to the publisher process and both ZMQ I/O threads sharing the 2 cores.
Run-to-run spread is large (0.27x to 0.50x in five runs of the same code). Tried: per-event
instead of per-block count updates in `TierIndex._removed` (kept; within the noise). Next
steps, with their measured shares: `copy=False` frames and a receive path without the
per-frame `RCVMORE` query (~0.15 s of 1.8 s); a decoder that skips re-validating tokens that
`pack_tokens` checks again (~0.03 s).""",
    2: """\
Same per-batch costs as benchmark 1, plus 16 stream threads and 4 publisher processes sharing 2
cores under one GIL: the aggregate cannot exceed one core's worth of Python, and the
publishers' ZMQ I/O threads take CPU from it. See benchmark 1 for the profile and next steps.""",
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
Built: `orjson` parses the body and serialises the answer; type and range are checked by
packing the ids as 32-bit integers in C (the element-by-element checks run only for bad
bodies or bodies containing `true`/`false`). Measured before: 0.43x. Per request, parsing a
4,096-id body now takes ~65 us (`json.loads` + checks took ~280 us); what is left is Flask and
gunicorn request handling, reading the 30 kB body, keys and the 16-stream query, on 2 cores
of which `wrk` takes about one. Next step: a leaner WSGI path for the query endpoint (no
Flask request/response objects), outside this change.""",
    6: """\
Load = time from add_stream to synchronized minus the engine's own encoding time (the sim
encodes the whole reply before the first message; measured by a bare DEALER fetch of the same
snapshot). The sim sends one BlockStored event per block, so per-event costs of the decoder
(dataclass construction, field checks) and the index dominate over hashing.""",
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
}


def _table(results: list[Result]) -> list[str]:
    rows = ["| # | benchmark | target | measured ratio(s) | met |", "|---|---|---|---|---|"]
    for r in results:
        met = {True: "yes", False: "**no**", None: "n/a"}[r.met]
        rows.append(f"| {r.number} | {r.name} | {r.target} | {r.ratio_text()} | {met} |")
    return rows


def write_results(results: list[Result], machine: dict[str, str], wall_s: float) -> None:
    """Write ``bench/RESULTS.md``."""
    lines = ["# kvsvc benchmark results (issue 3)", "",
             "Written by `python -m bench.run`; every ratio is measured side by side in this "
             "one run.", "", "## Machine", ""]
    lines += [f"- {k}: {v}" for k, v in machine.items()]
    lines += [f"- suite wall time: {wall_s:.0f} s", "", "## Summary", ""]
    lines += _table(results)
    lines += ["", "## Details", ""]
    for r in results:
        lines += [f"### {r.number}. {r.name}", "", f"Target: {r.target}. Result: "
                  f"{r.ratio_text()}.", ""]
        lines += [f"- {f}" for f in r.figures]
        lines += [f"- {n}" for n in r.notes]
        if r.number in ANALYSIS and r.met is not True:
            lines += ["", ANALYSIS[r.number]]
        lines.append("")
    # Keep the routing section `kvsvc bench-routing` writes (kvsvc.bench_routing).
    old = RESULTS.read_text() if RESULTS.exists() else ""
    begin, end = "<!-- routing:begin -->", "<!-- routing:end -->"
    if begin in old and end in old:
        lines += [old[old.index(begin):old.index(end) + len(end)], ""]
    RESULTS.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    """Run the suite. :returns: 0 when every benchmark ran (targets met or not), 1 otherwise."""
    parser = argparse.ArgumentParser(description="kvsvc benchmark suite (issue 3)")
    parser.add_argument("--only", default="", help="comma-separated benchmark numbers")
    parser.add_argument("--idle-seconds", type=float, default=60.0,
                        help="benchmark 7 window (issue: 60)")
    parser.add_argument("--no-write", action="store_true", help="do not write RESULTS.md")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    wanted = [int(x) for x in args.only.split(",") if x] or sorted(BENCHES)
    machine = machine_info()
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
    if not args.no_write and not args.only:
        write_results(results, machine, wall)
        print(f"wrote {RESULTS}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
