"""``kvsvc serve`` as a real gunicorn process group: :class:`Server` (start, wait healthy, HTTP,
stop by signal), :func:`serve_env` (the environment it runs with) and :func:`group_alive`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional

import requests

from tests.support.util import wait_for

ROOT = Path(__file__).resolve().parents[2]
#: Bound of a clean stop after a signal: gunicorn's graceful timeout is 10 s.
STOP_BOUND_S = 15.0


def serve_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSVC_")}
    # No fixed baidu_std port 8889 (§13) in tests: two services (or two test runs) would
    # collide on it; the tests of that port pass --rpc_port.
    env["KVSVC_RPC_PORT"] = "0"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def group_alive(pgid: int) -> bool:
    """True while any process of the group exists."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


class Server:
    """One ``kvsvc serve`` process in its own process group; :meth:`stop` leaves none behind."""

    def __init__(self, tmp_path: Path, port: int, args: list[str],
                 env: Optional[dict[str, str]] = None) -> None:
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        self.log_path = tmp_path / f"serve-{port}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvsvc", "serve", "--host", "127.0.0.1", "--port", str(port),
             *args],
            env=env or serve_env(), stdin=subprocess.DEVNULL, stdout=self._log,
            stderr=subprocess.STDOUT, start_new_session=True)
        self.pgid = self.proc.pid  # start_new_session: the leader's pid is the group id

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def get(self, path: str, **kwargs) -> requests.Response:
        return requests.get(self.base + path, timeout=5, **kwargs)

    def post(self, path: str, **kwargs) -> requests.Response:
        return requests.post(self.base + path, timeout=5, **kwargs)

    def wait_healthy(self) -> None:
        def healthy() -> bool:
            assert self.proc.poll() is None, f"server exited early:\n{self.log()}"
            try:
                return self.get("/health").status_code == 200
            except requests.ConnectionError:
                return False
        wait_for(healthy, timeout_s=30, interval_s=0.05, what="/health")

    def stop(self, sig: int = signal.SIGINT) -> int:
        """Signal the arbiter; wait for it and its whole group. Returns the exit code."""
        try:
            if self.proc.poll() is None:
                os.kill(self.proc.pid, sig)
            code = self.proc.wait(timeout=STOP_BOUND_S)
            wait_for(lambda: not group_alive(self.pgid), timeout_s=STOP_BOUND_S,
                     what="process group gone")
            return code
        finally:
            if group_alive(self.pgid):  # only after a failed assertion above
                os.killpg(self.pgid, signal.SIGKILL)
                self.proc.wait(timeout=STOP_BOUND_S)
            self._log.close()
