"""Registry (§9) against a real etcd: join, refresh, replacement, DP size change, malformed and
unknown fields, lease loss with the /health probe (LEASE_LOST -> SUSPECT -> removed, with
timings), heartbeats, an etcd restart while running, and the start/close contract of its three
threads (a thread blocked on a paused etcd or a silent /health makes close() raise, after the
other threads were closed)."""

from __future__ import annotations

import http.server
import json
import logging
import socket
import threading
import time
from typing import Iterator

import pytest

from kvsvc.clock import VirtualClock
from kvsvc.cluster.etcd import EtcdClient
from kvsvc.http.errors import status_of
from kvsvc.cluster.model import Instance, InstanceState, InstanceType, LoadMetrics, RegistrySettings
from kvsvc.cluster.registry import Registry
from kvsvc.errors import (
    ConfigError,
    InvalidHeartbeat,
    LifecycleError,
    StaleIncarnation,
    UnknownInstance,
)
from tests.support.util import free_port, wait_for
from tests.support.registry import GRACE_S, REMOVAL_S, settings


def kvsvc_threads() -> list[str]:
    """Names of the live kvsvc threads (``kvsvc-...``), sorted."""
    return sorted(t.name for t in threading.enumerate()
                  if t.name.startswith("kvsvc-") and t.is_alive())


@pytest.fixture
def registry(etcd_server) -> Iterator[Registry]:
    reg = Registry(settings(etcd_server.addr))
    reg.start()
    yield reg
    reg.close()


@pytest.fixture
def vregistry(etcd_server, caplog) -> Iterator[tuple[Registry, VirtualClock]]:
    """A started registry whose §9 timers run on a virtual clock (etcd, its leases and the
    /health probes stay real), and that clock; INFO log lines of the registry captured."""
    caplog.set_level(logging.INFO, logger="kvsvc.cluster.registry")
    clock = VirtualClock()
    reg = Registry(settings(etcd_server.addr), clock=clock)
    reg.start()
    yield reg, clock
    reg.close()


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        status = 200 if self.path == "/health" else 404
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def health() -> Iterator[str]:
    """A ``/health`` server on 127.0.0.1; yields its ``host:port`` (the instance name)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              name="test-health")
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def key(name: str, type_: str = "PREFILL") -> str:
    return f"/t/XLLM:{type_}:{name}"


def value(name: str, type_: int = 1, **fields) -> str:
    return json.dumps({"name": name, "type": type_, **fields})


def state_of(reg: Registry, name: str):
    inst = reg.snapshot().instances.get(name)
    return inst.state if inst else None


def test_settings_rejected():
    # etcd_addr, namespace, suspect_removal_s and max_load_age_s come from the settings table,
    # which checks them once (tests/unit/test_settings.py); the registry's own timings here.
    with pytest.raises(ConfigError) as err:
        RegistrySettings(etcd_addr="127.0.0.1:2379", lease_lost_grace_s=0)
    assert err.value.field == "lease_lost_grace_s"
    with pytest.raises(ConfigError) as err:
        RegistrySettings(etcd_addr="127.0.0.1:2379", master_lease_ttl_s=0)
    assert err.value.field == "master_lease_ttl_s"


def test_join_parsed_fields_and_unknown_fields_ignored(registry, etcd):
    etcd.put(key("10.0.0.1:8000"), value("10.0.0.1:8000", 1, incarnation_id="inc-1",
                                         register_ts_ms=1700000000123, dp_size=2,
                                         backend_type="xllm", rpc_address="10.0.0.1:9000",
                                         cluster_ids=[1, 2], future_field={"x": 1}))
    etcd.put(key("10.0.0.2:8000", "DEFAULT"), "{}")
    snap = registry.wait_for(lambda s: len(s.instances) == 2, 5)
    assert snap.fresh is True
    assert snap.instances["10.0.0.1:8000"] == Instance(
        name="10.0.0.1:8000", type=InstanceType.PREFILL, role=InstanceType.PREFILL,
        incarnation_id="inc-1", register_ts_ms=1700000000123, dp_size=2, backend_type="xllm",
        rpc_address="10.0.0.1:9000", state=InstanceState.ACTIVE, load=None)
    assert snap.instances["10.0.0.2:8000"] == Instance(
        name="10.0.0.2:8000", type=InstanceType.DEFAULT, role=InstanceType.DEFAULT,
        incarnation_id=None, register_ts_ms=None, dp_size=1, backend_type="xllm",
        rpc_address=None, state=InstanceState.ACTIVE, load=None)
    # Keys outside the namespace are not ours.
    etcd.put("XLLM:PREFILL:10.0.0.9:8000", "{}")
    etcd.put(key("10.0.0.3:8000", "DECODE"), value("10.0.0.3:8000", 2, dp_size=0))
    snap = registry.wait_for(lambda s: "10.0.0.3:8000" in s.instances, 5)
    assert sorted(snap.instances) == ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
    assert snap.instances["10.0.0.3:8000"].dp_size == 1
    assert snap.instances["10.0.0.3:8000"].role is InstanceType.DECODE


def test_refresh_same_incarnation_dp_change_and_replacement(registry, etcd):
    name = "10.0.0.1:8000"
    etcd.put(key(name), value(name, incarnation_id="a", dp_size=1, register_ts_ms=1))
    registry.wait_for(lambda s: name in s.instances, 5)
    registry.heartbeat(name, "a", 7, 0.25)
    load = registry.snapshot().instances[name].load
    assert (load.waiting_requests_num, load.gpu_cache_usage_perc) == (7, 0.25)

    gen = registry.snapshot().generation
    etcd.put(key(name), value(name, incarnation_id="a", dp_size=1, register_ts_ms=1))
    # A refresh with identical content changes nothing visible; load kept.
    etcd.put(key(name), value(name, incarnation_id="a", dp_size=4, register_ts_ms=1))
    snap = registry.wait_for(lambda s: s.instances[name].dp_size == 4, 5)
    assert snap.generation > gen
    assert snap.instances[name].incarnation_id == "a"
    assert snap.instances[name].load == load
    assert snap.instances[name].state is InstanceState.ACTIVE

    etcd.put(key(name), value(name, incarnation_id="b", dp_size=4, register_ts_ms=2))
    snap = registry.wait_for(lambda s: s.instances[name].incarnation_id == "b", 5)
    assert snap.instances[name].load is None   # the old process's load is dropped
    assert snap.instances[name].register_ts_ms == 2
    with pytest.raises(StaleIncarnation) as err:
        registry.heartbeat(name, "a", 1, 0.1)
    assert status_of(err.value) == 409


def test_replacement_without_incarnation_by_register_ts(registry, etcd):
    name = "10.0.0.1:8000"
    etcd.put(key(name), value(name, register_ts_ms=100))
    registry.wait_for(lambda s: name in s.instances, 5)
    registry.heartbeat(name, None, 3, 0.5)
    etcd.put(key(name), value(name, register_ts_ms=200))
    snap = registry.wait_for(lambda s: s.instances[name].register_ts_ms == 200, 5)
    assert snap.instances[name].load is None


def test_malformed_registrations_ignored_others_unaffected(registry, etcd, caplog):
    good = "10.0.0.1:8000"
    etcd.put(key(good), value(good))
    etcd.put(key("10.0.0.2:8000"), "not json")
    etcd.put(key("10.0.0.3:8000"), value("10.0.0.3:8000", type_=2))       # type differs
    etcd.put(key("10.0.0.4:8000"), value("10.0.0.99:8000"))               # name differs
    etcd.put(key("nohostport"), "{}")
    etcd.put(key("10.0.0.5:8000"), json.dumps({"dp_size": "2"}))           # wrong type
    etcd.put(key("10.0.0.6:8000"), "[1, 2]")
    last = "10.0.0.7:8000"
    etcd.put(key(last, "DEFAULT"), value(last, 0))
    snap = registry.wait_for(lambda s: last in s.instances, 5)
    assert sorted(snap.instances) == [good, last]
    # Re-lists (1 s period) must not log the same bad revision again: wait for two of them.
    gen = registry.snapshot().generation
    for n in (1, 2):
        before = registry.last_listed_at()
        wait_for(lambda: (registry.last_listed_at() or 0.0) > (before or 0.0), timeout_s=5.0,
                 what=f"re-list {n}")
    # A malformed PUT over a good registration drops that instance, nothing else.
    etcd.put(key(good), "{broken")
    snap = registry.wait_for(lambda s: good not in s.instances, 5)
    assert sorted(snap.instances) == [last]
    assert snap.generation > gen
    with pytest.raises(UnknownInstance):
        registry.heartbeat(good, None, 1, 0.1)
    logged = [r.getMessage() for r in caplog.records if "malformed registration" in r.getMessage()]
    assert len(logged) == 7


def test_load_value_no_float_holds_is_malformed_and_a_bug_does_not_end_the_registry(
        registry, etcd, monkeypatch, caplog):
    """A LOADMETRICS value with a 400-digit usage (no float holds it) is malformed, not a crash
    of the etcd thread; and any other unexpected error on that thread (here a list that raises
    something that is not an etcd error) is logged, the registry goes stale, re-lists and
    carries on."""
    name = "10.0.0.1:8000"
    etcd.put(key(name), value(name))
    registry.wait_for(lambda s: name in s.instances, 5)
    etcd.put(f"/t/XLLM:LOADMETRICS:{name}",
             '{"waiting_requests_num": 1, "gpu_cache_usage_perc": 1' + "0" * 400 + "}")
    wait_for(lambda: any("malformed load" in r.getMessage() for r in caplog.records),
             timeout_s=5, what="the load value logged as malformed")
    assert registry.snapshot().fresh
    real = EtcdClient.list_prefix
    calls = []

    def broken_once(self, prefix):
        if threading.current_thread().name == "kvsvc-registry-etcd":
            calls.append(prefix)
            if len(calls) == 1:
                raise RuntimeError("injected bug")
        return real(self, prefix)

    monkeypatch.setattr(EtcdClient, "list_prefix", broken_once)
    registry.wait_for(lambda s: not s.fresh, 10)     # the next re-list hits the bug
    other = "10.0.0.2:8000"
    etcd.put(key(other), value(other))
    snap = registry.wait_for(lambda s: s.fresh and other in s.instances, 10)
    assert sorted(snap.instances) == [name, other] and len(calls) >= 2
    assert any("registry: internal error" in r.getMessage() for r in caplog.records)


def test_same_name_under_two_types_ignored(registry, etcd):
    name = "10.0.0.1:8000"
    etcd.put(key(name, "PREFILL"), value(name, 1))
    registry.wait_for(lambda s: name in s.instances, 5)
    etcd.put(key(name, "DECODE"), value(name, 2))
    registry.wait_for(lambda s: name not in s.instances, 5)
    etcd.delete(key(name, "DECODE"))
    snap = registry.wait_for(lambda s: name in s.instances, 5)
    assert snap.instances[name].type is InstanceType.PREFILL


def test_lease_expiry_probe_ok_lease_lost_suspect_removed(vregistry, etcd, health, caplog):
    """etcd expires the lease (real, TTL 1 s): the probe answers, LEASE_LOST; then SUSPECT
    after the grace and removed after the removal time, both on the virtual clock (the log
    lines give the exact durations; real-time bounds raced a loaded machine)."""
    registry, clock = vregistry
    lease = etcd.grant_lease(1)
    etcd.put(key(health), value(health, incarnation_id="x"), lease_id=lease)
    registry.wait_for(lambda s: health in s.instances, 5)
    t0 = time.monotonic()   # the lease is never refreshed: etcd deletes the key after ~1 s
    registry.wait_for(lambda s: s.instances[health].state is InstanceState.LEASE_LOST, 5)
    assert 0.5 <= time.monotonic() - t0   # not before etcd's TTL
    inst = registry.snapshot().instances[health]
    assert inst.load is None and inst.incarnation_id == "x"
    clock.advance(GRACE_S)
    registry.wait_for(lambda s: s.instances[health].state is InstanceState.SUSPECT, 5)
    assert f"{health} LEASE_LOST -> SUSPECT (no heartbeat for {GRACE_S:.1f}s)" in caplog.text
    clock.advance(REMOVAL_S)
    registry.wait_for(lambda s: health not in s.instances, 5)
    assert f"{health} removed (SUSPECT for {REMOVAL_S:.1f}s)" in caplog.text


def test_heartbeat_during_lease_lost_delays_suspect(vregistry, etcd, health, caplog):
    """Heartbeats keep a LEASE_LOST instance from becoming SUSPECT; it becomes SUSPECT one
    grace period after the last one. The §9 timers run on a virtual clock, so the heartbeats
    are 0.25 s apart however slow the machine (paced in real time they raced the 0.5 s grace),
    and the log line gives the exact time since the last heartbeat."""
    registry, clock = vregistry
    etcd.put(key(health), value(health, incarnation_id="x"))
    registry.wait_for(lambda s: health in s.instances, 5)
    etcd.delete(key(health))
    registry.wait_for(lambda s: s.instances[health].state is InstanceState.LEASE_LOST, 5)
    # A heartbeat every 0.25 s for 1 s, twice the grace (0.5 s): still LEASE_LOST.
    for _ in range(4):
        registry.heartbeat(health, "x", 2, 0.5)
        clock.advance(0.25)
        assert state_of(registry, health) is InstanceState.LEASE_LOST
    clock.advance(GRACE_S - 0.25)                    # one grace after the last heartbeat
    registry.wait_for(lambda s: s.instances[health].state is InstanceState.SUSPECT, 5)
    assert f"{health} LEASE_LOST -> SUSPECT (no heartbeat for {GRACE_S:.1f}s)" in caplog.text
    assert registry.snapshot().instances[health].load.waiting_requests_num == 2


def test_probe_failure_suspect_then_removed(vregistry, etcd, caplog):
    """A deleted key whose /health probe fails is SUSPECT at once, with no timer (the virtual
    clock has not moved), and removed after the removal time."""
    registry, clock = vregistry
    name = f"127.0.0.1:{free_port()}"   # nothing listens: /health fails
    etcd.put(key(name), value(name))
    registry.wait_for(lambda s: name in s.instances, 5)
    etcd.delete(key(name))
    registry.wait_for(lambda s: s.instances[name].state is InstanceState.SUSPECT, 5)
    assert f"{name} ACTIVE -> SUSPECT (lease gone, /health failed)" in caplog.text
    clock.advance(REMOVAL_S)
    registry.wait_for(lambda s: name not in s.instances, 5)
    assert f"{name} removed (SUSPECT for {REMOVAL_S:.1f}s)" in caplog.text


def test_put_during_lease_lost_and_suspect_brings_back_active(registry, etcd, health):
    etcd.put(key(health), value(health, incarnation_id="x"))
    registry.wait_for(lambda s: health in s.instances, 5)
    registry.heartbeat(health, "x", 4, 0.5)
    etcd.delete(key(health))
    registry.wait_for(lambda s: s.instances[health].state is InstanceState.LEASE_LOST, 5)
    etcd.put(key(health), value(health, incarnation_id="x"))
    snap = registry.wait_for(lambda s: s.instances[health].state is InstanceState.ACTIVE, 5)
    assert snap.instances[health].load.waiting_requests_num == 4   # same incarnation
    # From SUSPECT too.
    etcd.delete(key(health))
    registry.wait_for(lambda s: s.instances[health].state is InstanceState.SUSPECT, 5)
    etcd.put(key(health), value(health, incarnation_id="x"))
    registry.wait_for(lambda s: s.instances[health].state is InstanceState.ACTIVE, 5)


def test_heartbeats(registry, etcd):
    name = "10.0.0.1:8000"
    etcd.put(key(name), value(name, incarnation_id="a"))
    registry.wait_for(lambda s: name in s.instances, 5)
    before = time.monotonic()
    registry.heartbeat(name, "a", 3, 0.5)
    load = registry.snapshot().instances[name].load
    assert isinstance(load, LoadMetrics)
    assert (load.waiting_requests_num, load.gpu_cache_usage_perc) == (3, 0.5)
    assert before <= load.received_at <= time.monotonic()
    registry.heartbeat(name, None, 0, 0)         # no incarnation: accepted
    assert registry.snapshot().instances[name].load.waiting_requests_num == 0
    with pytest.raises(UnknownInstance) as err:
        registry.heartbeat("10.0.0.9:8000", "a", 1, 0.1)
    assert status_of(err.value) == 409
    with pytest.raises(StaleIncarnation) as err:
        registry.heartbeat(name, "old", 1, 0.1)
    assert status_of(err.value) == 409
    # (1, 1.5) is clamped, not refused (tests/integration/test_load_age.py).
    for bad in ((-1, 0.1), (1, -0.5), (True, 0.1), (1, "0.1"), (1.0, 0.1), (2**31, 0.1),
                (10**400, 0.1), (1, 10**400), (1, float("inf"))):   # an int no float can hold: refused, no crash
        with pytest.raises(InvalidHeartbeat) as err:
            registry.heartbeat(name, "a", *bad)
        assert status_of(err.value) == 400
    assert registry.snapshot().instances[name].load.waiting_requests_num == 0


@pytest.mark.etcd_fresh
def test_etcd_down_at_start_then_up(etcd_server):
    etcd_server.stop()
    reg = Registry(settings(etcd_server.addr))
    reg.start()
    try:
        snap = reg.snapshot()
        assert (snap.fresh, len(snap.instances)) == (False, 0)
        etcd_server.start()
        reg.wait_for(lambda s: s.fresh, 10)
    finally:
        reg.close()


@pytest.mark.etcd_fresh
def test_etcd_restart_keeps_snapshot_then_relists(registry, etcd_server, etcd):
    names = ["10.0.0.1:8000", "10.0.0.2:8000"]
    for n in names:
        etcd.put(key(n), value(n, incarnation_id="i"))
    registry.wait_for(lambda s: len(s.instances) == 2, 5)
    registry.heartbeat(names[0], "i", 5, 0.5)
    before = registry.snapshot().instances
    etcd_server.stop()
    t_down = time.monotonic()
    snap = registry.wait_for(lambda s: not s.fresh, 10)
    print(f"etcd down -> not fresh {time.monotonic() - t_down:.3f}s")
    assert dict(snap.instances) == dict(before)
    etcd_server.start()
    t_up = time.monotonic()
    snap = registry.wait_for(lambda s: s.fresh, 10)
    print(f"etcd up -> fresh {time.monotonic() - t_up:.3f}s")
    assert dict(snap.instances) == dict(before)
    # The watch is re-established: a new key shows up, a deleted one is probed.
    etcd.put(key("10.0.0.3:8000"), value("10.0.0.3:8000"))
    snap = registry.wait_for(lambda s: "10.0.0.3:8000" in s.instances, 5)
    assert [snap.instances[n].state for n in names] == [InstanceState.ACTIVE] * 2


def test_mix_roles(registry, etcd):
    etcd.put(key("10.0.0.1:8000", "MIX"), value("10.0.0.1:8000", 3))
    snap = registry.wait_for(lambda s: "10.0.0.1:8000" in s.instances, 5)
    assert snap.instances["10.0.0.1:8000"].role is InstanceType.DECODE   # no decoder yet
    etcd.put(key("10.0.0.2:8000", "MIX"), value("10.0.0.2:8000", 3))
    snap = registry.wait_for(lambda s: "10.0.0.2:8000" in s.instances, 5)
    assert snap.instances["10.0.0.2:8000"].role is InstanceType.PREFILL
    etcd.put(key("10.0.0.3:8000", "MIX"), value("10.0.0.3:8000", 3))
    snap = registry.wait_for(lambda s: "10.0.0.3:8000" in s.instances, 5)
    assert snap.instances["10.0.0.3:8000"].role is InstanceType.PREFILL
    # The only decoder goes: the MIX prefill with the greatest name flips to DECODE.
    etcd.delete(key("10.0.0.1:8000", "MIX"))
    snap = registry.wait_for(lambda s: "10.0.0.1:8000" not in s.instances or
                             s.instances["10.0.0.1:8000"].state is InstanceState.SUSPECT, 5)
    assert {n: i.role for n, i in snap.instances.items() if i.state is not InstanceState.SUSPECT} \
        == {"10.0.0.2:8000": InstanceType.PREFILL, "10.0.0.3:8000": InstanceType.DECODE}


def test_heartbeat_errors_name_the_field(registry, etcd):
    name = "10.0.0.1:8000"
    etcd.put(key(name), value(name, incarnation_id="a"))
    registry.wait_for(lambda s: name in s.instances, 5)
    waiting = "load_metrics.waiting_requests_num: must be an integer in [0, 2147483647]"
    usage = ("load_metrics.gpu_cache_usage_perc: must be a finite number >= 0 (above 1 counts "
             "as 1)")
    for bad, message in (((-1, 0.1), waiting), ((2**31, 0.1), waiting), ((None, 0.1), waiting),
                         ((False, 0.1), waiting), ((1.0, 0.1), waiting), (("1", 0.1), waiting),
                         ((1, -0.1), usage), ((1, float("nan")), usage), ((1, None), usage),
                         ((1, True), usage), ((1, "0.5"), usage), ((1, float("inf")), usage)):
        with pytest.raises(InvalidHeartbeat) as err:
            registry.heartbeat(name, "a", *bad)
        assert (status_of(err.value), err.value.message) == (400, message), bad
    assert registry.snapshot().instances[name].load is None


# -- the start/close contract of the three threads ---------------------------------------------

def test_start_twice_raises_close_before_start_and_twice_are_no_ops(etcd_server):
    reg = Registry(settings(etcd_server.addr))
    reg.close()                     # never started: nothing to do
    assert kvsvc_threads() == []
    reg.start()
    try:
        assert kvsvc_threads() == ["kvsvc-election", "kvsvc-registry-etcd",
                                   "kvsvc-registry-timer"]
        with pytest.raises(LifecycleError, match="already started"):
            reg.start()
    finally:
        reg.close()
    assert kvsvc_threads() == []
    reg.close()                     # closed already: nothing to do
    reg.start()                     # and it starts again
    try:
        reg.wait_for(lambda s: s.fresh, 5)
    finally:
        reg.close()
    assert kvsvc_threads() == []


@pytest.mark.etcd_fresh
def test_close_raises_when_the_election_hangs_on_a_paused_etcd_and_closes_the_rest(etcd_server):
    # Requests of the election time out after 1 s (lease TTL 3 s); the re-list is far away, so
    # the etcd thread is only waiting on its watch queue when close() comes.
    reg = Registry(settings(etcd_server.addr, master_lease_ttl_s=3, relist_interval_s=30.0))
    reg.start()
    try:
        reg.wait_for(lambda s: s.is_master, 10)
        with etcd_server.paused():
            # The election thread revokes its lease in its teardown: that request hangs.
            with pytest.raises(LifecycleError, match="kvsvc-election: did not stop"):
                reg.close(timeout_s=0.5)
            assert kvsvc_threads() == ["kvsvc-election"]
            with pytest.raises(LifecycleError, match="already started"):
                reg.start()
    finally:
        reg.close(timeout_s=5.0)    # etcd answers again: the revoke ends, so does the thread
    assert kvsvc_threads() == []
    assert reg.snapshot().is_master is False


def test_close_raises_when_a_health_probe_hangs_and_closes_the_rest(etcd_server, etcd):
    with socket.socket() as silent:  # accepts connections (the kernel does), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        silent.settimeout(5.0)
        name = f"127.0.0.1:{silent.getsockname()[1]}"
        reg = Registry(settings(etcd_server.addr, health_probe_timeout_s=5.0))
        reg.start()
        try:
            etcd.put(key(name), value(name))
            reg.wait_for(lambda s: name in s.instances, 5)
            etcd.delete(key(name))
            conn, _ = silent.accept()   # the timer thread's probe is waiting for an answer
            with conn:
                with pytest.raises(LifecycleError, match="kvsvc-registry-timer: did not stop"):
                    reg.close(timeout_s=0.3)
                assert kvsvc_threads() == ["kvsvc-registry-timer"]
            # The connection closed: the probe fails at once, the thread ends.
        finally:
            reg.close(timeout_s=5.0)
    assert kvsvc_threads() == []
