"""config/kvsvc.service: the unit's required keys, ``systemd-analyze verify`` (when installed),
and its ExecStartPre/ExecStart command lines run as written (install paths substituted) with
config/kvsvc.env, a token credential file and a NOTIFY_SOCKET, against a protocol publisher on
127.0.0.1; the started service is scraped at /metrics."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from kvsvc.server import GRACEFUL_TIMEOUT_S, STREAM_TIMEOUT_S
from tests.support.publisher import removed, stored
from tests.support.util import free_port, wait_for
from tests.support.systemd import BS, Deployment, ENV_TEMPLATE, INSTANCE, KVSVC_BIN, ROOT, Running, TOKEN, UNIT, command, one, read_env_file, unit, wait_healthy

INSTALL_DIR = "/opt/kvsvc"
ETC = "/etc/kvsvc/"


def test_unit_has_the_required_keys():
    u = unit()
    svc = u["Service"]
    assert one(svc, "Type") == "notify"
    assert one(svc, "KillMode") == "mixed"
    assert one(svc, "Restart") == "on-failure"
    assert one(svc, "RestartPreventExitStatus") == "2"
    user = one(svc, "User")
    assert user not in ("root", "0", "nobody") and one(svc, "Group") == user
    assert int(one(svc, "TimeoutStopSec")) > GRACEFUL_TIMEOUT_S + STREAM_TIMEOUT_S
    for key, value in {"NoNewPrivileges": "yes", "ProtectSystem": "strict",
                       "ProtectHome": "yes", "PrivateTmp": "yes", "PrivateDevices": "yes",
                       "ProtectKernelTunables": "yes", "ProtectKernelModules": "yes",
                       "ProtectControlGroups": "yes", "RestrictNamespaces": "yes",
                       "RestrictSUIDSGID": "yes", "LockPersonality": "yes",
                       "CapabilityBoundingSet": "", "UMask": "0077"}.items():
        assert one(svc, key) == value, key
    assert one(svc, "RestrictAddressFamilies").split() == ["AF_INET", "AF_INET6", "AF_UNIX"]
    assert one(svc, "LoadCredential") == "token:/etc/kvsvc/token"
    assert one(svc, "EnvironmentFile") == "/etc/kvsvc/kvsvc.env"
    pre, start = one(svc, "ExecStartPre"), one(svc, "ExecStart")
    assert shlex.split(pre)[:2] == [KVSVC_BIN, "check-config"]
    assert shlex.split(start)[:2] == [KVSVC_BIN, "serve"]
    # Same flags for both: check-config validates what serve runs with.
    assert shlex.split(pre)[2:] == shlex.split(start)[2:] == [
        "--internal_api_token_file", "${CREDENTIALS_DIRECTORY}/token"]
    text = UNIT.read_text(encoding="utf-8")
    assert "--internal_api_token " not in text and "KVSVC_INTERNAL_API_TOKEN=" not in text
    assert "KVSVC_INTERNAL_API_TOKEN" not in ENV_TEMPLATE.read_text(encoding="utf-8")
    assert one(u["Install"], "WantedBy") == "multi-user.target"


def substituted_unit(tmp_path: Path) -> Path:
    """The unit with the install paths replaced by this checkout's (for systemd-analyze)."""
    launcher = tmp_path / "kvsvc"
    launcher.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m kvsvc \"$@\"\n")
    launcher.chmod(0o755)
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "token").write_text(TOKEN + "\n")
    (etc / "kvsvc.env").write_text(ENV_TEMPLATE.read_text())
    text = (UNIT.read_text(encoding="utf-8").replace(KVSVC_BIN, str(launcher))
            .replace(ETC, str(etc) + "/").replace(INSTALL_DIR, str(ROOT)))
    path = tmp_path / "kvsvc.service"
    path.write_text(text)
    return path


# Under CI a missing systemd-analyze fails (.ci/run installs Debian's systemd); elsewhere it skips.
@pytest.mark.skipif(shutil.which("systemd-analyze") is None and not os.environ.get("CI"),
                    reason="systemd-analyze missing")
def test_systemd_analyze_verify(tmp_path):
    path = substituted_unit(tmp_path)
    proc = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True,
                          text=True, timeout=60)
    # The dedicated user need not exist on a build machine; nothing else may be reported.
    problems = [line for line in (proc.stdout + proc.stderr).splitlines()
                if line.strip() and "kvsvc.service" in line]
    assert proc.returncode == 0 and problems == [], proc.stdout + proc.stderr


# -- the command lines as written ---------------------------------------------------------------


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_exec_lines_as_written_notify_ready_and_metrics(tmp_path, raw_engine, etcd_server):
    # The template's etcd is 127.0.0.1:2379; the test's etcd runs on a free port.
    dep = Deployment(tmp_path, raw_engine.event_port, raw_engine.replay_port,
                     {"KVSVC_ETCD_ADDR": etcd_server.addr,
                      "KVSVC_RPC_PORT": str(free_port()), "KVSVC_RPC_HOST": "127.0.0.1"})
    raw_engine.set_snapshot([stored([1, 2], None, range(8), BS)], watermark=None)

    pre = subprocess.run(command(one(dep.svc, "ExecStartPre"), dep.creds), env=dep.env,
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert pre.returncode == 0, pre.stderr
    assert f"internal token: from file {dep.creds}/token" in pre.stdout
    assert "streams: 1 configured, 1 kept" in pre.stdout
    assert TOKEN not in pre.stdout + pre.stderr

    notify_path = str(tmp_path / "notify.sock")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(notify_path)
    notify.settimeout(30)
    run = Running(command(one(dep.svc, "ExecStart"), dep.creds),
                  {**dep.env, "NOTIFY_SOCKET": notify_path}, tmp_path / "serve.log")
    try:
        message = notify.recv(4096).decode()
        assert message.splitlines()[0] == "READY=1"
        wait_healthy(run, dep.base)
        wait_for(lambda: requests.get(dep.base + "/ready?streams=synchronized", timeout=2).status_code == 200,
                 timeout_s=15, what="/ready 200")
        raw_engine.wait_subscribed()
        raw_engine.publish([stored([3], 2, range(8, 12), BS)])                  # seq 0
        raw_engine.publish([stored([9], None, range(4), BS, medium="disk")])    # 1: other medium
        raw_engine.publish([removed([3])])                                      # 2

        def seq2() -> bool:
            body = requests.get(dep.base + "/ready?streams=synchronized", timeout=2).json()
            return body["streams"][0]["sequence"] == 2
        wait_for(seq2, timeout_s=10, what="seq 2 applied")
        auth = {"X-Internal-Token": TOKEN}
        q = requests.post(dep.base + "/v1/internal/kv-cache/query",
                          json={"token_ids": list(range(8))}, headers=auth, timeout=5)
        assert q.json()["matches"][0]["device_hit_tokens"] == 8

        # /metrics: no token needed by default.
        response = requests.get(dep.base + "/metrics", timeout=5)
        assert response.status_code == 200
        m = samples(response.text)
        lbl = {"instance": INSTANCE, "dp_rank": "0"}

        def v(name: str, **extra: str) -> Optional[float]:
            return m.get((name, frozenset({**lbl, **extra}.items())))

        assert v("kvsvc_stream_state", state="synchronized") == 1
        assert v("kvsvc_stream_last_applied_sequence") == 2
        assert v("kvsvc_stream_resident_blocks", tier="device") == 2
        assert v("kvsvc_stream_engine_map_entries") == 2
        assert v("kvsvc_stream_events_applied_total", type="BlockStored") == 2
        assert v("kvsvc_stream_events_applied_total", type="BlockRemoved") == 1
        assert v("kvsvc_stream_events_not_indexed_total", reason="other_medium") == 1
        assert v("kvsvc_stream_recoveries_total", trigger="start") == 1
        assert v("kvsvc_stream_snapshot_attempts_total", outcome="ok") == 1
        assert m[("kvsvc_query_duration_seconds_count", frozenset())] == 1
        assert m[("kvsvc_service_running", frozenset())] == 1
        names = {n for n, _ in m}
        assert {"kvsvc_stream_decode_errors_total", "kvsvc_stream_blocks_not_indexed_total",
                "kvsvc_stream_snapshot_duration_seconds_sum", "kvsvc_stream_buffered_bytes",
                "kvsvc_stream_seconds_since_last_event", "kvsvc_proxy_upstream_retries_total",
                "kvsvc_route_duration_seconds_count", "kvsvc_heartbeats_total"} - names == {
                    "kvsvc_route_duration_seconds_count", "kvsvc_heartbeats_total"}
    finally:
        code = run.stop()
        notify.close()
    assert code == 0, run.log()
    assert TOKEN not in run.log()


def test_exec_start_pre_refuses_what_serve_would_refuse(tmp_path, raw_engine):
    """ExecStartPre fails (exit 2, field named) for each class of setting serve validates: the
    token source, the §8 file, the discovery/etcd rule, the routing flags."""
    cases = [
        ({}, "missing", "internal_api_token_file"),
        ({"KVSVC_LOAD_BALANCE_POLICY": "LEAST_LOAD"}, None, "KVSVC_LOAD_BALANCE_POLICY"),
        ({"KVSVC_CAR_PREFILL_LAMBDA": "2"}, None, "KVSVC_CAR_PREFILL_LAMBDA"),
        ({"KVSVC_LOG_FORMAT": "xml"}, None, "KVSVC_LOG_FORMAT"),
        ({"KVSVC_ETCD_ADDR": "nohostport"}, None, "KVSVC_ETCD_ADDR"),
        # KVSVC_ETCD_ADDR set (empty): the variable to edit is the one named
        # (kvsvc.settings.source_of: a variable that is set is the value's source).
        ({"KVSVC_KV_EVENTS_CONFIG_FILE": str(ROOT / "config" / "kv_events_discovery_config.json"),
          "KVSVC_ETCD_ADDR": ""}, None, "KVSVC_ETCD_ADDR"),
    ]
    for i, (extra, token_state, field) in enumerate(cases):
        case_dir = tmp_path / f"case{i}"
        case_dir.mkdir()
        dep = Deployment(case_dir, raw_engine.event_port, raw_engine.replay_port, extra)
        if token_state == "missing":
            (dep.creds / "token").unlink()
        proc = subprocess.run(command(one(dep.svc, "ExecStartPre"), dep.creds), env=dep.env,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, (extra, proc.stdout, proc.stderr)
        assert f"invalid configuration: {field}:" in proc.stderr, (extra, proc.stderr)


def test_template_as_shipped_routes_completions(tmp_path, raw_engine, etcd_server, etcd):
    """The env template as shipped routes: only the listen address, the §8 file and the etcd
    address (the test's etcd cannot take 2379) differ. An engine registered in etcd and sending
    heartbeats gets the completion (before the fix the template had no registry: every
    completion was 503)."""
    from tests.support.upstreams import upstreams

    template = read_env_file(ENV_TEMPLATE)
    assert template["KVSVC_ETCD_ADDR"] == "127.0.0.1:2379"
    assert 0 < int(template["KVSVC_MAX_IN_FLIGHT_REQUESTS"]) < int(
        template["KVSVC_WORKER_THREADS"])
    dep = Deployment(tmp_path, raw_engine.event_port, raw_engine.replay_port,
                     {"KVSVC_ETCD_ADDR": etcd_server.addr,
                      "KVSVC_RPC_PORT": str(free_port()), "KVSVC_RPC_HOST": "127.0.0.1"})
    with upstreams("json") as (up,):
        etcd.put(f"XLLM:DEFAULT:{up.name}", json.dumps(
            {"name": up.name, "type": 0, "incarnation_id": "inc-1"}))
        run = Running(command(one(dep.svc, "ExecStart"), dep.creds), dep.env,
                      tmp_path / "serve.log")
        try:
            wait_healthy(run, dep.base)
            auth = {"X-Internal-Token": TOKEN}
            heartbeat = {"name": up.name, "incarnation_id": "inc-1",
                         "load_metrics": {"waiting_requests_num": 0,
                                          "gpu_cache_usage_perc": 0.0}}

            def answered() -> bool:
                requests.post(dep.base + "/v1/internal/heartbeat", json=heartbeat,
                              headers=auth, timeout=5)
                r = requests.post(dep.base + "/v1/completions", timeout=5,
                                  json={"model": "m", "prompt": "hi", "max_tokens": 1})
                assert r.status_code in (200, 503), r.text
                return r.status_code == 200
            wait_for(answered, timeout_s=30, interval_s=0.2, what="a completion answered")
            assert up.requests and up.requests[-1]["path"] == "/v1/completions"
        finally:
            code = run.stop()
    assert code == 0, run.log()
