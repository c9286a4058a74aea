"""Issue 3, benchmark 4: the query endpoint over HTTP under ``wrk`` load, against a trivial
JSON endpoint (``GET /health``) of the same app under the same load.

The service runs as ``python -m kvsvc serve`` (its real gunicorn config: one ``gthread`` worker,
16 threads) in its own process group, with 16 streams of 2,048 blocks served by a
stream-server process; stream 0 holds the 4,096-token prompt. ``wrk`` (Debian package ``wrk``)
runs each endpoint for the same duration with the same threads and connections. Needs ``wrk``
on ``PATH``: without it the benchmark is reported as not run, with the install command.
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
from pathlib import Path

import requests

from ._common import (
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
from tests.util import free_port

QUERY_TOKENS = 4096
N_STREAMS = 16


def _wrk(url: str, seconds: int, connections: int, script: str | None) -> tuple[float, int, int]:
    """Run wrk. :returns: (requests/s, requests, errors: socket errors + non-2xx)."""
    cmd = ["wrk", "-t2", f"-c{connections}", f"-d{seconds}s", "--latency"]
    if script:
        cmd += ["-s", script]
    out = subprocess.run(cmd + [url], capture_output=True, text=True, timeout=seconds + 60).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    total = int(re.search(r"(\d+) requests in", out).group(1))
    errors = sum(int(n) for n in re.findall(r"(?:connect|read|write|timeout) (\d+)", out))
    m = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return rps, total, errors + (int(m.group(1)) if m else 0)


def bench_http(seconds: int = 10, connections: int = 32) -> Result:
    """Benchmark 4."""
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
    with tempfile.TemporaryDirectory(prefix="kvsvc-bench-") as tmp:
        cfg = Path(tmp, "kv.json")
        cfg.write_text(json.dumps({"streams": [{
            "instance_name": f"bench-{i:03d}", "endpoint": s.endpoint,
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
            answer = requests.post(base + "/v1/internal/kv-cache/query", data=body,
                                   headers={"Content-Type": "application/json"}, timeout=5).json()
            hits = [m["device_hit_tokens"] for m in answer["matches"]]
            if hits != [QUERY_TOKENS] + [0] * (N_STREAMS - 1):
                raise AssertionError(f"unexpected HTTP answer {hits}")
            _wrk(base + "/health", 2, connections, None)  # warm-up
            triv_rps, triv_n, triv_err = _wrk(base + "/health", seconds, connections, None)
            q_rps, q_n, q_err = _wrk(base + "/v1/internal/kv-cache/query", seconds,
                                     connections, str(script))
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
    res.ratios["query/trivial req/s"] = (q_rps / triv_rps, 0.7, False)
    if q_err or triv_err:
        res.ratios["errors (must be 0)"] = (float(q_err + triv_err), 0.0, True)
    res.figures += [
        f"wrk -t2 -c{connections} -d{seconds}s; {N_STREAMS} streams x 2048 blocks, "
        f"{QUERY_TOKENS}-token prompt ({len(body)} bytes JSON)",
        f"query {q_rps:,.0f} req/s ({q_n} requests, {q_err} errors); GET /health "
        f"{triv_rps:,.0f} req/s ({triv_n} requests, {triv_err} errors)",
    ]
    return res
