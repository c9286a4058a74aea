"""config/kvsvc.service: the unit's required keys, ``systemd-analyze verify`` (when installed),
and its ExecStartPre/ExecStart command lines run as written (install paths substituted) with
config/kvsvc.env, a token credential file and a NOTIFY_SOCKET, against a protocol publisher on
127.0.0.1; the started service is scraped at /metrics."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from kvsvc.server import GRACEFUL_TIMEOUT_S, STREAM_TIMEOUT_S
from tests.publisher import removed, stored
from tests.util import free_port, wait_for

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "config" / "kvsvc.service"
ENV_TEMPLATE = ROOT / "config" / "kvsvc.env"
INSTALL_DIR = "/opt/kvsvc"
KVSVC_BIN = "/opt/kvsvc/.venv/bin/kvsvc"
ETC = "/etc/kvsvc/"
TOKEN = "unit-test-secret-7f3a9c"
INSTANCE = "127.0.0.1:9400"
BS = 4
STOP_BOUND_S = 20.0


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """section -> key -> values (systemd allows repeated keys), comments and blanks skipped."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: Optional[dict[str, list[str]]] = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"key outside a section: {line!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not key=value: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def unit() -> dict[str, dict[str, list[str]]]:
    return parse_unit(UNIT.read_text(encoding="utf-8"))


def one(section: dict[str, list[str]], key: str) -> str:
    values = section.get(key, [])
    assert len(values) == 1, f"{key}: {values}"
    return values[0]


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


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze missing")
def test_systemd_analyze_verify(tmp_path):
    path = substituted_unit(tmp_path)
    proc = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True,
                          text=True, timeout=60)
    # The dedicated user need not exist on a build machine; nothing else may be reported.
    problems = [line for line in (proc.stdout + proc.stderr).splitlines()
                if line.strip() and "kvsvc.service" in line]
    assert proc.returncode == 0 and problems == [], proc.stdout + proc.stderr


# -- the command lines as written ---------------------------------------------------------------

def read_env_file(path: Path) -> dict[str, str]:
    """systemd EnvironmentFile= lines (KEY=value, # comments), as systemd reads this file."""
    env: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = value
    return env


def command(line: str, creds: Path) -> list[str]:
    """An Exec line as systemd runs it: ${CREDENTIALS_DIRECTORY} expanded, the install path of
    the kvsvc script replaced by this interpreter running the package."""
    argv = [a.replace("${CREDENTIALS_DIRECTORY}", str(creds)) for a in shlex.split(line)]
    assert argv[0] == KVSVC_BIN
    return [sys.executable, "-m", "kvsvc", *argv[1:]]


class Deployment:
    """The files of the documented deployment under ``tmp_path`` and the service's env."""

    def __init__(self, tmp_path: Path, event_port: int, replay_port: int,
                 extra_env: Optional[dict[str, str]] = None) -> None:
        self.port = free_port()
        self.creds = tmp_path / "credentials"
        self.creds.mkdir()
        (self.creds / "token").write_text(TOKEN + "\n")
        (self.creds / "token").chmod(0o600)
        kv = tmp_path / "kv_events.json"
        kv.write_text(json.dumps({
            "streams": [{"instance_name": INSTANCE, "block_size": BS,
                         "endpoint": f"tcp://127.0.0.1:{event_port}",
                         "replay_endpoint": f"tcp://127.0.0.1:{replay_port}"}],
            "replay_timeout_ms": 500}))
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("KVSVC_") and k != "NOTIFY_SOCKET"}
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        unit_env = read_env_file(ENV_TEMPLATE)
        unit_env.update(KVSVC_HOST="127.0.0.1", KVSVC_PORT=str(self.port),
                        KVSVC_KV_EVENTS_CONFIG_FILE=str(kv))
        unit_env.update(extra_env or {})
        env.update(unit_env)
        self.env = env
        self.svc = unit()["Service"]
        self.base = f"http://127.0.0.1:{self.port}"


class Running:
    """The ExecStart process (its own process group), its output in a file, stopped the way
    KillMode=mixed does: SIGTERM to the main process, SIGKILL to the group only if needed."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.pgid = self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def group_alive(self) -> bool:
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        return True

    def stop(self) -> int:
        try:
            if self.proc.poll() is None:
                os.kill(self.proc.pid, signal.SIGTERM)
            code = self.proc.wait(timeout=STOP_BOUND_S)
            wait_for(lambda: not self.group_alive(), timeout_s=STOP_BOUND_S, what="group gone")
            return code
        finally:
            if self.group_alive():
                os.killpg(self.pgid, signal.SIGKILL)
                self.proc.wait(timeout=STOP_BOUND_S)
            self._log.close()


def wait_healthy(run: Running, base: str) -> None:
    def healthy() -> bool:
        assert run.proc.poll() is None, f"service exited early:\n{run.log()}"
        try:
            return requests.get(base + "/health", timeout=2).status_code == 200
        except requests.ConnectionError:
            return False
    wait_for(healthy, timeout_s=30, interval_s=0.05, what="/health")


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_exec_lines_as_written_notify_ready_and_metrics(tmp_path, raw_engine):
    dep = Deployment(tmp_path, raw_engine.event_port, raw_engine.replay_port)
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
        wait_for(lambda: requests.get(dep.base + "/ready", timeout=2).status_code == 200,
                 timeout_s=15, what="/ready 200")
        raw_engine.wait_subscribed()
        raw_engine.publish([stored([3], 2, range(8, 12), BS)])                  # seq 0
        raw_engine.publish([stored([9], None, range(4), BS, medium="disk")])    # 1: other medium
        raw_engine.publish([removed([3])])                                      # 2

        def seq2() -> bool:
            body = requests.get(dep.base + "/ready", timeout=2).json()
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
        ({"KVSVC_KV_EVENTS_CONFIG_FILE": str(ROOT / "config" / "kv_events_discovery_config.json")},
         None, "--etcd_addr"),
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
