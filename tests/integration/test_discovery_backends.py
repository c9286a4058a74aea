"""Discovery by backend (§8 ``discovery.backends`` / ``replay_modes``, §9): which instances get
streams, with which ``replay_mode``, what is logged and shown for the others; and a vLLM instance
registered the way xllm-service's ``vllm_sidecar`` registers one (``XLLM:DEFAULT:<host:port>``,
``type`` 0, ``backend_type`` ``"vllm"``, no ``dp_size``, held by a lease) on a real etcd.

The stream machine of history mode is not under test here: these tests stop at the
discovery/directory seam, asserting the :class:`~kvsvc.config.StreamConfig` the directory is
handed (a directory without a ZMQ context runs no stream thread)."""

from __future__ import annotations

import json
import logging

from kvsvc.cluster.discovery import Discovery, describe_backends
from kvsvc.cluster.etcd import EtcdClient
from kvsvc.cluster.model import InstanceType, parse_registration
from kvsvc.cluster.registry import Registry
from kvsvc.config import Backend, DiscoveryConfig, KvEventsConfig, ReplayMode
from kvsvc.directory import Directory
from kvsvc.streams.state import StreamId
from tests.support.discovery import DISC, SnapshotSource, ids, inst, plan
from tests.support.registry import settings as registry_settings

T = InstanceType
ALL = DiscoveryConfig(block_size=4, topic="kv", refresh_interval_ms=50,
                      backends=[Backend.XLLM, Backend.VLLM, Backend.SGLANG])

#: The value xllm-service's vllm_sidecar puts under ``XLLM:DEFAULT:<addr>`` (its
#: ``build_instance_meta``: these six fields, nothing else; no ``dp_size``).
SIDECAR_NAME = "10.0.0.7:8000"
SIDECAR_VALUE = {"name": SIDECAR_NAME, "rpc_address": SIDECAR_NAME, "type": 0,
                 "backend_type": "vllm", "incarnation_id": "vllm-3f9a0c1d2e4b",
                 "register_ts_ms": 1764590000123}


def modes(p) -> dict[tuple[str, int], str]:
    return {(sid.instance_name, sid.dp_rank): ps.config.replay_mode.value
            for sid, ps in sorted(p.streams.items())}


# -- the pure plan ---------------------------------------------------------------------------

def test_default_backends_subscribe_xllm_only_and_list_the_others():
    p = plan(inst("h:8000"), inst("h:8100", backend="vllm"), inst("h:8200", backend="sglang"),
             inst("h:8300", backend="trtllm"))
    assert modes(p) == {("h:8000", 0): "snapshot"}
    assert dict(p.other_backends) == {"h:8100": "vllm", "h:8200": "sglang",
                                      "h:8300": "trtllm"}
    assert dict(p.excluded) == {}


def test_listed_backends_get_streams_with_their_replay_mode():
    p = plan(inst("h:8000"), inst("h:8100", backend="vllm", dp=2), inst("h:8300", backend="sglang"),
             inst("h:8400", backend="trtllm"), disc=ALL)
    assert modes(p) == {("h:8000", 0): "snapshot", ("h:8100", 0): "history",
                        ("h:8100", 1): "history", ("h:8300", 0): "history"}
    assert {sid.instance_name: ps.backend for sid, ps in p.streams.items()} == {
        "h:8000": Backend.XLLM, "h:8100": Backend.VLLM, "h:8300": Backend.SGLANG}
    # The port rule is the same for every backend (§7h: DP rank r on port + r).
    s1 = p.streams[StreamId("h:8100", 1)].config
    assert (s1.endpoint, s1.replay_endpoint, s1.block_size, s1.topic) == (
        "tcp://h:18101", "tcp://h:38101", 4, "kv")
    assert dict(p.other_backends) == {"h:8400": "trtllm"}


def test_replay_modes_override_applies_to_that_backend_only():
    disc = DiscoveryConfig(block_size=4, backends=[Backend.XLLM, Backend.VLLM],
                           replay_modes={Backend.VLLM: ReplayMode.SNAPSHOT})
    p = plan(inst("h:8000"), inst("h:8100", backend="vllm"), disc=disc)
    assert modes(p) == {("h:8000", 0): "snapshot", ("h:8100", 0): "snapshot"}
    disc = DiscoveryConfig(block_size=4, backends=[Backend.VLLM],
                           replay_modes={Backend.XLLM: ReplayMode.HISTORY})
    p = plan(inst("h:8000"), inst("h:8100", backend="vllm"), disc=disc)
    assert modes(p) == {("h:8100", 0): "history"}
    assert dict(p.other_backends) == {"h:8000": "xllm"}


def test_backend_type_matches_without_regard_to_case_or_blanks():
    p = plan(inst("h:8100", backend="VLLM"), inst("h:8200", backend=" SGLang "), disc=ALL)
    assert modes(p) == {("h:8100", 0): "history", ("h:8200", 0): "history"}


def test_only_instances_that_would_be_subscribed_are_listed_as_other_backends():
    from kvsvc.cluster.model import InstanceState
    p = plan(inst("h:8100", T.DECODE, backend="vllm"),
             inst("h:8200", T.MIX, role=T.DECODE, backend="vllm"),
             inst("h:8300", backend="vllm", state=InstanceState.SUSPECT),
             inst("h:8400", T.PREFILL, backend="vllm"))
    assert ids(p) == []
    assert dict(p.other_backends) == {"h:8400": "vllm"}


def test_skipped_backends_take_part_in_no_collision():
    # h:8001 (vllm, not listed) would collide with h:8000's rank 1.
    p = plan(inst("h:8000", dp=2), inst("h:8001", backend="vllm"))
    assert ids(p) == [("h:8000", 0), ("h:8000", 1)]
    assert dict(p.excluded) == {}
    # Listed, it collides like any other instance.
    p = plan(inst("h:8000", dp=2), inst("h:8001", backend="vllm"), disc=ALL)
    assert ids(p) == []
    assert sorted(p.excluded) == ["h:8000", "h:8001"]


def test_describe_backends_in_configured_order():
    assert describe_backends(DISC) == "xllm (snapshot)"
    assert describe_backends(ALL) == "xllm (snapshot), vllm (history), sglang (history)"


def test_a_vllm_sidecar_registration_parses_as_a_one_rank_default_vllm_instance():
    reg = parse_registration(T.DEFAULT, SIDECAR_NAME, json.dumps(SIDECAR_VALUE).encode())
    assert (reg.type, reg.backend_type, reg.dp_size, reg.incarnation_id, reg.register_ts_ms,
            reg.rpc_address) == (T.DEFAULT, "vllm", 1, "vllm-3f9a0c1d2e4b", 1764590000123,
                                 SIDECAR_NAME)
    # Without the field (xllm's own engines) or with it null/empty: "xllm" (§9).
    for value in ({}, {"backend_type": None}, {"backend_type": ""}):
        doc = {"name": SIDECAR_NAME, "type": 0, **value}
        assert parse_registration(T.DEFAULT, SIDECAR_NAME,
                                  json.dumps(doc).encode()).backend_type == "xllm"


# -- the discovery/directory seam --------------------------------------------------------------

def unstarted_directory(disc: DiscoveryConfig) -> Directory:
    """A directory without a ZMQ context and not started: add_stream records the configuration
    and runs no thread, so the test sees exactly what discovery hands over."""
    return Directory(KvEventsConfig(discovery=disc))


def test_discovery_hands_history_mode_configs_to_the_directory_and_logs_skips_once(caplog):
    caplog.set_level(logging.INFO, logger="kvsvc.cluster.discovery")
    disc = DiscoveryConfig(block_size=4, topic="kv", backends=[Backend.XLLM, Backend.VLLM])
    directory = unstarted_directory(disc)
    source = SnapshotSource()
    discovery = Discovery(source, directory, disc, KvEventsConfig(discovery=disc))
    source.set(inst("h:8000"), inst("h:8100", backend="vllm", dp=2),
               inst("h:8200", backend="sglang"), inst("h:8300", backend="trtllm"))
    for _ in range(3):
        result = discovery.refresh()
    assert directory.replay_modes() == {
        StreamId("h:8000", 0): ReplayMode.SNAPSHOT, StreamId("h:8100", 0): ReplayMode.HISTORY,
        StreamId("h:8100", 1): ReplayMode.HISTORY}
    assert result.kept == 3
    assert dict(discovery.other_backends()) == {"h:8200": "sglang", "h:8300": "trtllm"}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "discovery: instance h:8200 not subscribed: backend_type 'sglang' is not in "
        "discovery.backends [xllm, vllm]; add \"sglang\" to discovery.backends in the "
        "kv_events_config_file to index it (replay mode history, §9), or to "
        "discovery.approximate_backends if it publishes no KV events (§14); until then "
        "routing counts it with 0 cache hits",
        "discovery: instance h:8300 not subscribed: kvsvc cannot index backend_type 'trtllm' "
        "(it indexes xllm, vllm, sglang); routing counts it with 0 cache hits",
    ]
    assert ("discovery: stream h:8100/dp1 added (identity inc-1, dp_size 2, backend vllm, "
            "replay_mode history, endpoints tcp://h:18101|tcp://h:38101)") in caplog.text
    # Registered again with another backend: one more line; gone: one INFO line.
    caplog.clear()
    source.set(inst("h:8000"), inst("h:8100", backend="vllm", dp=2),
               inst("h:8200", backend="SGLang"))
    discovery.refresh()
    discovery.refresh()
    assert [r.getMessage() for r in caplog.records] == [
        "discovery: instance h:8200 not subscribed: backend_type 'SGLang' is not in "
        "discovery.backends [xllm, vllm]; add \"sglang\" to discovery.backends in the "
        "kv_events_config_file to index it (replay mode history, §9), or to "
        "discovery.approximate_backends if it publishes no KV events (§14); until then "
        "routing counts it with 0 cache hits",
        "discovery: instance h:8300 no longer skipped for its backend",
    ]


def test_a_vllm_instance_registered_like_vllm_sidecar_gets_history_streams(etcd_server):
    """The sidecar's key and value on a real etcd, read by the real registry: with ``"vllm"``
    listed the instance gets one history-mode stream by the port rule; with the default
    backends it gets none and is listed as another backend."""
    etcd = EtcdClient(etcd_server.addr)
    registry = Registry(registry_settings(etcd_server.addr))
    registry.start()
    try:
        lease = etcd.grant_lease(6)  # the sidecar's default --lease-ttl
        etcd.put(f"/t/XLLM:DEFAULT:{SIDECAR_NAME}", json.dumps(SIDECAR_VALUE), lease_id=lease)
        snap = registry.wait_for(lambda s: SIDECAR_NAME in s.instances, timeout_s=10.0)
        assert snap.instances[SIDECAR_NAME].backend_type == "vllm"

        vllm = DiscoveryConfig(block_size=16, backends=[Backend.VLLM])
        directory = unstarted_directory(vllm)
        discovery = Discovery(registry, directory, vllm, KvEventsConfig(discovery=vllm))
        assert discovery.refresh().added == (StreamId(SIDECAR_NAME, 0),)
        cfg = directory.stream_config(StreamId(SIDECAR_NAME, 0))
        assert (cfg.replay_mode, cfg.endpoint, cfg.replay_endpoint, cfg.block_size) == (
            ReplayMode.HISTORY, "tcp://10.0.0.7:18000", "tcp://10.0.0.7:38000", 16)
        assert directory.identity(StreamId(SIDECAR_NAME, 0)) == "vllm-3f9a0c1d2e4b"

        default = DiscoveryConfig(block_size=16)
        other = unstarted_directory(default)
        skipped = Discovery(registry, other, default, KvEventsConfig(discovery=default))
        assert skipped.refresh().added == ()
        assert other.stream_ids() == []
        assert dict(skipped.other_backends()) == {SIDECAR_NAME: "vllm"}
    finally:
        registry.close()
        etcd.close()


def test_ready_lists_instances_of_other_backends(etcd_server):
    """A running service with the default backends: the sidecar-registered vLLM instance gets
    no stream and ``/ready`` names it under ``discovery.other_backends``."""
    from kvsvc.config import parse_kv_events_config
    from kvsvc.http.app import create_app
    from kvsvc.http.extensions import EXTENSION
    from kvsvc.settings import load_service_settings
    from tests.support.util import wait_for

    etcd = EtcdClient(etcd_server.addr)
    kv_config = parse_kv_events_config({"discovery": {"block_size": 16,
                                                      "refresh_interval_ms": 50}})
    app = create_app(load_service_settings(etcd_addr=etcd_server.addr, etcd_namespace="t"),
                     kv_config)
    svc = app.extensions[EXTENSION]
    svc.start(timeout_s=10.0)
    try:
        etcd.put(f"/t/XLLM:DEFAULT:{SIDECAR_NAME}", json.dumps(SIDECAR_VALUE),
                 lease_id=etcd.grant_lease(6))
        client = app.test_client()

        def skipped() -> dict | None:
            body = client.get("/ready?streams=synchronized").get_json()
            return body if body["discovery"]["other_backends"] else None

        body = wait_for(skipped, timeout_s=10.0, what="vllm instance skipped")
        assert body["discovery"] == {"excluded": {}, "other_backends": {SIDECAR_NAME: "vllm"}}
        assert body["streams"] == []
    finally:
        svc.close(timeout_s=10.0)
        etcd.close()
