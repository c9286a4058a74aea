"""Discovery end to end (§9): a real etcd, simulated engines that register themselves (in process
and as ``kvsvc sim --etcd`` subprocesses), and the service (in process, and as two real
``kvsvc serve`` replicas). Exact stream sets, states, identities and hits.

Measured here and printed (``pytest -s`` shows them): discovery reaction time (registration put
-> stream synchronized) and master failover time between two service processes."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import flask
import pytest
import requests

from kvsvc.http.app import create_app
from kvsvc.http.extensions import EXTENSION
from kvsvc.http.internal import QUERY_PATH
from kvsvc.config import parse_kv_events_config
from kvsvc.settings import load_service_settings
from kvsvc.testbed.demo import free_instance_port
from kvsvc.cluster.etcd import EtcdClient
from kvsvc.cluster.model import InstanceState
from kvsvc.testbed.sim.engine import SimEngine
from kvsvc.testbed.sim.registration import EtcdRegistration, Load
from kvsvc.streams.state import StreamId
from tests.support.util import free_port, wait_for

pytestmark = pytest.mark.etcd  # every test here runs against a real etcd

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "e2e-discovery-token"
DISCOVERY = {"enabled": True, "block_size": 4, "topic": "kv", "event_port_offset": 10000,
             "replay_port_offset": 30000, "refresh_interval_ms": 100}
TOKENS = [1, 2, 3, 4, 5, 6, 7, 8]




def kv_doc(replay_timeout_ms: int = 2000) -> dict:
    return {"discovery": DISCOVERY, "replay_timeout_ms": replay_timeout_ms}


@contextmanager
def service(etcd_addr: str, suspect_s: float = 15.0) -> Iterator[flask.Flask]:
    """The service in process (not served over HTTP): registry, directory, discovery."""
    settings = load_service_settings(etcd_addr=etcd_addr, host="127.0.0.1", port=free_port(),
                                     detect_disconnected_instance_interval=suspect_s)
    app = create_app(settings, parse_kv_events_config(kv_doc()))
    svc = app.extensions[EXTENSION]
    svc.start(timeout_s=10.0)
    try:
        yield app
    finally:
        svc.close(timeout_s=10.0)


@contextmanager
def registered_sim(etcd_addr: str, port: int, dp: int = 1) -> Iterator[tuple[SimEngine,
                                                                              EtcdRegistration]]:
    """An in-process engine serving /health on ``port`` and registered under a 3 s lease."""
    name = f"127.0.0.1:{port}"
    eng = SimEngine(name, port + 10000, port + 30000, dp_size=dp, block_size=4, topic="kv",
                    http_port=port)
    eng.start()
    reg = EtcdRegistration(etcd_addr, name, dp,
                           lambda: Load(eng.waiting_requests(), eng.device_usage()))
    try:
        reg.start()
        yield eng, reg
    finally:
        try:
            reg.close()
        finally:
            eng.close()


def answers(app: flask.Flask, tokens: list[int] = TOKENS) -> dict[tuple[str, int], tuple]:
    directory = app.extensions[EXTENSION].directory
    return {(m.instance_name, m.dp_rank): (m.synchronized, m.sequence, m.device_hit_tokens)
            for m in directory.query(tokens)}


def status(app: flask.Flask, sid: StreamId):
    directory = app.extensions[EXTENSION].directory
    return {st.stream: st for st in directory.statuses()}[sid]


def test_join_refresh_keeps_index_replacement_starts_empty(etcd_server):
    port = free_instance_port(2, 10000, 30000)
    name = f"127.0.0.1:{port}"
    s0, s1 = StreamId(name, 0), StreamId(name, 1)
    with service(etcd_server.addr) as app, registered_sim(etcd_server.addr, port, dp=2) as (eng, reg):
        directory = app.extensions[EXTENSION].directory
        reg.wait_registered()
        t0 = time.monotonic()
        wait_for(lambda: answers(app) == {(name, 0): (True, None, 0), (name, 1): (True, None, 0)},
                 timeout_s=10.0, what="both ranks discovered and synchronized")
        print(f"\ndiscovery reaction (put -> 2 streams synchronized): "
              f"{1000 * (time.monotonic() - t0):.0f} ms")
        assert directory.stream_ids() == [s0, s1]
        assert directory.identity(s0) == directory.identity(s1) == reg.incarnation_id
        eng.execute(TOKENS, rank=0)
        wait_for(lambda: answers(app)[(name, 0)] == (True, 0, 8), what="hit on rank 0")

        # A refresh of the registration with the same incarnation: streams and index kept.
        registry = app.extensions[EXTENSION].registry
        gen = registry.snapshot().generation
        etcd = EtcdClient(etcd_server.addr)
        try:
            value = dict(reg.value(), register_ts_ms=reg.value()["register_ts_ms"] + 5)
            etcd.put(reg.key, json.dumps(value))
        finally:
            etcd.close()
        registry.wait_for(lambda s: s.generation > gen
                          and s.instances[name].register_ts_ms == value["register_ts_ms"], 5.0)
        disc = app.extensions[EXTENSION].discovery
        seen = disc.refreshes
        wait_for(lambda: disc.refreshes >= seen + 2, what="two refreshes after the put")
        assert answers(app)[(name, 0)] == (True, 0, 8)
        assert (status(app, s0).recoveries, status(app, s1).recoveries) == (1, 1)
        old_identity = directory.identity(s0)

        # Process replacement at the same address: new incarnation -> new streams that answer
        # nothing until their first snapshot (held back 0.7 s here to observe it).
        eng.restart()
        eng.execute(TOKENS, rank=0)
        eng.delay_snapshots(0, 0.7, count=20)
        new_identity = reg.reincarnate()
        assert new_identity != old_identity
        wait_for(lambda: directory.identity(s0) == new_identity, what="rank 0 replaced")
        assert answers(app)[(name, 0)] == (False, None, 0)
        assert status(app, s0).recoveries == 0
        wait_for(lambda: answers(app)[(name, 0)] == (True, 0, 8), timeout_s=10.0,
                 what="replaced stream synchronized by its snapshot")
        assert directory.identity(s1) == new_identity
        assert directory.stream_ids() == [s0, s1]


@pytest.mark.etcd_fresh
def test_deregistration_removes_streams_and_etcd_outage_keeps_readiness(etcd_server):
    """Issue 13: an etcd outage no longer drains the replica (main answered 503 here): /ready
    stays 200 routing on the last snapshot and says so; streams go on serving."""
    port = free_instance_port(1, 10000, 30000)
    name = f"127.0.0.1:{port}"
    with service(etcd_server.addr) as app:
        client = app.test_client()
        with registered_sim(etcd_server.addr, port) as (eng, reg):
            wait_for(lambda: answers(app) == {(name, 0): (True, None, 0)}, timeout_s=10.0,
                     what="stream synchronized")
            eng.execute(TOKENS)
            wait_for(lambda: answers(app)[(name, 0)] == (True, 0, 8), what="hit")
            r = client.get("/ready?streams=synchronized")
            body = r.get_json()
            assert r.status_code == 200 and body["ready"] is True
            assert (body["registry"]["fresh"], body["registry"]["instances"]) == (True, 1)
            assert [(s["instance_name"], s["identity"], s["state"]) for s in body["streams"]] == [
                (name, reg.incarnation_id, "synchronized")]

            # etcd down: the last snapshot is kept, streams go on serving, the replica stays
            # ready (every replica shares etcd: 503 would drain them all at once).
            etcd_server.stop()
            wait_for(lambda: not client.get("/ready?streams=synchronized").get_json()["registry"]["fresh"],
                     timeout_s=15.0, what="registry not fresh")
            r = client.get("/ready?streams=synchronized")
            body = r.get_json()
            assert (r.status_code, body["ready"], body["registry"]["fresh"],
                    body["registry"]["routing_on_last_snapshot"], body["registry"]["instances"],
                    body["waiting_for"]) == (200, True, False, True, 1, [])
            assert body["registry"]["stale_for_s"] > 0
            assert answers(app)[(name, 0)] == (True, 0, 8)
            etcd_server.start()
            wait_for(lambda: client.get("/ready?streams=synchronized").get_json()["registry"]["fresh"],
                     timeout_s=15.0, what="registry fresh again")
            body = client.get("/ready?streams=synchronized").get_json()
            assert (body["ready"], body["registry"]["routing_on_last_snapshot"],
                    body["registry"]["stale_for_s"]) == (True, False, None)
            assert answers(app)[(name, 0)] == (True, 0, 8)
        # Clean stop revokes the lease: the key goes at once, /health fails -> SUSPECT ->
        # streams removed.
        wait_for(lambda: answers(app) == {}, timeout_s=10.0, what="streams removed")
        assert app.extensions[EXTENSION].directory.identity(StreamId(name, 0)) is None


def test_ready_waits_for_the_first_plans_streams_then_stays_through_a_replacement(etcd_server):
    """Issue 13: warm-up is the streams of discovery's first plan synchronized once (main
    answered 200 with them unsynchronized, as soon as the registry was fresh); after it a
    replaced stream that has not synchronized yet does not make the replica unready (main:
    503)."""
    port = free_instance_port(1, 10000, 30000)
    name = f"127.0.0.1:{port}"
    with registered_sim(etcd_server.addr, port) as (eng, reg):
        reg.wait_registered()
        eng.delay_snapshots(0, 1.0)
        with service(etcd_server.addr) as app:
            client = app.test_client()
            directory = app.extensions[EXTENSION].directory
            wait_for(lambda: directory.stream_ids() == [StreamId(name, 0)], timeout_s=10.0,
                     what="stream discovered")
            r = client.get("/ready?streams=synchronized")
            body = r.get_json()
            assert (r.status_code, body["ready"], body["warmed_up"], body["waiting_for"]) == (
                503, False, False, [f"stream {name}/dp0 first synchronization"])
            wait_for(lambda: client.get("/ready?streams=synchronized").status_code == 200, timeout_s=10.0,
                     what="ready after the first synchronization")
            assert answers(app)[(name, 0)][0] is True

            eng.restart()
            eng.delay_snapshots(0, 1.0, count=20)
            new_identity = reg.reincarnate()
            wait_for(lambda: directory.identity(StreamId(name, 0)) == new_identity,
                     what="stream replaced")
            r = client.get("/ready?streams=synchronized")
            body = r.get_json()
            assert answers(app)[(name, 0)][0] is False
            assert (r.status_code, body["ready"], body["warmed_up"]) == (200, True, True)
            assert [(s["identity"], s["synchronized_once"]) for s in body["streams"]] == [
                (new_identity, False)]


def sim_process(etcd_addr: str, port: int, log_path: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSVC_")}
    env["KVSVC_INTERNAL_API_TOKEN"] = TOKEN
    with open(log_path, "w", encoding="utf-8") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "kvsvc", "sim", "--etcd", etcd_addr, "--port", str(port),
             "--block-size", "4", "--topic", "kv", "--heartbeat-interval-s", "0.5",
             "--log-level", "info"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT, env=env)


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(15.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5.0)


def test_killed_sim_leaves_by_lease_expiry(etcd_server, tmp_path):
    port = free_instance_port(1, 10000, 30000)
    name = f"127.0.0.1:{port}"
    with service(etcd_server.addr, suspect_s=1.0) as app:
        registry = app.extensions[EXTENSION].registry
        proc = sim_process(etcd_server.addr, port, tmp_path / "sim.log")
        try:
            wait_for(lambda: answers(app) == {(name, 0): (True, None, 0)}, timeout_s=15.0,
                     what="sim subprocess discovered")
            proc.kill()  # no deregistration: the 3 s lease has to expire
            proc.wait(5.0)
            t0 = time.monotonic()
            snap = registry.wait_for(
                lambda s: name in s.instances and s.instances[name].state == InstanceState.SUSPECT,
                timeout_s=10.0)
            assert snap.instances[name].state == InstanceState.SUSPECT
            wait_for(lambda: answers(app) == {}, timeout_s=5.0, what="streams removed")
            removed_s = time.monotonic() - t0
            registry.wait_for(lambda s: name not in s.instances, timeout_s=10.0)
            print(f"\nlease expiry -> streams removed: {removed_s:.2f} s after SIGKILL")
            assert removed_s < 3.0 + 1.0 + 1.0
        finally:
            stop_process(proc, signal.SIGKILL)


def serve_process(etcd_addr: str, port: int, cfg: Path, log_path: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSVC_")}
    env["KVSVC_INTERNAL_API_TOKEN"] = TOKEN
    env["KVSVC_LOG_LEVEL"] = "info"
    env["KVSVC_RPC_PORT"] = "0"   # replicas side by side: no fixed baidu_std port
    with open(log_path, "w", encoding="utf-8") as out:
        # Its own process group, so the test can kill arbiter and worker at once (a crash).
        return subprocess.Popen(
            [sys.executable, "-m", "kvsvc", "serve", "--host", "127.0.0.1", "--port", str(port),
             "--kv_events_config_file", str(cfg), "--etcd_addr", etcd_addr],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT, env=env,
            start_new_session=True)


def ready_body(port: int) -> Optional[dict]:
    try:
        return requests.get(f"http://127.0.0.1:{port}/ready?streams=synchronized", timeout=2.0).json()
    except (requests.RequestException, ValueError):
        return None


def test_two_service_replicas_discover_alone_and_fail_over(etcd_server, tmp_path):
    cfg = tmp_path / "kv.json"
    cfg.write_text(json.dumps(kv_doc()), encoding="utf-8")
    sim_port = free_instance_port(1, 10000, 30000)
    name = f"127.0.0.1:{sim_port}"
    ports = [free_port(), free_port()]
    procs = [serve_process(etcd_server.addr, p, cfg, tmp_path / f"serve{i}.log")
             for i, p in enumerate(ports)]
    sim = sim_process(etcd_server.addr, sim_port, tmp_path / "sim.log")
    try:
        def both_ready() -> bool:
            bodies = [ready_body(p) for p in ports]
            return all(b is not None and b["ready"] and
                       [(s["instance_name"], s["state"]) for s in b["streams"]] ==
                       [(name, "synchronized")] for b in bodies)
        wait_for(both_ready, timeout_s=30.0, interval_s=0.05, what="both replicas ready")
        masters = [ready_body(p)["registry"]["is_master"] for p in ports]
        assert sorted(masters) == [False, True]
        master = masters.index(True)
        other = 1 - master

        # Heartbeats reach the master; the load is written to etcd for the other replica.
        etcd = EtcdClient(etcd_server.addr)
        try:
            assert etcd.get("XLLM:SERVICE:MASTER").value == f"127.0.0.1:{ports[master]}".encode()
            kv = wait_for(lambda: etcd.get(f"XLLM:LOADMETRICS:{name}"), timeout_s=10.0,
                          what="load metrics written by the master")
            assert json.loads(kv.value) == {"waiting_requests_num": 0, "gpu_cache_usage_perc": 0.0}
        finally:
            etcd.close()
        headers = {"X-Internal-Token": TOKEN}
        r = requests.post(f"http://127.0.0.1:{ports[other]}{QUERY_PATH}", headers=headers,
                          json={"token_ids": TOKENS}, timeout=5.0)
        assert [(m["instance_name"], m["synchronized"], m["device_hit_tokens"])
                for m in r.json()["matches"]] == [(name, True, 0)]

        # Crash the master (arbiter and worker): the key's lease has to expire.
        os.killpg(procs[master].pid, signal.SIGKILL)
        procs[master].wait(5.0)
        t0 = time.monotonic()
        wait_for(lambda: (ready_body(ports[other]) or {}).get("registry", {}).get("is_master"),
                 timeout_s=10.0, interval_s=0.02, what="the other replica becomes master")
        failover_s = time.monotonic() - t0
        print(f"\nmaster failover after SIGKILL: {failover_s:.2f} s")
        # One lease TTL plus one election refresh (3 s + 1 s), plus slack for a loaded machine.
        assert failover_s <= 3.0 + 1.0 + 1.0
        body = ready_body(ports[other])
        assert body["ready"] is True
        assert [(s["instance_name"], s["state"]) for s in body["streams"]] == [
            (name, "synchronized")]
    finally:
        stop_process(sim)
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(15.0)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(5.0)


def test_demo_on_discovery_with_a_given_etcd(etcd_server):
    from kvsvc.testbed.demo import DemoOptions, run_demo

    out = io.StringIO()
    rep = run_demo(DemoOptions(requests=20, engines=2, device_blocks=64, host_blocks=64,
                               etcd=etcd_server.addr), out)
    assert (rep.requests, rep.streams, rep.comparisons) == (20, 3, 60)
    assert (rep.exact, rep.false_hits, rep.wait_timeouts, rep.unsynchronized_answers) == (
        60, 0, 0, 0)
    assert (rep.predicted_device_tokens, rep.predicted_host_only_tokens) == (
        rep.true_device_tokens, rep.true_host_only_tokens)
    text = out.getvalue()
    assert f"2 engines registered in etcd {etcd_server.addr}, 3 streams discovered" in text
    assert "(local)" not in text and "PASS" in text
    # The demo deregistered its engines when it stopped (leases revoked; should a revoke have
    # failed on a loaded machine, the 3 s lease expires instead).
    etcd = EtcdClient(etcd_server.addr)
    try:
        wait_for(lambda: [kv.key for kv in etcd.list_prefix("XLLM:").kvs
                          if not kv.key.startswith("XLLM:LOADMETRICS:")] == [],
                 timeout_s=5.0, what="no registration left")
    finally:
        etcd.close()


def test_sim_health_server_and_registration_lease_regrant(etcd_server):
    from kvsvc.errors import LifecycleError

    port = free_instance_port(1, 10000, 30000)
    name = f"127.0.0.1:{port}"
    with registered_sim(etcd_server.addr, port) as (eng, reg):
        assert requests.get(f"http://{name}/health", timeout=2.0).json() == {"status": "ok"}
        assert requests.get(f"http://{name}/other", timeout=2.0).status_code == 404
        # The health port is taken: a second engine there cannot start.
        twin = SimEngine("twin", free_port(), free_port(), http_port=port)
        with pytest.raises(LifecycleError):
            twin.start()
        twin.close()
        reg.wait_registered()
        etcd = EtcdClient(etcd_server.addr)
        try:
            kv = etcd.get(f"XLLM:DEFAULT:{name}")
            value = json.loads(kv.value)
            assert value == {"name": name, "rpc_address": name, "type": 0,
                             "incarnation_id": reg.incarnation_id,
                             "register_ts_ms": value["register_ts_ms"], "dp_size": 1,
                             "backend_type": "xllm"}
            # The lease is revoked behind the engine's back: the next keep-alive finds it gone,
            # and the same incarnation is registered again under a new lease.
            etcd.revoke(kv.lease)
            assert etcd.get(f"XLLM:DEFAULT:{name}") is None
            again = wait_for(lambda: etcd.get(f"XLLM:DEFAULT:{name}"), timeout_s=5.0,
                             what="registered again")
            assert again.lease != kv.lease
            assert json.loads(again.value) == value
            # The thread counts a put after etcd has it: wait for the count, not just the key.
            wait_for(lambda: reg.stats().registrations == 2, timeout_s=5.0,
                     what="second registration counted")
        finally:
            etcd.close()
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://{name}/health", timeout=2.0)
