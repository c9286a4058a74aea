"""The routing app in process against a real etcd (§9, §11): :func:`running` (an app whose registry
reads a key prefix), :func:`register` (an instance key), :func:`completion` (a routed request)."""

from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Iterator, Optional

import flask

from kvsvc.clock import MONOTONIC, Clock
from kvsvc.cluster.etcd import EtcdClient
from kvsvc.config import KvEventsConfig
from kvsvc.http.app import create_app
from kvsvc.http.extensions import EXTENSION, ROUTING_EXTENSION
from kvsvc.http.internal import HEARTBEAT_PATH
from kvsvc.settings import load_service_settings

TOKEN = "route-token"
AUTH = {"X-Internal-Token": TOKEN}
NS = "r"
TYPES = {"DEFAULT": 0, "PREFILL": 1, "DECODE": 2, "MIX": 3}


@contextmanager
def running(etcd_server, kv_config: Optional[KvEventsConfig] = None, clock: Clock = MONOTONIC,
            **overrides) -> Iterator[flask.Flask]:
    """A started app with a registry on ``etcd_server``; closed (proxy too) afterwards.
    ``clock``: the service's (a :class:`~kvsvc.clock.VirtualClock` ages the loads without
    waiting); ``overrides``: settings."""
    kwargs = dict(internal_api_token=TOKEN, etcd_addr=etcd_server.addr, etcd_namespace=NS,
                  model="m1,m2", upstream_connect_timeout_s=1.0, upstream_read_timeout_s=2.0)
    kwargs.update(overrides)
    app = create_app(load_service_settings(**kwargs), kv_config, clock)
    svc = app.extensions[EXTENSION]
    svc.start(timeout_s=10.0)
    try:
        yield app
    finally:
        app.extensions[ROUTING_EXTENSION].close()
        svc.close(timeout_s=5.0)


def register(app, etcd: EtcdClient, name: str, type_: str = "DEFAULT", waiting: int = 0,
             usage: float = 0.0, heartbeat: bool = True) -> None:
    """Put the instance's §9 key, wait until the registry has it, then send its load."""
    etcd.put(f"/{NS}/XLLM:{type_}:{name}", json.dumps(
        {"name": name, "type": TYPES[type_], "incarnation_id": f"inc-{name}"}))
    registry = app.extensions[EXTENSION].registry
    registry.wait_for(lambda s: name in s.instances, timeout_s=10.0)
    if heartbeat:
        r = app.test_client().post(HEARTBEAT_PATH, headers=AUTH, json={
            "name": name, "incarnation_id": f"inc-{name}",
            "load_metrics": {"waiting_requests_num": waiting, "gpu_cache_usage_perc": usage}})
        assert r.status_code == 200, r.get_json()


def completion(client, body, **kwargs):
    return client.post("/v1/completions", data=body if isinstance(body, (bytes, str))
                       else json.dumps(body), content_type="application/json", **kwargs)
