"""Issue 3, benchmark 4: the query endpoint over HTTP under ``wrk`` load, against a trivial
JSON endpoint of the same app under the same load.

**The trivial endpoint** is ``GET /health`` (``flask.jsonify(status="ok")``, touching nothing).
It is served by the same process and the same path as the query: one gunicorn ``gthread``
worker, the Flask app, its ``before_request`` token hook and its error handlers. There is no
lean path in front of Flask for either endpoint, so the ratio compares the query's own work
(body read, parse and checks of 4,096 ids, content keys, the 16-stream directory query, the
answer) with the cost of serving any request of this app.

The service runs as ``python -m kvsvc serve`` (its real gunicorn config: one ``gthread``
worker with the default ``--worker_threads``) in its own process group, with 16 streams of 2,048 blocks served by a
stream-server process; stream 0 holds the 4,096-token prompt, and the answer is checked
before the load. ``wrk`` (Debian package ``wrk``) loads each endpoint with the same threads and
connections, in four phases of ``seconds / 2`` each ordered trivial, query, query, trivial, so a
change of the shared machine's load during the run weighs on both sides alike; each side's rate
is its requests over its two phases' time. Needs ``wrk`` on ``PATH``: without it the benchmark
is reported as not run, with the install command.

Besides the rates, the figures give the worker process's CPU time per request of each side
(user + system, from ``/proc/<pid>/stat``; Linux only): the part of the gap that is the
service's own work, as opposed to ``wrk`` and the kernel sharing the 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import requests

from ._common import (
    cpu_seconds,
    gunicorn_worker_pid,
    ROOT,
    Result,
    StreamServer,
    make_streams,
    snapshot_payloads,
    token_pool,
    wait_until,
)
from ._common import chain_events
from .query import _filler
from tests.support.util import free_port

QUERY_TOKENS = 4096
N_STREAMS = 16
QUERY_PATH = "/v1/internal/kv-cache/query"
TRIVIAL_PATH = "/health"


@dataclass
class WrkRun:
    """One ``wrk`` run.

    :param requests: completed requests.
    :param seconds: wrk's measured duration, seconds.
    :param errors: socket errors plus non-2xx/3xx answers.
    :param cpu_s: CPU time (user + system) the worker process spent during the run, seconds;
        ``None`` where ``/proc`` is not readable.
    """

    requests: int
    seconds: float
    errors: int
    cpu_s: Optional[float]


def _wrk(url: str, seconds: float, connections: int, script: Optional[str],
         worker: Optional[int]) -> WrkRun:
    """Run wrk against ``url`` for ``seconds``, measuring the worker's CPU time meanwhile."""
    cmd = ["wrk", "-t2", f"-c{connections}", f"-d{seconds:g}s", "--latency"]
    if script:
        cmd += ["-s", script]
    cpu0 = cpu_seconds(worker)
    out = subprocess.run(cmd + [url], capture_output=True, text=True,
                         timeout=seconds + 60).stdout
    cpu1 = cpu_seconds(worker)
    m = re.search(r"(\d+) requests in ([\d.]+)(m?s)", out)
    if m is None:
        raise RuntimeError(f"unexpected wrk output: {out!r}")
    duration = float(m.group(2)) / (1000.0 if m.group(3) == "ms" else 1.0)
    errors = sum(int(n) for n in re.findall(r"(?:connect|read|write|timeout) (\d+)", out))
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    cpu = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
    return WrkRun(int(m.group(1)), duration, errors + (int(non2xx.group(1)) if non2xx else 0),
                  cpu)


def _side(runs: list[WrkRun]) -> tuple[float, int, int, Optional[float]]:
    """(req/s, requests, errors, worker CPU us per request) over the runs of one side."""
    n = sum(r.requests for r in runs)
    rps = n / sum(r.seconds for r in runs)
    cpu = None if any(r.cpu_s is None for r in runs) else sum(r.cpu_s for r in runs)
    return rps, n, sum(r.errors for r in runs), (cpu / n * 1e6 if cpu is not None and n else None)


def bench_http(seconds: int = 10, connections: int = 32) -> Result:
    """Benchmark 4 (see the module docstring).

    :param seconds: load time of each side, seconds (two phases of half of it each).
    :param connections: wrk connections (2 wrk threads).
    """
    res = Result(4, "query over HTTP", "query req/s >= 0.7 x trivial req/s, no errors")
    if shutil.which("wrk") is None:
        res.skipped = "wrk not installed (apt-get install -y wrk)"
        return res
    pool = token_pool(QUERY_TOKENS + 2048 * 128, seed=17)
    prompt, rest = pool[:QUERY_TOKENS], pool[QUERY_TOKENS:]
    streams = make_streams(N_STREAMS)
    with_prompt = snapshot_payloads(chain_events(prompt, 1) + _filler(rest, 2048 - QUERY_TOKENS // 128))
    without = snapshot_payloads(_filler(rest, 2048))
    for i, s in enumerate(streams):
        s.snapshot = with_prompt if i == 0 else without
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    half = seconds / 2
    with tempfile.TemporaryDirectory(prefix="kvsvc-bench-") as tmp:
        cfg = Path(tmp, "kv.json")
        cfg.write_text(json.dumps({"streams": [{
            "instance_name": f"127.0.0.1:{20000 + i}", "endpoint": s.endpoint,
            "replay_endpoint": s.replay_endpoint} for i, s in enumerate(streams)],
            "resync_interval_ms": 600_000}))
        body = json.dumps({"token_ids": prompt})
        script = Path(tmp, "query.lua")
        script.write_text('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
                          f"wrk.body = {json.dumps(body)}\n")
        server = StreamServer(streams)
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSVC_")}
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        log = open(Path(tmp, "serve.log"), "wb")
        proc = None
        try:
            server.start()
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvsvc", "serve", "--host", "127.0.0.1", "--port",
                 str(port), "--kv_events_config_file", str(cfg), "--log_level", "warning"],
                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)

            def ready() -> bool:
                if proc.poll() is not None:
                    raise RuntimeError("kvsvc serve exited early")
                try:
                    return requests.get(base + "/ready", timeout=2).status_code == 200
                except requests.ConnectionError:
                    return False

            wait_until(ready, 60, "/ready", interval_s=0.1)
            answer = requests.post(base + QUERY_PATH, data=body,
                                   headers={"Content-Type": "application/json"}, timeout=5).json()
            hits = [m["device_hit_tokens"] for m in answer["matches"]]
            if hits != [QUERY_TOKENS] + [0] * (N_STREAMS - 1):
                raise AssertionError(f"unexpected HTTP answer {hits}")
            worker = gunicorn_worker_pid(proc.pid)
            trivial_url, query_url = base + TRIVIAL_PATH, base + QUERY_PATH
            _wrk(trivial_url, 1, connections, None, None)  # warm-up, both sides
            _wrk(query_url, 1, connections, str(script), None)
            trivial = [_wrk(trivial_url, half, connections, None, worker)]
            query = [_wrk(query_url, half, connections, str(script), worker)]
            query.append(_wrk(query_url, half, connections, str(script), worker))
            trivial.append(_wrk(trivial_url, half, connections, None, worker))
        finally:
            if proc is not None:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGINT)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=10)
            log.close()
            server.close()
    triv_rps, triv_n, triv_err, triv_cpu = _side(trivial)
    q_rps, q_n, q_err, q_cpu = _side(query)
    res.ratios["query/trivial req/s"] = (q_rps / triv_rps, 0.7, False)
    if q_err or triv_err:
        res.ratios["errors (must be 0)"] = (float(q_err + triv_err), 0.0, True)
    res.figures += [
        f"wrk -t2 -c{connections}, {seconds} s per side in phases of {half:g} s ordered "
        f"trivial, query, query, trivial; {N_STREAMS} streams x 2048 blocks, "
        f"{QUERY_TOKENS}-token prompt ({len(body)} bytes JSON)",
        f"query {q_rps:,.0f} req/s ({q_n} requests, {q_err} errors); trivial GET /health "
        f"{triv_rps:,.0f} req/s ({triv_n} requests, {triv_err} errors)",
    ]
    if q_cpu is not None and triv_cpu is not None:
        res.figures.append(f"worker CPU per request: query {q_cpu:.0f} us, trivial "
                           f"{triv_cpu:.0f} us")
    res.notes.append("trivial endpoint: GET /health (flask.jsonify) through the same gunicorn "
                     "worker, Flask app, token hook and error handlers as the query; no lean "
                     "path for either")
    return res
