"""Discovery (§9): the pure plan (every rule, exact stream sets) and the discovery thread applying
plans to a real directory whose streams talk to real simulated engines (keep / replace / remove).

The thread tests feed discovery a registry snapshot held in a small object (``SnapshotSource``):
discovery reads nothing but ``snapshot()``; the real registry over etcd is exercised in
``test_e2e_discovery.py``. The thread's start/close contract is tested with a source whose
``snapshot()`` blocks until the test lets it go."""

from __future__ import annotations

import logging
import threading

import pytest

from kvsvc.config import DiscoveryConfig, KvEventsConfig, parse_kv_events_config
from kvsvc.directory import Directory
from kvsvc.errors import LifecycleError
from kvsvc.cluster.discovery import Discovery
from kvsvc.cluster.model import RegistrySnapshot, instance_identity
from kvsvc.testbed.sim.engine import SimEngine
from kvsvc.streams.state import StreamId
from tests.support.util import wait_for
from tests.support.discovery import DISC, LIMITS, S, SnapshotSource, T, ids, inst, plan, snap


# -- the pure plan --------------------------------------------------------------------------------

def test_join_gives_port_rule_endpoints_and_identity():
    p = plan(inst("127.0.0.1:8000", dp=2, inc="abc"))
    assert ids(p) == [("127.0.0.1:8000", 0), ("127.0.0.1:8000", 1)]
    s0, s1 = (p.streams[StreamId("127.0.0.1:8000", r)] for r in (0, 1))
    assert (s0.config.endpoint, s0.config.replay_endpoint) == (
        "tcp://127.0.0.1:18000", "tcp://127.0.0.1:38000")
    assert (s1.config.endpoint, s1.config.replay_endpoint) == (
        "tcp://127.0.0.1:18001", "tcp://127.0.0.1:38001")
    assert (s1.config.block_size, s1.config.topic, s1.config.hash_seed) == (4, "kv", 1024)
    assert (s0.identity, s0.dp_size) == ("abc", 2)
    assert dict(p.excluded) == {}


def test_identity_falls_back_to_register_ts_ms_and_dp_size_zero_means_one():
    p = plan(inst("h:9000", inc=None, ts=1234, dp=0), inst("h:9001", inc="", ts=77))
    assert ids(p) == [("h:9000", 0), ("h:9001", 0)]
    assert p.streams[StreamId("h:9000", 0)].identity == "register_ts_ms:1234"
    assert p.streams[StreamId("h:9001", 0)].identity == "register_ts_ms:77"
    assert instance_identity(inst("x:1", inc="u-1", ts=5)) == "u-1"


def test_ipv6_name_is_bracketed_in_endpoints():
    p = plan(inst("[::1]:8000"))
    s = p.streams[StreamId("[::1]:8000", 0)]
    assert (s.config.endpoint, s.config.replay_endpoint) == ("tcp://[::1]:18000",
                                                              "tcp://[::1]:38000")


def test_dp_size_change_changes_the_planned_identity_of_every_rank():
    before = plan(inst("h:8000", dp=1))
    after = plan(inst("h:8000", dp=2))
    assert ids(before) == [("h:8000", 0)]
    assert ids(after) == [("h:8000", 0), ("h:8000", 1)]
    # Same incarnation, but rank 0's planned stream differs (dp_size), so it is replaced.
    assert before.streams[StreamId("h:8000", 0)] != after.streams[StreamId("h:8000", 0)]


def test_port_collision_excludes_both_instances_and_names_each_other():
    # h:8000 with 2 ranks uses event port 18001, which h:8001 rank 0 uses too.
    p = plan(inst("h:8000", dp=2), inst("h:8001"), inst("h:9000"))
    assert ids(p) == [("h:9000", 0)]
    assert dict(p.excluded) == {
        "h:8000": "endpoint collision: tcp://h:18001 also used by h:8001",
        "h:8001": "endpoint collision: tcp://h:18001 also used by h:8000",
    }


def test_event_endpoint_colliding_with_a_replay_endpoint_excludes_both():
    # h:8000's replay port 38000 is h:28000's event port.
    p = plan(inst("h:8000"), inst("h:28000"))
    assert ids(p) == []
    assert dict(p.excluded) == {
        "h:8000": "endpoint collision: tcp://h:38000 also used by h:28000",
        "h:28000": "endpoint collision: tcp://h:38000 also used by h:8000",
    }


def test_same_port_on_different_hosts_is_no_collision():
    p = plan(inst("a:8000"), inst("b:8000"))
    assert ids(p) == [("a:8000", 0), ("b:8000", 0)]


def test_equal_offsets_collide_with_the_instance_itself():
    disc = DiscoveryConfig(event_port_offset=100, replay_port_offset=100)
    p = plan(inst("h:8000"), disc=disc)
    assert ids(p) == []
    assert dict(p.excluded) == {"h:8000": "endpoint collision: tcp://h:8100 used twice by h:8000"}


def test_port_overflow_excludes_only_that_instance():
    # 35535 + 30000 = 65535 is the last valid port; rank 1 would need 65536.
    # Distinct hosts, so that no two of them collide.
    p = plan(inst("a:35535"), inst("b:35534", dp=2), inst("c:35536"), inst("d:35535", dp=2))
    assert ids(p) == [("a:35535", 0), ("b:35534", 0), ("b:35534", 1)]
    assert dict(p.excluded) == {
        "c:35536": "port overflow: rank 0 would use port 65536 > 65535",
        "d:35535": "port overflow: rank 1 would use port 65536 > 65535",
    }


def test_bad_names_are_excluded():
    p = plan(inst("no-port"), inst("h:0"), inst("0.0.0.0:8000"), inst("h:8000"))
    assert ids(p) == [("h:8000", 0)]
    assert sorted(p.excluded) == ["0.0.0.0:8000", "h:0", "no-port"]
    assert p.excluded["no-port"] == "instance name 'no-port' is not host:port"
    assert p.excluded["0.0.0.0:8000"].startswith("no connectable endpoint for host '0.0.0.0'")


def test_max_streams_cuts_whole_instances_in_name_order():
    limits = KvEventsConfig(discovery=DISC, max_streams=4)
    p = plan(inst("h:8400", dp=1), inst("h:8100", dp=2), inst("h:8200", dp=2),
             inst("h:8300", dp=1), limits=limits)
    # h:8100 (2) + h:8200 (2) = 4; h:8300 and h:8400 would exceed, skipped whole.
    assert ids(p) == [("h:8100", 0), ("h:8100", 1), ("h:8200", 0), ("h:8200", 1)]
    assert dict(p.excluded) == {"h:8300": "max_streams=4 reached: 1 streams skipped",
                                "h:8400": "max_streams=4 reached: 1 streams skipped"}


def test_max_streams_never_splits_ranks_and_later_smaller_instances_fit():
    limits = KvEventsConfig(discovery=DISC, max_streams=3)
    p = plan(inst("h:8100", dp=2), inst("h:8200", dp=2), inst("h:8300", dp=1), limits=limits)
    assert ids(p) == [("h:8100", 0), ("h:8100", 1), ("h:8300", 0)]
    assert dict(p.excluded) == {"h:8200": "max_streams=3 reached: 2 streams skipped"}


def test_decode_and_other_backends_are_ignored():
    p = plan(inst("h:8000", T.DECODE), inst("h:8100", backend="vllm"), inst("h:8200", T.PREFILL),
             inst("h:8300", T.DEFAULT))
    assert ids(p) == [("h:8200", 0), ("h:8300", 0)]
    assert dict(p.excluded) == {}


def test_ignored_instances_take_part_in_no_collision():
    # The DECODE instance h:8001 would collide with h:8000's rank 1, but it is not subscribed.
    p = plan(inst("h:8000", dp=2), inst("h:8001", T.DECODE))
    assert ids(p) == [("h:8000", 0), ("h:8000", 1)]


def test_mix_only_while_acting_as_prefill():
    assert ids(plan(inst("h:8000", T.MIX, role=T.PREFILL))) == [("h:8000", 0)]
    assert ids(plan(inst("h:8000", T.MIX, role=T.DECODE))) == []


def test_suspect_has_no_streams_lease_lost_keeps_them():
    p = plan(inst("h:8000", state=S.SUSPECT), inst("h:8100", state=S.LEASE_LOST),
             inst("h:8200", state=S.ACTIVE))
    assert ids(p) == [("h:8100", 0), ("h:8200", 0)]
    assert ids(plan()) == []


# -- the discovery thread on a real directory and real engines ----------------------------------


def engine_for(port: int, dp: int = 1) -> SimEngine:
    return SimEngine(f"127.0.0.1:{port}", port + DISC.event_port_offset,
                     port + DISC.replay_port_offset, dp_size=dp, block_size=4, topic="kv")


def free_instance_port(dp: int = 1) -> int:
    from kvsvc.testbed.demo import free_instance_port as pick
    return pick(dp, DISC.event_port_offset, DISC.replay_port_offset)


@pytest.fixture
def directory(zmq_ctx):
    cfg = parse_kv_events_config({"discovery": DISC.model_dump(), "replay_timeout_ms": 500})
    d = Directory(cfg, zmq_ctx)
    d.start()
    yield d
    d.close()


def synced(directory: Directory, tokens: list[int]) -> dict[tuple[str, int], tuple]:
    return {(m.instance_name, m.dp_rank): (m.synchronized, m.sequence, m.device_hit_tokens)
            for m in directory.query(tokens)}


def test_refresh_adds_keeps_replaces_and_removes(directory, caplog):
    caplog.set_level(logging.INFO, logger="kvsvc.cluster.discovery")
    port = free_instance_port(2)
    source = SnapshotSource()
    disc = Discovery(source, directory, DISC, LIMITS)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    with engine_for(port, dp=2) as eng:
        name = eng.name
        source.set(inst(name, dp=2, inc="inc-1"))
        r = disc.refresh()
        assert (r.added, r.replaced, r.removed, r.kept) == (
            (StreamId(name, 0), StreamId(name, 1)), (), (), 0)
        assert directory.identity(StreamId(name, 1)) == "inc-1"
        eng.execute(tokens, rank=0)
        wait_for(lambda: synced(directory, tokens) == {(name, 0): (True, 0, 8),
                                                       (name, 1): (True, None, 0)},
                 what="both ranks synchronized, rank 0 with the request")

        # A refresh with the same incarnation (register_ts_ms may change) keeps the index.
        source.set(inst(name, dp=2, inc="inc-1", ts=99999))
        r = disc.refresh()
        assert (r.added, r.replaced, r.removed, r.kept) == ((), (), (), 2)
        assert synced(directory, tokens)[(name, 0)] == (True, 0, 8)

        # New incarnation at the same address: replaced, no hits until its first snapshot.
        eng.delay_snapshots(0, 0.5)
        source.set(inst(name, dp=2, inc="inc-2"))
        r = disc.refresh()
        assert (r.added, r.replaced, r.removed, r.kept) == (
            (), (StreamId(name, 0), StreamId(name, 1)), (), 0)
        assert directory.identity(StreamId(name, 0)) == "inc-2"
        first = synced(directory, tokens)[(name, 0)]
        assert first == (False, None, 0)
        wait_for(lambda: synced(directory, tokens)[(name, 0)] == (True, 0, 8),
                 what="replaced stream synchronized by its snapshot")

        # SUSPECT: streams removed.
        source.set(inst(name, dp=2, inc="inc-2", state=S.SUSPECT))
        r = disc.refresh()
        assert (r.added, r.replaced, r.removed, r.kept) == (
            (), (), (StreamId(name, 0), StreamId(name, 1)), 0)
        assert directory.stream_ids() == []
        assert directory.identity(StreamId(name, 0)) is None
    text = caplog.text
    assert text.count("discovery: stream 127.0.0.1") == 6  # 2 added, 2 replaced, 2 removed
    assert f"stream {name}/dp0 replaced: identity inc-1 -> inc-2" in text


def test_dp_size_change_replaces_every_rank(directory):
    port = free_instance_port(2)
    source = SnapshotSource()
    disc = Discovery(source, directory, DISC, LIMITS)
    name = f"127.0.0.1:{port}"
    source.set(inst(name, dp=1))
    assert disc.refresh().added == (StreamId(name, 0),)
    source.set(inst(name, dp=2))
    r = disc.refresh()
    assert (r.added, r.replaced, r.removed) == ((StreamId(name, 1),), (StreamId(name, 0),), ())
    source.set(inst(name, dp=1))
    r = disc.refresh()
    assert (r.added, r.replaced, r.removed) == ((), (StreamId(name, 0),), (StreamId(name, 1),))
    assert directory.stream_ids() == [StreamId(name, 0)]


def test_exclusion_is_logged_once_per_change(directory, caplog):
    caplog.set_level(logging.INFO, logger="kvsvc.cluster.discovery")
    source = SnapshotSource()
    disc = Discovery(source, directory, DISC, LIMITS)
    source.set(inst("127.0.0.1:8000", dp=2), inst("127.0.0.1:8001"))
    for _ in range(3):
        disc.refresh()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "discovery: instance 127.0.0.1:8000 excluded: endpoint collision: "
        "tcp://127.0.0.1:18001 also used by 127.0.0.1:8001",
        "discovery: instance 127.0.0.1:8001 excluded: endpoint collision: "
        "tcp://127.0.0.1:18001 also used by 127.0.0.1:8000",
    ]
    assert directory.stream_ids() == []
    source.set(inst("127.0.0.1:8000", dp=2))
    disc.refresh()
    assert "discovery: instance 127.0.0.1:8001 no longer excluded" in caplog.text
    assert directory.stream_ids() == [StreamId("127.0.0.1:8000", 0), StreamId("127.0.0.1:8000", 1)]
    assert dict(disc.excluded()) == {}


def test_thread_follows_the_snapshot_and_stops(directory):
    port = free_instance_port(1)
    source = SnapshotSource()
    disc = Discovery(source, directory, DISC, LIMITS)
    name = f"127.0.0.1:{port}"
    disc.start(timeout_s=5.0)
    try:
        wait_for(lambda: disc.refreshes >= 1, what="first refresh")
        assert directory.stream_ids() == []
        source.set(inst(name))
        wait_for(lambda: directory.stream_ids() == [StreamId(name, 0)], what="stream added")
        source.set()
        wait_for(lambda: directory.stream_ids() == [], what="stream removed")
    finally:
        disc.close()
    count = disc.refreshes
    source.set(inst(name))
    assert disc.refreshes == count and directory.stream_ids() == []


class BlockingSource:
    """A snapshot source whose ``snapshot()`` blocks until :attr:`release` is set."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def snapshot(self) -> RegistrySnapshot:
        self.entered.set()
        self.release.wait(30)
        return snap()


def test_thread_start_close_contract_and_close_raises_while_a_refresh_blocks(directory):
    source = BlockingSource()
    disc = Discovery(source, directory, DISC, LIMITS)
    disc.close()                     # never started: nothing to do
    assert not disc.running
    disc.start()
    try:
        with pytest.raises(LifecycleError, match="kvsvc-discovery: already started"):
            disc.start()
        assert source.entered.wait(5), "first refresh"
        with pytest.raises(LifecycleError, match="kvsvc-discovery: did not stop"):
            disc.close(timeout_s=0.2)
        assert disc.running
    finally:
        source.release.set()
        disc.close()
    assert not disc.running and disc.refreshes == 1
    disc.close()                     # closed already: nothing to do


# -- configuration -------------------------------------------------------------------------------

def test_discovery_without_etcd_addr_refuses_start_up(tmp_path, monkeypatch):
    import argparse
    import json

    from kvsvc.http.app import create_app
    from kvsvc.cli import resolve_serve_settings, serve_environment
    from kvsvc.settings import load_service_settings
    from kvsvc.errors import ConfigError

    for key in [k for k in __import__("os").environ if k.startswith("KVSVC_")]:
        monkeypatch.delenv(key)
    path = tmp_path / "kv.json"
    path.write_text(json.dumps({"discovery": {"enabled": True}}), encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        create_app(load_service_settings(kv_events_config_file=str(path)))
    assert (info.value.field, info.value.message) == (
        "--etcd_addr", "required when kv_events_config_file enables discovery")
    args = argparse.Namespace(
        host="127.0.0.1", port=9100, kv_events_config_file=str(path), internal_api_token=None,
        internal_api_token_file=None, max_query_tokens=None, log_level=None, etcd_addr=None,
        etcd_namespace=None, detect_disconnected_instance_interval=None, self_address=None)
    with pytest.raises(ConfigError) as info:
        resolve_serve_settings(args)
    assert info.value.field == "--etcd_addr"
    args.etcd_addr, args.etcd_namespace = "127.0.0.1:2379", "prod"
    args.detect_disconnected_instance_interval = 7.5
    settings = resolve_serve_settings(args)
    env = serve_environment(settings, {})
    assert (env["KVSVC_ETCD_ADDR"], env["KVSVC_ETCD_NAMESPACE"],
            env["KVSVC_DETECT_DISCONNECTED_INSTANCE_INTERVAL"], env["KVSVC_SELF_ADDRESS"]) == (
        "127.0.0.1:2379", "prod", "7.5", "")
    assert settings.advertised_address() == "127.0.0.1:9100"
    # A disabled discovery block needs no registry (beside static streams: alone it would
    # configure nothing, which the file check refuses).
    path.write_text(json.dumps({"discovery": {"enabled": False}, "streams": [{
        "instance_name": "127.0.0.1:9", "endpoint": "tcp://127.0.0.1:10009",
        "replay_endpoint": "tcp://127.0.0.1:30009"}]}), encoding="utf-8")
    app = create_app(load_service_settings(kv_events_config_file=str(path)))
    assert app.extensions["kvsvc"].discovery is None
    with pytest.raises(ConfigError) as info:
        load_service_settings(etcd_addr="no-port")
    assert info.value.field == "--etcd_addr"
