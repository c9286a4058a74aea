"""Routing endpoints through the Flask test client, with a real Registry on a real etcd
(instances registered as etcd keys, loads sent as heartbeats), real upstream HTTP servers and,
for cache hits, a real static stream fed by tests/support/publisher.py."""

from __future__ import annotations

import io
import json
import logging
from typing import Optional

import pytest

from kvsvc.config import KvEventsConfig, parse_kv_events_config
from kvsvc.http.extensions import EXTENSION, ROUTING_EXTENSION
from kvsvc.streams.state import Completeness, StreamId
from tests.support.metrics import scrape
from tests.support.publisher import ProtocolPublisher, stored
from tests.support.upstreams import refused_name, upstreams
from tests.support.tokenizer import build_tokenizer
from tests.support.util import free_ports, wait_for
from tests.support.routes import AUTH, completion, register, running


def openai_error(r) -> tuple[int, str, Optional[str], Optional[str]]:
    err = r.get_json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return r.status_code, err["type"], err["param"], err["code"]


# -- proxying --------------------------------------------------------------------------------------

def test_completion_proxied_to_the_default_instance_with_headers(etcd_server, etcd):
    with upstreams("json") as (up,), running(etcd_server) as app:
        register(app, etcd, up.name)
        body = b'{"model": "m1", "prompt": [1, 2, 3], "max_tokens": 4}'
        r = completion(app.test_client(), body, headers={"Authorization": "Bearer k"})
        assert r.status_code == 200
        assert r.get_json() == {"echo": json.loads(body)}
        assert r.headers["x-kvsvc-prefill"] == up.name
        assert "x-kvsvc-decode" not in r.headers   # no D: no header (not an empty one)
        assert r.headers["X-Upstream"] == "kept" and "X-Hop" not in r.headers
        (req,) = up.requests
        assert req["body"] == body  # the client's bytes, unchanged without a D
        assert req["headers"]["Authorization"] == "Bearer k"


def test_pd_mode_body_carries_routing_and_chat_is_proxied(etcd_server, etcd):
    with upstreams("json") as (p,), running(etcd_server) as app:
        register(app, etcd, p.name, "PREFILL")
        register(app, etcd, "127.0.0.1:1", "DECODE", usage=0.5)
        msgs = [{"role": "user", "content": "hello"}]
        r = app.test_client().post("/v1/chat/completions",
                                   json={"model": "m2", "messages": msgs})
        assert r.status_code == 200
        assert (r.headers["x-kvsvc-prefill"], r.headers["x-kvsvc-decode"]) == (
            p.name, "127.0.0.1:1")
        assert json.loads(p.requests[0]["body"]) == {
            "model": "m2", "messages": msgs,
            "routing": {"prefill_name": p.name, "decode_name": "127.0.0.1:1"}}
        assert p.requests[0]["path"] == "/v1/chat/completions"


def test_sse_stream_relayed_chunk_by_chunk(etcd_server, etcd):
    with upstreams("sse") as (up,), running(etcd_server) as app:
        register(app, etcd, up.name)
        r = completion(app.test_client(), {"model": "m1", "prompt": "hi", "stream": True},
                       buffered=False)
        assert r.status_code == 200
        assert r.headers["Content-Type"] == "text/event-stream"
        assert r.headers["x-kvsvc-prefill"] == up.name
        chunks = iter(r.response)
        assert next(chunks) == b"data: 0\n\n"
        up.release.set()
        assert b"".join(chunks) == b"data: 1\n\ndata: [DONE]\n\n"
        r.close()


def test_client_going_away_mid_stream_closes_the_upstream(etcd_server, etcd):
    with upstreams("flood") as (up,), running(etcd_server) as app:
        register(app, etcd, up.name)
        r = completion(app.test_client(), {"model": "m1", "prompt": [5], "stream": True},
                       buffered=False)
        assert next(iter(r.response)).startswith(b"data: xxx")
        r.close()  # what the WSGI server does when the client disconnects
        wait_for(up.broken.is_set, timeout_s=10.0, what="upstream write to fail")


def test_refused_upstream_retried_on_the_next_best(etcd_server, etcd):
    dead = refused_name()
    with upstreams("json") as (up,), running(etcd_server) as app:
        register(app, etcd, dead, waiting=0)
        register(app, etcd, up.name, waiting=4)  # queue cost 1: ranked second
        r = completion(app.test_client(), {"model": "m1", "prompt": [1]})
        assert r.status_code == 200
        assert r.headers["x-kvsvc-prefill"] == up.name
        assert app.extensions[ROUTING_EXTENSION].proxy.failures() == {dead: 1}


def test_no_candidate_is_503_and_unreachable_upstreams_502(etcd_server, etcd):
    with running(etcd_server) as app:
        client = app.test_client()
        r = completion(client, {"model": "m1", "prompt": "x"})
        assert openai_error(r) == (503, "service_unavailable", None, None)
        assert r.get_json()["error"]["message"] == (
            "no instance available: no schedulable instance with a current load report")
        register(app, etcd, "127.0.0.1:2", heartbeat=False)  # no load report: not a candidate
        assert completion(client, {"model": "m1", "prompt": "x"}).status_code == 503
        dead = refused_name()
        register(app, etcd, dead)
        r = completion(client, {"model": "m1", "prompt": "x"})
        assert openai_error(r) == (502, "upstream_error", None, None)


# -- a broken upstream (issue 13) -------------------------------------------------------------------

def test_stream_broken_mid_answer_ends_with_an_error_event_and_an_aborted_relay(
        etcd_server, etcd, caplog):
    """The engine dies after one event: the client gets that event, one event in OpenAI's
    streaming error shape (no [DONE]) and then a failed transfer; the answer counts as
    ``upstream_broken``, not 200; one WARNING names instance, endpoint, bytes and error."""
    with upstreams("die") as (up,), running(etcd_server) as app, \
            caplog.at_level(logging.WARNING):
        register(app, etcd, up.name)
        client = app.test_client()
        r = completion(client, {"model": "m1", "prompt": "hi", "stream": True},
                       buffered=False)
        assert (r.status_code, r.headers["x-kvsvc-prefill"]) == (200, up.name)
        chunks = iter(r.response)
        assert next(chunks) == b"data: 0\n\n"
        event = next(chunks)
        assert event.startswith(b"data: ") and event.endswith(b"\n\n")
        assert b"[DONE]" not in event
        error = json.loads(event[len(b"data: "):])["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["type"], error["param"], error["code"]) == (
            "upstream_error", None, "upstream_broken")
        assert up.name in error["message"] and "after 9 bytes" in error["message"]
        with pytest.raises(ConnectionResetError):  # the WSGI server aborts the transfer
            next(chunks)
        r.close()
        m = scrape(client)
        labels = {"endpoint": "completions"}
        assert m.value("kvsvc_proxy_requests_total", status="upstream_broken", **labels) == 1
        assert m.value("kvsvc_proxy_requests_total", status="200", **labels) is None
        assert m.value("kvsvc_proxy_upstream_errors_total", instance=up.name,
                       kind="broken_body") == 1
        assert m.value("kvsvc_proxy_request_duration_seconds_count", instance=up.name,
                       **labels) == 1
        assert m.value("kvsvc_proxy_time_to_first_token_seconds_count", instance=up.name,
                       **labels) == 1
        assert app.extensions[ROUTING_EXTENSION].in_flight.counts() == {}
    broken = [rec for rec in caplog.records if rec.levelno == logging.WARNING
              and "body broken" in rec.getMessage()]
    assert len(broken) == 1
    text = broken[0].getMessage()
    assert up.name in text and "/v1/completions" in text and "9 bytes" in text
    assert "IncompleteRead" in text


def test_non_streamed_body_broken_is_502_and_counted(etcd_server, etcd):
    with upstreams("cut") as (up,), running(etcd_server) as app:
        register(app, etcd, up.name)
        client = app.test_client()
        r = completion(client, {"model": "m1", "prompt": "hi"})
        assert openai_error(r) == (502, "upstream_error", None, None)
        assert up.name in r.get_json()["error"]["message"]
        m = scrape(client)
        assert m.value("kvsvc_proxy_requests_total", endpoint="completions", status="502") == 1
        assert m.value("kvsvc_proxy_upstream_errors_total", instance=up.name,
                       kind="broken_body") == 1


def test_proxied_answers_are_timed_by_endpoint_and_instance(etcd_server, etcd):
    """A completed stream: counted 200 when its relay ends, timed to the last byte and to the
    first data event; a JSON answer: timed, no time to first token; a 5xx: counted by kind."""
    with upstreams("sse", "json", "error") as (sse, js, bad), running(etcd_server) as app:
        register(app, etcd, sse.name)
        client = app.test_client()
        sse.release.set()
        # The test client closes a response (as a WSGI server does after the last byte) only
        # when told to.
        with completion(client, {"model": "m1", "prompt": "hi", "stream": True}) as r:
            assert r.get_data() == b"data: 0\n\ndata: 1\n\ndata: [DONE]\n\n"
        register(app, etcd, js.name, waiting=0)
        register(app, etcd, sse.name, waiting=9)  # js ranks first now
        with client.post("/v1/chat/completions", json={
                "model": "m1", "messages": [{"role": "user", "content": "x"}]}) as chat:
            assert (chat.status_code, chat.headers["x-kvsvc-prefill"]) == (200, js.name)
        register(app, etcd, bad.name, waiting=0)
        register(app, etcd, js.name, waiting=9)
        with completion(client, {"model": "m1", "prompt": "x"}) as r:
            assert r.status_code == 500
        m = scrape(client)
        done = {"endpoint": "completions", "instance": sse.name}
        assert m.value("kvsvc_proxy_requests_total", endpoint="completions", status="200") == 1
        assert m.value("kvsvc_proxy_request_duration_seconds_count", **done) == 1
        assert m.value("kvsvc_proxy_time_to_first_token_seconds_count", **done) == 1
        assert 0 < m.value("kvsvc_proxy_time_to_first_token_seconds_sum", **done) <= \
            m.value("kvsvc_proxy_request_duration_seconds_sum", **done) < 10
        assert m.value("kvsvc_proxy_request_duration_seconds_bucket", le="120.0", **done) == 1
        assert m.value("kvsvc_proxy_request_duration_seconds_bucket", le="0.01", **done) is not None
        chat_labels = {"endpoint": "chat_completions", "instance": js.name}
        assert m.value("kvsvc_proxy_request_duration_seconds_count", **chat_labels) == 1
        assert m.value("kvsvc_proxy_time_to_first_token_seconds_count", **chat_labels) is None
        assert m.value("kvsvc_proxy_upstream_errors_total", instance=bad.name,
                       kind="http_5xx") == 1
        assert {k: m.value("kvsvc_proxy_upstream_errors_total", instance=sse.name, kind=k)
                for k in ("refused", "reset", "timeout", "broken_body", "http_5xx")} == dict.fromkeys(
            ("refused", "reset", "timeout", "broken_body", "http_5xx"), 0)


# -- bad input -------------------------------------------------------------------------------------

@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", b"{nope", None),
    ("/v1/completions", b"[1]", None),
    ("/v1/completions", b'{"model": "m1"}', "prompt"),
    ("/v1/completions", b'{"model": "m1", "prompt": []}', "prompt"),
    ("/v1/completions", b'{"model": "m1", "prompt": [1, -2]}', "prompt"),
    ("/v1/completions", b'{"model": "m1", "prompt": [1, true]}', "prompt"),
    ("/v1/completions", b'{"model": "m1", "prompt": "x", "stream": "yes"}', "stream"),
    ("/v1/completions", b'{"prompt": "x"}', "model"),
    ("/v1/completions", b'{"model": "m1", "prompt": "x", "max_tokens": 0}', "max_tokens"),
    ("/v1/completions", b'{"model": "m1", "prompt": "x", "max_tokens": "8"}', "max_tokens"),
    ("/v1/completions", b'{"model": "m1", "prompt": "x", "max_tokens": 2.5}', "max_tokens"),
    ("/v1/chat/completions", b'{"model": "m1", "messages": [{"role": "user", "content": "x"}], '
     b'"max_completion_tokens": -1}', "max_completion_tokens"),
    ("/v1/chat/completions", b'{"model": "m1", "messages": []}', "messages"),
    ("/v1/chat/completions", b'{"model": "m1", "messages": [{"content": "x"}]}',
     "messages[0].role"),
    ("/v1/chat/completions", b'{"model": "m1", "messages": [{"role": "user", "content": "x"}], '
     b'"tools": 1}', "tools"),
    # Standard fields' types and ranges (issue 19 item 5), for every backend.
    *[("/v1/chat/completions", b'{"model": "m1", "messages": [{"role": "user", "content": "x"}'
       b'], ' + extra + b'}', param) for extra, param in [
        (b'"temperature": "hot"', "temperature"), (b'"temperature": NaN', "temperature"),
        (b'"temperature": Infinity', "temperature"), (b'"top_p": 1.5', "top_p"),
        (b'"presence_penalty": 3', "presence_penalty"), (b'"n": 0', "n"), (b'"n": 1.5', "n"),
        (b'"stop": 5', "stop"), (b'"stop": ["a", 1]', "stop"), (b'"logprobs": 1', "logprobs"),
        (b'"top_logprobs": 21', "top_logprobs"), (b'"seed": "x"', "seed"),
        (b'"stream_options": {"include_usage": "yes"}', "stream_options.include_usage"),
        (b'"user": 7', "user"), (b'"max_tokens": true', "max_tokens")]],
    ("/v1/chat/completions", b'{"model": "m1", "messages": [{"role": "user", "content": "x"}, '
     b'{"role": "wizard", "content": "y"}]}', "messages[1].role"),
    ("/v1/chat/completions", b'{"model": "m1", "messages": [{"role": "user", "content": 5}]}',
     "messages[0].content"),
    ("/v1/chat/completions", b'{"model": "m1", "messages": [{"role": "user", "content": '
     b'{"text": "x"}}]}', "messages[0].content"),
    ("/v1/chat/completions", b'{"model": "m1", "messages": [{"role": "user", "content": '
     b'[{"text": "x"}]}]}', "messages[0].content[0].type"),
    ("/v1/chat/completions", b'{"model": "m1", "messages": [{"role": "user", "content": '
     b'[{"type": "text", "text": 3}]}]}', "messages[0].content[0].text"),
    ("/v1/chat/completions", b'{"model": "m1", "messages": [{"role": "system"}]}',
     "messages[0].content"),
    ("/v1/completions", b'{"model": "m1", "prompt": "x", "logprobs": true}', "logprobs"),
    ("/v1/completions", b'{"model": "m1", "prompt": "x", "best_of": 0}', "best_of"),
    ("/v1/completions", b'{"model": "m1", "prompt": "x", "echo": "no"}', "echo"),
    ("/v1/completions", b'{"model": "m1", "prompt": "x", "temperature": -0.1}', "temperature"),
    # A lone UTF-16 surrogate (the stdlib parser takes it; no tokenizer or upstream can).
    ("/v1/completions", b'{"model": "m1", "prompt": "\\ud800", "max_tokens": 2}', "prompt"),
    ("/v1/chat/completions", b'{"model": "m1", "messages": [{"role": "user", '
     b'"content": "a\\udc00"}]}', "messages[0].content"),
])
def test_malformed_body_is_400_before_routing(etcd_server, path, body, param):
    with running(etcd_server) as app:  # no instance at all: routing would answer 503
        r = app.test_client().post(path, data=body, content_type="application/json")
        assert openai_error(r) == (400, "invalid_request_error", param, None)


def test_non_finite_numbers_are_named_so_and_extensions_pass(etcd_server):
    """NaN is "not a finite number" (not a misleading range); a field kvsvc does not know
    (an engine's extension) and valid standard fields pass validation (503 here: no
    instance), for the HTTP relay's backends."""
    with running(etcd_server) as app:
        client = app.test_client()
        r = client.post("/v1/completions", content_type="application/json",
                        data=b'{"model": "m1", "prompt": "x", "top_p": NaN}')
        assert openai_error(r)[:3] == (400, "invalid_request_error", "top_p")
        assert "not a finite number" in r.get_json()["error"]["message"]
        r = completion(client, {"model": "m1", "prompt": "x", "top_k": 5, "min_p": 0.1,
                                "guided_json": {"type": "object"}, "temperature": 0,
                                "top_p": 1, "n": 2, "stop": ["a"], "logprobs": 2, "seed": 7,
                                "presence_penalty": -2, "stream_options": None})
        assert r.status_code == 503, r.get_json()
        r = client.post("/v1/chat/completions", json={
            "model": "m1", "messages": [
                {"role": "developer", "content": "d"},
                {"role": "user", "content": [{"type": "text", "text": "x"},
                                             {"type": "image_url", "image_url": {"url": "u"}}]},
                {"role": "assistant", "content": None, "tool_calls": []},
                {"role": "tool", "content": "r", "tool_call_id": "t"}],
            "logprobs": True, "top_logprobs": 3, "repetition_penalty": 1.1})
        assert r.status_code == 503, r.get_json()


def test_unknown_model_404_models_list_and_413(etcd_server):
    with running(etcd_server, max_request_bytes=2048) as app:
        client = app.test_client()
        r = completion(client, {"model": "gpt-x", "prompt": "hi"})
        assert openai_error(r) == (404, "invalid_request_error", "model", "model_not_found")
        assert r.get_json()["error"]["message"] == "The model `gpt-x` does not exist."
        r = client.get("/v1/models")
        assert r.get_json() == {"object": "list", "data": [
            {"id": "m1", "object": "model", "created": 0, "owned_by": "kvsvc"},
            {"id": "m2", "object": "model", "created": 0, "owned_by": "kvsvc"}]}
        r = completion(client, {"model": "m1", "prompt": "x" * 2100})
        assert openai_error(r) == (413, "invalid_request_error", None, "request_too_large")
        r = completion(client, {"model": "m1", "prompt": "x" * 1900})
        assert r.status_code == 503  # within the limit: validated, then no candidate


def test_every_error_under_v1_is_in_openai_shape_except_internal(etcd_server):
    """405, 404 and 413 (with and without Content-Length) of the OpenAI API in OpenAI's shape,
    the 413 naming the limit and its flag; /v1/internal/* keeps kvsvc's shape."""
    with running(etcd_server, max_request_bytes=2048) as app:
        client = app.test_client()
        r = client.get("/v1/completions")
        assert openai_error(r) == (405, "invalid_request_error", None, "method_not_allowed")
        assert "POST" in r.headers["Allow"]
        r = client.post("/v1/models")
        assert openai_error(r) == (405, "invalid_request_error", None, "method_not_allowed")
        assert "GET" in r.headers["Allow"]
        r = client.get("/v1/chat/completions")
        assert openai_error(r)[0] == 405
        r = client.get("/v1/engines")
        assert openai_error(r) == (404, "invalid_request_error", None, "unknown_url")
        too_large = (413, "invalid_request_error", None, "request_too_large")
        r = completion(client, {"model": "m1", "prompt": "x" * 2100})
        assert openai_error(r) == too_large
        message = r.get_json()["error"]["message"]
        assert "2048 bytes" in message and "--max_request_bytes" in message
        r = client.post("/v1/chat/completions", input_stream=io.BytesIO(b" " * 3000), headers={
            "Content-Type": "application/json", "Transfer-Encoding": "chunked"},
            environ_overrides={"wsgi.input_terminated": True})
        assert openai_error(r) == too_large
        assert r.get_json()["error"]["message"] == message
        # The internal API: kvsvc's own {"error": "..."}.
        r = client.get("/v1/internal/route", headers=AUTH)
        assert r.status_code == 405 and isinstance(r.get_json()["error"], str)
        r = client.post("/v1/internal/route", headers=AUTH, data=b" " * 3000,
                        content_type="application/json")
        assert r.status_code == 413 and isinstance(r.get_json()["error"], str)
        r = client.get("/v1/internal/nope", headers=AUTH)
        assert r.status_code == 404 and isinstance(r.get_json()["error"], str)
        assert isinstance(client.post("/health").get_json()["error"], str)


def test_unexpected_error_on_an_openai_endpoint_is_an_openai_500(etcd_server, monkeypatch):
    with running(etcd_server) as app:
        def broken(*_a, **_k):
            raise RuntimeError("boom")

        # A mock only to force the rare path: an unexpected exception inside a view.
        monkeypatch.setattr(app.extensions[ROUTING_EXTENSION], "decide", broken)
        r = completion(app.test_client(), {"model": "m1", "prompt": "x"})
        assert openai_error(r) == (500, "server_error", None, None)
        assert r.get_json()["error"]["message"] == "internal server error"


# -- decision endpoint -----------------------------------------------------------------------------

def one_stream(name: str, event_port: int, replay_port: int) -> KvEventsConfig:
    return parse_kv_events_config({"streams": [{
        "instance_name": name, "block_size": 4, "endpoint": f"tcp://127.0.0.1:{event_port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}"}], "replay_timeout_ms": 500})


def test_route_endpoint_reports_hits_and_picks_the_cached_instance(etcd_server, etcd, zmq_ctx,
                                                                     tmp_path):
    build_tokenizer().save(str(tmp_path / "tokenizer.json"))
    event_port, replay_port = free_ports(2)
    cached, cold = "127.0.0.1:9101", "127.0.0.1:9102"
    pub = ProtocolPublisher(zmq_ctx, event_port, replay_port)
    # Tokens [1, 6, 7, 8] (= "<s> hello world how") and [9, 10, 6, 7] stored: two blocks.
    pub.set_snapshot([stored([11, 12], None, [1, 6, 7, 8, 9, 10, 6, 7], 4)], watermark=None)
    with pub, running(etcd_server, one_stream(cached, event_port, replay_port),
                      tokenizer_path=str(tmp_path / "tokenizer.json")) as app:
        svc = app.extensions[EXTENSION]
        wait_for(svc.directory.ready, timeout_s=10.0, what="stream synchronized")
        register(app, etcd, cached, waiting=1)
        register(app, etcd, cold, waiting=2)
        client = app.test_client()
        assert client.post("/v1/internal/route", json={"token_ids": [1]}).status_code == 401
        r = client.post("/v1/internal/route", headers=AUTH,
                        json={"token_ids": [1, 6, 7, 8, 9, 10, 6, 7, 5, 5]})
        assert r.status_code == 200
        got = r.get_json()
        assert (got["policy"], got["prefill"], got["decode"], got["input_tokens"],
                got["tokenized"]) == ("CAR", cached, None, 10, True)
        # cached: hit 8/10, queue 1/2: 0.5 * 0.2 + 0.5 * 0.5 = 0.35; cold: 0.5 + 0.5 = 1.0.
        by_name = {c["name"]: c for c in got["candidates"]}
        assert by_name[cached]["ranks"] == [{"dp_rank": 0, "device_hit_tokens": 8,
                                             "host_only_hit_tokens": 0, "pending_hit_tokens": 0, "hit_ratio": 0.8,
                                             "reason": None, "completeness": "exact"}]
        assert by_name[cold]["ranks"][0]["reason"] == "missing"
        assert (by_name[cached]["queue_cost"], by_name[cold]["queue_cost"]) == (0.5, 1.0)
        assert by_name[cached]["score"] == pytest.approx(0.35, abs=1e-12)
        assert by_name[cold]["score"] == 1.0
        assert [c["name"] for c in got["candidates"]] == [cached, cold]
        # A text prompt is tokenized ("<s> hello world how" -> [1, 6, 7, 8]): one block hit.
        r = client.post("/v1/internal/route", headers=AUTH,
                        json={"model": "m1", "prompt": "hello world how"})
        got = r.get_json()
        by_name = {c["name"]: c for c in got["candidates"]}
        assert (got["input_tokens"], got["tokenized"]) == (4, True)
        assert by_name[cached]["hit_ratio"] == 1.0
        assert r.status_code == 200
        # Nothing was sent anywhere: both instances are unreachable names.
        assert client.post("/v1/internal/route", headers=AUTH, json={"x": 1}).status_code == 400


def test_route_entries_show_completeness_and_car_uses_subset_hits_as_they_are(etcd_server, etcd,
                                                                              zmq_ctx):
    """§7h/§10: the per-rank entry names what its hits are worth; a subset stream's hits are
    counted exactly as an exact one's (the same score), never discounted."""
    event_port, replay_port = free_ports(2)
    cached, cold = "127.0.0.1:9111", "127.0.0.1:9112"
    pub = ProtocolPublisher(zmq_ctx, event_port, replay_port)
    pub.set_snapshot([stored([11, 12], None, [1, 6, 7, 8, 9, 10, 6, 7], 4)], watermark=None)
    with pub, running(etcd_server, one_stream(cached, event_port, replay_port)) as app:
        svc = app.extensions[EXTENSION]
        wait_for(svc.directory.ready, timeout_s=10.0, what="stream synchronized")
        register(app, etcd, cached, waiting=1)
        register(app, etcd, cold, waiting=2)
        client = app.test_client()

        def route() -> dict:
            r = client.post("/v1/internal/route", headers=AUTH,
                            json={"token_ids": [1, 6, 7, 8, 9, 10, 6, 7, 5, 5]})
            assert r.status_code == 200
            return {c["name"]: c for c in r.get_json()["candidates"]}

        exact = route()
        assert [r["completeness"] for r in exact[cached]["ranks"]] == ["exact"]
        assert (exact[cold]["ranks"][0]["reason"], exact[cold]["ranks"][0]["completeness"]) == (
            "missing", None)
        # The stream machine says its index is a subset (§7h): same hits, same score.
        svc.directory.subscriber(StreamId(cached, 0))._serving.set_completeness(
            Completeness.SUBSET)
        subset = route()
        assert subset[cached]["ranks"] == [{"dp_rank": 0, "device_hit_tokens": 8,
                                            "host_only_hit_tokens": 0, "pending_hit_tokens": 0, "hit_ratio": 0.8,
                                            "reason": None, "completeness": "subset"}]
        assert (subset[cached]["hit_ratio"], subset[cached]["score"]) == (
            exact[cached]["hit_ratio"], exact[cached]["score"])
        assert subset[cached]["score"] == pytest.approx(0.35, abs=1e-12)
