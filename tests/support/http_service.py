"""A real ``kvsvc serve`` with one stream fed by a :class:`~tests.support.publisher.ProtocolPublisher`
(:func:`real_service`), raw HTTP bytes to a port (:func:`raw_request`) and the pids of a process
group (:func:`group_pids`)."""

from __future__ import annotations

import json
import os
import signal
import socket
from contextlib import contextmanager
from typing import Iterator

from tests.support.gunicorn import Server, group_alive, serve_env
from tests.support.publisher import ProtocolPublisher, stored
from tests.support.util import free_ports, wait_for

TOKEN = "fuzz-token"
INSTANCE = "127.0.0.1:9300"
BS = 4


def group_pids(pgid: int) -> set[int]:
    out = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(pid)) == pgid:
                out.add(int(pid))
        except (ProcessLookupError, FileNotFoundError):
            continue
    return out


def raw_request(port: int, data: bytes, timeout_s: float = 5.0) -> bytes:
    """Send ``data`` on a fresh connection, half-close, read the answer until EOF (bounded)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server may close early on a bad request line; read what it said
        chunks = []
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
        except (ConnectionResetError, socket.timeout):
            pass
    return b"".join(chunks)


@contextmanager
def real_service(tmp_path, zmq_ctx) -> Iterator[tuple[Server, ProtocolPublisher]]:
    """``kvsvc serve`` (gunicorn) with one stream holding blocks [1..8] (2 blocks of 4), ready;
    stopped by SIGKILL if the test did not stop it."""
    event_port, replay_port, http_port = free_ports(3)
    cfg = tmp_path / "kv.json"
    cfg.write_text(json.dumps({"streams": [{
        "instance_name": INSTANCE, "block_size": BS,
        "endpoint": f"tcp://127.0.0.1:{event_port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}"}], "replay_timeout_ms": 500}))
    pub = ProtocolPublisher(zmq_ctx, event_port, replay_port)
    pub.set_snapshot([stored([1, 2], None, list(range(1, 9)), BS, medium="gpu")], watermark=None)
    pub.start()
    server = None
    try:
        server = Server(tmp_path, http_port, ["--kv_events_config_file", str(cfg)],
                        env={**serve_env(), "KVSVC_INTERNAL_API_TOKEN": TOKEN})
        server.wait_healthy()
        wait_for(lambda: server.get("/ready?streams=synchronized").status_code == 200, timeout_s=20, interval_s=0.05,
                 what="/ready 200")
        wait_for(lambda: len(group_pids(server.pgid)) == 2, timeout_s=10, what="arbiter + worker")
        yield server, pub
    finally:
        if server is not None and (server.proc.poll() is None or group_alive(server.pgid)):
            server.stop(signal.SIGKILL)
        pub.close()
