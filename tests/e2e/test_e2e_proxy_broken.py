"""A broken upstream under the real ``kvsvc serve`` (gunicorn gthread) (issue 13): the engine
dies in the middle of a streamed answer. A raw socket client sees the relayed event, OpenAI's
streaming error event and then the connection closed with the chunked body incomplete (no
zero-length chunk); ``requests`` raises ``ChunkedEncodingError``; ``/metrics`` counts
``upstream_broken``; the log holds one WARNING per broken stream and no traceback."""

from __future__ import annotations

import json
import socket

import pytest
import requests

from tests.support.gunicorn import Server
from tests.support.metrics import Scrape
from tests.support.upstreams import upstreams
from tests.support.util import free_port, wait_for

#: Bound of every socket read of the raw client, seconds.
READ_BOUND_S = 10.0


def raw_stream(port: int, body: bytes) -> tuple[bytes, bytes]:
    """POST /v1/completions over a raw HTTP/1.1 socket and read until the server closes it;
    returns (head, raw chunked body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=READ_BOUND_S) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: kvsvc\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        data = b""
        while True:
            part = sock.recv(65536)  # bounded by the socket timeout
            if not part:
                break
            data += part
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


def dechunk(raw: bytes) -> tuple[list[bytes], bool]:
    """Chunks of a chunked body and whether it ended with the zero-length chunk."""
    chunks: list[bytes] = []
    while raw:
        size_line, sep, raw = raw.partition(b"\r\n")
        if not sep:
            break
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            return chunks, True
        chunks.append(raw[:size])
        raw = raw[size + 2:]
    return chunks, False


def test_engine_dying_mid_stream_is_a_failed_transfer_under_gunicorn(tmp_path, etcd_server,
                                                                     etcd):
    with upstreams("die") as (up,):
        etcd.put(f"XLLM:DEFAULT:{up.name}", json.dumps(
            {"name": up.name, "type": 0, "incarnation_id": "inc-1"}))
        server = Server(tmp_path, free_port(), ["--etcd_addr", etcd_server.addr,
                                                "--model", "m1"])
        try:
            server.wait_healthy()
            heartbeat = {"name": up.name, "incarnation_id": "inc-1",
                         "load_metrics": {"waiting_requests_num": 0,
                                          "gpu_cache_usage_perc": 0.0}}

            def candidate() -> bool:
                if server.post("/v1/internal/heartbeat", json=heartbeat).status_code != 200:
                    return False
                route = server.post("/v1/internal/route", json={"token_ids": [1]}).json()
                return route["prefill"] == up.name

            wait_for(candidate, timeout_s=30.0, interval_s=0.1, what="instance a candidate")
            body = json.dumps({"model": "m1", "prompt": "hi", "stream": True}).encode()

            head, raw = raw_stream(server.port, body)
            assert head.startswith(b"HTTP/1.1 200")
            assert b"transfer-encoding: chunked" in head.lower()
            chunks, terminated = dechunk(raw)
            assert not terminated, raw  # the body is incomplete: no zero-length chunk
            text = b"".join(chunks)
            assert text.startswith(b"data: 0\n\n")
            event = text[len(b"data: 0\n\n"):]
            assert event.startswith(b"data: ") and event.endswith(b"\n\n")
            assert b"[DONE]" not in text
            error = json.loads(event[len(b"data: "):])["error"]
            assert (error["type"], error["param"], error["code"]) == (
                "upstream_error", None, "upstream_broken")

            r = requests.post(server.base + "/v1/completions", data=body, stream=True,
                              headers={"Content-Type": "application/json"}, timeout=10)
            lines: list[bytes] = []
            with pytest.raises(requests.exceptions.ChunkedEncodingError):
                for line in r.iter_lines():
                    if line:  # the blank line ending each event
                        lines.append(line)
            assert lines[0] == b"data: 0"
            assert json.loads(lines[-1][len(b"data: "):])["error"]["code"] == "upstream_broken"
            r.close()

            # The worker still serves, and counted both answers as upstream_broken.
            m = Scrape(server.get("/metrics").text)
            assert m.value("kvsvc_proxy_requests_total", endpoint="completions",
                           status="upstream_broken") == 2
            assert m.value("kvsvc_proxy_requests_total", endpoint="completions",
                           status="200") is None
            assert m.value("kvsvc_proxy_upstream_errors_total", instance=up.name,
                           kind="broken_body") == 2
            assert m.value("kvsvc_proxy_in_flight_requests", instance=up.name) == 0
        finally:
            assert server.stop() == 0
    log = server.log()
    broken = [line for line in log.splitlines() if "body broken" in line]
    assert len(broken) == 2, log
    assert all(up.name in line and "/v1/completions" in line and "9 bytes" in line
               for line in broken)
    assert "Traceback" not in log, log


def test_engine_framing_by_eof_dying_mid_stream_is_broken_not_200(tmp_path, etcd_server, etcd):
    """Issue 19 item 2: an engine answering HTTP/1.0 without Content-Length (its body ends
    when the connection closes) dies mid-stream. EOF before ``data: [DONE]`` is no clean end:
    the client gets the error event and an incomplete body, the answer counts as
    ``upstream_broken`` (never 200) with one WARNING; a non-streamed JSON body cut the same
    way is a 502."""
    with upstreams("eof_sse") as (up,):
        etcd.put(f"XLLM:DEFAULT:{up.name}", json.dumps(
            {"name": up.name, "type": 0, "incarnation_id": "inc-1"}))
        server = Server(tmp_path, free_port(), ["--etcd_addr", etcd_server.addr,
                                                "--model", "m1"])
        try:
            server.wait_healthy()
            heartbeat = {"name": up.name, "incarnation_id": "inc-1",
                         "load_metrics": {"waiting_requests_num": 0,
                                          "gpu_cache_usage_perc": 0.0}}

            def candidate() -> bool:
                if server.post("/v1/internal/heartbeat", json=heartbeat).status_code != 200:
                    return False
                route = server.post("/v1/internal/route", json={"token_ids": [1]}).json()
                return route["prefill"] == up.name

            wait_for(candidate, timeout_s=30.0, interval_s=0.1, what="instance a candidate")
            body = json.dumps({"model": "m1", "prompt": "hi", "stream": True}).encode()
            head, raw = raw_stream(server.port, body)
            assert head.startswith(b"HTTP/1.1 200")
            chunks, terminated = dechunk(raw)
            assert not terminated, raw
            text = b"".join(chunks)
            assert text.startswith(b"data: 0\n\n") and b"[DONE]" not in text
            error = json.loads(text[len(b"data: 0\n\n"):][len(b"data: "):])["error"]
            assert (error["type"], error["code"]) == ("upstream_error", "upstream_broken")
            assert "DONE event" in error["message"]

            up.mode = "eof_json"
            r = server.post("/v1/completions", json={"model": "m1", "prompt": "hi"})
            assert r.status_code == 502, r.text
            assert r.json()["error"]["type"] == "upstream_error"

            m = Scrape(server.get("/metrics").text)
            assert m.value("kvsvc_proxy_requests_total", endpoint="completions",
                           status="upstream_broken") == 1
            assert m.value("kvsvc_proxy_requests_total", endpoint="completions",
                           status="502") == 1
            assert m.value("kvsvc_proxy_requests_total", endpoint="completions",
                           status="200") is None
            assert m.value("kvsvc_proxy_upstream_errors_total", instance=up.name,
                           kind="broken_body") == 2
        finally:
            assert server.stop() == 0
    log = server.log()
    broken = [line for line in log.splitlines() if "body broken" in line]
    assert len(broken) == 2 and all(up.name in line for line in broken), log
    assert "WARNING" in broken[0] or "warning" in broken[0].lower(), log
    assert "Traceback" not in log, log
