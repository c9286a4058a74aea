"""What operators expect of the OpenAI front end (issue 20 item 7), through the Flask test
client with a real registry on a real etcd and real upstream HTTP servers: ``--api_key``
(Bearer) on ``/v1/*`` but not ``/v1/internal/*``, ``/v1/embeddings`` passed through by model,
``x-request-id`` kept or created, sent upstream and returned, the in-flight limit answering
429 with ``Retry-After`` (503s carry it too), and per-model token histograms."""

from __future__ import annotations

import json
import threading
from typing import Optional

from kvsvc.http.admission import InFlightLimit, RequestIdFilter, current_request_id
from kvsvc.http.extensions import ADMISSION_EXTENSION
from tests.support.metrics import scrape
from tests.support.routes import AUTH, completion, register, running
from tests.support.upstreams import upstreams

BODY = {"model": "m1", "prompt": [1, 2, 3], "max_tokens": 4}


def openai_error(r) -> tuple[int, str, Optional[str], Optional[str]]:
    """(status, type, param, code) of an OpenAI error answer, its keys checked."""
    err = r.get_json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return r.status_code, err["type"], err["param"], err["code"]


def test_api_key_guards_the_openai_api_not_the_internal_one(etcd_server, etcd):
    with upstreams("json") as (up,), running(etcd_server, api_key="client-key") as app:
        register(app, etcd, up.name)
        client = app.test_client()
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "client-key"},
                        {"X-Internal-Token": AUTH["X-Internal-Token"]}):
            r = completion(client, BODY, headers=headers)
            assert openai_error(r) == (401, "invalid_request_error", None, "invalid_api_key")
            assert client.get("/v1/models", headers=headers).status_code == 401
        assert up.requests == []
        r = completion(client, BODY, headers={"Authorization": "Bearer client-key"})
        assert r.status_code == 200
        # The engine gets the key too (it may check the same one).
        assert up.requests[0]["headers"]["Authorization"] == "Bearer client-key"
        assert client.get("/v1/models", headers={"Authorization": "bearer client-key"}
                          ).status_code == 200
        # The internal API keeps its own token and needs no API key.
        r = client.post("/v1/internal/route", json={"token_ids": [1]}, headers=AUTH)
        assert r.status_code == 200
        assert client.get("/health").status_code == 200


def test_embeddings_passed_through_by_model(etcd_server, etcd):
    with upstreams("json") as (up,), running(etcd_server) as app:
        register(app, etcd, up.name)
        client = app.test_client()
        body = {"model": "m2", "input": ["a", "b"]}
        r = client.post("/v1/embeddings", json=body)
        assert r.status_code == 200 and r.get_json() == {"echo": body}
        assert up.requests[-1]["path"] == "/v1/embeddings"
        assert r.headers["x-kvsvc-prefill"] == up.name
        r = client.post("/v1/embeddings", json={"model": "other", "input": "a"})
        assert openai_error(r)[:3] == (404, "invalid_request_error", "model")
        r = client.post("/v1/embeddings", json={"model": "m1"})
        assert openai_error(r)[:3] == (400, "invalid_request_error", "input")
        assert len(up.requests) == 1
        m = scrape(client)
        assert m.value("kvsvc_proxy_requests_total", endpoint="embeddings", status="200") == 1


def test_request_id_kept_or_created_sent_upstream_and_returned(etcd_server, etcd):
    with upstreams("json") as (up,), running(etcd_server) as app:
        register(app, etcd, up.name)
        client = app.test_client()
        r = completion(client, BODY, headers={"X-Request-Id": "client-chosen-42"})
        assert r.headers["x-request-id"] == "client-chosen-42"
        assert up.requests[-1]["headers"]["X-Request-Id"] == "client-chosen-42"
        r = completion(client, BODY)
        created = r.headers["x-request-id"]
        assert len(created) == 32 and int(created, 16) >= 0
        assert up.requests[-1]["headers"]["X-Request-Id"] == created
        # A value that could forge log lines (or is too long) is replaced, not forwarded.
        for bad in ("a" * 200, "two words"):
            r = completion(client, BODY, headers={"X-Request-Id": bad})
            assert r.headers["x-request-id"] not in (bad, created)
            sent = [v for k, v in up.requests[-1]["headers"].items()
                    if k.lower() == "x-request-id"]
            assert sent == [r.headers["x-request-id"]]
        # Errors carry it too; non-OpenAI paths do not get one.
        r = completion(client, {"model": "m1"})
        assert r.status_code == 400 and len(r.headers["x-request-id"]) == 32
        assert "x-request-id" not in client.get("/health").headers


def test_request_id_filter_tags_records_of_the_request_thread_only():
    import logging
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
    assert RequestIdFilter().filter(record) and not hasattr(record, "request_id")
    assert current_request_id() == ""


def test_in_flight_limit_answers_429_with_retry_after_and_frees_the_slot(etcd_server, etcd):
    with upstreams("sse") as (up,), running(etcd_server, max_in_flight_requests=1) as app:
        register(app, etcd, up.name)
        client = app.test_client()
        limit: InFlightLimit = app.extensions[ADMISSION_EXTENSION]
        streamed = completion(client, {**BODY, "stream": True}, buffered=False)
        assert streamed.status_code == 200
        first = next(streamed.response)  # the stream holds its slot until its relay closes
        assert first.startswith(b"data: 0")
        assert limit.count == 1
        r = completion(client, BODY)
        assert openai_error(r) == (429, "rate_limit_error", None, "rate_limit_exceeded")
        assert r.headers["Retry-After"] == "1"
        up.release.set()
        rest = b"".join(streamed.response)
        assert rest.endswith(b"data: [DONE]\n\n")
        streamed.close()
        assert limit.count == 0 and limit.refused == 1
        # A refused key or a bad body holds no slot.
        r = completion(client, {"model": "m1"})
        assert r.status_code == 400 and limit.count == 0
        m = scrape(client)
        assert m.value("kvsvc_proxy_requests_total", endpoint="completions", status="429") == 1


def test_in_flight_limit_counts_concurrent_threads(etcd_server, etcd):
    limit = InFlightLimit(3)
    got: list[bool] = []
    lock = threading.Lock()

    def take() -> None:
        ok = limit.acquire()
        with lock:
            got.append(ok)

    threads = [threading.Thread(target=take) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert sorted(got) == [False] * 5 + [True] * 3 and limit.count == 3 and limit.refused == 5
    unlimited = InFlightLimit(0)
    assert all(unlimited.acquire() for _ in range(100)) and unlimited.count == 100


def test_no_candidate_503_carries_retry_after(etcd_server, etcd):
    with running(etcd_server) as app:
        r = completion(app.test_client(), BODY)
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"


def test_token_counts_from_the_usage_of_an_answer():
    from kvsvc.http.metrics import Children, TokenMetrics
    from kvsvc.routing.observer import RequestInfo
    from prometheus_client import CollectorRegistry, Histogram

    class Instruments:
        def __init__(self) -> None:
            reg = CollectorRegistry()
            self.registry = reg
            self.inter_token_seconds = Histogram("itl", "", ["model"], registry=reg)
            self.inter_token_seconds_of = Children(self.inter_token_seconds)
            self.prompt_tokens = Histogram("p", "", ["model"], registry=reg)
            self.completion_tokens = Histogram("c", "", ["model"], registry=reg)
            self.prompt_tokens_of = Children(self.prompt_tokens)
            self.completion_tokens_of = Children(self.completion_tokens)

    inst = Instruments()
    observer = TokenMetrics(inst)  # type: ignore[arg-type]
    info = RequestInfo(7, "p:1", "", 40, model="qwen")
    observer.on_first_token(info)
    observer.on_token(info)
    observer.on_token(info)
    observer.on_end(info, {"prompt_tokens": 40, "completion_tokens": 3})
    reg = inst.registry
    assert reg.get_sample_value("itl_count", {"model": "qwen"}) == 2
    assert reg.get_sample_value("p_sum", {"model": "qwen"}) == 40
    assert reg.get_sample_value("c_sum", {"model": "qwen"}) == 3
    observer.on_end(info, {"prompt_tokens": "x"})  # not a count: nothing observed
    assert reg.get_sample_value("p_count", {"model": "qwen"}) == 1
    assert json.dumps(observer._last) == "{}"  # nothing kept after the end


def test_tokenizer_cache_counters_in_metrics(etcd_server, etcd, tmp_path):
    from kvsvc.testbed.tokenizer import write_tokenizer

    tok = write_tokenizer(tmp_path / "tok")
    with upstreams("json") as (up,), running(etcd_server, tokenizer_path=str(tok)) as app:
        register(app, etcd, up.name)
        client = app.test_client()
        turn = [{"role": "user", "content": "tell me about the cache " * 40}]
        for extra in ([], [{"role": "assistant", "content": "it holds blocks"}]):
            r = client.post("/v1/chat/completions", json={"model": "m1", "messages": turn + extra})
            assert r.status_code == 200
        m = scrape(client)
        assert m.value("kvsvc_tokenizer_cache_segments_total", outcome="hit") >= 1
        assert m.value("kvsvc_tokenizer_cache_segments_total", outcome="miss") >= 1
        assert m.value("kvsvc_tokenizer_cache_reused_tokens_total") > 40
        assert m.value("kvsvc_tokenizer_cache_enabled") == 1
