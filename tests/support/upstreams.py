"""Loopback HTTP upstreams (engines seen by the proxy, §12): :func:`upstreams` starts scripted
:class:`Upstream` servers; :func:`refused_name` is an address nobody listens on."""

from __future__ import annotations

import http.server
import json
import threading
from contextlib import contextmanager
from typing import Iterator

from tests.support.util import free_port

#: Bound of every wait inside a test server's handler.
HANDLER_WAIT_S = 10.0


class Upstream:
    """A threaded HTTP server whose ``POST`` behaviour is ``mode``; it records the requests.

    Modes: ``json`` (200 echo), ``error`` (500 JSON), ``sse`` (one event, then two more once
    ``release`` is set), ``flood`` (1 KiB SSE events until the connection breaks, bounded),
    ``cut`` (a JSON head announcing 100 bytes, 11 of them, then the connection is dropped),
    ``hang`` (no answer until ``release``, then the connection is dropped), ``die`` (an SSE
    head and one event, then the connection is dropped without the last chunk, as when the
    engine is killed; ``release`` first when ``hold`` is set), ``stall`` (an SSE head and one
    event, then nothing until ``release``), ``comment`` (an SSE comment, then, once
    ``release`` is set, a data event split across two chunks and the end).

    ``GET /v1/models`` answers ``models`` (ids) as OpenAI's list; ``models_status`` other than
    200 answers that status instead; ``models_hang`` holds the answer until ``release``.
    """

    def __init__(self, mode: str, models: tuple[str, ...] = ()) -> None:
        self.mode = mode
        self.models = models
        self.models_status = 200
        self.models_hang = False
        self.models_served = 0
        self.hold = False
        self.requests: list[dict] = []
        self.release = threading.Event()
        self.broken = threading.Event()
        self.events_written = 0
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                owner.requests.append({"path": self.path, "headers": dict(self.headers),
                                       "body": body})
                getattr(owner, "_" + owner.mode)(self, body)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                owner._models_list(self)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.name = f"127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever,
                                        kwargs={"poll_interval": 0.05}, name="test-upstream")

    def start(self) -> "Upstream":
        self._thread.start()
        return self

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()  # joins the handler threads
        self._thread.join(5)

    # -- behaviours ---------------------------------------------------------------------------

    def _json(self, h, body: bytes) -> None:
        data = json.dumps({"echo": json.loads(body or b"null")}).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.send_header("Connection", "X-Hop")
        h.send_header("X-Hop", "dropped")
        h.send_header("Keep-Alive", "timeout=5")
        h.send_header("X-Upstream", "kept")
        h.end_headers()
        h.wfile.write(data)

    def _error(self, h, body: bytes) -> None:
        data = b'{"error": {"message": "engine overloaded"}}'
        h.send_response(500)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _sse_head(self, h) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()

    @staticmethod
    def _chunk(h, data: bytes) -> None:
        h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        h.wfile.flush()

    def _sse(self, h, body: bytes) -> None:
        self._sse_head(h)
        self._chunk(h, b"data: 0\n\n")
        self.release.wait(HANDLER_WAIT_S)
        self._chunk(h, b"data: 1\n\n")
        self._chunk(h, b"data: [DONE]\n\n")
        h.wfile.write(b"0\r\n\r\n")

    def _flood(self, h, body: bytes) -> None:
        self._sse_head(h)
        event = b"data: " + b"x" * 1016 + b"\n\n"
        try:
            for _ in range(100_000):  # 100 MiB at most: far beyond any socket buffers
                self._chunk(h, event)
                self.events_written += 1
        except OSError:
            self.broken.set()
        h.close_connection = True

    def _cut(self, h, body: bytes) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", "100")
        h.end_headers()
        h.wfile.write(b'{"partial": ')
        h.wfile.flush()
        h.close_connection = True

    # An engine that answers HTTP/1.0 without Content-Length (the body ends when the
    # connection closes, as the simulated engine's http.server does) and then dies: EOF is
    # its only framing, so only the content can tell a cut body from a whole one.
    def _eof_head(self, h, content_type: str) -> None:
        h.protocol_version = "HTTP/1.0"
        h.send_response(200)
        h.send_header("Content-Type", content_type)
        h.end_headers()
        h.close_connection = True

    def _eof_sse(self, h, body: bytes) -> None:
        self._eof_head(h, "text/event-stream")
        h.wfile.write(b"data: 0\n\n")
        h.wfile.flush()
        if self.hold:
            self.release.wait(HANDLER_WAIT_S)

    def _eof_sse_done(self, h, body: bytes) -> None:
        self._eof_head(h, "text/event-stream")
        h.wfile.write(b"data: 0\n\n")
        h.wfile.flush()
        h.wfile.write(b"data: [DONE]\n\n")

    def _eof_json(self, h, body: bytes) -> None:
        self._eof_head(h, "application/json")
        h.wfile.write(b'{"partial": ')

    def _eof_json_whole(self, h, body: bytes) -> None:
        self._eof_head(h, "application/json")
        h.wfile.write(b'{"whole": true}')

    def _hang(self, h, body: bytes) -> None:
        self.release.wait(HANDLER_WAIT_S)
        h.close_connection = True

    def _die(self, h, body: bytes) -> None:
        self._sse_head(h)
        self._chunk(h, b"data: 0\n\n")
        if self.hold:
            self.release.wait(HANDLER_WAIT_S)
        h.close_connection = True  # no "0\r\n\r\n": the body is cut short of its framing

    def _stall(self, h, body: bytes) -> None:
        self._sse_head(h)
        self._chunk(h, b"data: 0\n\n")
        self.release.wait(HANDLER_WAIT_S)
        h.close_connection = True

    def _comment(self, h, body: bytes) -> None:
        self._sse_head(h)
        self._chunk(h, b": ping\n\n")
        self.release.wait(HANDLER_WAIT_S)
        self._chunk(h, b"da")
        self._chunk(h, b"ta: 1\n\n")
        self._chunk(h, b"data: [DONE]\n\n")
        h.wfile.write(b"0\r\n\r\n")

    def _models_list(self, h) -> None:
        if h.path != "/v1/models":
            h.send_error(404)
            return
        if self.models_hang:
            self.release.wait(HANDLER_WAIT_S)
        self.models_served += 1
        status = self.models_status
        data = (json.dumps({"object": "list", "data": [
            {"id": m, "object": "model", "created": 1700000000 + i, "owned_by": self.name}
            for i, m in enumerate(self.models)]}) if status == 200
            else json.dumps({"detail": "Not Found"})).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)


@contextmanager
def upstreams(*modes: str) -> Iterator[list[Upstream]]:
    servers = [Upstream(m).start() for m in modes]
    try:
        yield servers
    finally:
        for s in servers:
            s.close()


def refused_name() -> str:
    """A loopback ``host:port`` nobody listens on (connections are refused)."""
    return f"127.0.0.1:{free_port()}"
