"""Predicted vs actual cached tokens through the real path (issue 14): the Flask app with a
real Registry on a real etcd and a static stream of a real simulated engine that serves the
proxied requests on 127.0.0.1; every answer is audited against the engine's own
``cached_tokens``, exported in ``GET /metrics`` and listed in ``/v1/internal/route``'s
``recent_cache_predictions``."""

from __future__ import annotations

import json
from typing import Iterator

import pytest

from kvsvc.config import parse_kv_events_config
from kvsvc.http.app import create_app
from kvsvc.http.extensions import EXTENSION, ROUTING_EXTENSION
from kvsvc.http.internal import HEARTBEAT_PATH, ROUTE_PATH
from kvsvc.routing.cache_audit import CAUSE_NOT_TOKENIZED
from kvsvc.settings import load_service_settings
from kvsvc.testbed.sim import SimEngine
from kvsvc.testbed.sim.serving import ServingConfig
from tests.support.metrics import scrape
from tests.support.util import free_ports, wait_for

TOKEN = "audit-token"
AUTH = {"X-Internal-Token": TOKEN}
BS = 4


@pytest.fixture
def cluster(etcd_server, etcd) -> Iterator[tuple]:
    ev, rp, http = free_ports(3)
    name = f"127.0.0.1:{http}"
    eng = SimEngine(name, ev, rp, block_size=BS, device_blocks=64, http_port=http,
                    serving=ServingConfig(prefill_us_per_token=10.0,
                                          decode_us_per_token=100.0))
    eng.start()
    kv = parse_kv_events_config({"streams": [{"instance_name": name, "block_size": BS,
                                              "endpoint": f"tcp://127.0.0.1:{ev}",
                                              "replay_endpoint": f"tcp://127.0.0.1:{rp}"}]})
    app = create_app(load_service_settings(
        internal_api_token=TOKEN, etcd_addr=etcd_server.addr, etcd_namespace="a",
        load_balance_policy="CAR", model="sim", upstream_read_timeout_s=10.0), kv)
    svc = app.extensions[EXTENSION]
    svc.start(timeout_s=10.0)
    try:
        etcd.put(f"/a/XLLM:DEFAULT:{name}", json.dumps(
            {"name": name, "type": 0, "incarnation_id": "inc-1"}))
        svc.registry.wait_for(lambda s: name in s.instances, timeout_s=10.0)
        r = app.test_client().post(HEARTBEAT_PATH, headers=AUTH, json={
            "name": name, "incarnation_id": "inc-1",
            "load_metrics": {"waiting_requests_num": 0, "gpu_cache_usage_perc": 0.0}})
        assert r.status_code == 200
        wait_for(lambda: svc.directory.statuses()[0].state.value == "synchronized", 10.0,
                 what="stream synchronized")
        yield app, eng, name
    finally:
        app.extensions[ROUTING_EXTENSION].close()
        svc.close(timeout_s=5.0)
        eng.close()


def route(client, body: dict) -> dict:
    r = client.post(ROUTE_PATH, headers=AUTH, json=body)
    assert r.status_code == 200, r.get_json()
    return r.get_json()


def predicted_hit(client, prompt: list[int], name: str) -> int:
    (cand,) = [c for c in route(client, {"token_ids": prompt})["candidates"]
               if c["name"] == name]
    return cand["ranks"][0]["device_hit_tokens"]


def test_every_answer_is_audited_exported_and_listed(cluster):
    app, eng, name = cluster
    client = app.test_client()
    first = list(range(100, 132))                       # 8 full blocks
    r = client.post("/v1/completions", json={"model": "sim", "prompt": first, "max_tokens": 2})
    assert r.status_code == 200
    assert r.get_json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # The engine's events reach the index: the router now predicts the 8 blocks.
    longer = first + [7, 8, 9, 10, 11, 12]
    wait_for(lambda: predicted_hit(client, longer, name) == 32, 10.0, what="index caught up")
    r = client.post("/v1/completions", json={"model": "sim", "prompt": longer, "max_tokens": 2})
    assert r.get_json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    assert r.headers["x-kvsvc-predicted-cached-tokens"] == "32"
    assert "x-kvsvc-predicted-ttft-ms" not in r.headers   # CAR predicts no time
    # Streamed, usage from the last chunk (include_usage): 36 blocks-worth predicted once the
    # second answer's block (7..10) is indexed.
    wait_for(lambda: predicted_hit(client, longer, name) == 36, 10.0, what="second indexed")
    r = client.post("/v1/completions", json={"model": "sim", "prompt": longer, "max_tokens": 3, "stream": True,
                                             "stream_options": {"include_usage": True}})
    assert b"data: [DONE]" in r.get_data()
    r.close()  # what the WSGI server does at the end: the relay's end reaches the audit
    # A text prompt the router cannot tokenize (no --tokenizer_path): predicted 0 while the
    # engine, tokenizing it itself, reuses the first answer's blocks: a large miss, named.
    text = "the same text prompt, twice over"           # 32 bytes: 8 blocks
    client.post("/v1/completions", json={"model": "sim", "prompt": text, "max_tokens": 1})
    r = client.post("/v1/completions", json={"model": "sim", "prompt": text, "max_tokens": 1})
    assert r.get_json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 32

    audit = app.extensions[EXTENSION].cache_audit
    wait_for(lambda: audit.snapshot().audited == 5, 5.0, what="five answers audited")
    recent = route(client, {"token_ids": [1]})["recent_cache_predictions"]
    got = [(e["instance"], e["predicted"], e["actual"], e["diff"], e["outcome"], e["cause"],
            e["exact"]) for e in recent]
    assert got == [
        (name, 0, 0, 0, "within_block", None, True),
        (name, 32, 32, 0, "within_block", None, True),
        (name, 36, 36, 0, "within_block", None, True),
        (name, 0, 0, 0, "within_block", None, False),
        (name, 0, 32, 32, "under", CAUSE_NOT_TOKENIZED, False),
    ]
    assert [e["engine_prompt_tokens"] for e in recent] == [32, 38, 38, 32, 32]
    assert {e["policy"] for e in recent} == {"CAR"}

    m = scrape(client)
    assert m.types["kvsvc_cache_prediction_diff_tokens"] == "histogram"
    assert m.value("kvsvc_cache_prediction_diff_tokens_bucket", le="+Inf") == 5.0
    assert m.value("kvsvc_cache_prediction_abs_error_tokens_total") == 32.0
    assert m.value("kvsvc_cache_prediction_diff_tokens_bucket", le="0.0") == 4.0
    assert m.value("kvsvc_cache_prediction_diff_tokens_bucket", le="128.0") == 5.0
    assert m.value("kvsvc_cache_predictions_total", instance=name,
                   outcome="within_block") == 4.0
    assert m.value("kvsvc_cache_predictions_total", instance=name, outcome="under") == 1.0
    assert m.value("kvsvc_cache_predictions_exact_total", instance=name,
                   outcome="within_block") == 3.0
    assert m.value("kvsvc_cache_predictions_exact_total", instance=name, outcome="under") is None
    assert m.value("kvsvc_cache_prediction_misses_total", instance=name,
                   cause=CAUSE_NOT_TOKENIZED) == 1.0
    assert m.value("kvsvc_cache_predictions_unaudited_total", reason="no_usage") == 0.0
