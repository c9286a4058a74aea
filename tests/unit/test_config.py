"""§8 configuration rules (every error names its field). The service settings: test_settings.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from kvsvc.config import Backend, ReplayMode, load_kv_events_config, parse_kv_events_config
from kvsvc.errors import ConfigError


def stream(name: str = "a:1", rank: int = 0, port: int = 5000, **extra: Any) -> dict:
    """One valid ``streams[]`` entry with distinct endpoints per (port)."""
    doc = {"instance_name": name, "dp_rank": rank,
           "endpoint": f"tcp://127.0.0.1:{port}", "replay_endpoint": f"tcp://127.0.0.1:{port + 1}"}
    doc.update(extra)
    return doc


def config_error(data: Any) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse_kv_events_config(data)
    return info.value


def test_defaults_and_valid_static_config():
    cfg = parse_kv_events_config({"streams": [stream()]})
    assert (cfg.max_streams, cfg.max_blocks_per_stream, cfg.max_message_bytes,
            cfg.max_buffered_bytes, cfg.replay_timeout_ms, cfg.resync_interval_ms) == (
        128, 262144, 8388608, 16777216, 2000, 30000)
    s = cfg.streams[0]
    assert (s.dp_rank, s.block_size, s.topic, s.hash_seed) == (0, 128, "", 1024)
    assert cfg.discovery is None


def test_shipped_loopback_config_matches_the_sim_port_rule():
    """config/kv_events_sim_loopback.json follows `kvsvc sim --port 8000 --dp 2 --topic
    xllm-kv` (docs/testbed.md): events on port + 10000 + r, snapshots on port + 30000 + r."""
    path = Path(__file__).resolve().parents[2] / "config" / "kv_events_sim_loopback.json"
    cfg = load_kv_events_config(path)
    assert [(s.instance_name, s.dp_rank, s.topic, s.endpoint, s.replay_endpoint)
            for s in cfg.kept_streams()] == [
        ("127.0.0.1:8000", r, "xllm-kv", f"tcp://127.0.0.1:{18000 + r}",
         f"tcp://127.0.0.1:{38000 + r}") for r in (0, 1)]


def test_example_config_file_is_valid():
    path = Path(__file__).resolve().parents[2] / "config" / "kv_events_static_example.json"
    cfg = load_kv_events_config(path)
    assert [(s.instance_name, s.dp_rank) for s in cfg.kept_streams()] == [
        ("10.0.0.5:9000", 0), ("10.0.0.5:9000", 1), ("10.0.0.6:9000", 0)]


@pytest.mark.parametrize("data, field", [
    ({"streams": [], "bogus": 1}, "bogus"),
    ({"streams": [stream(colour="red")]}, "streams[0].colour"),
    ({"discovery": {"enabled": False, "extra": 1}}, "discovery.extra"),
])
def test_unknown_key_is_named(data, field):
    err = config_error(data)
    assert (err.field, err.message) == (field, "unknown key")


@pytest.mark.parametrize("data, field", [
    ({"max_streams": "8"}, "max_streams"),
    ({"max_streams": 8.0}, "max_streams"),
    ({"max_streams": True}, "max_streams"),
    ({"streams": {}}, "streams"),
    ({"streams": [stream(dp_rank="0")]}, "streams[0].dp_rank"),
    ({"streams": [stream(block_size=None)]}, "streams[0].block_size"),
    ({"streams": [stream(topic=1)]}, "streams[0].topic"),
    ({"streams": [stream(hash_seed=1.5)]}, "streams[0].hash_seed"),
    ({"discovery": {"enabled": "yes"}}, "discovery.enabled"),
])
def test_wrong_type_is_named(data, field):
    assert config_error(data).field == field


@pytest.mark.parametrize("key, bad, good", [
    ("max_streams", 0, 1), ("max_streams", 129, 128),
    ("max_blocks_per_stream", 0, 1),
    ("max_message_bytes", 1023, 1024),
    ("max_buffered_bytes", 1023, 1024),
    ("replay_timeout_ms", 0, 1),
    ("resync_interval_ms", 999, 1000),
])
def test_limit_ranges(key, bad, good):
    assert config_error({key: bad}).field == key
    assert getattr(parse_kv_events_config({key: good}), key) == good


@pytest.mark.parametrize("bad, good", [(49, 50), (60001, 60000)])
def test_refresh_interval_range(bad, good):
    err = config_error({"discovery": {"refresh_interval_ms": bad}})
    assert err.field == "discovery.refresh_interval_ms"
    cfg = parse_kv_events_config({"discovery": {"refresh_interval_ms": good}})
    assert cfg.discovery.refresh_interval_ms == good


@pytest.mark.parametrize("field, bad", [
    ("dp_rank", -1), ("block_size", 0), ("hash_seed", -1), ("hash_seed", 2**64),
    ("instance_name", ""),
])
def test_stream_field_ranges(field, bad):
    assert config_error({"streams": [stream(**{field: bad})]}).field == f"streams[0].{field}"


def test_missing_required_stream_fields_are_named():
    for key in ("instance_name", "endpoint", "replay_endpoint"):
        doc = stream()
        del doc[key]
        err = config_error({"streams": [doc]})
        assert err.field == f"streams[0].{key}"


@pytest.mark.parametrize("endpoint", [
    "tcp://*:5000", "tcp://0.0.0.0:5000", "127.0.0.1:5000", "ipc:///tmp/x",
    "tcp://127.0.0.1", "tcp://127.0.0.1:0", "tcp://127.0.0.1:70000", "tcp://127.0.0.1:5000/x",
    # ZMQ would take these, but none is a plain connect address: userinfo, ZMQ's
    # "interface;address" source syntax, "0" (= 0.0.0.0), the IPv6 unspecified address.
    "tcp://u@127.0.0.1:5000", "tcp://eth0;127.0.0.1:5000", "tcp://0:5000", "tcp://[::]:5000",
])
@pytest.mark.parametrize("key", ["endpoint", "replay_endpoint"])
def test_endpoint_rules(key, endpoint):
    err = config_error({"streams": [stream(port=6000, **{key: endpoint})]})
    assert err.field == f"streams[0].{key}"


def test_streams_and_enabled_discovery_are_exclusive():
    err = config_error({"streams": [stream()], "discovery": {"enabled": True}})
    assert err.field == "streams"
    assert "mutually exclusive" in err.message
    # Disabled discovery beside streams, or enabled discovery with no streams, is fine.
    assert len(parse_kv_events_config(
        {"streams": [stream()], "discovery": {"enabled": False}}).streams) == 1
    assert parse_kv_events_config({"discovery": {}}).discovery.enabled is True


def test_duplicate_instance_rank_pair_rejected():
    err = config_error({"streams": [stream("a:1", 0, 5000), stream("a:1", 0, 5010)]})
    assert err.field == "streams[1]"
    assert "duplicate" in err.message


@pytest.mark.parametrize("second, field", [
    ({"endpoint": "tcp://127.0.0.1:5000"}, "streams[1].endpoint"),
    ({"endpoint": "tcp://127.0.0.1:5001"}, "streams[1].endpoint"),
    ({"replay_endpoint": "tcp://127.0.0.1:5000"}, "streams[1].replay_endpoint"),
    ({"replay_endpoint": "tcp://127.0.0.1:5001"}, "streams[1].replay_endpoint"),
    # Compared as (host, port), not as strings.
    ({"endpoint": "tcp://127.0.0.1:05000"}, "streams[1].endpoint"),
    ({"endpoint": "tcp://[::1]:7000"}, None),
])
def test_endpoint_used_twice_rejected(second, field):
    doc = {"streams": [stream("a:1", 0, 5000), stream("b:1", 0, 5010, **second)]}
    if field is None:  # a different host is a different endpoint
        assert len(parse_kv_events_config(doc).streams) == 2
        return
    assert config_error(doc).field == field


def test_same_stream_event_and_replay_endpoint_rejected():
    err = config_error({"streams": [stream(replay_endpoint="tcp://127.0.0.1:5000")]})
    assert err.field == "streams[0].replay_endpoint"


def test_max_streams_cuts_whole_instances_in_name_order(caplog):
    streams = [stream("c:1", 0, 5000), stream("b:1", 1, 5010), stream("b:1", 0, 5020),
               stream("a:1", 0, 5030), stream("d:1", 0, 5040)]
    cfg = parse_kv_events_config({"streams": streams, "max_streams": 3})
    with caplog.at_level(logging.WARNING, logger="kvsvc.config"):
        kept = cfg.kept_streams()
    # a (1) + b (2) = 3; c and d would exceed and are skipped whole.
    assert [(s.instance_name, s.dp_rank) for s in kept] == [("a:1", 0), ("b:1", 0), ("b:1", 1)]
    assert sum("skipped" in r.getMessage() for r in caplog.records) == 2


def test_max_streams_never_splits_an_instance():
    streams = [stream("a:1", 0, 5000), stream("a:1", 1, 5010), stream("b:1", 0, 5020)]
    cfg = parse_kv_events_config({"streams": streams, "max_streams": 1})
    # a has 2 ranks and does not fit; b (1 rank) does.
    assert [(s.instance_name, s.dp_rank) for s in cfg.kept_streams()] == [("b:1", 0)]


def test_top_level_must_be_object_and_file_errors(tmp_path):
    assert config_error([]).field == "kv_events_config_file"
    with pytest.raises(ConfigError) as info:
        load_kv_events_config(tmp_path / "missing.json")
    assert info.value.field == "kv_events_config_file"
    bad = tmp_path / "bad.json"
    bad.write_text("{not json", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_kv_events_config(bad)
    assert info.value.field == "kv_events_config_file"
    assert "not valid JSON" in info.value.message
    not_utf8 = tmp_path / "latin1.json"
    not_utf8.write_bytes(b"\xff\xfe{")
    with pytest.raises(ConfigError) as info:
        load_kv_events_config(not_utf8)
    assert info.value.field == "kv_events_config_file"
    assert "not UTF-8" in info.value.message
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000, encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_kv_events_config(deep)
    assert info.value.field == "kv_events_config_file"


def test_duplicate_json_key_is_named(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text('{"max_streams": 0, "max_streams": 5}', encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_kv_events_config(path)
    assert (info.value.field, info.value.message) == (
        "max_streams", "key given twice in one JSON object")


# -- every error at once; host:port names; a file that configures nothing (issue 13) ---------------

def test_every_error_of_a_document_is_reported_at_once_with_field_and_value():
    """Five problems in one document: one ConfigError lists them all in document order, each
    naming its field and, where there is one, the bad value."""
    err = config_error({"streams": [stream("a:1", dp_rank=-1, block_size="128"),
                                    stream("b:1", 5010, endpoint="tcp://*:5010")],
                        "max_streams": 0, "bogus": 1})
    assert [(p.field, p.message) for p in err.problems] == [
        ("streams[0].dp_rank", "Input should be greater than or equal to 0, got -1"),
        ("streams[0].block_size", "Input should be a valid integer, got '128'"),
        ("streams[1].endpoint", "host must be connectable, not '*', got 'tcp://*:5010'"),
        ("max_streams", "Input should be greater than or equal to 1, got 0"),
        ("bogus", "unknown key"),
    ]
    assert (err.field, err.message) == (err.problems[0].field, err.problems[0].message)
    assert str(err).count("; ") == 4   # every problem in the one message too


def test_a_long_bad_value_is_shown_cut():
    err = config_error({"streams": [stream(topic=list(range(10_000)))]})
    assert err.field == "streams[0].topic" and err.message.endswith("...")
    assert len(err.message) < 200


def test_every_duplicate_is_reported_at_once():
    err = config_error({"streams": [stream("a:1", 0, 5000), stream("a:1", 0, 5010),
                                    stream("b:1", 0, 5020, endpoint="tcp://127.0.0.1:5000")]})
    assert [p.field for p in err.problems] == ["streams[1]", "streams[2].endpoint"]
    assert "also streams[0]" in err.problems[0].message
    assert "already used by streams[0].endpoint" in err.problems[1].message


@pytest.mark.parametrize("name", ["a", "a:", ":8000", "a:0", "a:70000", "a:http", "[::1]"])
def test_instance_name_must_be_host_port(name):
    err = config_error({"streams": [stream(name)]})
    assert err.field == "streams[0].instance_name"
    assert "host:port" in err.message or "out of range" in err.message
    assert "e.g. 10.0.0.5:9000" in err.message


@pytest.mark.parametrize("name", ["10.0.0.5:9000", "engine-1.local:8000", "[::1]:8000"])
def test_host_port_instance_names_are_accepted(name):
    assert parse_kv_events_config({"streams": [stream(name)]}).streams[0].instance_name == name


@pytest.mark.parametrize("doc", [{"streams": []}, {}, {"streams": [], "max_streams": 4},
                                 {"discovery": {"enabled": False}}])
def test_a_file_that_configures_no_stream_is_refused(tmp_path, doc):
    """An empty streams list without enabled discovery builds an index of nothing: the file
    is refused naming `streams` and saying what to do; the document alone (limits for streams
    added later) still parses."""
    path = tmp_path / "kv.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_kv_events_config(path)
    assert info.value.field == "streams"
    assert "configures no stream" in info.value.message
    assert "enable \"discovery\"" in info.value.message
    assert "kv_events_config_file empty" in info.value.message
    assert parse_kv_events_config(doc).streams == []
    path.write_text(json.dumps({"discovery": {}}), encoding="utf-8")
    assert load_kv_events_config(path).discovery.enabled


def test_check_config_prints_every_problem_one_per_line(clean_env, tmp_path, capsys):
    from kvsvc.cli import main

    path = tmp_path / "kv.json"
    path.write_text(json.dumps({"streams": [stream("a", dp_rank=-1)], "max_streams": 0}),
                    encoding="utf-8")
    assert main(["check-config", "--kv_events_config_file", str(path)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "kvsvc: invalid configuration: streams[0].instance_name: must be host:port, got 'a' "
        "(the instance's HTTP address as it registers itself, e.g. 10.0.0.5:9000)",
        "kvsvc: invalid configuration: streams[0].dp_rank: Input should be greater than or "
        "equal to 0, got -1",
        "kvsvc: invalid configuration: max_streams: Input should be greater than or equal to "
        "1, got 0",
    ]


# -- replay modes and backends (§7h, §8, §9) ------------------------------------------------------

def test_replay_mode_of_static_streams_defaults_to_snapshot_and_parses_history():
    cfg = parse_kv_events_config({"streams": [stream("a:1"), stream("b:1", port=6000,
                                                                    replay_mode="history"),
                                              stream("c:1", port=7000,
                                                     replay_mode="snapshot")]})
    assert [s.replay_mode for s in cfg.streams] == [
        ReplayMode.SNAPSHOT, ReplayMode.HISTORY, ReplayMode.SNAPSHOT]
    assert [s.replay_mode.value for s in cfg.streams] == ["snapshot", "history", "snapshot"]


@pytest.mark.parametrize("bad", ["History", "replay", "", 1, None, True, ["history"]])
def test_bad_replay_mode_of_a_static_stream_is_named(bad):
    err = config_error({"streams": [stream(), stream("b:1", port=6000, replay_mode=bad)]})
    assert (err.field, err.message) == (
        "streams[1].replay_mode", f"Input should be 'snapshot' or 'history', got {bad!r}")


def test_discovery_backends_and_replay_modes_defaults():
    d = parse_kv_events_config({"discovery": {}}).discovery
    assert d.backends == [Backend.XLLM]
    assert d.replay_modes == {Backend.XLLM: ReplayMode.SNAPSHOT,
                              Backend.VLLM: ReplayMode.HISTORY,
                              Backend.SGLANG: ReplayMode.HISTORY}
    assert [d.replay_mode(b) for b in Backend] == [
        ReplayMode.SNAPSHOT, ReplayMode.HISTORY, ReplayMode.HISTORY]


def test_discovery_replay_modes_override_one_key_and_keep_the_others():
    d = parse_kv_events_config({"discovery": {
        "backends": ["vllm", "xllm", "sglang"],
        "replay_modes": {"sglang": "snapshot"}}}).discovery
    assert d.backends == [Backend.VLLM, Backend.XLLM, Backend.SGLANG]  # the order given
    assert d.replay_modes == {Backend.XLLM: ReplayMode.SNAPSHOT,
                              Backend.VLLM: ReplayMode.HISTORY,
                              Backend.SGLANG: ReplayMode.SNAPSHOT}


@pytest.mark.parametrize("discovery, field, message", [
    ({"backends": ["trtllm"]}, "discovery.backends[0]",
     "Input should be 'xllm', 'vllm' or 'sglang', got 'trtllm'"),
    ({"backends": ["xllm", "VLLM"]}, "discovery.backends[1]",
     "Input should be 'xllm', 'vllm' or 'sglang', got 'VLLM'"),
    ({"backends": [0]}, "discovery.backends[0]",
     "Input should be 'xllm', 'vllm' or 'sglang', got 0"),
    ({"backends": "vllm"}, "discovery.backends", "Input should be a valid list, got 'vllm'"),
    ({"backends": []}, "discovery.backends",
     "must list at least one backend type ('xllm', 'vllm', 'sglang'), got [] (or list the "
     "backends without KV events in approximate_backends, §14)"),
    ({"backends": ["xllm"], "approximate_backends": ["vllm", "xllm"]},
     "discovery.approximate_backends[1]",
     "'xllm' is also in discovery.backends (a backend has KV event streams or an approximate "
     "index, not both), got 'xllm'"),
    ({"backends": [], "approximate_backends": ["xllm", "xllm"]},
     "discovery.approximate_backends", "'xllm' listed twice, got ['xllm', 'xllm']"),
    ({"approximate_backends": ["trtllm"]}, "discovery.approximate_backends[0]",
     "Input should be 'xllm', 'vllm' or 'sglang', got 'trtllm'"),
    ({"approximate_ttl_s": 0}, "discovery.approximate_ttl_s",
     "Input should be greater than or equal to 1, got 0"),
    ({"approximate_ttl_s": 86401}, "discovery.approximate_ttl_s",
     "Input should be less than or equal to 86400, got 86401"),
    ({"approximate_ttl_s": 1.5}, "discovery.approximate_ttl_s",
     "Input should be a valid integer, got 1.5"),
    ({"approximate_blocks": 0}, "discovery.approximate_blocks",
     "Input should be greater than or equal to 1, got 0"),
    ({"approximate_blocks": 262145}, "discovery.approximate_blocks",
     "must be at most max_blocks_per_stream (262144), got 262145"),
    ({"backends": ["vllm", "xllm", "vllm"]}, "discovery.backends",
     "'vllm' listed twice, got ['vllm', 'xllm', 'vllm']"),
    ({"replay_modes": {"trtllm": "history"}}, "discovery.replay_modes.trtllm",
     "Input should be 'xllm', 'vllm' or 'sglang', got 'trtllm'"),
    ({"replay_modes": {"vllm": "live"}}, "discovery.replay_modes.vllm",
     "Input should be 'snapshot' or 'history', got 'live'"),
    ({"replay_modes": {"vllm": None}}, "discovery.replay_modes.vllm",
     "Input should be 'snapshot' or 'history', got None"),
    ({"replay_modes": ["history"]}, "discovery.replay_modes",
     "Input should be a valid dictionary, got ['history']"),
])
def test_bad_backends_and_replay_modes_are_named(discovery, field, message):
    err = config_error({"discovery": discovery})
    assert (err.field, err.message) == (field, message)


def test_approximate_backends_defaults_and_an_xllm_cluster_of_today():
    d = parse_kv_events_config({"discovery": {}}).discovery
    assert (d.approximate_backends, d.approximate_ttl_s, d.approximate_blocks) == ([], 120, 65536)
    # §14: today's xLLM engines publish no events: no streams, approximate indexes instead.
    d = parse_kv_events_config({"discovery": {"backends": [], "approximate_backends": ["xllm"],
                                              "approximate_ttl_s": 30,
                                              "approximate_blocks": 1000}}).discovery
    assert (d.backends, d.approximate_backends, d.approximate_ttl_s,
            d.approximate_blocks) == ([], [Backend.XLLM], 30, 1000)
    # The upper bound follows max_blocks_per_stream.
    cfg = parse_kv_events_config({"max_blocks_per_stream": 10,
                                  "discovery": {"approximate_blocks": 10}})
    assert cfg.discovery.approximate_blocks == 10
    err = config_error({"max_blocks_per_stream": 10, "discovery": {"approximate_blocks": 11}})
    assert (err.field, err.message) == ("discovery.approximate_blocks",
                                        "must be at most max_blocks_per_stream (10), got 11")


def test_vllm_example_configs_are_valid():
    root = Path(__file__).resolve().parents[2] / "config"
    static = load_kv_events_config(root / "kv_events_vllm_static_example.json")
    assert [(s.instance_name, s.dp_rank, s.block_size, s.endpoint, s.replay_endpoint,
             s.replay_mode.value) for s in static.kept_streams()] == [
        ("10.0.0.5:9000", 0, 128, "tcp://10.0.0.5:19000", "tcp://10.0.0.5:39000", "snapshot"),
        ("10.0.0.7:8000", 0, 16, "tcp://10.0.0.7:18000", "tcp://10.0.0.7:38000", "history"),
        ("10.0.0.7:8000", 1, 16, "tcp://10.0.0.7:18001", "tcp://10.0.0.7:38001", "history")]
    d = load_kv_events_config(root / "kv_events_vllm_discovery.json").discovery
    assert (d.block_size, d.backends, d.replay_mode(Backend.VLLM),
            d.replay_mode(Backend.SGLANG)) == (
        16, [Backend.VLLM, Backend.SGLANG], ReplayMode.HISTORY, ReplayMode.HISTORY)
    d = load_kv_events_config(root / "kv_events_discovery_config.json").discovery
    assert (d.backends, d.replay_mode(Backend.XLLM)) == ([Backend.XLLM], ReplayMode.SNAPSHOT)
    d = load_kv_events_config(root / "kv_events_xllm_approximate.json").discovery
    assert (d.backends, d.approximate_backends, d.approximate_ttl_s, d.approximate_blocks,
            d.block_size) == ([], [Backend.XLLM], 120, 65536, 128)


def test_check_config_prints_each_static_streams_replay_mode(clean_env, capsys):
    from kvsvc.cli import main

    path = Path(__file__).resolve().parents[2] / "config" / "kv_events_vllm_static_example.json"
    assert main(["check-config", "--kv_events_config_file", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    streams = [line for line in out if line.startswith("  10.0.0.")]
    assert [line.split(": ")[0].strip() for line in streams] == [
        "10.0.0.5:9000/dp0", "10.0.0.7:8000/dp0", "10.0.0.7:8000/dp1"]
    assert [line.rsplit(" ", 1)[1] for line in streams] == [
        "replay_mode=snapshot", "replay_mode=history", "replay_mode=history"]
    assert not any(line.startswith("discovery") for line in out)


def test_check_config_prints_discoverys_backends_and_their_replay_modes(clean_env, tmp_path,
                                                                       capsys):
    from kvsvc.cli import main

    path = tmp_path / "kv.json"
    path.write_text(json.dumps({"discovery": {"backends": ["xllm", "vllm"],
                                              "replay_modes": {"vllm": "snapshot"}}}),
                    encoding="utf-8")
    assert main(["check-config", "--etcd_addr", "127.0.0.1:1",
                 "--kv_events_config_file", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert ("discovery backends (replay mode): xllm (snapshot), vllm (snapshot); instances of "
            "other backends get no streams") in out
    path.write_text(json.dumps({"discovery": {}}), encoding="utf-8")
    assert main(["check-config", "--etcd_addr", "127.0.0.1:1",
                 "--kv_events_config_file", str(path)]) == 0
    assert ("discovery backends (replay mode): xllm (snapshot); instances of other backends "
            "get no streams") in capsys.readouterr().out.splitlines()
