"""``GET /metrics`` (kvsvc.http.metrics), ``/health`` and ``/ready`` through the Flask test client,
with real subscribers fed by a tests/support/publisher.py engine and, for the instance metrics, a real
etcd. Every value asserted is the exact count of what the test sent."""

from __future__ import annotations

import json
import platform
from typing import Optional

import flask
import prometheus_client

import kvsvc

from kvsvc.http.app import create_app
from kvsvc.config import KvEventsConfig, parse_kv_events_config
from kvsvc.settings import load_service_settings
from kvsvc.cluster.etcd import EtcdClient
from kvsvc.http.extensions import EXTENSION, METRICS_EXTENSION
from kvsvc.http.internal import HEARTBEAT_PATH, QUERY_PATH
from kvsvc.streams.frame import encode_live
from tests.support.publisher import removed, stored
from tests.support.util import free_port, free_ports, wait_for
from tests.support.metrics import INSTANCE, Scrape, scrape

TOKEN = "metrics-test-token"
AUTH = {"X-Internal-Token": TOKEN}
BS = 4


def stream_config(event_port: int, replay_port: int) -> KvEventsConfig:
    return parse_kv_events_config({
        "streams": [{"instance_name": INSTANCE, "block_size": BS,
                     "endpoint": f"tcp://127.0.0.1:{event_port}",
                     "replay_endpoint": f"tcp://127.0.0.1:{replay_port}"}],
        "replay_timeout_ms": 500})


def running(settings_kwargs: dict, kv_config: Optional[KvEventsConfig]):
    settings = load_service_settings(**settings_kwargs)
    app = create_app(settings, kv_config)
    app.extensions[EXTENSION].start(timeout_s=5.0)
    return app


def status(app: flask.Flask):
    return app.extensions[EXTENSION].directory.statuses()[0]


STREAM_FAMILIES = {
    # family sample name -> extra label names besides (instance, dp_rank)
    "kvsvc_stream_state": {"state"},
    "kvsvc_stream_completeness": {"completeness"},
    "kvsvc_stream_synchronized_once": set(),
    "kvsvc_stream_last_applied_sequence": set(),
    "kvsvc_stream_seconds_since_last_event": set(),
    "kvsvc_stream_resident_blocks": {"tier"},
    "kvsvc_stream_engine_map_entries": set(),
    "kvsvc_stream_events_applied_total": {"type"},
    "kvsvc_stream_events_not_indexed_total": {"reason"},
    "kvsvc_stream_blocks_not_indexed_total": {"reason"},
    "kvsvc_stream_decode_errors_total": {"reason"},
    "kvsvc_stream_recoveries_total": {"trigger"},
    "kvsvc_stream_synchronizations_total": set(),
    "kvsvc_stream_snapshot_attempts_total": {"outcome"},
    "kvsvc_stream_snapshot_duration_seconds_count": set(),
    "kvsvc_stream_snapshot_duration_seconds_sum": set(),
    "kvsvc_stream_last_snapshot_duration_seconds": set(),
    "kvsvc_stream_last_snapshot_bytes": set(),
    "kvsvc_stream_last_snapshot_messages": set(),
    "kvsvc_stream_buffered_bytes": set(),
    "kvsvc_stream_resync_differences_total": set(),
    "kvsvc_stream_messages_dropped_total": {"reason"},
}


def check_stream_label_sets(m: Scrape) -> None:
    for name, extra in STREAM_FAMILIES.items():
        assert m.labels(name) == {frozenset({"instance", "dp_rank", *extra})}, name


def test_stream_metrics_count_exactly_what_the_engine_sent(raw_engine):
    raw_engine.set_snapshot([stored([1, 2], None, range(8), BS)], watermark=None)
    app = running({"internal_api_token": TOKEN}, stream_config(raw_engine.event_port,
                                                               raw_engine.replay_port))
    try:
        client = app.test_client()
        wait_for(lambda: status(app).synchronized_once, timeout_s=10, what="first snapshot")
        raw_engine.wait_subscribed()
        raw_engine.publish([stored([3], 2, range(8, 12), BS)])                       # seq 0
        raw_engine.publish([stored([10, 11], None, range(8), BS, lora_id=7)])        # 1: excluded
        raw_engine.publish([stored([20], None, range(4), BS, medium="disk")])        # 2: other medium
        raw_engine.publish([removed([3])])                                           # 3
        raw_engine.publish([stored([30], None, range(100, 104), BS, medium="cpu")])  # 4: Host
        wait_for(lambda: status(app).sequence == 4, timeout_s=10, what="seq 4 applied")
        for _ in range(2):
            assert client.post(QUERY_PATH, json={"token_ids": list(range(8))},
                               headers=AUTH).status_code == 200

        m = scrape(client)
        check_stream_label_sets(m)
        assert [m.stream("kvsvc_stream_state", state=s)
                for s in ("unsynchronized", "recovering", "synchronized")] == [0, 0, 1]
        assert [m.stream("kvsvc_stream_completeness", completeness=c)
                for c in ("exact", "subset")] == [1, 0]  # snapshot mode: exact (§7h)
        assert m.stream("kvsvc_stream_synchronized_once") == 1
        assert m.stream("kvsvc_stream_last_applied_sequence") == 4
        assert m.stream("kvsvc_stream_resident_blocks", tier="device") == 2   # 1, 2
        assert m.stream("kvsvc_stream_resident_blocks", tier="host") == 1     # 30
        assert m.stream("kvsvc_stream_engine_map_entries") == 5               # 1, 2, 30, 10, 11
        assert {t: m.stream("kvsvc_stream_events_applied_total", type=t) for t in
                ("BlockStored", "BlockRemoved", "AllBlocksCleared")} == {
            "BlockStored": 4, "BlockRemoved": 1, "AllBlocksCleared": 0}
        assert m.stream("kvsvc_stream_events_not_indexed_total", reason="other_medium") == 1
        assert {r: m.stream("kvsvc_stream_blocks_not_indexed_total", reason=r) for r in
                ("excluded", "unknown_tokenless", "unknown_removal")} == {
            "excluded": 2, "unknown_tokenless": 0, "unknown_removal": 0}
        assert {r for (n, lbl), v in m.samples.items()
                if n == "kvsvc_stream_decode_errors_total" for k, r in lbl if k == "reason"} \
            == {"frame", "payload", "event", "unknown_parent", "hash_conflict", "capacity"}
        assert sum(v for (n, _), v in m.samples.items()
                   if n == "kvsvc_stream_decode_errors_total") == 0
        assert m.stream("kvsvc_stream_recoveries_total", trigger="start") == 1
        assert sum(v for (n, _), v in m.samples.items()
                   if n == "kvsvc_stream_recoveries_total") == 1
        assert m.stream("kvsvc_stream_synchronizations_total") == 1
        assert m.stream("kvsvc_stream_snapshot_attempts_total", outcome="ok") == 1
        assert m.stream("kvsvc_stream_snapshot_duration_seconds_count") == 1
        assert m.stream("kvsvc_stream_last_snapshot_messages") == 1
        assert m.stream("kvsvc_stream_last_snapshot_bytes") > 0
        assert 0 < m.stream("kvsvc_stream_last_snapshot_duration_seconds") < 5
        assert m.stream("kvsvc_stream_buffered_bytes") == 0
        assert 0 <= m.stream("kvsvc_stream_seconds_since_last_event") < 10
        assert m.stream("kvsvc_stream_resync_differences_total") == 0
        assert m.stream("kvsvc_stream_messages_dropped_total", reason="topic_mismatch") == 0
        assert m.value("kvsvc_query_duration_seconds_count") == 2
        assert m.value("kvsvc_service_running") == 1
        assert m.types["kvsvc_stream_events_applied"] == "counter"
        assert m.types["kvsvc_query_duration_seconds"] == "histogram"

        # A payload that is not MessagePack (seq 5): one decode error, one recovery it
        # triggered, then a second snapshot (state at watermark 5) swapped in.
        raw_engine.set_snapshot([stored([1, 2], None, range(8), BS)], watermark=5)
        raw_engine._send(encode_live(b"", 5, b"\xc1"))
        wait_for(lambda: status(app).recoveries == 2 and status(app).sequence == 5,
                 timeout_s=10, what="second snapshot")
        m = scrape(client)
        assert m.stream("kvsvc_stream_decode_errors_total", reason="payload") == 1
        assert m.stream("kvsvc_stream_recoveries_total", trigger="decode_error") == 1
        assert m.stream("kvsvc_stream_synchronizations_total") == 2
        assert m.stream("kvsvc_stream_snapshot_attempts_total", outcome="ok") == 2
        assert m.stream("kvsvc_stream_resident_blocks", tier="device") == 2
        assert m.stream("kvsvc_stream_resident_blocks", tier="host") == 0
        # Live counts survive the index they were counted on; the snapshot adds none.
        assert m.stream("kvsvc_stream_events_applied_total", type="BlockStored") == 4
        assert m.stream("kvsvc_stream_blocks_not_indexed_total", reason="excluded") == 2
        assert m.stream("kvsvc_stream_events_not_indexed_total", reason="other_medium") == 1
    finally:
        app.extensions[EXTENSION].close(timeout_s=5.0)


def test_request_metrics_heartbeats_routing_and_proxy_statuses():
    # No streams, no registry: every answer is deterministic.
    app = running({"internal_api_token": TOKEN}, None)
    try:
        client = app.test_client()
        hb = {"name": "127.0.0.1:1", "load_metrics": {"waiting_requests_num": 0,
                                                      "gpu_cache_usage_perc": 0.5}}
        assert client.post(HEARTBEAT_PATH, json=hb, headers=AUTH).status_code == 503
        assert client.post(HEARTBEAT_PATH, data=b"{", headers=AUTH).status_code == 400
        assert client.post(HEARTBEAT_PATH, json=hb, headers={"X-Internal-Token": "no"}
                           ).status_code == 401
        assert client.post("/v1/internal/route", json={"token_ids": [1, 2, 3]},
                           headers=AUTH).status_code == 200
        for _ in range(3):
            assert client.post("/v1/completions", json={"model": "m", "prompt": "hi"}
                               ).status_code == 503
        assert client.post("/v1/completions", json={"prompt": "hi"}).status_code == 400
        m = scrape(client)
        assert {o: m.value("kvsvc_heartbeats_total", outcome=o) for o in
                ("no_registry", "malformed", "unauthorized")} == {
            "no_registry": 1, "malformed": 1, "unauthorized": 1}
        assert m.value("kvsvc_heartbeats_total", outcome="ok") is None
        assert m.value("kvsvc_routing_decisions_total", policy="CAR", prefill="none") == 4
        assert m.value("kvsvc_route_duration_seconds_count", policy="CAR") == 4
        assert m.value("kvsvc_routing_predicted_hit_ratio_count") == 0
        assert m.value("kvsvc_proxy_requests_total", endpoint="completions", status="503") == 3
        assert m.value("kvsvc_proxy_requests_total", endpoint="completions", status="400") == 1
        assert m.value("kvsvc_proxy_upstream_retries_total") == 0
        # Issue 13: build info, and the proxy's latency and error families (empty: nothing
        # was relayed from an instance).
        assert m.value("kvsvc_build_info", version=kvsvc.__version__,
                       python=platform.python_version()) == 1
        assert m.types["kvsvc_proxy_request_duration_seconds"] == "histogram"
        assert m.types["kvsvc_proxy_time_to_first_token_seconds"] == "histogram"
        assert m.types["kvsvc_proxy_upstream_errors"] == "counter"
        assert not [n for (n, _) in m.samples if n.startswith((
            "kvsvc_proxy_request_duration_seconds_", "kvsvc_proxy_time_to_first_token_",
            "kvsvc_proxy_upstream_errors_"))]
        assert m.value("kvsvc_query_duration_seconds_count") == 0
        # No directory, registry or discovery: their families are absent, not zero.
        assert not [n for (n, _) in m.samples if n.startswith(("kvsvc_stream_",
                                                                "kvsvc_instance_",
                                                                "kvsvc_discovery_"))]
    finally:
        app.extensions[EXTENSION].close(timeout_s=5.0)


def test_each_app_has_its_own_registry_and_the_global_one_stays_empty():
    apps = [create_app(load_service_settings(), None) for _ in range(2)]
    registries = {id(a.extensions[METRICS_EXTENSION].registry) for a in apps}
    assert len(registries) == 2
    apps[0].test_client().post(QUERY_PATH, json={"token_ids": [1]})
    assert scrape(apps[0].test_client()).value("kvsvc_query_duration_seconds_count") == 1
    assert scrape(apps[1].test_client()).value("kvsvc_query_duration_seconds_count") == 0
    global_text = prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()
    assert "kvsvc_" not in global_text


def test_metrics_token_optional():
    open_app = create_app(load_service_settings(internal_api_token=TOKEN), None)
    assert open_app.test_client().get("/metrics").status_code == 200
    closed = create_app(load_service_settings(internal_api_token=TOKEN,
                                              metrics_require_token=True), None)
    client = closed.test_client()
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers={"X-Internal-Token": "wrong"}).status_code == 401
    assert client.get("/metrics", headers=AUTH).status_code == 200


def test_instance_metrics_and_heartbeat_ok_on_a_real_etcd(etcd_server):
    name = "127.0.0.1:9311"
    etcd = EtcdClient(etcd_server.addr)
    try:
        lease = etcd.grant_lease(60)
        etcd.put(f"XLLM:DEFAULT:{name}", json.dumps({
            "name": name, "type": 0, "incarnation_id": "inc-1", "dp_size": 1}), lease_id=lease)
        app = running({"internal_api_token": TOKEN, "etcd_addr": etcd_server.addr}, None)
        try:
            svc = app.extensions[EXTENSION]
            svc.registry.wait_for(lambda s: name in s.instances and s.fresh, timeout_s=10)
            client = app.test_client()
            m = scrape(client)
            assert m.value("kvsvc_instance_load_age_seconds", instance=name) is None
            hb = {"name": name, "incarnation_id": "inc-1",
                  "load_metrics": {"waiting_requests_num": 7, "gpu_cache_usage_perc": 0.25}}
            assert client.post(HEARTBEAT_PATH, json=hb, headers=AUTH).status_code == 200
            stale = dict(hb, incarnation_id="inc-0")
            assert client.post(HEARTBEAT_PATH, json=stale, headers=AUTH).status_code == 409
            unknown = dict(hb, name="127.0.0.1:1")
            assert client.post(HEARTBEAT_PATH, json=unknown, headers=AUTH).status_code == 409
            m = scrape(client)
            assert m.value("kvsvc_registry_fresh") == 1
            assert {s: m.value("kvsvc_instance_state", instance=name, state=s)
                    for s in ("ACTIVE", "LEASE_LOST", "SUSPECT")} == {
                "ACTIVE": 1, "LEASE_LOST": 0, "SUSPECT": 0}
            assert 0 <= m.value("kvsvc_instance_load_age_seconds", instance=name) < 10
            assert m.value("kvsvc_instance_waiting_requests", instance=name) == 7
            assert m.value("kvsvc_instance_gpu_cache_usage_ratio", instance=name) == 0.25
            assert {o: m.value("kvsvc_heartbeats_total", outcome=o) for o in
                    ("ok", "stale_incarnation", "unknown_instance")} == {
                "ok": 1, "stale_incarnation": 1, "unknown_instance": 1}
            # Routing with the instance known: RR/CAR pick it; CAR has a hit ratio (0 here).
            route = client.post("/v1/internal/route", json={"token_ids": [1, 2]}, headers=AUTH)
            assert route.status_code == 200
            assert route.get_json()["prefill"] == name, route.get_json()
            m = scrape(client)
            assert m.value("kvsvc_routing_decisions_total", policy="CAR", prefill=name) == 1
            assert m.value("kvsvc_routing_predicted_hit_ratio_count") == 1
            assert m.value("kvsvc_routing_predicted_hit_ratio_bucket", le="0.0") == 1
        finally:
            svc.close(timeout_s=5.0)
    finally:
        etcd.close()


# -- /health and /ready (§10 and issue 6 item 4) -------------------------------------------------

def test_health_touches_neither_registry_nor_directory(monkeypatch):
    """/health answers from nothing: with etcd unreachable and the directory's and registry's
    read paths made to fail, it is still 200 (the patches only force what must never run)."""
    dead_etcd = f"127.0.0.1:{free_port()}"
    event_port, replay_port = free_ports(2)
    app = running({"etcd_addr": dead_etcd}, stream_config(event_port, replay_port))
    svc = app.extensions[EXTENSION]
    try:
        client = app.test_client()
        ready = client.get("/ready?streams=synchronized")
        assert ready.status_code == 503
        body = ready.get_json()
        assert body["registry"]["fresh"] is False
        assert [(s["instance_name"], s["state"] in ("recovering", "unsynchronized"),
                 s["synchronized_once"]) for s in body["streams"]] == [(INSTANCE, True, False)]

        def boom(*_a, **_k):
            raise AssertionError("/health must not read this")

        monkeypatch.setattr(svc.registry, "snapshot", boom)
        monkeypatch.setattr(svc.directory, "statuses", boom)
        monkeypatch.setattr(svc.directory, "query", boom)
        health = client.get("/health")
        assert (health.status_code, health.get_json()) == (200, {"status": "ok"})
    finally:
        monkeypatch.undo()
        svc.close(timeout_s=5.0)


def test_ready_static_streams_need_a_first_sync_and_a_first_registry_list(raw_engine):
    """Static streams + unreachable etcd: 503 until the stream synchronized once, and still 503
    after it while the registry never listed (issue 13: nothing to route on; it used to be
    200 here), naming what it waits for."""
    dead_etcd = f"127.0.0.1:{free_port()}"
    raw_engine.hold_replies()
    app = running({"etcd_addr": dead_etcd}, stream_config(raw_engine.event_port, raw_engine.replay_port))
    svc = app.extensions[EXTENSION]
    try:
        client = app.test_client()
        wait_for(lambda: raw_engine.requests, timeout_s=10, what="snapshot request")
        first = client.get("/ready?streams=synchronized")
        assert first.status_code == 503
        assert first.get_json()["streams"][0]["synchronized_once"] is False
        assert first.get_json()["waiting_for"] == [
            "registry first list", f"stream {INSTANCE}/dp0 first synchronization"]
        raw_engine.release_replies()
        wait_for(lambda: status(app).synchronized_once, timeout_s=10, what="synchronized")
        r = client.get("/ready?streams=synchronized")
        body = r.get_json()
        assert (r.status_code, body["ready"], body["registry"]["fresh"],
                body["streams"][0]["state"], body["streams"][0]["synchronized_once"],
                body["waiting_for"]) == (503, False, False, "synchronized", True,
                                         ["registry first list"])
    finally:
        svc.close(timeout_s=5.0)
