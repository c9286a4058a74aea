"""Never route on a stale load (§11) with a real etcd and the whole app: a ``XLLM:LOADMETRICS``
value left by a previous master ages out after ``--max_load_age_s`` on a replica and is never
used by a new master; refused heartbeats do not refresh a load; usage above 1 is clamped and
counted; ``/v1/internal/route`` and ``/ready`` say why an instance is not a candidate."""

from __future__ import annotations

import json
import logging

from kvsvc.clock import VirtualClock
from kvsvc.cluster.etcd import EtcdClient
from kvsvc.http.extensions import EXTENSION
from kvsvc.http.internal import HEARTBEAT_PATH, ROUTE_PATH
from tests.support.metrics import scrape
from tests.support.routes import AUTH, NS, running
from tests.support.util import wait_for

NAME = "127.0.0.1:7101"
LOAD_KEY = f"/{NS}/XLLM:LOADMETRICS:{NAME}"
MASTER_KEY = f"/{NS}/XLLM:SERVICE:MASTER"


def put_instance(etcd: EtcdClient, name: str = NAME) -> None:
    etcd.put(f"/{NS}/XLLM:DEFAULT:{name}", json.dumps(
        {"name": name, "type": 0, "incarnation_id": f"inc-{name}"}))


def leave_previous_masters_load(etcd: EtcdClient) -> None:
    """What a previous master (xllm-service, or kvsvc before this change) leaves behind: a
    LOADMETRICS value without a lease."""
    etcd.put(LOAD_KEY, json.dumps({"waiting_requests_num": 0, "gpu_cache_usage_perc": 0.1}))


def route(client) -> dict:
    r = client.post(ROUTE_PATH, headers=AUTH, json={"token_ids": [1, 2, 3]})
    assert r.status_code == 200, r.get_json()
    return r.get_json()


def heartbeat(client, usage: object, waiting: int = 0):
    return client.post(HEARTBEAT_PATH, headers=AUTH, json={
        "name": NAME, "incarnation_id": f"inc-{NAME}",
        "load_metrics": {"waiting_requests_num": waiting, "gpu_cache_usage_perc": usage}})


def test_previous_masters_load_ages_out_on_a_replica(etcd_server, etcd):
    """Another replica holds the master key, so ours reads loads from etcd: the stale value is
    dated when read, current for max_load_age_s, then not a candidate (with the age as why).
    The service runs on a virtual clock: current and stale are judged at chosen ages, however
    slow the machine (in real time the first judgement could come too late to be made)."""
    max_age = 2.0
    clock = VirtualClock()
    lease = etcd.grant_lease(60)
    assert etcd.create(MASTER_KEY, "10.9.9.9:9999", lease)
    put_instance(etcd)
    leave_previous_masters_load(etcd)
    with running(etcd_server, clock=clock, max_load_age_s=max_age) as app:
        client = app.test_client()
        registry = app.extensions[EXTENSION].registry
        snap = registry.wait_for(lambda s: NAME in s.instances
                                 and s.instances[NAME].load is not None, timeout_s=10.0)
        assert not snap.is_master
        received_at = snap.instances[NAME].load.received_at
        clock.advance(max_age - (clock.now() - received_at))     # exactly max_age old: current
        answer = route(client)
        assert answer["prefill"] == NAME and answer["excluded"] == {}
        clock.advance(0.25)                                      # 2.25 s old: stale
        stale = route(client)
        assert stale["prefill"] is None
        assert stale["excluded"][NAME] == "load report 2.2 s old (max_load_age_s 2)"
        assert stale["reason"] == "no schedulable instance with a current load report"
        ready = client.get("/ready?streams=synchronized").get_json()
        assert list(ready["not_candidates"]) == [NAME]
        assert ready["not_candidates"][NAME].endswith(" s old (max_load_age_s 2)")
        # Re-lists (every 5 s) of the same revision do not make the value young again.
        assert registry.snapshot().instances[NAME].load.received_at == received_at
        etcd.revoke(lease)


def test_new_master_never_routes_on_loads_read_from_etcd(etcd_server, etcd, caplog):
    """No master key: our replica becomes master and drops the value it read before winning,
    deletes it from etcd (no current load), and writes heartbeat loads under its lease."""
    put_instance(etcd)
    leave_previous_masters_load(etcd)
    caplog.set_level(logging.INFO, logger="kvsvc.cluster.registry")
    with running(etcd_server, max_load_age_s=60.0) as app:
        client = app.test_client()
        registry = app.extensions[EXTENSION].registry
        snap = registry.wait_for(lambda s: s.is_master and NAME in s.instances, timeout_s=10.0)
        assert snap.instances[NAME].load is None
        answer = route(client)
        assert answer["prefill"] is None
        assert answer["excluded"] == {NAME: "no load report yet"}
        assert client.get("/ready?streams=synchronized").get_json()["not_candidates"] == {NAME: "no load report yet"}
        # The stale value is not left for the next process to adopt.
        wait_for(lambda: etcd.get(LOAD_KEY) is None, timeout_s=10.0)
        assert heartbeat(client, 0.4, waiting=2).status_code == 200
        answer = route(client)
        assert (answer["prefill"], answer["excluded"]) == (NAME, {})
        written = wait_for(lambda: etcd.get(LOAD_KEY), timeout_s=10.0)
        assert json.loads(written.value) == {"waiting_requests_num": 2,
                                             "gpu_cache_usage_perc": 0.4}
        master = etcd.get(MASTER_KEY)
        assert master is not None and written.lease == master.lease != 0
    # Closing revoked the master lease: no load of this master outlives it.
    assert etcd.get(LOAD_KEY) is None
    dropped = [r.getMessage() for r in caplog.records if "dropped the loads" in r.getMessage()]
    assert dropped in ([], ["registry: master now; dropped the loads of 1 instances read from "
                            "etcd (only heartbeats accepted here count)"])


def test_refused_heartbeats_never_refresh_a_load(etcd_server, etcd):
    max_age = 1.5
    clock = VirtualClock()                 # the load ages only when the test says so
    put_instance(etcd)
    with running(etcd_server, clock=clock, max_load_age_s=max_age) as app:
        client = app.test_client()
        registry = app.extensions[EXTENSION].registry
        registry.wait_for(lambda s: s.is_master and NAME in s.instances, timeout_s=10.0)
        assert heartbeat(client, 0.3).status_code == 200
        received_at = registry.snapshot().instances[NAME].load.received_at
        assert route(client)["prefill"] == NAME

        for _ in range(4):                 # 2 s of refused reports, past max_age
            r = heartbeat(client, -0.5)   # the instance keeps contradicting its last load
            assert r.status_code == 400
            clock.advance(0.5)
        stale = route(client)
        assert stale["prefill"] is None
        assert stale["excluded"][NAME] == f"load report 2.0 s old (max_load_age_s {max_age:g})"
        assert registry.snapshot().instances[NAME].load.received_at == received_at
        m = scrape(client)
        assert m.value("kvsvc_heartbeats_total", outcome="invalid_load") >= 1


def test_usage_above_one_is_clamped_counted_and_logged_once(etcd_server, etcd, caplog):
    """vllm_sidecar's sum over a multi-engine vLLM (1.3) is accepted as 1.0, not refused."""
    put_instance(etcd)
    caplog.set_level(logging.INFO, logger="kvsvc.cluster.registry")
    with running(etcd_server) as app:
        client = app.test_client()
        registry = app.extensions[EXTENSION].registry
        registry.wait_for(lambda s: NAME in s.instances, timeout_s=10.0)
        for usage in (1.3, 2, 0.5, 1.7):
            r = heartbeat(client, usage)
            assert (r.status_code, r.get_json()) == (200, {"ok": True}), usage
            expected = min(float(usage), 1.0)
            assert registry.snapshot().instances[NAME].load.gpu_cache_usage_perc == expected
        assert route(client)["prefill"] == NAME
        m = scrape(client)
        assert m.value("kvsvc_load_clamped_total", instance=NAME, source="heartbeat") == 3
        assert m.value("kvsvc_heartbeats_total", outcome="ok") == 4
        assert m.value("kvsvc_heartbeats_total", outcome="invalid_load") is None
    warned = [r.getMessage() for r in caplog.records if "above 1" in r.getMessage()]
    assert warned == [f"registry: {NAME} reports gpu_cache_usage_perc 1.3 (heartbeat), above 1: "
                      "used as 1.0 (a sidecar summing several engines?); further ones only "
                      "counted in kvsvc_load_clamped_total"]
