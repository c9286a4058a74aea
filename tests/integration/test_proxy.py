"""Upstream forwarding against small real HTTP servers on 127.0.0.1: JSON and SSE relayed,
hop-by-hop headers dropped both ways, retry once on a refused upstream (never on a silent
one), the client watched while waiting for the head, error statuses after the response head
passed through, closing the body closes the upstream connection, a body
broken after the head raises (logged once, counted), upstream errors counted by kind, and the
relay's end (first SSE data event, completion) reported once."""

from __future__ import annotations

import json
import http.server
import logging
import socket
import threading
import time
from typing import Iterator

import pytest

from kvsvc.errors import UpstreamTimeout, UpstreamUnreachable
from kvsvc.http.errors import status_of
from kvsvc.routing.proxy import (
    Proxy,
    ProxySettings,
    RelayEnd,
    downstream_headers,
    upstream_headers,
)
from tests.support.util import wait_for
from tests.support.upstreams import HANDLER_WAIT_S, refused_name, upstreams


@pytest.fixture
def proxy() -> Iterator[Proxy]:
    p = Proxy(ProxySettings(connect_timeout_s=1.0, read_timeout_s=0.5))
    yield p
    p.close()


def fixed(body: bytes):
    return lambda target: body


def test_json_relayed_and_hop_by_hop_headers_dropped_both_ways(proxy):
    sent = upstream_headers([
        ("Host", "kvsvc:8888"), ("Content-Length", "12"), ("Connection", "keep-alive, X-Trace"),
        ("X-Trace", "hop"), ("Keep-Alive", "300"), ("TE", "trailers"),
        ("Proxy-Authorization", "Basic x"), ("X-Internal-Token", "secret"),
        ("Authorization", "Bearer k"), ("Content-Type", "application/json"),
        ("X-Request-Id", "r1")])
    assert sent == {"Authorization": "Bearer k", "Content-Type": "application/json",
                    "X-Request-Id": "r1"}
    with upstreams("json") as (up,):
        reply = proxy.forward([up.name], "/v1/completions?x=1", fixed(b'{"prompt": "hi"}'),
                              sent)
        assert (reply.target, reply.status, reply.attempts) == (up.name, 200, [up.name])
        assert reply.body.read_all() == b'{"echo": {"prompt": "hi"}}'
        headers = {k.lower(): v for k, v in reply.headers}
        assert headers["x-upstream"] == "kept" and headers["content-type"] == "application/json"
        for dropped in ("connection", "x-hop", "keep-alive", "content-length"):
            assert dropped not in headers
        assert not reply.is_event_stream
        (req,) = up.requests
        assert req["path"] == "/v1/completions?x=1"
        assert req["body"] == b'{"prompt": "hi"}'
        got = {k.lower(): v for k, v in req["headers"].items()}
        assert got["authorization"] == "Bearer k" and got["x-request-id"] == "r1"
        for absent in ("x-internal-token", "x-trace", "proxy-authorization", "te", "cookie"):
            assert absent not in got
        assert got["content-length"] == "16"
    assert proxy.failures() == {}


def test_downstream_headers_drop_connection_named_ones():
    assert downstream_headers({"Connection": "close, X-A", "X-A": "1", "X-B": "2",
                               "Transfer-Encoding": "chunked", "Content-Length": "5"}) == [
        ("X-B", "2")]


def test_refused_upstream_is_marked_and_retried_once_on_the_next(proxy, caplog):
    dead = refused_name()
    with upstreams("json") as (up,):
        reply = proxy.forward([dead, up.name, "127.0.0.1:1"], "/v1/completions",
                              lambda target: json.dumps({"to": target}).encode(), {})
        assert (reply.target, reply.status, reply.attempts) == (up.name, 200, [dead, up.name])
        # The retried body is built for the new target (P/D bodies name the prefill).
        assert reply.body.read_all() == json.dumps({"echo": {"to": up.name}}).encode()
    assert proxy.failures() == {dead: 1}


def test_two_refusals_give_502_and_only_one_retry(proxy):
    dead1, dead2, dead3 = refused_name(), refused_name(), refused_name()
    with pytest.raises(UpstreamUnreachable) as err:
        proxy.forward([dead1, dead2, dead3], "/v1/completions", fixed(b"{}"), {})
    assert status_of(err.value) == 502
    assert err.value.message == (f"upstream {dead2}: connection failed "
                                 f"(tried {dead1}, {dead2})")
    assert proxy.failures() == {dead1: 1, dead2: 1}


def test_silent_upstream_times_out_and_is_never_re_sent(proxy):
    """An upstream that accepted the request but sends no head is answered 504, never re-sent
    to the next candidate (§15: it may still be working on it)."""
    with upstreams("hang", "json") as (slow, fast):
        with pytest.raises(UpstreamTimeout) as err:
            proxy.forward([slow.name, fast.name], "/v1/chat/completions", fixed(b'{"a": 1}'),
                          {})
        assert status_of(err.value) == 504
        assert f"tried {slow.name})" in err.value.message
        assert len(slow.requests) == 1 and fast.requests == []
    assert proxy.failures() == {slow.name: 1}
    assert proxy.retries() == 0
    assert proxy.errors() == {(slow.name, "timeout"): 1}


def test_error_status_after_the_head_is_passed_through_not_retried(proxy):
    with upstreams("error", "json") as (bad, good):
        reply = proxy.forward([bad.name, good.name], "/v1/completions", fixed(b"{}"), {})
        assert (reply.target, reply.status, reply.attempts) == (bad.name, 500, [bad.name])
        assert reply.body.read_all() == b'{"error": {"message": "engine overloaded"}}'
        assert good.requests == []
    assert proxy.failures() == {}


def test_sse_chunks_are_relayed_as_they_arrive(proxy):
    with upstreams("sse") as (up,):
        reply = proxy.forward([up.name], "/v1/completions", fixed(b'{"stream": true}'), {})
        assert reply.is_event_stream
        chunks = iter(reply.body)
        # The first event arrives while the upstream still holds the rest back.
        assert next(chunks) == b"data: 0\n\n"
        up.release.set()
        assert b"".join(chunks) == b"data: 1\n\ndata: [DONE]\n\n"
        assert reply.body.bytes_relayed == 9 + 9 + 14
        reply.body.close()


def test_closing_the_body_mid_stream_closes_the_upstream(proxy):
    with upstreams("flood") as (up,):
        reply = proxy.forward([up.name], "/v1/completions", fixed(b'{"stream": true}'), {})
        chunks = iter(reply.body)
        assert next(chunks).startswith(b"data: xxx")  # de-chunked, undecoded SSE bytes
        reply.body.close()
        reply.body.close()  # idempotent
        wait_for(up.broken.is_set, timeout_s=10.0, what="upstream write to fail")
        assert up.events_written < 100_000
        assert list(chunks) == []


def body_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "kvsvc.routing.proxy" and r.levelno == logging.WARNING
            and "body broken" in r.getMessage()]


def test_body_broken_after_the_head_raises_logs_once_and_counts(proxy, caplog):
    """The engine dies mid-stream: the chunks before are relayed, then the iterator raises
    (no clean end), one WARNING names instance, path, bytes and error; ``broken_body``."""
    ends: list[RelayEnd] = []
    with upstreams("die") as (up,), caplog.at_level(logging.WARNING):
        reply = proxy.forward([up.name], "/v1/chat/completions", fixed(b"{}"), {})
        reply.body.when_closed(ends.append)
        chunks = iter(reply.body)
        assert next(chunks) == b"data: 0\n\n"
        with pytest.raises(UpstreamUnreachable) as err:
            next(chunks)
        assert status_of(err.value) == 502
        assert err.value.message.startswith(f"upstream {up.name} broke the body after 9 bytes")
        reply.body.close()
        reply.body.close()
    (warning,) = body_warnings(caplog)
    assert up.name in warning and "/v1/chat/completions" in warning
    assert "after 9 bytes relayed" in warning and "IncompleteRead" in warning
    assert proxy.errors() == {(up.name, "broken_body"): 1}
    assert proxy.failures() == {}  # not a failure before the first byte: never retried
    (end,) = ends
    assert (end.target, end.bytes_relayed, end.complete) == (up.name, 9, False)
    assert end.broken is not None and "IncompleteRead" in end.broken
    assert end.first_data_at is not None and end.first_data_at <= end.ended_at


def test_body_that_stalls_past_the_read_timeout_raises_timeout(proxy, caplog):
    with upstreams("stall") as (up,), caplog.at_level(logging.WARNING):
        reply = proxy.forward([up.name], "/v1/completions", fixed(b"{}"), {})
        chunks = iter(reply.body)
        assert next(chunks) == b"data: 0\n\n"
        with pytest.raises(UpstreamTimeout) as err:
            next(chunks)  # read timeout 0.5 s
        assert status_of(err.value) == 504
        reply.body.close()
    assert len(body_warnings(caplog)) == 1
    assert proxy.errors() == {(up.name, "timeout"): 1}


def test_non_streamed_body_cut_short_raises_before_anything_is_sent(proxy, caplog):
    with upstreams("cut") as (up,), caplog.at_level(logging.WARNING):
        reply = proxy.forward([up.name], "/v1/completions", fixed(b"{}"), {})
        with pytest.raises(UpstreamUnreachable):
            reply.body.read_all()
        assert reply.body.closed
    assert len(body_warnings(caplog)) == 1
    assert proxy.errors() == {(up.name, "broken_body"): 1}


def test_event_stream_ending_without_done_is_broken_not_a_clean_end(proxy, caplog):
    """An engine framing its body by EOF (HTTP/1.0, no Content-Length) dies mid-stream: the
    events before are relayed, then EOF before ``data: [DONE]`` raises like a reset body
    (one WARNING, ``broken_body``, the relay end not complete) (issue 19 item 2)."""
    ends: list[RelayEnd] = []
    with upstreams("eof_sse") as (up,), caplog.at_level(logging.WARNING):
        reply = proxy.forward([up.name], "/v1/completions", fixed(b"{}"), {})
        reply.body.when_closed(ends.append)
        chunks = iter(reply.body)
        assert next(chunks) == b"data: 0\n\n"
        with pytest.raises(UpstreamUnreachable) as err:
            next(chunks)
        assert status_of(err.value) == 502 and "without its final DONE event" in err.value.message
        reply.body.close()
    (warning,) = body_warnings(caplog)
    assert up.name in warning and "/v1/completions" in warning and "DONE event" in warning
    assert proxy.errors() == {(up.name, "broken_body"): 1}
    (end,) = ends
    assert end.complete is False and end.broken is not None


def test_eof_framed_bodies_that_are_whole_end_cleanly(proxy, caplog):
    with upstreams("eof_sse_done", "eof_json_whole") as (sse, js), \
            caplog.at_level(logging.WARNING):
        reply = proxy.forward([sse.name], "/v1/chat/completions", fixed(b"{}"), {})
        assert b"".join(reply.body).endswith(b"data: [DONE]\n\n")
        reply.body.close()
        reply = proxy.forward([js.name], "/v1/completions", fixed(b"{}"), {})
        assert reply.body.read_all() == b'{"whole": true}'
    assert body_warnings(caplog) == [] and proxy.errors() == {}


def test_non_streamed_eof_framed_body_cut_short_is_broken(proxy, caplog):
    """A JSON answer framed by EOF that is no complete document: 502 before anything is
    sent, logged and counted as ``broken_body`` (issue 19 item 2)."""
    with upstreams("eof_json") as (up,), caplog.at_level(logging.WARNING):
        reply = proxy.forward([up.name], "/v1/completions", fixed(b"{}"), {})
        with pytest.raises(UpstreamUnreachable) as err:
            reply.body.read_all()
        assert status_of(err.value) == 502 and "incomplete" in err.value.message
        assert reply.body.closed
    assert len(body_warnings(caplog)) == 1
    assert proxy.errors() == {(up.name, "broken_body"): 1}


def test_upstream_errors_counted_by_instance_and_kind(proxy):
    dead = refused_name()
    with upstreams("hang", "error") as (slow, bad):
        with pytest.raises(UpstreamTimeout):  # accepted, silent: never re-sent
            proxy.forward([slow.name, dead], "/v1/completions", fixed(b"{}"), {})
        with pytest.raises(UpstreamUnreachable):
            proxy.forward([dead], "/v1/completions", fixed(b"{}"), {})
        slow.release.set()  # from now on it closes the connection without answering
        with pytest.raises(UpstreamUnreachable):
            proxy.forward([slow.name], "/v1/completions", fixed(b"{}"), {})
        reply = proxy.forward([bad.name], "/v1/completions", fixed(b"{}"), {})
        assert reply.status == 500
        reply.body.read_all()
    assert proxy.errors() == {(slow.name, "timeout"): 1, (dead, "refused"): 1,
                              (slow.name, "reset"): 1, (bad.name, "http_5xx"): 1}


def test_relay_end_reports_the_first_data_event_not_a_comment(proxy):
    """A comment is no token: the first data event is noted when it arrives, also when its
    ``data:`` is split across two chunks; a body read to its end is complete."""
    ends: list[RelayEnd] = []
    with upstreams("comment") as (up,):
        reply = proxy.forward([up.name], "/v1/completions", fixed(b"{}"), {})
        reply.body.when_closed(ends.append)
        chunks = iter(reply.body)
        assert next(chunks) == b": ping\n\n"
        assert reply.body.first_data_at is None
        up.release.set()
        rest = b"".join(chunks)
        assert rest == b"data: 1\n\ndata: [DONE]\n\n"
        assert reply.body.first_data_at is not None
        reply.body.close()
    (end,) = ends
    assert (end.bytes_relayed, end.complete, end.broken) == (8 + 9 + 14, True, None)
    assert end.first_data_at == reply.body.first_data_at


def test_closing_before_reading_closes_the_upstream(proxy):
    with upstreams("flood") as (up,):
        reply = proxy.forward([up.name], "/v1/completions", fixed(b"{}"), {})
        reply.body.close()
        wait_for(up.broken.is_set, timeout_s=10.0, what="upstream write to fail")


def test_client_gone_before_the_head_cancels_the_attempt_and_is_not_retried():
    """§15: the client's connection closes while the upstream holds the request: the attempt
    is cancelled (its upstream connection closed, its in-flight count released), nothing is
    sent to the next candidate, and ClientGone is raised."""
    from kvsvc.errors import ClientGone
    from kvsvc.routing.in_flight import InFlight
    from kvsvc.routing.proxy import ClientWatch

    in_flight = InFlight()
    p = Proxy(ProxySettings(connect_timeout_s=1.0, read_timeout_s=HANDLER_WAIT_S), in_flight)
    ours, theirs = socket.socketpair()
    try:
        with upstreams("hang", "json") as (slow, fast):
            closer = threading.Timer(0.2, theirs.close)
            closer.start()
            try:
                with pytest.raises(ClientGone) as err:
                    p.forward([slow.name, fast.name], "/v1/completions", fixed(b"{}"), {},
                              client=ClientWatch(ours))
            finally:
                closer.join(HANDLER_WAIT_S)
            assert slow.name in err.value.message
            assert len(slow.requests) == 1 and fast.requests == []
            assert p.client_gone() == 1 and p.retries() == 0 and p.failures() == {}
            assert in_flight.counts() == {}
    finally:
        ours.close()
        theirs.close()
        p.close()


def test_a_client_that_sends_more_bytes_is_still_there():
    """Pipelined bytes on the client's connection are not a close: the answer comes."""
    from kvsvc.routing.proxy import ClientWatch

    p = Proxy(ProxySettings(connect_timeout_s=1.0, read_timeout_s=HANDLER_WAIT_S))
    ours, theirs = socket.socketpair()
    try:
        theirs.sendall(b"GET /health HTTP/1.1\r\n\r\n")
        watch = ClientWatch(ours)
        assert watch.client_gone() is None
        with upstreams("json") as (up,):
            reply = p.forward([up.name], "/v1/completions", fixed(b'{"a": 1}'), {},
                              client=watch)
            assert reply.body.read_all() == b'{"echo": {"a": 1}}'
        assert not watch.gone
        assert ours.recv(64, socket.MSG_DONTWAIT).startswith(b"GET /health")  # not consumed
        theirs.close()
        assert watch.client_gone() is True
    finally:
        ours.close()
        theirs.close()
        p.close()


def test_upstream_connections_are_kept_alive_and_reused():
    """Answers read to their end hand their connection back: three requests, one TCP
    connection; a body closed before its end is not reused (its connection is closed)."""
    accepted: list[int] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers.get("Content-Length", "0")))
            data = b'{"ok": true}' if self.path != "/big" else b"x" * 200_000
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            try:
                self.wfile.write(data)
            except OSError:
                pass

        def log_message(self, *args) -> None:
            pass

    class Server(http.server.ThreadingHTTPServer):
        daemon_threads = True

        def get_request(self):
            conn = super().get_request()
            accepted.append(1)
            return conn

    server = Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    name = f"127.0.0.1:{server.server_address[1]}"
    p = Proxy(ProxySettings(connect_timeout_s=1.0, read_timeout_s=5.0))
    try:
        for _ in range(3):
            reply = p.forward([name], "/v1/completions", fixed(b"{}"), {})
            assert reply.body.read_all() == b'{"ok": true}'
        assert len(accepted) == 1
        big = p.forward([name], "/big", fixed(b"{}"), {})
        next(iter(big.body))  # a first chunk only: the client went away
        big.body.close()
        reply = p.forward([name], "/v1/completions", fixed(b"{}"), {})
        assert reply.body.read_all() == b'{"ok": true}'
        assert len(accepted) == 2  # the unfinished answer's connection was not reused
    finally:
        p.close()
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_a_watched_wait_for_the_head_lasts_the_read_timeout_not_the_connect_timeout():
    """The client watch waits up to the read timeout: an upstream answering after longer than
    the connect timeout is answered, not timed out."""
    from kvsvc.routing.proxy import ClientWatch

    p = Proxy(ProxySettings(connect_timeout_s=0.2, read_timeout_s=HANDLER_WAIT_S))
    ours, theirs = socket.socketpair()
    try:
        with upstreams("hang") as (slow,):
            # "hang" answers nothing and drops the connection once released: released after
            # 4x the connect timeout, the wait must still be going on (a reset, not a timeout).
            releaser = threading.Timer(0.8, slow.release.set)
            releaser.start()
            started = time.monotonic()
            try:
                with pytest.raises(UpstreamUnreachable):
                    p.forward([slow.name], "/v1/completions", fixed(b"{}"), {},
                              client=ClientWatch(ours))
            finally:
                releaser.join(HANDLER_WAIT_S)
            assert time.monotonic() - started >= 0.7
    finally:
        ours.close()
        theirs.close()
        p.close()
