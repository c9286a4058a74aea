"""Issue 19, measures 1 and 3: the baidu_std server's answer time under load (§13).

- a 64-entry ``Generations`` call answered in p99 <= 2 ms while ``--streams`` (100) streams are
  relayed;
- a ``Heartbeat`` answered in p99 <= 2 ms under that load (an engine's heartbeat thread waits on
  each answer).

A real ``kvsvc serve`` (one gunicorn ``gthread`` worker, ``--xllm_dispatch native``, a baidu_std
port) and ``--engines`` simulated xLLM engines in native mode (``kvsvc sim --serve --native``,
registered in a local etcd): every output token of every request comes back as one
``Generations`` call over baidu_std and kvsvc writes one SSE chunk per entry. ``--streams``
client threads keep that many streamed completions of ``--tokens`` tokens in flight. A probe,
in a process of its own (so that the clients' threads do not delay its clock), then calls the
server every ``--interval-ms``, alternately: ``Heartbeat`` for one of the engines (its name
and incarnation: the whole registry path) and ``Generations`` with 64 entries (for
``service_req_id``s no request holds: the lookup, the conversion and the StatusSet of 64,
without a queue append per entry). Its figures are wall time from the first byte written to
the whole answer read, on a kept-alive connection.

``--load senders`` replaces the relayed streams (and the engines) with ``--engines`` plain
``Generations`` senders, each on its own connection sending every ``--step-ms`` one call with
one entry per stream it holds (``--streams / --engines``), as engines push a token per
running request per step: the server's load without the HTTP relay's.

``python -m bench.rpc_latency [--seconds 30] [--streams 100] [--engines 2]
[--serve-arg=--worker_switch_interval_ms=5]``; prints one JSON line per call kind and a
Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import requests

from kvsvc.testbed.etcd_launcher import LocalEtcd
from kvsvc.testbed.ports import free_instance_port, free_port_run

ROOT = Path(__file__).resolve().parents[1]
SERVICE = "xllm_service.proto.XllmRpcService"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSVC_")}
    env["PYTHONPATH"] = str(ROOT)
    return env


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
    for proc in procs:
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` by the nearest-rank rule."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q * len(ordered) + 0.5)) - 1))]


# -- the probe (its own process) -----------------------------------------------------------

def probe(target: str, name: str, incarnation: str, seconds: float, interval_ms: float) -> dict:
    """Alternate Heartbeat and 64-entry Generations calls to ``target`` for ``seconds``."""
    from kvsvc.rpc import messages
    from kvsvc.rpc.client import RpcClient

    client = RpcClient()
    hb = messages.HeartbeatRequest(name=name, incarnation_id=incarnation)
    hb.load_metrics.waiting_requests_num = 0
    hb_bytes = messages.serialize(hb)
    gens = messages.DisaggStreamGenerations()
    for i in range(64):
        g = gens.gens.add(req_id=f"probe-{i}", service_req_id=f"probe-none-{i}")
        g.outputs.add(index=0, text="t ", token_ids=[1000 + i])
    gens_bytes = messages.serialize(gens)
    out: dict[str, list[float]] = {"Heartbeat": [], "Generations64": []}
    bad = {"Heartbeat": 0, "Generations64": 0}
    stop_at = time.monotonic() + seconds
    turn = 0
    try:
        # Warm the connection.
        client.call(target, SERVICE, "Hello", b"")
        while time.monotonic() < stop_at:
            kind = "Heartbeat" if turn % 2 == 0 else "Generations64"
            turn += 1
            t0 = time.perf_counter()
            if kind == "Heartbeat":
                resp = client.call(target, SERVICE, "Heartbeat", hb_bytes)
                ok = messages.parse(messages.Status, resp.message).ok
            else:
                resp = client.call(target, SERVICE, "Generations", gens_bytes)
                ok = len(messages.parse(messages.StatusSet, resp.message).all_status) == 64
            out[kind].append((time.perf_counter() - t0) * 1000.0)
            if not ok:
                bad[kind] += 1
            time.sleep(interval_ms / 1000.0)
    finally:
        client.close()
    return {k: {"n": len(v), "p50_ms": round(statistics.median(v), 3),
                "p99_ms": round(percentile(v, 0.99), 3), "max_ms": round(max(v), 3),
                "not_ok": bad[k]} for k, v in out.items() if v}


# -- the load -----------------------------------------------------------------------------

def senders(target: str, engines: int, streams: int, step_ms: float, seconds: float) -> dict:
    """``engines`` threads, each on its own connection, sending every ``step_ms`` one
    Generations call with one entry per stream it holds (``streams / engines``), as engines
    push one token per running request per step."""
    from kvsvc.rpc import messages
    from kvsvc.rpc.client import RpcClient

    per = max(1, streams // engines)
    call = messages.DisaggStreamGenerations()
    for i in range(per):
        call.gens.add(req_id=f"load-{i}", service_req_id=f"load-none-{i}").outputs.add(
            text="t ", token_ids=[1000 + i])
    data = messages.serialize(call)
    calls = [0] * engines
    stop_at = time.monotonic() + seconds

    def run(i: int) -> None:
        client = RpcClient()
        try:
            next_at = time.monotonic()
            while time.monotonic() < stop_at:
                client.call(target, SERVICE, "Generations", data)
                calls[i] += 1
                next_at += step_ms / 1000.0
                time.sleep(max(0.0, next_at - time.monotonic()))
        finally:
            client.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(engines)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 30)
    total = sum(calls)
    return {"calls": total, "entries_per_s": round(total * per / seconds, 1),
            "entries_per_call": per}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="probe duration")
    parser.add_argument("--streams", type=int, default=100)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=100000,
                        help="max_tokens of each relayed stream (long: the streams stay open)")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="the simulated engines' time compression (1: real time)")
    parser.add_argument("--interval-ms", type=float, default=10.0)
    parser.add_argument("--load", choices=("relay", "senders"), default="relay")
    parser.add_argument("--step-ms", type=float, default=20.0,
                        help="--load senders: one call per engine every this many ms")
    parser.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                        help="one more argument of `kvsvc serve` (repeatable), e.g. "
                        "--serve-arg=--worker_switch_interval_ms=5 for an A/B run")
    parser.add_argument("--probe", nargs=3, metavar=("TARGET", "NAME", "INCARNATION"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--senders", metavar="TARGET", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        print(json.dumps(probe(*args.probe, args.seconds, args.interval_ms)))
        return 0
    if args.senders:
        print(json.dumps(senders(args.senders, args.engines, args.streams, args.step_ms,
                                 args.seconds)))
        return 0
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    env = _env()
    tmp = Path(tempfile.mkdtemp(prefix="bench-rpc-"))
    etcd = LocalEtcd(name="bench-rpc")
    etcd.start()
    namespace = f"bench-rpc-{secrets.token_hex(3)}"
    procs: list[subprocess.Popen] = []
    stop = threading.Event()
    counts = [0] * args.streams
    errors = [0] * args.streams
    first_error: list[str] = []
    try:
        port, rpc_port = free_port_run(1), free_port_run(1)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "kvsvc", "serve", "--host", "127.0.0.1", "--port", str(port),
             "--etcd_addr", etcd.addr, "--etcd_namespace", namespace, "--model", "sim",
             "--load_balance_policy", "RR", "--kv_events_config_file", "",
             "--log_level", "warning", "--xllm_dispatch", "native", "--rpc_port", str(rpc_port),
             "--rpc_host", "127.0.0.1", "--worker_threads", str(max(128, args.streams + 32)),
             *args.serve_arg],
            env=env, cwd=ROOT, stdout=open(tmp / "serve.log", "w"), stderr=subprocess.STDOUT,
            start_new_session=True))
        names = []
        for i in range(args.engines if args.load == "relay" else 1):
            eport = free_instance_port(1, 10000, 30000, avoid={port, rpc_port})
            names.append(f"127.0.0.1:{eport}")
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "kvsvc", "sim", "--serve", "--native", "--kv-events",
                 "off", "--host", "127.0.0.1", "--port", str(eport), "--etcd", etcd.addr,
                 "--etcd-namespace", namespace, "--time-scale", str(args.time_scale),
                 "--max-num-seqs", "256", "--stream-coalesce-ms", "0",
                 "--max-connections", "512", "--log-level", "warning"],
                env=env, cwd=ROOT, stdout=open(tmp / f"sim{i}.log", "w"),
                stderr=subprocess.STDOUT, start_new_session=True))
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            try:
                route = requests.post(base + "/v1/internal/route", json={"token_ids": [1]},
                                      timeout=2).json()
                if {c["name"] for c in route.get("candidates", [])} >= set(names):
                    break
            except (requests.RequestException, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"engines never became candidates (logs in {tmp})")
            time.sleep(0.2)
        from kvsvc.cluster.etcd import EtcdClient
        reg = EtcdClient(etcd.addr)
        try:
            kv = reg.get(f"/{namespace}/XLLM:DEFAULT:{names[0]}")
            incarnation = json.loads(kv.value)["incarnation_id"] if kv else ""
        finally:
            reg.close()

        threads: list[threading.Thread] = []
        load: Optional[subprocess.Popen] = None
        if args.load == "relay":
            body = json.dumps({"model": "sim", "prompt": list(range(1, 65)),
                               "max_tokens": args.tokens, "stream": True}).encode()

            def client(i: int) -> None:
                with requests.Session() as s:
                    s.trust_env = False
                    while not stop.is_set():
                        try:
                            with s.post(base + "/v1/completions", data=body, stream=True,
                                        timeout=60,
                                        headers={"Content-Type": "application/json"}) as r:
                                if r.status_code != 200:
                                    errors[i] += 1
                                    first_error.append(f"{r.status_code} {r.text[:200]}")
                                    time.sleep(0.5)
                                    continue
                                for line in r.iter_lines():
                                    if line.startswith(b"data: {"):
                                        counts[i] += 1
                                    if stop.is_set():
                                        break
                        except requests.RequestException:
                            errors[i] += 1

            threads = [threading.Thread(target=client, args=(i,), daemon=True)
                       for i in range(args.streams)]
            for t in threads:
                t.start()
        else:
            load = subprocess.Popen(
                [sys.executable, "-m", "bench.rpc_latency", "--senders",
                 f"127.0.0.1:{rpc_port}", "--streams", str(args.streams), "--engines",
                 str(args.engines), "--step-ms", str(args.step_ms), "--seconds",
                 str(args.seconds + 10)], env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        time.sleep(5.0)   # every stream open and relaying
        before = sum(counts)
        t0 = time.monotonic()
        out = subprocess.run(
            [sys.executable, "-m", "bench.rpc_latency", "--probe", f"127.0.0.1:{rpc_port}",
             names[0], incarnation, "--seconds", str(args.seconds), "--interval-ms",
             str(args.interval_ms)], env=env, cwd=ROOT, capture_output=True, text=True,
            timeout=args.seconds + 120)
        wall = time.monotonic() - t0
        relayed = sum(counts) - before
        stop.set()
        if out.returncode != 0:
            raise RuntimeError(f"probe failed: {out.stderr[-2000:]}")
        result = json.loads(out.stdout.strip().splitlines()[-1])
        load_line = ({"load": "relay", "streams": args.streams, "engines": args.engines,
                      "entries_relayed_per_s": round(relayed / wall, 1),
                      "client_errors": sum(errors),
                      "first_error": first_error[0] if first_error else None}
                     if args.load == "relay" else
                     {"load": "senders", "engines": args.engines, "streams": args.streams,
                      "step_ms": args.step_ms})
        if load is not None:
            sent, _ = load.communicate(timeout=args.seconds + 60)
            load_line.update(json.loads(sent.strip().splitlines()[-1]))
        print(json.dumps(load_line))
        for kind, figures in result.items():
            print(json.dumps({"call": kind, **figures}))
        print("\n| call | n | p50 ms | p99 ms | max ms | target |\n|---|---|---|---|---|---|")
        for kind, f in result.items():
            print(f"| {kind} | {f['n']} | {f['p50_ms']} | {f['p99_ms']} | {f['max_ms']} | "
                  f"p99 <= 2 ms |")
        for t in threads:
            t.join(10)
    finally:
        stop.set()
        _stop(procs)
        etcd.cleanup()
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
