"""The simulated engine's HTTP port: ``GET /health`` (§9: the registry probes
``http://<name>/health`` when an instance's lease is deleted; success means ``LEASE_LOST``,
failure ``SUSPECT``).

:class:`HealthServer` is a ``http.server.ThreadingHTTPServer`` on its own thread, owned by the
:class:`~kvsvc.sim.engine.SimEngine` that starts it: ``start()`` binds and returns once the
serving thread runs (:class:`~kvsvc.errors.LifecycleError` when the port is taken),
``close()`` shuts it down, joins the thread and closes the socket.
"""

from __future__ import annotations

import http.server
import json
import logging
import threading
from typing import Any, Optional

from ..errors import LifecycleError

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 5.0
_CLOSE_TIMEOUT_S = 5.0
_POLL_INTERVAL_S = 0.1


class _Handler(http.server.BaseHTTPRequestHandler):
    """``GET /health`` -> 200 ``{"status": "ok"}``; anything else 404. No access log."""

    server_version = "kvsvc-sim"

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path.split("?", 1)[0] == "/health":
            self._reply(200, {"status": "ok"})
        else:
            self._reply(404, {"error": "not found"})

    def _reply(self, status: int, doc: dict) -> None:
        body = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass  # the registry probes often; one line per probe would drown the engine's log


class HealthServer:
    """``GET /health`` on ``host:port`` (the instance's registered HTTP address).

    :param host: bind address.
    :param port: TCP port (the ``port`` of the instance name ``host:port``).
    :param label: instance name for logs and the thread name.
    """

    def __init__(self, host: str, port: int, label: str) -> None:
        self.host = host
        self.port = port
        self._label = label
        self._server: Optional[http.server.ThreadingHTTPServer] = None
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        """Bind and serve on a thread; return once it serves.

        :raises LifecycleError: the port cannot be bound, or the thread did not start in 5 s.
        """
        if self._thread is not None:
            return
        try:
            server = http.server.ThreadingHTTPServer((self.host, self.port), _Handler)
        except OSError as exc:
            raise LifecycleError(f"sim {self._label}: cannot serve /health on "
                                 f"{self.host}:{self.port}: {exc.strerror}") from exc
        server.daemon_threads = True
        running = threading.Event()

        def serve() -> None:
            running.set()
            server.serve_forever(poll_interval=_POLL_INTERVAL_S)

        self._server = server
        self._thread = threading.Thread(target=serve, name=f"sim-http-{self._label}", daemon=True)
        self._thread.start()
        if not running.wait(_START_TIMEOUT_S):
            self.close()
            raise LifecycleError(f"sim {self._label}: /health thread did not start")
        log.info("sim %s: serving GET /health on %s:%d", self._label, self.host, self.port)

    def close(self) -> None:
        """Stop serving, join the thread (5 s) and close the socket. Idempotent."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is None:
            return
        if thread is not None and thread.is_alive():
            server.shutdown()  # returns once serve_forever has left its loop
            thread.join(_CLOSE_TIMEOUT_S)
            if thread.is_alive():
                log.error("sim %s: /health thread did not stop within %.0f s", self._label,
                          _CLOSE_TIMEOUT_S)
        server.server_close()
        log.info("sim %s: /health on %s:%d closed", self._label, self.host, self.port)
