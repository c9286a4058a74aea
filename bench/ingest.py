"""Issue 3, benchmarks 1 and 2: live ingest rate against plain ``ormsgpack.unpackb``.

Ingest rate = blocks applied per second (stored + removed blocks) from the moment the publisher
processes are told to send until every stream's ``status().sequence`` reaches the last
published seq. Raw decode rate = the same blocks over the time of ``ormsgpack.unpackb`` of the
same payloads in one thread (best of 3). Both are measured in the same run.

Exactness checks: every stream ends synchronized, with exactly one recovery (its first
snapshot), sequence = last seq, and 0 resident blocks (every stored block was removed).
"""

from __future__ import annotations

import logging
import os
import threading
import time

from kvsvc.directory import Directory

from ._common import (
    Result,
    StreamServer,
    all_synchronized,
    best_of,
    churn_payloads,
    decode_all,
    directory_config,
    make_streams,
    wait_until,
)

log = logging.getLogger(__name__)


def _stream_threads_cpu_s() -> float:
    """CPU seconds (user + system) used so far by this process's stream threads, from
    ``/proc/self/task/<tid>/stat`` (Linux); 0.0 where that is not readable."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for t in threading.enumerate():
        if not t.name.startswith("kvsvc-stream-") or t.native_id is None:
            continue
        try:
            with open(f"/proc/self/task/{t.native_id}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
    return total / tick

#: No periodic resync during the run (it would re-snapshot mid-measure).
_LIMITS = {"resync_interval_ms": 600_000}


def _run_ingest(n_streams: int, n_procs: int,
                n_stored: int) -> tuple[float, int, float, int, float]:
    """Publish ``n_stored`` store+remove pairs per stream from ``n_procs`` processes.

    :returns: (ingest seconds, blocks applied in all, raw decode seconds of one stream's
        payloads, blocks of one stream, CPU seconds the stream threads used while ingesting).
    """
    payloads, blocks = churn_payloads(n_stored, seed=3)
    decode_s = best_of(lambda: decode_all(payloads))
    streams = make_streams(n_streams)
    for s in streams:
        s.live = payloads  # same bytes on every stream: hashes only mean something per stream
    last = len(payloads) - 1
    per_proc = n_streams // n_procs
    servers = [StreamServer(streams[i * per_proc:(i + 1) * per_proc]) for i in range(n_procs)]
    directory = None
    try:
        for srv in servers:
            srv.start()
        directory = Directory(directory_config(streams, **_LIMITS))
        directory.start()
        wait_until(lambda: all_synchronized(directory), 30, "first snapshots")
        wait_until(lambda: sum(s.subscriptions for s in servers) >= n_streams, 30,
                   "subscriptions")
        cpu0 = _stream_threads_cpu_s()
        t0 = time.perf_counter()
        for srv in servers:
            srv.go()
        t1 = wait_until(lambda: all(st.sequence == last for st in directory.statuses()),
                        600, "catch-up", interval_s=0.002)
        cpu_s = _stream_threads_cpu_s() - cpu0
        for st in directory.statuses():
            if (st.state.value != "synchronized" or st.recoveries != 1 or st.device_blocks
                    or st.host_blocks or st.entries):
                raise AssertionError(f"ingest not exact: {st}")
        return t1 - t0, blocks * n_streams, decode_s, blocks, cpu_s
    finally:
        if directory is not None:
            directory.close()
        for srv in servers:
            srv.close()


def bench_ingest_one(n_stored: int = 12_000) -> Result:
    """Benchmark 1: one stream, one publisher process."""
    res = Result(1, "ingest, 1 stream", "ingest >= 0.6 x raw decode rate")
    ingest_s, blocks, decode_s, _, cpu_s = _run_ingest(1, 1, n_stored)
    ingest_rate, decode_rate = blocks / ingest_s, blocks / decode_s
    res.ratios["ingest/decode"] = (ingest_rate / decode_rate, 0.6, False)
    n = 2 * n_stored
    res.figures += [
        f"{n} batches ({n_stored} BlockStored of 16 x 128 tokens, each followed by "
        f"its BlockRemoved), {blocks} blocks",
        f"ingest {ingest_rate:,.0f} blocks/s ({ingest_s:.2f} s); raw ormsgpack.unpackb "
        f"{decode_rate:,.0f} blocks/s ({decode_s:.2f} s)",
        _cpu_figure(cpu_s, ingest_s, decode_s, n),
    ]
    return res


def _cpu_figure(cpu_s: float, ingest_s: float, decode_s: float, messages: int) -> str:
    """The stream threads' CPU per message against raw decode per message: what the ratio
    would be if they had a core to themselves (the rest of the gap is CPU they did not get)."""
    if cpu_s <= 0:
        return "stream-thread CPU: not measurable here (/proc)"
    return (f"stream threads' CPU {cpu_s * 1e6 / messages:.1f} us per message "
            f"({cpu_s / ingest_s:.0%} of the wall time) against raw decode "
            f"{decode_s * 1e6 / messages:.1f} us: CPU-bound ratio {decode_s / cpu_s:.2f}x")


def bench_ingest_many(n_stored: int = 3_000) -> Result:
    """Benchmark 2: 16 streams from 4 publisher processes, aggregate."""
    res = Result(2, "ingest, 16 streams", "aggregate >= 0.5 x raw decode rate")
    ingest_s, blocks, decode_s, one, cpu_s = _run_ingest(16, 4, n_stored)
    ingest_rate, decode_rate = blocks / ingest_s, one / decode_s
    res.ratios["aggregate/decode"] = (ingest_rate / decode_rate, 0.5, False)
    res.figures += [
        f"16 streams x {2 * n_stored} batches from 4 processes, {blocks} blocks",
        f"aggregate ingest {ingest_rate:,.0f} blocks/s ({ingest_s:.2f} s); raw decode "
        f"{decode_rate:,.0f} blocks/s",
        _cpu_figure(cpu_s, ingest_s, decode_s * 16, 16 * 2 * n_stored),
    ]
    return res
