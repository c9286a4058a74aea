"""Pending prefixes (§16) through the real app: a real registry on etcd, a real static stream fed
by a protocol publisher, a real upstream. A proxied request's blocks after the stream's exact
prefix become pending; the query and the route explanation show them apart from the exact hits;
the stream's own events settle them (stored: exact; AllBlocksCleared: gone)."""

from __future__ import annotations

from kvsvc.config import KvEventsConfig, parse_kv_events_config
from kvsvc.http.extensions import EXTENSION
from tests.support.publisher import ProtocolPublisher, cleared, stored
from tests.support.routes import AUTH, completion, register, running
from tests.support.upstreams import upstreams
from tests.support.util import free_ports, wait_for

BS = 4
PROMPT = [1, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 5]   # 3 full blocks and one token


def one_stream(name: str, event_port: int, replay_port: int) -> KvEventsConfig:
    return parse_kv_events_config({"streams": [{
        "instance_name": name, "block_size": BS, "endpoint": f"tcp://127.0.0.1:{event_port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}"}], "replay_timeout_ms": 500})


def query(client) -> dict:
    r = client.post("/v1/internal/kv-cache/query", headers=AUTH, json={"token_ids": PROMPT})
    assert r.status_code == 200
    (m,) = r.get_json()["matches"]
    return m


def test_a_proxied_prompt_is_pending_until_its_events_arrive(etcd_server, etcd, zmq_ctx):
    event_port, replay_port = free_ports(2)
    pub = ProtocolPublisher(zmq_ctx, event_port, replay_port)
    pub.set_snapshot([stored([11], None, PROMPT[:BS], BS)], watermark=None)
    with upstreams("json") as (up,), pub, running(
            etcd_server, one_stream(up.name, event_port, replay_port)) as app:
        svc = app.extensions[EXTENSION]
        wait_for(svc.directory.ready, timeout_s=10.0, what="stream synchronized")
        register(app, etcd, up.name)
        client = app.test_client()
        assert (query(client)["device_hit_tokens"], query(client)["pending_hit_tokens"]) == (
            BS, 0)
        r = completion(client, {"model": "m1", "prompt": PROMPT, "max_tokens": 1})
        assert r.status_code == 200 and r.headers["x-kvsvc-prefill"] == up.name
        # Dispatched: the two blocks after the exact one are pending, never exact.
        m = query(client)
        assert (m["device_hit_tokens"], m["pending_hit_tokens"], m["completeness"]) == (
            BS, 2 * BS, "exact")
        got = client.post("/v1/internal/route", headers=AUTH,
                          json={"token_ids": PROMPT}).get_json()
        (rank,) = got["candidates"][0]["ranks"]
        assert (rank["device_hit_tokens"], rank["pending_hit_tokens"], rank["hit_ratio"]) == (
            BS, 2 * BS, 12 / 13)
        # The engine's event for the second block: exact now, one block still pending.
        pub.wait_subscribed()
        pub.publish([stored([12], 11, PROMPT[BS:2 * BS], BS)])
        wait_for(lambda: query(client)["device_hit_tokens"] == 2 * BS, timeout_s=10.0,
                 what="the stored block applied")
        assert query(client)["pending_hit_tokens"] == BS
        # AllBlocksCleared covers every pending block.
        pub.publish([cleared()])
        wait_for(lambda: query(client)["device_hit_tokens"] == 0, timeout_s=10.0,
                 what="the clear applied")
        assert query(client)["pending_hit_tokens"] == 0
