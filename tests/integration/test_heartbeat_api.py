"""``POST /v1/internal/heartbeat`` (§9) through the Flask test client: 200 records the load at
once, 400 for a body of the wrong shape (``malformed``) or a load the registry refuses
(``invalid_load``, the registry's message) changes nothing, 401 bad token, 409 unknown instance
or stale incarnation, 503 without a registry. The registry is the real one over a real etcd."""

from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Iterator, Optional

import flask
import pytest

from kvsvc.clock import MONOTONIC, Clock, VirtualClock
from kvsvc.http.app import create_app
from kvsvc.http.body import parse_heartbeat
from kvsvc.http.errors import status_of
from kvsvc.http.extensions import EXTENSION
from kvsvc.http.internal import HEARTBEAT_PATH, ROUTE_PATH
from kvsvc.settings import load_service_settings
from kvsvc.errors import BadRequest, InvalidHeartbeat
from kvsvc.cluster.etcd import EtcdClient
from tests.support.metrics import scrape

TOKEN = "hb-token"
HEADERS = {"X-Internal-Token": TOKEN}
NAME = "127.0.0.1:7001"
INCARNATION = "inc-aaaa"




@contextmanager
def running_app(etcd_addr: str = "", token: Optional[str] = TOKEN,
                clock: Clock = MONOTONIC) -> Iterator[flask.Flask]:
    settings = load_service_settings(internal_api_token=token, etcd_addr=etcd_addr,
                                     host="127.0.0.1", port=18888)
    app = create_app(settings, None, clock)
    svc = app.extensions[EXTENSION]
    svc.start(timeout_s=10.0)
    try:
        yield app
    finally:
        svc.close(timeout_s=10.0)


def body(name: str = NAME, incarnation: Optional[str] = INCARNATION, waiting: object = 3,
         usage: object = 0.25, **extra: object) -> dict:
    doc = {"name": name, "incarnation_id": incarnation,
           "load_metrics": {"waiting_requests_num": waiting, "gpu_cache_usage_perc": usage},
           "latency_metrics": {"recent_max_ttft": 12, "recent_max_tbt": 3}}
    doc.update(extra)
    return doc


def post(client, doc: object, headers: Optional[dict] = None):
    data = doc if isinstance(doc, (bytes, str)) else json.dumps(doc)
    return client.post(HEARTBEAT_PATH, data=data, headers=HEADERS if headers is None else headers,
                       content_type="application/json")


@pytest.fixture
def registered(etcd_server) -> Iterator[flask.Flask]:
    """A running app whose registry holds NAME (incarnation INCARNATION) and NAME2 without an
    incarnation; the keys are written directly, held by a long lease. The service runs on a
    :class:`~kvsvc.clock.VirtualClock` (``service.clock``): its timers move only when a test
    advances it."""
    client = EtcdClient(etcd_server.addr)
    try:
        lease = client.grant_lease(60)
        client.put(f"XLLM:PREFILL:{NAME}", json.dumps({
            "name": NAME, "rpc_address": NAME, "type": 1, "incarnation_id": INCARNATION,
            "register_ts_ms": 1000, "dp_size": 1, "backend_type": "xllm"}), lease_id=lease)
        client.put("XLLM:DECODE:127.0.0.1:7002", json.dumps({
            "name": "127.0.0.1:7002", "type": 2, "register_ts_ms": 2000}), lease_id=lease)
        with running_app(etcd_server.addr, clock=VirtualClock()) as app:
            registry = app.extensions[EXTENSION].registry
            registry.wait_for(lambda s: len(s.instances) == 2, timeout_s=10.0)
            yield app
    finally:
        client.close()


def load_of(app: flask.Flask, name: str = NAME):
    inst = app.extensions[EXTENSION].registry.snapshot().instances[name]
    return None if inst.load is None else (inst.load.waiting_requests_num,
                                           inst.load.gpu_cache_usage_perc)


def test_heartbeat_200_records_the_load_at_once(registered):
    client = registered.test_client()
    r = post(client, body(waiting=3, usage=0.25))
    assert (r.status_code, r.get_json()) == (200, {"ok": True})
    assert load_of(registered) == (3, 0.25)
    r = post(client, body(waiting=0, usage=1))
    assert (r.status_code, r.get_json()) == (200, {"ok": True})
    assert load_of(registered) == (0, 1.0)
    # No incarnation on either side: accepted (cannot be judged).
    r = post(client, body(name="127.0.0.1:7002", incarnation=None, waiting=7, usage=0.5))
    assert (r.status_code, r.get_json()) == (200, {"ok": True})
    assert load_of(registered, "127.0.0.1:7002") == (7, 0.5)


def test_heartbeat_409_unknown_instance_and_stale_incarnation(registered):
    client = registered.test_client()
    r = post(client, body(name="127.0.0.1:9999"))
    assert r.status_code == 409
    assert r.get_json() == {"error": "unknown instance '127.0.0.1:9999'"}
    r = post(client, body(incarnation="inc-old"))
    assert r.status_code == 409
    assert r.get_json() == {"error": f"stale incarnation 'inc-old' for '{NAME}' "
                                     f"(registered '{INCARNATION}')"}
    assert load_of(registered) is None


WAITING_ERROR = "load_metrics.waiting_requests_num: must be an integer in [0, 2147483647]"
USAGE_ERROR = "load_metrics.gpu_cache_usage_perc: must be a number in [0, 1]"
#: Bodies of the wrong shape: refused by the HTTP parser, counted ``malformed``.
MALFORMED = [
    (b"{not json", "body is not valid JSON"),
    ([1, 2], "body must be a JSON object"),
    ({"incarnation_id": INCARNATION, "load_metrics": {}}, "name: must be a non-empty string"),
    (body(name=""), "name: must be a non-empty string"),
    (body(incarnation=5), "incarnation_id: must be a string"),
    ({"name": NAME, "incarnation_id": INCARNATION}, "load_metrics: must be an object"),
    (body(waiting=True), WAITING_ERROR),
    (body(waiting="3"), WAITING_ERROR),
    (body(waiting=None), WAITING_ERROR),
    ({"name": NAME, "load_metrics": {"gpu_cache_usage_perc": 0.5}}, WAITING_ERROR),
    (body(usage=None), USAGE_ERROR),
    (body(usage="0.5"), USAGE_ERROR),
    (body(usage=False), USAGE_ERROR),
    (body(latency_metrics=[1]), "latency_metrics: must be an object"),
]
#: Loads of the right JSON type the registry refuses (``check_load``): counted ``invalid_load``.
INVALID_LOAD = [
    (-1, 0.5), (1.5, 0.5),
    # Would reach the Prometheus gauge and the CAR queue term as a float: OverflowError.
    (10**400, 0.5), (2**31, 0.5),
    (2, -0.1), (2, float("nan")), (2, float("inf")), (2, 10**400),
]


def test_heartbeat_400_malformed_changes_nothing(registered):
    # One etcd and service for every case (each costs a second to start).
    client = registered.test_client()
    assert post(client, body(waiting=2, usage=0.5)).status_code == 200
    for doc, error in MALFORMED:
        r = post(client, doc)
        assert (r.status_code, r.get_json()) == (400, {"error": error}), doc
        assert load_of(registered) == (2, 0.5)
    m = scrape(client)
    assert m.value("kvsvc_heartbeats_total", outcome="malformed") == len(MALFORMED)
    assert m.value("kvsvc_heartbeats_total", outcome="invalid_load") is None


def test_heartbeat_out_of_range_load_is_the_registrys_400_invalid_load(registered):
    """The load's ranges are checked once, by the registry: over HTTP its message comes back as
    a 400 and the heartbeat counts as ``invalid_load``."""
    client = registered.test_client()
    registry = registered.extensions[EXTENSION].registry
    assert post(client, body(waiting=2, usage=0.5)).status_code == 200
    for waiting, usage in INVALID_LOAD:
        with pytest.raises(InvalidHeartbeat) as err:
            registry.heartbeat(NAME, INCARNATION, waiting, usage)
        r = post(client, json.dumps(body(waiting=waiting, usage=usage)))
        assert (r.status_code, r.get_json()) == (400, {"error": err.value.message}), (
            waiting, usage)
        assert load_of(registered) == (2, 0.5)
    r = post(client, body(waiting=-1))
    assert r.get_json() == {
        "error": "load_metrics.waiting_requests_num: must be an integer in [0, 2147483647]"}
    m = scrape(client)
    assert m.value("kvsvc_heartbeats_total", outcome="invalid_load") == len(INVALID_LOAD) + 1
    assert m.value("kvsvc_heartbeats_total", outcome="malformed") is None
    assert m.value("kvsvc_heartbeats_total", outcome="ok") == 1


def test_heartbeat_401_without_the_token_changes_nothing(registered):
    client = registered.test_client()
    for headers in ({}, {"X-Internal-Token": "wrong"}):
        r = post(client, body(), headers=headers)
        assert (r.status_code, r.get_json()) == (401, {"error": "missing or wrong X-Internal-Token"})
    assert load_of(registered) is None


def test_heartbeat_without_registry_is_503():
    with running_app("") as app:
        r = post(app.test_client(), body())
        assert (r.status_code, r.get_json()) == (
            503, {"error": "no instance registry configured (--etcd_addr is empty)"})
        assert post(app.test_client(), b"[").status_code == 400


def test_parse_heartbeat_checks_the_shape_only():
    hb = parse_heartbeat(json.dumps(body(extra_field=1, usage=0)).encode())
    assert (hb.name, hb.incarnation_id, hb.waiting_requests_num, hb.gpu_cache_usage_perc) == (
        NAME, INCARNATION, 3, 0)
    assert parse_heartbeat(json.dumps(body(incarnation="")).encode()).incarnation_id is None
    # Numbers out of range (NaN included) are the registry's to refuse, not the parser's.
    hb = parse_heartbeat(b'{"name": "a:1", "load_metrics": {"waiting_requests_num": -1.5, '
                         b'"gpu_cache_usage_perc": NaN}}')
    assert hb.waiting_requests_num == -1.5 and hb.gpu_cache_usage_perc != hb.gpu_cache_usage_perc
    with pytest.raises(BadRequest) as info:
        parse_heartbeat(b'{"name": "a:1", "load_metrics": {"waiting_requests_num": 0, '
                        b'"gpu_cache_usage_perc": "NaN"}}')
    assert (status_of(info.value), info.value.message) == (400, USAGE_ERROR)


# -- refused heartbeats are said (issue 13: silent rejections) ---------------------------------

REJECTION_LOGGER = "kvsvc.cluster.rejections"
UNKNOWN = "127.0.0.1:9999"

#: case -> (headers, body, status, who the log names, reason, the likely cause's words).
REFUSALS = {
    "wrong token": ({"X-Internal-Token": "not-the-token"}, body(), 401,
                    f"a sender that claims to be {NAME}", "token_mismatch",
                    "token mismatch: the sender's X-Internal-Token differs from "
                    "--internal_api_token"),
    "missing token": ({}, body(), 401, f"a sender that claims to be {NAME}", "missing_token",
                      "missing X-Internal-Token"),
    "unknown instance": (HEADERS, body(name=UNKNOWN), 409, UNKNOWN, "unknown_instance",
                         "unknown instance: registered under another --etcd_namespace, or not "
                         "registered yet?"),
    "stale incarnation": (HEADERS, body(incarnation="inc-old"), 409, NAME, "stale_incarnation",
                          "stale incarnation: a replaced engine process is still sending"),
}


def rejection_lines(caplog, level: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == REJECTION_LOGGER and r.levelname == level]


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_heartbeats_log_one_warning_a_reminder_a_minute_and_info_when_accepted(
        case, registered, etcd_server, caplog):
    """One WARNING naming the sender and the likely cause when refusals start, none more
    within the minute (the service's virtual clock), a reminder with the count after it, one INFO when
    accepted again; ``/ready`` and ``/v1/internal/route`` list the refused sender meanwhile."""
    headers, doc, status, who, reason, cause = REFUSALS[case]
    name = doc["name"]
    svc = registered.extensions[EXTENSION]
    clock = svc.clock   # the service's: the ledger's reminders are judged on it
    client = registered.test_client()
    caplog.set_level("INFO", logger=REJECTION_LOGGER)

    for _ in range(3):
        assert post(client, doc, headers).status_code == status
        clock.advance(10.0)
    warnings = rejection_lines(caplog, "WARNING")
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"heartbeats from {who} refused: {cause}")

    for answer in (client.get("/ready?streams=synchronized"),
                   client.post(ROUTE_PATH, headers=HEADERS, json={"token_ids": [1, 2, 3]})):
        assert answer.status_code == 200, answer.get_json()
        listed = answer.get_json()["heartbeat_rejections"]
        assert list(listed) == [name]
        assert (listed[name]["reason"], listed[name]["count"], listed[name]["since_s"],
                listed[name]["claimed"]) == (reason, 3, 30.0, status == 401)
        assert listed[name]["cause"].startswith(cause)

    clock.advance(31.0)   # 61 s after the first refusal
    assert post(client, doc, headers).status_code == status
    warnings = rejection_lines(caplog, "WARNING")
    assert len(warnings) == 2, warnings
    assert warnings[1].startswith(f"heartbeats from {who} still refused: {cause}")
    assert "4 refused since the first 61 s ago" in warnings[1]
    assert post(client, doc, headers).status_code == status
    assert len(rejection_lines(caplog, "WARNING")) == 2

    if case == "unknown instance":   # it registers (as it would under the right namespace)
        etcd = EtcdClient(etcd_server.addr)
        try:
            etcd.put(f"XLLM:PREFILL:{UNKNOWN}", json.dumps({
                "name": UNKNOWN, "type": 1, "incarnation_id": INCARNATION,
                "register_ts_ms": 3000}), lease_id=etcd.grant_lease(60))
        finally:
            etcd.close()
        svc.registry.wait_for(lambda s: UNKNOWN in s.instances, timeout_s=10.0)
    assert rejection_lines(caplog, "INFO") == []
    assert post(client, body(name=name)).status_code == 200
    infos = rejection_lines(caplog, "INFO")
    assert infos == [f"heartbeats from {name} accepted again, after 5 refused over 61.0 s "
                     f"({cause.split(':')[0]})"]
    assert client.get("/ready?streams=synchronized").get_json()["heartbeat_rejections"] == {}
    assert post(client, body(name=name)).status_code == 200
    assert len(rejection_lines(caplog, "INFO")) == 1


def test_refused_heartbeat_without_a_readable_name_is_its_remote_address(registered, caplog):
    caplog.set_level("WARNING", logger=REJECTION_LOGGER)
    client = registered.test_client()
    assert post(client, b"{not json", {"X-Internal-Token": "nope"}).status_code == 401
    # A name that could forge log lines is not shown either.
    assert post(client, body(name="x\nFAKE LINE"), {"X-Internal-Token": "nope"}).status_code == 401
    (line,) = rejection_lines(caplog, "WARNING")
    assert line.startswith("heartbeats from unidentified sender 127.0.0.1 refused: token mismatch")
    listed = client.get("/ready?streams=synchronized").get_json()["heartbeat_rejections"]
    assert listed["unidentified sender 127.0.0.1"]["count"] == 2


def test_unknown_instance_warning_names_this_kvsvcs_namespace(etcd_server, caplog):
    """The likely cause with the namespace this kvsvc reads, for the operator to compare."""
    caplog.set_level("WARNING", logger=REJECTION_LOGGER)
    settings = load_service_settings(internal_api_token=TOKEN, etcd_addr=etcd_server.addr,
                                     etcd_namespace="team-a", host="127.0.0.1", port=18888)
    app = create_app(settings, None)
    svc = app.extensions[EXTENSION]
    svc.start(timeout_s=10.0)
    try:
        assert post(app.test_client(), body()).status_code == 409
    finally:
        svc.close(timeout_s=10.0)
    (line,) = rejection_lines(caplog, "WARNING")
    assert line == (f"heartbeats from {NAME} refused: unknown instance: registered under another "
                    "--etcd_namespace, or not registered yet? [this kvsvc reads --etcd_namespace "
                    "'team-a']; its load is not recorded")
