"""``GET /ready`` (§10, §15, issues 13 and 20), with a real etcd and a real stream
(tests/support/publisher.py engine). The probe's rule: 200 once the router can route (registry
listed, at least one routing candidate), a stream that never synchronizes reported, not fatal.
The warm-up gate ``?streams=synchronized``: 503 before the registry's first list (etcd down at
boot: nothing to route on) and before warm-up (every configured stream synchronized once), each
missing piece named in ``waiting_for``; after warm-up 200 through an etcd outage (paused etcd:
every request hangs), routing on the last snapshot and saying so, and while a stream is out of
synchronization."""

from __future__ import annotations

import flask
import pytest

from kvsvc.config import parse_kv_events_config
from kvsvc.http.app import create_app
from kvsvc.http.extensions import EXTENSION
from kvsvc.settings import load_service_settings
from kvsvc.http.internal import QUERY_PATH
from kvsvc.streams.state import Completeness, StreamId
from tests.support.metrics import scrape
from tests.support.publisher import stored
from tests.support.routes import NS, register, running
from tests.support.util import free_ports, wait_for

INSTANCE = "127.0.0.1:9400"
STREAM = f"stream {INSTANCE}/dp0 first synchronization"


def started(etcd_addr: str, raw_engine=None) -> flask.Flask:
    kv_config = None if raw_engine is None else parse_kv_events_config({
        "streams": [{"instance_name": INSTANCE, "block_size": 4,
                     "endpoint": f"tcp://127.0.0.1:{raw_engine.event_port}",
                     "replay_endpoint": f"tcp://127.0.0.1:{raw_engine.replay_port}"}],
        "replay_timeout_ms": 500})
    app = create_app(load_service_settings(etcd_addr=etcd_addr), kv_config)
    app.extensions[EXTENSION].start(timeout_s=10.0)
    return app


def ready(client) -> tuple[int, dict]:
    """The warm-up gate (``?streams=synchronized``)."""
    r = client.get("/ready?streams=synchronized")
    return r.status_code, r.get_json()


def probe(client) -> tuple[int, dict]:
    """The probe's ``/ready``."""
    r = client.get("/ready")
    return r.status_code, r.get_json()


def test_probe_ready_with_a_candidate_although_its_stream_never_synchronizes(etcd_server, etcd):
    """An engine started without KV events: its stream never synchronizes, completions route
    fine. /ready is 503 only while no instance is a candidate, then 200 with the stream's
    state in the body; the warm-up gate still waits for the stream."""
    dead_event, dead_replay = free_ports(2)   # nothing listens: never synchronized
    kv = parse_kv_events_config({
        "streams": [{"instance_name": INSTANCE, "block_size": 4,
                     "endpoint": f"tcp://127.0.0.1:{dead_event}",
                     "replay_endpoint": f"tcp://127.0.0.1:{dead_replay}"}],
        "replay_timeout_ms": 300})
    with running(etcd_server, kv) as app:
        client = app.test_client()
        wait_for(lambda: probe(client)[1]["registry"]["listed_once"], timeout_s=10.0,
                 what="registry listed")
        status, body = probe(client)
        assert (status, body["ready"], body["waiting_for"], body["candidates"]) == (
            503, False, ["a routing candidate"], [])
        register(app, etcd, INSTANCE)   # registered, with a heartbeat: a candidate
        status, body = probe(client)
        assert (status, body["ready"], body["waiting_for"], body["candidates"]) == (
            200, True, [], [INSTANCE])
        assert body["unsynchronized_streams"] == [f"{INSTANCE}/dp0"]
        assert body["streams"][0]["synchronized_once"] is False
        assert body["warmed_up"] is False
        status, body = ready(client)
        assert (status, body["waiting_for"]) == (503, [STREAM])
        # Its load ages out (no heartbeat for max_load_age_s): no candidate, 503 again.
        etcd.delete(f"/{NS}/XLLM:DEFAULT:{INSTANCE}")
        wait_for(lambda: probe(client)[0] == 503, timeout_s=30.0, interval_s=0.1,
                 what="no candidate once the instance is gone")


def test_probe_ready_without_a_registry_is_the_service_running(raw_engine):
    app = started("", raw_engine)
    svc = app.extensions[EXTENSION]
    try:
        status, body = probe(app.test_client())
        assert (status, body["waiting_for"]) == (200, [])
        assert "candidates" not in body
    finally:
        svc.close(timeout_s=10.0)


@pytest.mark.etcd_fresh
def test_503_until_the_registry_listed_once_even_with_synchronized_static_streams(
        etcd_server, raw_engine):
    """etcd down at boot: the stream synchronizes (main answered 200 then), but with nothing
    listed there is nothing to route on: 503 naming the registry's first list, until it lists."""
    etcd_server.stop()
    app = started(etcd_server.addr, raw_engine)
    svc = app.extensions[EXTENSION]
    try:
        client = app.test_client()
        wait_for(lambda: svc.directory.ready(), timeout_s=10.0, what="stream synchronized")
        status, body = ready(client)
        assert (status, body["ready"], body["waiting_for"], body["registry"]["listed_once"],
                body["registry"]["routing_on_last_snapshot"], body["registry"]["stale_for_s"]) == (
            503, False, ["registry first list"], False, False, None)
        assert body["streams"][0]["synchronized_once"] is True
        etcd_server.start()
        wait_for(lambda: ready(client)[0] == 200, timeout_s=20.0, what="ready after the list")
        status, body = ready(client)
        assert (body["waiting_for"], body["warmed_up"], body["registry"]["fresh"],
                body["registry"]["listed_once"]) == ([], True, True, True)
    finally:
        svc.close(timeout_s=10.0)


@pytest.mark.etcd_fresh
def test_ready_stays_200_through_an_etcd_outage_and_a_stream_loss_after_warm_up(
        etcd_server, raw_engine):
    """503 naming the stream until its first synchronization; then 200 all through a paused
    etcd (the body: not fresh, routing on the last snapshot, stale for seconds) and while the
    stream recovers from a lost batch with its snapshot held back."""
    raw_engine.hold_replies()
    app = started(etcd_server.addr, raw_engine)
    svc = app.extensions[EXTENSION]
    try:
        client = app.test_client()
        wait_for(lambda: raw_engine.requests, timeout_s=10.0, what="snapshot request")
        status, body = ready(client)
        assert (status, body["ready"], body["warmed_up"], body["waiting_for"]) == (
            503, False, False, [STREAM])
        assert body["registry"]["fresh"] is True
        raw_engine.release_replies()
        wait_for(lambda: ready(client)[0] == 200, timeout_s=10.0, what="warmed up")

        statuses: list[int] = []

        def stale() -> bool:
            status, body = ready(client)
            statuses.append(status)
            return not body["registry"]["fresh"]

        with etcd_server.paused():
            wait_for(stale, timeout_s=30.0, interval_s=0.1, what="registry not fresh")
            # The stream loses a batch and cannot get its snapshot: out of synchronization.
            raw_engine.hold_replies()
            raw_engine.wait_subscribed()
            raw_engine.skip()
            raw_engine.publish([stored([11], None, [1, 2, 3, 4], 4)])
            wait_for(lambda: svc.directory.statuses()[0].state.value != "synchronized",
                     timeout_s=10.0, what="stream out of synchronization")
            status, body = ready(client)
        assert set(statuses) == {200}, statuses
        assert (status, body["ready"], body["waiting_for"], body["registry"]["fresh"],
                body["registry"]["routing_on_last_snapshot"]) == (200, True, [], False, True)
        assert body["registry"]["stale_for_s"] >= 1.0
        assert body["streams"][0]["state"] != "synchronized"
    finally:
        raw_engine.release_replies()
        svc.close(timeout_s=10.0)


def subscriber_serving(svc, instance: str):
    """The ServingState of ``instance``'s rank-0 stream: the value the stream machine sets
    (§7h; the history rules live in kvsvc.streams, outside this test), set here directly."""
    return svc.directory.subscriber(StreamId(instance, 0))._serving


def test_ready_and_metrics_show_each_streams_completeness_and_replay_mode(raw_engine):
    """No registry: ``/ready`` lists a snapshot stream (null until synchronized, then exact;
    subset when its serving state says so; null again once out of synchronization) and a
    history stream whose engine never answers (null); the gauge says the same."""
    history = "127.0.0.1:9401"
    dead_event, dead_replay = free_ports(2)
    kv_config = parse_kv_events_config({"streams": [
        {"instance_name": INSTANCE, "block_size": 4,
         "endpoint": f"tcp://127.0.0.1:{raw_engine.event_port}",
         "replay_endpoint": f"tcp://127.0.0.1:{raw_engine.replay_port}"},
        {"instance_name": history, "block_size": 4, "replay_mode": "history",
         "endpoint": f"tcp://127.0.0.1:{dead_event}",
         "replay_endpoint": f"tcp://127.0.0.1:{dead_replay}"}],
        "replay_timeout_ms": 500})
    raw_engine.set_snapshot([stored([1, 2], None, range(8), 4)], watermark=None)
    raw_engine.hold_replies()
    app = create_app(load_service_settings(), kv_config)
    svc = app.extensions[EXTENSION]
    svc.start(timeout_s=10.0)
    try:
        client = app.test_client()

        def shown() -> list[tuple]:
            body = ready(client)[1]
            return [(s["instance_name"], s["state"], s["completeness"], s["replay_mode"])
                    for s in body["streams"]]

        def gauge() -> dict[tuple[str, str], float]:
            m = scrape(client)
            return {(name, c): m.value("kvsvc_stream_completeness", instance=name,
                                       dp_rank="0", completeness=c)
                    for name in (INSTANCE, history) for c in ("exact", "subset")}

        wait_for(lambda: raw_engine.requests, timeout_s=10.0, what="snapshot request")
        assert [s[2:] for s in shown()] == [(None, "snapshot"), (None, "history")]
        assert set(gauge().values()) == {0.0}
        raw_engine.release_replies()
        wait_for(lambda: shown()[0][1] == "synchronized", timeout_s=10.0, what="synchronized")
        # The history stream's state is its machine's (never synchronized without an engine).
        first, second = shown()
        assert (first, second[0], second[2:]) == (
            (INSTANCE, "synchronized", "exact", "snapshot"), history, (None, "history"))
        assert gauge() == {(INSTANCE, "exact"): 1.0, (INSTANCE, "subset"): 0.0,
                           (history, "exact"): 0.0, (history, "subset"): 0.0}

        subscriber_serving(svc, INSTANCE).set_completeness(Completeness.SUBSET)
        assert shown()[0] == (INSTANCE, "synchronized", "subset", "snapshot")
        g = gauge()
        assert (g[(INSTANCE, "exact")], g[(INSTANCE, "subset")]) == (0.0, 1.0)
        # The query answer (§10) says the same, with its hits as they are.
        r = client.post(QUERY_PATH, json={"token_ids": list(range(8))})
        assert [(m["instance_name"], m["device_hit_tokens"], m["completeness"])
                for m in r.get_json()["matches"]] == [(INSTANCE, 8, "subset"), (history, 0, None)]

        # A lost batch with the snapshot held back: out of synchronization, null and 0s.
        raw_engine.hold_replies()
        raw_engine.wait_subscribed()
        raw_engine.skip()
        raw_engine.publish([stored([11], None, [1, 2, 3, 4], 4)])
        wait_for(lambda: shown()[0][1] != "synchronized", timeout_s=10.0,
                 what="out of synchronization")
        assert shown()[0][2] is None
        g = gauge()
        assert (g[(INSTANCE, "exact")], g[(INSTANCE, "subset")]) == (0.0, 0.0)
    finally:
        raw_engine.release_replies()
        svc.close(timeout_s=10.0)
