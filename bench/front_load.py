"""Issue 22 item 3: what the OpenAI front end costs per short request, against the simulated
engines served directly, in one run.

``python -m bench.front_load`` starts etcd, ``--engines`` simulated vLLM engines (``kvsvc sim
--serve --flavor vllm`` at 1000x: model time ~0) and ``kvsvc serve`` (its real gunicorn
config, CAR, the testbed's shared tokenizer) in front of them, then drives closed loops of
short requests (16-token prompts, ``max_tokens`` 1 plain / 16 streamed, the peers harness's
``overhead`` phase) at each ``--concurrency``, per body kind (``text`` prompts tokenized by
the router, ``ids`` token-id prompts) and answer kind (``plain``, ``stream``):

- **direct**: the same client straight to the engines (round robin): what the client and the
  engines can do on this machine without a router;
- **kvsvc**: through the router.

Each cell reports requests/s, latency p50/p99, and the gunicorn worker's CPU per request
(user + system from ``/proc/<pid>/stat``, Linux only); the ratios are kvsvc against direct
in the same run, and against issue 22's targets (>= 1,000 requests/s at concurrency 128,
<= 1 ms router CPU per request). The client is one asyncio process speaking HTTP/1.1 keep-alive
on raw streams (no third-party client, little CPU per request); it shares the cores with the
router and the engines, as the peers harness's does.

``--profile DIR`` also records the worker with ``py-spy`` (when installed; ``--gil``
samples) during the text / plain cell at the highest concurrency, writing
``DIR/front-<cell>.txt`` (collapsed stacks). Every process started is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

if __package__ in (None, ""):  # ``python bench/front_load.py``
    sys.path[0] = str(Path(__file__).resolve().parent.parent)
    __package__ = "bench"

from bench._common import cpu_split, gunicorn_worker_pid, percentile  # noqa: E402
from kvsvc.testbed.bench_routing import MODEL, BenchOptions, EngineProcesses  # noqa: E402
from kvsvc.testbed.demo import (  # noqa: E402
    DemoOptions,
    ServiceProcess,
    discovery_config,
    free_port_run,
)
from kvsvc.testbed.etcd_launcher import LocalEtcd  # noqa: E402
from kvsvc.testbed.tokenizer import build_tokenizer, single_token_words, write_tokenizer  # noqa: E402

#: Issue 22's short-request targets at concurrency 128.
TARGET_RPS = 1000.0
TARGET_CPU_US = 1000.0
PROMPT_TOKENS = 16
#: Token ids of the short prompts are drawn below this (well inside the shared tokenizer's
#: vocabulary and the single-token words).
VOCAB = 2000


@dataclass
class Cell:
    """One closed-loop run.

    :ivar target: ``direct`` or ``kvsvc``.
    :ivar body: ``text`` or ``ids``.
    :ivar stream: streamed answers.
    :ivar conc: concurrent requests.
    :ivar done: requests answered 200 and complete within the measured window.
    :ivar failed: requests that failed within it.
    :ivar seconds: measured window, seconds.
    :ivar lat_ms: latencies of the requests counted in ``done``, ms.
    :ivar cpu_s: the router worker's CPU seconds over the window (``None``: direct / unknown).
    :ivar sys_s: the part of ``cpu_s`` spent in the kernel.
    :ivar errors: error text -> count.
    """

    target: str
    body: str
    stream: bool
    conc: int
    done: int = 0
    failed: int = 0
    seconds: float = 0.0
    lat_ms: list[float] = field(default_factory=list)
    cpu_s: Optional[float] = None
    sys_s: Optional[float] = None
    errors: dict[str, int] = field(default_factory=dict)

    @property
    def rps(self) -> float:
        """Requests answered per second."""
        return self.done / self.seconds if self.seconds else 0.0

    @property
    def cpu_us(self) -> Optional[float]:
        """Router worker CPU per answered request, microseconds."""
        if self.cpu_s is None or not self.done:
            return None
        return 1e6 * self.cpu_s / self.done

    def p(self, q: float) -> float:
        """Latency percentile ``q`` (0..100) of the answered requests, ms; NaN when none was
        answered (the cell is reported as failed, not the run lost)."""
        return percentile(self.lat_ms, q) if self.lat_ms else float("nan")

    @property
    def label(self) -> str:
        return f"{self.target} {self.body} {'stream' if self.stream else 'plain'} c={self.conc}"


def short_bodies(n: int, stream: bool, words: Optional[list[str]], seed: int) -> list[bytes]:
    """``n`` completion bodies of :data:`PROMPT_TOKENS`-token prompts: token ids, or (with
    ``words``) text of one single-token word per id."""
    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [rnd.randrange(VOCAB) for _ in range(PROMPT_TOKENS)]
        prompt: object = ids if words is None else "".join(words[t % len(words)] for t in ids)
        doc: dict = {"model": MODEL, "prompt": prompt, "max_tokens": 16 if stream else 1}
        if stream:
            doc.update(stream=True, stream_options={"include_usage": True})
        out.append(json.dumps(doc, separators=(",", ":")).encode())
    return out


class _Broken(Exception):
    pass


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str,
                    body: bytes) -> tuple[int, bytes, bool]:
    """One POST /v1/completions on a kept-alive connection: (status, body, keep-alive)."""
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: " + host.encode()
                 + b"\r\nContent-Type: application/json\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    version, status = lines[0].split(b" ", 2)[:2]
    headers = {}
    for line in lines[1:]:
        if line:
            k, _, v = line.partition(b":")
            headers[k.strip().lower()] = v.strip().lower()
    keep = version == b"HTTP/1.1" and headers.get(b"connection") != b"close"
    if b"content-length" in headers:
        data = await reader.readexactly(int(headers[b"content-length"]))
    elif headers.get(b"transfer-encoding") == b"chunked":
        parts = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                break
            parts.append((await reader.readexactly(size + 2))[:-2])
        data = b"".join(parts)
    else:
        data = await reader.read(-1)
        keep = False
    return int(status), data, keep


def _complete(data: bytes, stream: bool) -> bool:
    if stream:
        return b'"usage"' in data and data.rstrip().endswith(b"[DONE]")
    return b'"usage"' in data


async def closed_loop(targets: Sequence[tuple[str, int]], bodies: Sequence[bytes], cell: Cell,
                      warm_s: float, dur_s: float, cpu_pid: Optional[int]) -> None:
    """``cell.conc`` workers, each sending its next body as soon as the last one is answered,
    for ``warm_s`` + ``dur_s`` seconds; counts requests sent and answered within the last
    ``dur_s`` seconds."""
    loop = asyncio.get_running_loop()
    t_meas = loop.time() + warm_s
    t_stop = t_meas + dur_s
    counter = [0]
    cpu: list[Optional[tuple[float, float]]] = [None, None]

    async def measure() -> None:
        await asyncio.sleep(max(0.0, t_meas - loop.time()))
        cpu[0] = cpu_split(cpu_pid)
        await asyncio.sleep(max(0.0, t_stop - loop.time()))
        cpu[1] = cpu_split(cpu_pid)

    async def worker() -> None:
        conn: Optional[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = None
        try:
            while loop.time() < t_stop:
                k = counter[0]
                counter[0] += 1
                host, port = targets[k % len(targets)]
                sent = loop.time()
                try:
                    if conn is None or len(targets) > 1:
                        if conn is not None:
                            conn[1].close()
                        conn = await asyncio.open_connection(host, port)
                    status, data, keep = await _exchange(*conn, f"{host}:{port}",
                                                         bodies[k % len(bodies)])
                    if not keep:
                        conn[1].close()
                        conn = None
                    ok = status == 200 and _complete(data, cell.stream)
                    why = "" if ok else f"{status} {data[:60]!r}"
                except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                        ValueError) as exc:
                    ok, why = False, type(exc).__name__
                    if conn is not None:
                        conn[1].close()
                    conn = None
                end = loop.time()
                if sent >= t_meas and end <= t_stop:
                    if ok:
                        cell.done += 1
                        cell.lat_ms.append(1000 * (end - sent))
                    else:
                        cell.failed += 1
                        cell.errors[why] = cell.errors.get(why, 0) + 1
        finally:
            if conn is not None:
                conn[1].close()

    await asyncio.gather(measure(), *(worker() for _ in range(cell.conc)))
    cell.seconds = dur_s
    if cpu[0] is not None and cpu[1] is not None:
        cell.cpu_s = (cpu[1][0] - cpu[0][0]) + (cpu[1][1] - cpu[0][1])
        cell.sys_s = cpu[1][1] - cpu[0][1]


def _profile(pid: int, seconds: float, out: Path) -> Optional[subprocess.Popen]:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        print("front_load: py-spy not installed; no profile", flush=True)
        return None
    return subprocess.Popen([spy, "record", "--nonblocking", "--gil", "-r", "97", "-p", str(pid),
                             "-d", str(max(1, int(seconds))), "-f", "raw", "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run(args: argparse.Namespace) -> list[Cell]:
    """Start everything, run every cell, stop everything; returns the cells in order."""
    levels = [int(c) for c in args.concurrency.split(",")]
    kinds = args.bodies.split(",")
    answers = [s == "stream" for s in args.answers.split(",")]
    cells: list[Cell] = []
    tmp = Path(tempfile.mkdtemp(prefix="kvsvc-front-"))
    tok_dir = tmp / "tokenizer"
    tok_dir.mkdir()
    write_tokenizer(tok_dir)
    words = single_token_words(build_tokenizer())
    token = secrets.token_hex(16)
    etcd = LocalEtcd()
    opts = BenchOptions(engines=args.engines, time_scale=1000.0, flavor="vllm",
                        stream_coalesce_ms=0.0, max_num_seqs=256, client_threads=512)
    demo = DemoOptions(block_size=opts.block_size, refresh_interval_ms=200,
                       resync_interval_ms=5000, flavor="vllm")
    engines = EngineProcesses(opts, etcd.addr, token, tmp, demo.event_port_offset,
                              demo.replay_port_offset, tok_dir / "tokenizer.json")
    service: Optional[ServiceProcess] = None
    try:
        etcd.start()
        engines.start(60.0)
        cfg = tmp / "kv_events.json"
        doc = discovery_config(demo)
        doc["discovery"]["backends"] = ["vllm"]  # history replay, as the engines serve it
        cfg.write_text(json.dumps(doc), encoding="utf-8")
        service = ServiceProcess(
            cfg, free_port_run(1), token, tmp / "service.log", etcd_addr=etcd.addr,
            extra_args=["--load_balance_policy", "CAR", "--car_prefill_lambda", "0.5",
                        "--model", MODEL, "--tokenizer_path", str(tok_dir / "tokenizer.json"),
                        "--load_scrape_interval_ms", "1000",
                        *(["--worker_threads", str(args.threads)] if args.threads else [])])
        service.start(60.0, {(n, 0) for n in engines.names})
        service.wait_routable(set(engines.names), 60.0)
        assert service.pid is not None
        worker = gunicorn_worker_pid(service.pid)
        idle0 = cpu_split(worker)
        time.sleep(args.idle_s)
        idle1 = cpu_split(worker)
        if idle0 is not None and idle1 is not None and args.idle_s > 0:
            print(f"  idle worker CPU: {100 * (sum(idle1) - sum(idle0)) / args.idle_s:.1f}% of "
                  f"a core over {args.idle_s:g} s", flush=True)
        direct = [(n.rsplit(":", 1)[0], int(n.rsplit(":", 1)[1])) for n in engines.names]
        router = [("127.0.0.1", service.port)]
        for kind in kinds:
            for stream in answers:
                bodies = short_bodies(4096, stream, words if kind == "text" else None,
                                      seed=1 + int(stream))
                for conc in levels:
                    for target in args.targets.split(","):
                        cell = Cell(target, kind, stream, conc)
                        spy = None
                        if (args.profile and target == "kvsvc" and kind == kinds[0]
                                and stream == answers[0] and conc == max(levels)
                                and worker is not None):
                            Path(args.profile).mkdir(parents=True, exist_ok=True)
                            spy = _profile(worker, args.warm_s + args.dur_s, Path(
                                args.profile, f"front-{kind}-{'stream' if stream else 'plain'}"
                                f"-c{conc}.txt"))
                        asyncio.run(closed_loop(direct if target == "direct" else router,
                                                bodies, cell, args.warm_s, args.dur_s,
                                                worker if target == "kvsvc" else None))
                        if spy is not None:
                            spy.wait(60)
                        cells.append(cell)
                        cpu = cell.cpu_us
                        print(f"  {cell.label:<28} {cell.rps:7.0f} req/s, p50 "
                              f"{cell.p(50):7.2f} ms, p99 "
                              f"{cell.p(99):7.2f} ms, worker CPU "
                              f"{'-' if cpu is None else f'{cpu:.0f}'} us/req "
                              f"({'-' if cell.sys_s is None else f'{1e6 * cell.sys_s / max(1, cell.done):.0f}'} sys), failed "
                              f"{cell.failed} {dict(list(cell.errors.items())[:2]) or ''}",
                              flush=True)
    finally:
        try:
            if service is not None:
                service.close()
        finally:
            try:
                engines.close()
            finally:
                etcd.stop()
    return cells


def report(cells: Sequence[Cell]) -> str:
    """The markdown table: per (body, answers, concurrency) direct and kvsvc requests/s,
    kvsvc/direct, kvsvc latency p50, worker CPU per request, and the targets' ratios."""
    rows = ["| body | answers | conc | direct req/s | kvsvc req/s | kvsvc/direct | kvsvc p50 ms "
            "| kvsvc p99 ms | worker CPU us/req | req/s / 1000 | CPU / 1 ms | failed |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    by = {(c.target, c.body, c.stream, c.conc): c for c in cells}
    for c in cells:
        if c.target != "kvsvc":
            continue
        d = by.get(("direct", c.body, c.stream, c.conc))
        cpu = c.cpu_us
        rows.append(
            f"| {c.body} | {'stream' if c.stream else 'plain'} | {c.conc} | "
            f"{f'{d.rps:,.0f}' if d else '-'} | {c.rps:,.0f} | "
            f"{f'{c.rps / d.rps:.2f}' if d and d.rps else '-'} | "
            f"{c.p(50):.1f} | {c.p(99):.1f} | "
            f"{'-' if cpu is None else f'{cpu:,.0f}'} | {c.rps / TARGET_RPS:.2f} | "
            f"{'-' if cpu is None else f'{cpu / TARGET_CPU_US:.2f}'} | "
            f"{c.failed + (d.failed if d else 0)} |")
    return "\n".join(rows)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--concurrency", default="1,32,128")
    ap.add_argument("--bodies", default="text,ids", help="text and/or ids")
    ap.add_argument("--answers", default="plain,stream", help="plain and/or stream")
    ap.add_argument("--targets", default="direct,kvsvc", help="direct and/or kvsvc")
    ap.add_argument("--warm-s", type=float, default=1.0)
    ap.add_argument("--dur-s", type=float, default=4.0, help="measured seconds per cell")
    ap.add_argument("--threads", type=int, default=0,
                    help="kvsvc serve --worker_threads (0: its default)")
    ap.add_argument("--idle-s", type=float, default=3.0,
                    help="seconds the idle worker's CPU is measured before the load")
    ap.add_argument("--profile", default="", help="directory for a py-spy profile")
    args = ap.parse_args(argv)
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    load0 = os.getloadavg()[0]
    cells = run(args)
    print(f"\nbench.front_load {' '.join(argv if argv is not None else sys.argv[1:])}: "
          f"started {started}, load average {load0:.1f} at start, "
          f"{os.getloadavg()[0]:.1f} at end\n")
    print(report(cells))
    bad = [c for c in cells if c.done == 0]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
