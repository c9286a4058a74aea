"""``python -m kvsvc serve`` as a real process tree (gunicorn arbiter + one worker) on loopback,
fed by a tests/support/publisher.py engine; stopped by signals with nothing left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from tests.support.publisher import ProtocolPublisher, stored
from tests.support.util import free_port, free_ports, wait_for
from tests.support.gunicorn import ROOT, Server, group_alive, serve_env

TOKEN = "e2e-token"
INSTANCE = "127.0.0.1:9100"
BLOCK = 4
QUERY = "/v1/internal/kv-cache/query"
AUTH = {"X-Internal-Token": TOKEN}


@pytest.fixture
def servers(tmp_path) -> Iterator[list[Server]]:
    started: list[Server] = []
    yield started
    for s in started:
        if s.proc.poll() is None or group_alive(s.pgid):
            s.stop(signal.SIGKILL)


def write_config(tmp_path: Path, event_port: int, replay_port: int) -> Path:
    path = tmp_path / "kv.json"
    path.write_text(json.dumps({
        "streams": [{"instance_name": INSTANCE, "block_size": BLOCK,
                     "endpoint": f"tcp://127.0.0.1:{event_port}",
                     "replay_endpoint": f"tcp://127.0.0.1:{replay_port}"}],
        "replay_timeout_ms": 500,
    }), encoding="utf-8")
    return path


def test_serve_ready_query_and_sigint(tmp_path, zmq_ctx, servers):
    event_port, replay_port, http_port = free_ports(3)
    cfg = write_config(tmp_path, event_port, replay_port)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n", encoding="utf-8")
    pub = ProtocolPublisher(zmq_ctx, event_port, replay_port)
    # Two stored blocks on Device, tokens 1..8, before the service starts: it must learn them
    # from the snapshot (no live batch published yet).
    pub.set_snapshot([stored([11, 12], None, list(range(1, 9)), BLOCK, medium="gpu")],
                     watermark=None)
    pub.start()
    try:
        server = Server(tmp_path, http_port,
                        ["--kv_events_config_file", str(cfg),
                         "--internal_api_token_file", str(token_file)])
        servers.append(server)
        server.wait_healthy()
        wait_for(lambda: server.get("/ready?streams=synchronized").status_code == 200, timeout_s=20,
                 interval_s=0.05, what="/ready 200")
        assert server.get("/ready?streams=synchronized").json()["streams"] == [{
            "instance_name": INSTANCE, "dp_rank": 0, "state": "synchronized",
            "synchronized_once": True, "sequence": None, "error": None,
            "device_blocks": 2, "host_blocks": 0, "recoveries": 1, "resync_differences": 0,
            "completeness": "exact", "replay_mode": "snapshot"}]

        # The token comes from the file; without it: 401.
        assert server.post(QUERY, json={"token_ids": [1]}).status_code == 401
        r = server.post(QUERY, headers=AUTH, json={"token_ids": list(range(1, 11))})
        assert r.status_code == 200
        assert r.json() == {"matches": [{
            "instance_name": INSTANCE, "dp_rank": 0, "synchronized": True, "sequence": None,
            "device_hit_tokens": 8, "host_only_hit_tokens": 0, "reusable_prefix_tokens": 8,
            "device_blocks": 2, "host_blocks": 0, "error": None, "completeness": "exact",
            "pending_hit_tokens": 0}]}

        # A live delta (seq 0) adds block 2 on Host: 8 device + 4 host-only tokens.
        pub.wait_subscribed(timeout_s=10)
        assert pub.publish([stored([13], 12, [9, 10, 11, 12], BLOCK, medium="cpu")]) == 0

        def at_seq_0() -> dict | None:
            match = server.post(QUERY, headers=AUTH,
                                json={"token_ids": list(range(1, 14))}).json()["matches"][0]
            return match if match["sequence"] == 0 else None
        assert wait_for(at_seq_0, timeout_s=10, interval_s=0.05, what="seq 0 applied") == {
            "instance_name": INSTANCE, "dp_rank": 0, "synchronized": True, "sequence": 0,
            "device_hit_tokens": 8, "host_only_hit_tokens": 4, "reusable_prefix_tokens": 12,
            "device_blocks": 2, "host_blocks": 1, "error": None, "completeness": "exact",
            "pending_hit_tokens": 0}

        cmdlines = group_cmdlines(server.pgid)
        assert len(cmdlines) == 2  # arbiter + one worker
        assert all(TOKEN.encode() not in c for c in cmdlines)

        assert server.stop(signal.SIGINT) == 0
        assert not group_alive(server.pgid)
        assert "Traceback" not in server.log()
    finally:
        pub.close()


def group_cmdlines(pgid: int) -> list[bytes]:
    """Command lines of the processes of group ``pgid`` (ones exiting meanwhile skipped)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(pid)) == pgid:
                out.append(Path(f"/proc/{pid}/cmdline").read_bytes())
        except (ProcessLookupError, FileNotFoundError):
            continue
    return out


def test_serve_index_disabled_sigterm(tmp_path, servers):
    http_port = free_port()
    server = Server(tmp_path, http_port, ["--kv_events_config_file", ""],
                    env={**serve_env(), "KVSVC_INTERNAL_API_TOKEN": TOKEN})
    servers.append(server)
    server.wait_healthy()
    wait_for(lambda: server.get("/ready?streams=synchronized").status_code == 200, timeout_s=20, interval_s=0.05,
             what="/ready 200")
    r = server.post(QUERY, headers=AUTH, json={"token_ids": [1, 2, 3]})
    assert (r.status_code, r.json()) == (200, {"matches": []})
    assert server.stop(signal.SIGTERM) == 0
    assert not group_alive(server.pgid)
    assert "index disabled" in server.log()


@pytest.mark.parametrize("args, field", [
    (["--kv_events_config_file", "BAD"], "streams[0].endpoint"),
    (["--kv_events_config_file", "MISSING"], "kv_events_config_file"),
    (["--port", "0"], "--port"),
    (["--max_query_tokens", "0"], "--max_query_tokens"),
    (["--internal_api_token_file", "MISSING"], "internal_api_token_file"),
])
def test_bad_config_exits_2_naming_the_field(tmp_path, args, field):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"streams": [{"instance_name": "a", "endpoint": "tcp://*:5000",
                                            "replay_endpoint": "tcp://127.0.0.1:5001"}]}),
                   encoding="utf-8")
    args = [str(bad) if a == "BAD" else str(tmp_path / "missing") if a == "MISSING" else a
            for a in args]
    # A repeated flag takes its last value, so "--port 0" in args overrides the free port.
    proc = subprocess.run([sys.executable, "-m", "kvsvc", "serve", "--port", str(free_port()),
                           *args],
                          env=serve_env(), stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert f"invalid configuration: {field}:" in proc.stderr
    assert proc.stdout == ""


def test_check_config_command(tmp_path):
    example = ROOT / "config" / "kv_events_static_example.json"
    proc = subprocess.run([sys.executable, "-m", "kvsvc", "check-config",
                           "--kv_events_config_file", str(example)],
                          env=serve_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert "streams: 3 configured, 3 kept (max_streams=128), 2 instances" in proc.stdout
    assert "worker: 128 threads; snapshots at once: 1" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "kvsvc", "check-config",
                           "--kv_events_config_file", str(example), "--worker_threads", "32",
                           "--max_concurrent_snapshots", "4"],
                          env=serve_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert "worker: 32 threads; snapshots at once: 4" in proc.stdout
    bad = tmp_path / "bad.json"
    bad.write_text('{"max_streams": 0}', encoding="utf-8")
    proc = subprocess.run([sys.executable, "-m", "kvsvc", "check-config",
                           "--kv_events_config_file", str(bad)],
                          env=serve_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "invalid configuration: max_streams:" in proc.stderr
