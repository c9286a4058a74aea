"""A client going away under the real ``kvsvc serve`` (gunicorn gthread) (§15, issue 20 item 4):
a non-streamed request whose client closes its connection while the engine is still working
on it is cancelled upstream (the engine sees its connection closed), never re-sent to a second
engine, and counted as ``client_closed``, not as 200; the worker serves on."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Optional

import requests

from tests.support.gunicorn import Server
from tests.support.metrics import Scrape
from tests.support.util import free_port, wait_for

#: Bound of every wait of the slow engine and of the client's socket, seconds.
BOUND_S = 15.0


class SlowEngine:
    """A raw HTTP server on 127.0.0.1 that answers ``POST`` only after ``release`` is set, and
    notes when the connection of a request it holds is closed by its peer (the router)."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.name = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self.requests: list[bytes] = []
        self.received = threading.Event()
        self.peer_closed = threading.Event()
        self.release = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._accept = threading.Thread(target=self._serve, name="slow-engine", daemon=True)

    def start(self) -> "SlowEngine":
        self._accept.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self.release.set()
        self._accept.join(BOUND_S)
        for t in self._threads:
            t.join(BOUND_S)
        self._listener.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            t = threading.Thread(target=self._handle, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(0.05)
            data = b""
            deadline = time.monotonic() + BOUND_S
            while time.monotonic() < deadline and not self._stop.is_set():
                try:
                    part = conn.recv(65536)
                except socket.timeout:
                    part = None
                if part == b"":
                    return  # a pooled connection closed while idle
                if part:
                    data += part
                head, sep, rest = data.partition(b"\r\n\r\n")
                if sep:
                    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                                   if line.lower().startswith(b"content-length:")), 0)
                    if len(rest) >= length:
                        break
            self.requests.append(data)
            self.received.set()
            # Hold the request like an engine in a long prefill; notice the peer closing.
            while time.monotonic() < deadline and not self.release.is_set():
                try:
                    if conn.recv(1) == b"":
                        self.peer_closed.set()
                        return
                except socket.timeout:
                    continue
                except OSError:
                    self.peer_closed.set()
                    return
            body = b'{"choices": []}'
            try:
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            except OSError:
                pass


def register(etcd, server: Server, engines: list[SlowEngine]) -> None:
    for e in engines:
        etcd.put(f"XLLM:DEFAULT:{e.name}", json.dumps(
            {"name": e.name, "type": 0, "incarnation_id": "inc-1"}))

    def candidates() -> bool:
        for e in engines:
            heartbeat = {"name": e.name, "incarnation_id": "inc-1",
                         "load_metrics": {"waiting_requests_num": 0,
                                          "gpu_cache_usage_perc": 0.0}}
            if server.post("/v1/internal/heartbeat", json=heartbeat).status_code != 200:
                return False
        route = server.post("/v1/internal/route", json={"token_ids": [1]}).json()
        names = {c["name"] for c in route.get("candidates", []) if c.get("side") == "P"}
        return names >= {e.name for e in engines}

    wait_for(candidates, timeout_s=30.0, interval_s=0.1, what="engines candidates")


def send_raw(port: int, body: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=BOUND_S)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: kvsvc\r\n"
                 b"Content-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


def which(engines: list[SlowEngine]) -> Optional[SlowEngine]:
    got = [e for e in engines if e.received.is_set()]
    return got[0] if len(got) == 1 else None


def test_non_streamed_request_cancelled_upstream_when_the_client_leaves(tmp_path, etcd_server,
                                                                        etcd):
    engines = [SlowEngine().start(), SlowEngine().start()]
    server = Server(tmp_path, free_port(), ["--etcd_addr", etcd_server.addr, "--model", "m1",
                                            "--load_balance_policy", "RR"])
    try:
        server.wait_healthy()
        register(etcd, server, engines)
        body = json.dumps({"model": "m1", "prompt": "hello", "max_tokens": 4}).encode()
        client = send_raw(server.port, body)
        wait_for(lambda: which(engines) is not None, timeout_s=BOUND_S, what="engine got it")
        engine = which(engines)
        assert engine is not None
        client.close()  # the client gives up while the engine is still working
        assert engine.peer_closed.wait(BOUND_S), "the engine never saw the request cancelled"

        def counted() -> bool:
            m = Scrape(server.get("/metrics").text)
            return m.value("kvsvc_proxy_requests_total", endpoint="completions",
                           status="client_closed") == 1
        # Counted once the router is done with the request: a (wrong) retry would have been
        # sent before that.
        wait_for(counted, timeout_s=BOUND_S, what="client_closed counted")
        # Never re-sent to the other engine.
        other = next(e for e in engines if e is not engine)
        assert not other.received.is_set()
        assert len(engine.requests) == 1
        m = Scrape(server.get("/metrics").text)
        assert m.value("kvsvc_proxy_requests_total", endpoint="completions",
                       status="200") is None
        assert m.value("kvsvc_proxy_in_flight_requests", instance=engine.name) == 0
        assert m.value("kvsvc_proxy_client_cancelled_total") == 1

        # A client that waits gets its answer from the same worker.
        for e in engines:
            e.release.set()
        r = requests.post(server.base + "/v1/completions", data=body, timeout=BOUND_S,
                          headers={"Content-Type": "application/json"})
        assert r.status_code == 200 and r.json() == {"choices": []}
    finally:
        code = server.stop()
        for e in engines:
            e.close()
    assert code == 0
    log = server.log()
    assert "Traceback" not in log, log
    assert "the client went away" in log
