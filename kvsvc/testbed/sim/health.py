"""The simulated engine's HTTP port: ``GET /health`` (§9: the registry probes
``http://<name>/health`` when an instance's lease is deleted; success means ``LEASE_LOST``,
failure ``SUSPECT``) and, when the engine serves requests, the OpenAI endpoints of
:class:`~kvsvc.testbed.sim.serving.Serving` (``POST /v1/completions``, ``POST /v1/chat/completions``).

:class:`HealthServer` is a threaded ``http.server`` (HTTP/1.0: one request per connection, so
a client closing its connection is the end of its request) on its own thread, owned by the
:class:`~kvsvc.testbed.sim.engine.SimEngine` that starts it, with the
:class:`~kvsvc.lifecycle.BackgroundThread` contract: ``start()`` binds on the thread and returns
once the socket is bound (:class:`~kvsvc.errors.LifecycleError` when the port is taken),
``close()`` stops it, ends the requests in flight, joins every thread and closes the socket
(:class:`~kvsvc.errors.LifecycleError` when the thread does not stop in time). At most
``max_connections`` connections are served at once (one thread each, joined by ``close()``); a
connection over the limit is answered 503 at once.
"""

from __future__ import annotations

import http.server
import json
import socket
import logging
import threading
import time
from typing import Any, Optional

from kvsvc.errors import LifecycleError
from kvsvc.lifecycle import BackgroundThread
from kvsvc.testbed.sim.native import NativeFront
from kvsvc.testbed.sim.serving import Serving

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 5.0
_CLOSE_TIMEOUT_S = 5.0
_POLL_INTERVAL_S = 0.1


#: Largest request body read, bytes (a 128k-token prompt as JSON is about 1 MiB).
MAX_BODY_BYTES = 16 << 20
_BUSY_REPLY = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
               b"Content-Length: 70\r\n\r\n"
               b'{"error": {"message": "too many connections", "type": "server_error"}}')


class _Handler(http.server.BaseHTTPRequestHandler):
    """``GET /health`` -> 200 ``{"status": "ok"}``; ``GET /v1/models`` (when serving) -> the
    engine's model list; ``GET /metrics`` (when serving) -> its Prometheus text; ``POST`` -> the engine's :class:`~kvsvc.testbed.sim.serving.Serving`
    when it has one; anything else 404. No access log."""

    server_version = "kvsvc-sim"
    server: "_BoundedServer"

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        path = self.path.split("?", 1)[0]
        serving = self.server.serving
        if path == "/health":
            self._reply(200, {"status": "ok"})
        elif path == "/v1/models" and serving is not None:
            # OpenAI's model list, as a real engine answers it (the router's /v1/models
            # merges these when --model is unset).
            self._reply(200, {"object": "list", "data": [{
                "id": serving.config.model, "object": "model", "created": 0,
                "owned_by": "kvsvc-sim"}]})
        elif path == "/metrics" and serving is not None:
            body = serving.metrics_text()  # TTFT/TPOT histograms, counters (issue 14)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self._reply(404, {"error": "not found"})

    def do_POST(self) -> None:  # noqa: N802
        serving = self.server.serving
        native = self.server.native
        if native is not None and self.path.startswith("/xllm.proto."):
            try:
                length = int(self.headers.get("Content-Length", "0"))
            except ValueError:
                length = -1
            if not 0 <= length <= MAX_BODY_BYTES:
                self._reply(400, {"error": "bad Content-Length"})
                return
            status, doc = native.handle_json(self.path.split("?", 1)[0], self.rfile.read(length))
            self._reply(status, doc)
            return
        if serving is None:
            self._reply(404, {"error": "not found"})
            return
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self._reply(411, {"error": "Content-Length required"})
            return
        if not 0 <= length <= MAX_BODY_BYTES:
            self._reply(413, {"error": "body too large"})
            return
        body = self.rfile.read(length)

        def start_response(status: int, headers: list[tuple[str, str]]) -> None:
            self.send_response(status)
            for k, v in headers:
                self.send_header(k, v)
            self.end_headers()

        def write(data: bytes) -> None:
            self.wfile.write(data)
            self.wfile.flush()

        serving.handle(self.path.split("?", 1)[0], body, self.connection, start_response, write,
                       self.headers.get("X-data-parallel-rank"))

    def _reply(self, status: int, doc: dict) -> None:
        body = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass  # the registry probes often; one line per probe would drown the engine's log


class _BoundedServer(http.server.ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` at once; tracks its threads so
    ``close()`` can join them."""

    daemon_threads = True
    block_on_close = False
    # socketserver's default listen backlog is 5: a burst of connections (HTTP/1.0, one per
    # request) overflows it, the kernel drops SYNs and clients see 1-3 s connect stalls.
    request_queue_size = 1024

    def __init__(self, addr: tuple[str, int], max_connections: int,
                 serving: Optional[Serving], native: Optional[NativeFront] = None) -> None:
        super().__init__(addr, _Handler)
        self.serving = serving
        self.native = native
        self._slots = threading.BoundedSemaphore(max_connections)
        self._live: set[threading.Thread] = set()
        self._live_lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            try:
                request.sendall(_BUSY_REPLY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        t = threading.Thread(target=self._run, args=(request, client_address),
                             name=f"sim-http-conn-{client_address[1]}", daemon=True)
        with self._live_lock:
            self._live.add(t)
        t.start()

    def _run(self, request: Any, client_address: Any) -> None:
        try:
            if self.native is not None and _is_baidu_std(request):
                self.native.serve_connection(request)
                self.shutdown_request(request)
                return
            self.process_request_thread(request, client_address)
        finally:
            with self._live_lock:
                self._live.discard(threading.current_thread())
            self._slots.release()

    def join_connections(self, timeout_s: float) -> int:
        """Join the connection threads within ``timeout_s``; returns how many are left."""
        deadline = time.monotonic() + timeout_s
        with self._live_lock:
            threads = list(self._live)
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return sum(1 for t in threads if t.is_alive())


def _is_baidu_std(sock: Any) -> bool:
    """The connection starts with baidu_std's ``PRPC`` magic (brpc serves it and HTTP on one
    port); waits up to 5 s for the first bytes."""
    try:
        sock.settimeout(5.0)
        head = sock.recv(4, socket.MSG_PEEK | socket.MSG_WAITALL)
        sock.settimeout(None)
    except OSError:
        return False
    return head == b"PRPC"


class HealthServer(BackgroundThread):
    """``GET /health`` (and the OpenAI endpoints of ``serving``) on ``host:port``, the
    instance's registered HTTP address, served by the thread ``sim-http-<label>``
    (the :class:`~kvsvc.lifecycle.BackgroundThread` contract).

    The thread binds the listening socket (:meth:`start` returns once it is bound and
    ``serving`` accepts requests), accepts connections in bounded waits of 0.1 s until
    :meth:`close`, then, last, stops ``serving`` (queued requests get 503, streams are cut),
    joins the connection threads (at most 5 s) and closes the socket.

    :param host: bind address.
    :param port: TCP port (the ``port`` of the instance name ``host:port``).
    :param label: instance name for logs and the thread name.
    :param serving: the request front, ``None`` for ``/health`` only.
    :param max_connections: connections served at once (threads); more get 503.
    :param native: the native API of an xLLM engine (:mod:`kvsvc.testbed.sim.native`) on the
        same port: baidu_std connections and ``POST /xllm.proto.<Service>/<Method>``;
        ``None``: none.
    """

    def __init__(self, host: str, port: int, label: str, serving: Optional[Serving] = None,
                 max_connections: int = 256, native: Optional[NativeFront] = None) -> None:
        self._native = native
        super().__init__(f"sim-http-{label}")
        self.host = host
        self.port = port
        self._label = label
        self._serving = serving
        self._max_connections = max_connections
        # Created, served and closed by the thread only.
        self._server: Optional[_BoundedServer] = None

    def start(self, timeout_s: float = _START_TIMEOUT_S) -> None:
        """Bind and serve on the thread; return once the socket is bound.

        :param timeout_s: bound of the start, seconds.
        :raises LifecycleError: already started, the port cannot be bound (the message names
            ``host:port`` and the OS reason), or the thread did not run within ``timeout_s``.
        """
        super().start(timeout_s)

    def close(self, timeout_s: float = 2 * _CLOSE_TIMEOUT_S) -> None:
        """Stop serving, end the requests in flight (queued ones get 503, streams are cut),
        join every thread and close the socket. Idempotent; nothing happens before
        :meth:`start`.

        :param timeout_s: bound of the join, seconds; it covers the thread's own wait for the
            connection threads (5 s).
        :raises LifecycleError: the thread is still alive after ``timeout_s``.
        """
        super().close(timeout_s)

    def _setup(self) -> None:
        try:
            self._server = _BoundedServer((self.host, self.port), self._max_connections,
                                          self._serving, self._native)
        except OSError as exc:
            raise LifecycleError(f"sim {self._label}: cannot serve /health on "
                                 f"{self.host}:{self.port}: {exc.strerror}") from exc
        # handle_request() waits at most this long, so the loop sees close() in time.
        self._server.timeout = _POLL_INTERVAL_S
        if self._serving is not None:
            self._serving.open()
        if self._native is not None:
            self._native.open()
        log.info("sim %s: serving GET /health%s on %s:%d", self._label,
                 " and OpenAI requests" if self._serving is not None else "", self.host, self.port)

    def _loop(self) -> None:
        server = self._server
        assert server is not None
        while not self.stopping:
            server.handle_request()

    def _teardown(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        if self._serving is not None:
            self._serving.close()
        if self._native is not None:
            self._native.join(_CLOSE_TIMEOUT_S)
        left = server.join_connections(_CLOSE_TIMEOUT_S)
        if left:
            log.error("sim %s: %d HTTP connection threads did not stop within %.0f s",
                      self._label, left, _CLOSE_TIMEOUT_S)
        server.server_close()
        log.info("sim %s: /health on %s:%d closed", self._label, self.host, self.port)
