"""The systemd unit (``config/kvsvc.service``) run the way systemd would run it: parse the unit and
its environment file, start its ``ExecStart`` as a :class:`Running` deployment, wait healthy."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional

import requests

from tests.support.util import free_port, wait_for

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "config" / "kvsvc.service"
ENV_TEMPLATE = ROOT / "config" / "kvsvc.env"
KVSVC_BIN = "/opt/kvsvc/.venv/bin/kvsvc"
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
        # Hermetic by default: the shipped template names etcd on 127.0.0.1:2379 and the
        # baidu_std port 8889, which a test must neither depend on nor collide with; tests of
        # the registry pass their own etcd and a free KVSVC_RPC_PORT in extra_env.
        unit_env.update(KVSVC_HOST="127.0.0.1", KVSVC_PORT=str(self.port),
                        KVSVC_KV_EVENTS_CONFIG_FILE=str(kv), KVSVC_ETCD_ADDR="",
                        KVSVC_RPC_PORT="0")
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
