"""Issue 19, measure 2: output tokens relayed per second per core through ``Generations`` -> SSE
(native xLLM dispatch, §13) beside the HTTP relay's rate, in the same run.

Each side is a real ``kvsvc serve`` (one gunicorn ``gthread`` worker) with one simulated
engine in its own process (``kvsvc sim --serve``, flavor xllm, registered in a local etcd):

- **native**: ``--xllm_dispatch native`` with a baidu_std port; the engine runs ``--native``:
  it takes each request over ``XllmAPIService`` and pushes every output token to kvsvc with
  ``Generations`` over baidu_std as an xLLM engine does: one call at a time, each carrying one
  decode step (one entry, one token) of every running request, the next call once the
  previous is answered (``kvsvc.testbed.sim.native.GenerationsPusher``); kvsvc writes one SSE
  chunk per entry, the entries queued for a request in one write;
- **http**: the same engine serving OpenAI over HTTP; kvsvc relays its SSE body.

The engine's latency model is compressed (``--time-scale``, 1000 by default) so that the
engine and kvsvc, not the model, bound the rate; ``--stream-coalesce-ms 0``: one write (HTTP)
or one entry (native) per token and step on both sides. With ``--time-scale 1`` the engines
run at a real pace and both sides relay the same offered load (compare CPU per token there).
``--streams`` concurrent clients each ask for ``--tokens`` tokens, repeatedly, for
``--seconds`` per phase; phases run http, native, native, http, so a change of the shared
machine's load weighs on both sides alike. Figures per side: tokens counted in the SSE answers
the clients read, the wall rate, and the kvsvc process group's CPU time (user + system,
``/proc/<pid>/stat``), whose ratio is the rate **per core** (the figure compared). Both sides
run the same ``kvsvc serve`` settings (``--serve-arg`` adds one to both).

``python -m bench.generations_relay [--seconds 20] [--streams 16] [--tokens 256]
[--time-scale 1000] [--serve-arg=...]``; prints one JSON line per side and a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import requests

from kvsvc.testbed.etcd_launcher import LocalEtcd
from kvsvc.testbed.ports import free_instance_port, free_port_run

ROOT = Path(__file__).resolve().parents[1]
CLK_TCK = os.sysconf("SC_CLK_TCK")


def group_cpu_s(pgid: int) -> float:
    """User + system CPU seconds of every live process of the group ``pgid``."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == pgid:   # pgrp
            total += int(fields[11]) + int(fields[12])   # utime, stime
    return total / CLK_TCK


@dataclass
class Side:
    """One side's service and engine processes."""

    mode: str
    base: str
    service: subprocess.Popen
    engine: subprocess.Popen
    tokens: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    errors: int = 0


def _start(mode: str, etcd: str, tmp: Path, namespace: str,
           serve_args: tuple[str, ...] = (), time_scale: float = 1000.0) -> Side:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSVC_")}
    env["PYTHONPATH"] = str(ROOT)
    port = free_port_run(1)
    args = [sys.executable, "-m", "kvsvc", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--etcd_addr", etcd, "--etcd_namespace", namespace, "--model", "sim",
            "--load_balance_policy", "RR", "--kv_events_config_file", "",
            "--log_level", "warning", "--xllm_dispatch", mode, *serve_args]
    if mode == "native":
        args += ["--rpc_port", str(free_port_run(1)), "--rpc_host", "127.0.0.1"]
    else:
        args += ["--rpc_port", "0"]
    service = subprocess.Popen(args, env=env, cwd=ROOT, stdout=open(tmp / f"{mode}-serve.log",
                                                                     "w"),
                               stderr=subprocess.STDOUT, start_new_session=True)
    eport = free_instance_port(1, 10000, 30000)
    eargs = [sys.executable, "-m", "kvsvc", "sim", "--serve", "--host", "127.0.0.1",
             "--port", str(eport), "--etcd", etcd, "--etcd-namespace", namespace,
             "--time-scale", str(time_scale), "--max-num-seqs", "256",
             "--stream-coalesce-ms", "0",
             "--max-connections", "512", "--heartbeat-interval-s", "0.5",
             "--log-level", "warning"]
    if mode == "native":
        eargs += ["--native", "--kv-events", "off"]
    engine = subprocess.Popen(eargs, env=env, cwd=ROOT,
                              stdout=open(tmp / f"{mode}-sim.log", "w"),
                              stderr=subprocess.STDOUT, start_new_session=True)
    side = Side(mode, f"http://127.0.0.1:{port}", service, engine)
    deadline = time.monotonic() + 60
    name = f"127.0.0.1:{eport}"
    while time.monotonic() < deadline:
        try:
            route = requests.post(side.base + "/v1/internal/route", json={"token_ids": [1]},
                                  timeout=2).json()
            if any(c["name"] == name for c in route.get("candidates", [])):
                return side
        except (requests.RequestException, ValueError):
            pass
        time.sleep(0.2)
    _stop(side)
    raise RuntimeError(f"{mode}: engine {name} never became a candidate (logs in {tmp})")


def _stop(side: Side) -> None:
    for proc in (side.service, side.engine):
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
    for proc in (side.service, side.engine):
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def _phase(side: Side, seconds: float, streams: int, tokens: int) -> None:
    stop_at = time.monotonic() + seconds
    counts = [0] * streams
    errors = [0] * streams
    body = json.dumps({"model": "sim", "prompt": list(range(1, 65)), "max_tokens": tokens,
                       "stream": True}).encode()

    def client(i: int) -> None:
        with requests.Session() as s:
            s.trust_env = False
            while time.monotonic() < stop_at:
                try:
                    r = s.post(side.base + "/v1/completions", data=body, stream=True,
                               timeout=30, headers={"Content-Type": "application/json"})
                    n = sum(1 for line in r.iter_lines() if line.startswith(b"data: {"))
                    counts[i] += n
                except requests.RequestException:
                    errors[i] += 1

    cpu0 = group_cpu_s(side.service.pid)
    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 60)
    side.wall_s += time.monotonic() - t0
    side.cpu_s += group_cpu_s(side.service.pid) - cpu0
    side.tokens += sum(counts)
    side.errors += sum(errors)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="per phase")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--time-scale", type=float, default=1000.0,
                        help="the simulated engines' time compression: 1000 (default) makes "
                        "the engine and kvsvc the bound; 1 is an engine's real pace (about "
                        "20-40 ms per token per stream), at which both sides relay the same "
                        "offered load")
    parser.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                        help="one more argument of both sides' `kvsvc serve` (repeatable), "
                        "e.g. --serve-arg=--worker_switch_interval_ms=5")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-gen-") as tmp_s:
        tmp = Path(tmp_s)
        etcd = LocalEtcd(name="bench-gen")
        etcd.start()
        sides: dict[str, Side] = {}
        try:
            for mode in ("http", "native"):
                sides[mode] = _start(mode, etcd.addr, tmp, f"bench-{mode}-{secrets.token_hex(3)}",
                                     tuple(args.serve_arg), args.time_scale)
            for mode in ("http", "native", "native", "http"):
                _phase(sides[mode], args.seconds / 2, args.streams, args.tokens)
        finally:
            for side in sides.values():
                _stop(side)
            etcd.cleanup()
    rows = []
    for mode in ("http", "native"):
        s = sides[mode]
        per_core = s.tokens / s.cpu_s if s.cpu_s else 0.0
        line = {"side": mode, "tokens": s.tokens, "wall_s": round(s.wall_s, 2),
                "tokens_per_s": round(s.tokens / s.wall_s, 1),
                "kvsvc_cpu_s": round(s.cpu_s, 2), "tokens_per_core_s": round(per_core, 1),
                "errors": s.errors}
        print(json.dumps(line))
        rows.append(line)
    ratio = rows[1]["tokens_per_core_s"] / rows[0]["tokens_per_core_s"] if rows[0][
        "tokens_per_core_s"] else 0.0
    print("\n| side | tokens | tokens/s (wall) | kvsvc CPU s | tokens per core-second | "
          "errors |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['side']} | {r['tokens']} | {r['tokens_per_s']} | {r['kvsvc_cpu_s']} | "
              f"{r['tokens_per_core_s']} | {r['errors']} |")
    print(f"\nnative / http per core: {ratio:.2f} (target >= 1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
