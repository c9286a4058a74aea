"""The pooled baidu_std client and the dispatch caller (§13) against a baidu_std engine built
from the codec on 127.0.0.1: many threads on one connection answered out of order, timeouts,
refused and broken connections, error codes, and ``ChatCompletions`` / ``Completions`` with
the fields kvsvc sends (service_request_id, token_ids, routing, source_xservice_addr)."""

from __future__ import annotations

import socket
import threading
from typing import Optional

import pytest

from kvsvc.errors import BadRequest, RpcCallFailed, RpcTimeout, RpcUnreachable, UpstreamError
from kvsvc.rpc import codec, messages
from kvsvc.rpc.client import ClientSettings, RpcClient
from kvsvc.rpc.engines import API_SERVICE, BaiduStdCaller
from tests.support.util import free_port, wait_for


class FakeEngine:
    """A baidu_std server with scripted methods: ``Echo`` answers its message at once,
    ``Batch`` holds answers until ``batch`` calls arrived and answers them in reverse order,
    ``Never`` never answers, ``Close`` closes the connection, ``Fail`` answers EINTERNAL,
    ``ChatCompletions`` / ``Completions`` record the request and answer an empty message
    (EREQUEST when the request carries no ``service_request_id``)."""

    def __init__(self, batch: int = 1) -> None:
        self.batch = batch
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.listener.settimeout(0.1)   # the accept loop looks at the stop flag
        self.port = self.listener.getsockname()[1]
        self.target = f"127.0.0.1:{self.port}"
        self.received: list[codec.Request] = []
        self.connections = 0
        self._held: list[tuple[socket.socket, codec.Connection, codec.Request]] = []
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._socks: list[socket.socket] = []
        self._stop = False
        self._accept = threading.Thread(target=self._accept_loop, name="fake-engine")
        self._accept.start()

    def _accept_loop(self) -> None:
        while not self._stop:
            try:
                sock, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            sock.settimeout(None)
            with self._lock:
                self.connections += 1
                self._socks.append(sock)
            t = threading.Thread(target=self._serve, args=(sock,), name="fake-engine-conn")
            self._threads.append(t)
            t.start()

    def _serve(self, sock: socket.socket) -> None:
        conn = codec.Connection(codec.Role.SERVER)
        try:
            while True:
                data = sock.recv(65536)
                events = conn.receive_data(data)
                if not data:
                    return
                for ev in events:
                    assert isinstance(ev, codec.Request)
                    with self._lock:
                        self.received.append(ev)
                    if not self._answer(sock, conn, ev):
                        return
        except OSError:
            return
        finally:
            sock.close()

    def _answer(self, sock: socket.socket, conn: codec.Connection, ev: codec.Request) -> bool:
        if ev.method == "Echo":
            sock.sendall(conn.send_response(ev.correlation_id, ev.message))
        elif ev.method == "Batch":
            with self._lock:
                self._held.append((sock, conn, ev))
                ready = len(self._held) >= self.batch
                held = self._held[::-1] if ready else []
                if ready:
                    self._held = []
            for s, c, e in held:
                s.sendall(c.send_response(e.correlation_id, e.message))
        elif ev.method == "Close":
            sock.shutdown(socket.SHUT_RDWR)
            return False
        elif ev.method == "Fail":
            sock.sendall(conn.send_response(ev.correlation_id, error_code=codec.EINTERNAL,
                                            error_text="boom"))
        elif ev.method in ("ChatCompletions", "Completions"):
            cls = (messages.ChatRequest if ev.method == "ChatCompletions"
                   else messages.CompletionRequest)
            if not messages.parse(cls, ev.message).service_request_id:
                sock.sendall(conn.send_response(ev.correlation_id, error_code=codec.EREQUEST,
                                                error_text="no service_request_id"))
            else:
                sock.sendall(conn.send_response(ev.correlation_id, b""))
        return True   # "Never": no answer

    def close(self) -> None:
        self._stop = True
        self._accept.join(5)
        self.listener.close()
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self._threads:
            t.join(5)


@pytest.fixture
def engine():
    eng = FakeEngine(batch=8)
    yield eng
    eng.close()


@pytest.fixture
def client():
    c = RpcClient(ClientSettings(connect_timeout_s=1.0, timeout_s=5.0))
    yield c
    c.close()


def test_threads_share_one_connection_and_get_their_own_answers(engine, client):
    results: dict[int, bytes] = {}
    errors: list[Exception] = []

    def call(k: int) -> None:
        try:
            results[k] = client.call(engine.target, "T", "Batch", f"msg-{k}".encode()).message
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors
    # Answered in reverse order of arrival, each to its own caller.
    assert results == {k: f"msg-{k}".encode() for k in range(8)}
    assert engine.connections == 1
    assert len({r.correlation_id for r in engine.received}) == 8


def test_timeout_then_the_connection_still_serves(engine, client):
    with pytest.raises(RpcTimeout, match="no answer within 0.2 s") as exc:
        client.call(engine.target, "T", "Never", b"", timeout_s=0.2)
    assert isinstance(exc.value, UpstreamError)
    assert client.call(engine.target, "T", "Echo", b"after").message == b"after"
    assert engine.connections == 1


def test_error_answers_and_a_closed_connection(engine, client):
    with pytest.raises(RpcCallFailed) as exc:
        client.call(engine.target, "T", "Fail", b"")
    assert (exc.value.code, exc.value.text) == (codec.EINTERNAL, "boom")
    with pytest.raises(RpcUnreachable, match="closed"):
        client.call(engine.target, "T", "Close", b"")
    # The next call connects again.
    assert client.call(engine.target, "T", "Echo", b"x").message == b"x"
    wait_for(lambda: engine.connections == 2, 5, what="a second connection")


def test_refused_connection_is_unreachable(client):
    with pytest.raises(RpcUnreachable, match="cannot connect"):
        client.call(f"127.0.0.1:{free_port()}", "T", "Echo", b"")
    with pytest.raises(RpcUnreachable):
        client.call("not-an-address", "T", "Echo", b"")


def test_closed_client_refuses_calls(engine):
    c = RpcClient()
    assert c.call(engine.target, "T", "Echo", b"1").message == b"1"
    c.close()
    c.close()
    with pytest.raises(RpcUnreachable, match="client closed"):
        c.call(engine.target, "T", "Echo", b"")


def test_dispatch_caller_sends_what_xllm_service_sends(engine, client):
    caller = BaiduStdCaller(answer_timeout_s=2.0)
    caller.call(engine.target, "ChatCompletions", {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
        "service_request_id": "svc-42", "token_ids": [1, 2, 3],
        "routing": {"prefill_name": "127.0.0.1:9000", "decode_name": ""},
        "source_xservice_addr": "127.0.0.1:8889", "max_tokens": 5})
    caller.call(engine.target, "Completions", {
        "model": "m", "prompt": "", "service_request_id": "svc-43", "token_ids": [7],
        "routing": {"prefill_name": "127.0.0.1:9000"}, "source_xservice_addr": "1.2.3.4:8889"})
    chat, comp = engine.received[-2:]
    assert (chat.service, chat.method, comp.method) == (API_SERVICE, "ChatCompletions",
                                                        "Completions")
    c = messages.parse(messages.ChatRequest, chat.message)
    assert (c.service_request_id, list(c.token_ids), c.routing.prefill_name,
            c.source_xservice_addr, c.stream, c.max_tokens, c.messages[0].content) == (
        "svc-42", [1, 2, 3], "127.0.0.1:9000", "127.0.0.1:8889", True, 5, "hi")
    p = messages.parse(messages.CompletionRequest, comp.message)
    assert (p.service_request_id, list(p.token_ids), p.source_xservice_addr) == (
        "svc-43", [7], "1.2.3.4:8889")
    # The engine refusing the request, and a body that does not fit the message: BadRequest.
    with pytest.raises(BadRequest, match="refused the request"):
        caller.call(engine.target, "ChatCompletions", {"model": "m"})
    with pytest.raises(BadRequest, match="no xLLM form"):
        caller.call(engine.target, "ChatCompletions", {"token_ids": "not a list"})
    caller.close()


def test_dispatch_caller_transport_errors_are_upstream_errors():
    caller = BaiduStdCaller(connect_timeout_s=0.5, answer_timeout_s=0.5)
    try:
        with pytest.raises(RpcUnreachable) as exc:
            caller.call(f"127.0.0.1:{free_port()}", "Completions",
                        {"service_request_id": "s", "token_ids": [1]})
        assert isinstance(exc.value, UpstreamError)
    finally:
        caller.close()
