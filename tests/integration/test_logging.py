"""Structured logs (kvsvc.server.log_config through gunicorn's logconfig_dict): JSON lines by
default, plain text on request, the access log off unless enabled, no line per request, and the
internal token in no log line and no process's command line."""

from __future__ import annotations

import io
import json
import logging
import logging.config
from pathlib import Path

import pytest
import requests

from kvsvc.server import log_config
from tests.support.publisher import ProtocolPublisher, stored
from tests.support.systemd import (
    BS,
    INSTANCE,
    TOKEN,
    Deployment,
    Running,
    command,
    one,
    wait_healthy,
)
from tests.support.util import free_ports, wait_for


@pytest.fixture
def restore_logging():
    """dictConfig replaces handlers process-wide: put the test runner's back afterwards."""
    saved = {name: (lg.handlers[:], lg.level, lg.propagate) for name, lg in
             [("", logging.getLogger())] + [(n, logging.getLogger(n)) for n in
                                            ("gunicorn.error", "gunicorn.access")]}
    yield
    for name, (handlers, level, propagate) in saved.items():
        lg = logging.getLogger(name)
        lg.handlers[:] = handlers
        lg.setLevel(level)
        lg.propagate = propagate


def configure(monkeypatch, *args, **kwargs) -> tuple[io.StringIO, io.StringIO]:
    err, out = io.StringIO(), io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.setattr("sys.stdout", out)
    logging.config.dictConfig(log_config(*args, **kwargs))
    return err, out


def test_json_lines_with_fields_and_exceptions(monkeypatch, restore_logging):
    err, out = configure(monkeypatch, "info", "json", access_log=False)
    log = logging.getLogger("kvsvc.streams.subscriber")
    log.info("stream %s: synchronized", "a:1/dp0")
    log.debug("not at info")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("stream %s: internal error", "a:1/dp0")
    logging.getLogger("gunicorn.access").info("%(h)s", {"h": "x"})
    lines = [json.loads(line) for line in err.getvalue().splitlines()]
    assert [(d["level"], d["logger"], d["message"]) for d in lines] == [
        ("INFO", "kvsvc.streams.subscriber", "stream a:1/dp0: synchronized"),
        ("ERROR", "kvsvc.streams.subscriber", "stream a:1/dp0: internal error")]
    assert all(set(d) >= {"timestamp", "process"} for d in lines)
    assert "ValueError: boom" in lines[1]["exc_info"]
    assert out.getvalue() == ""  # access log off: nothing at all


def test_text_format_and_access_log_on(monkeypatch, restore_logging):
    err, out = configure(monkeypatch, "warning", "text", access_log=True)
    logging.getLogger("kvsvc.cluster.registry").warning("registry: snapshot not fresh (%s)", "down")
    logging.getLogger("kvsvc.cluster.registry").info("hidden")
    logging.getLogger("gunicorn.access").info("%(h)s %(s)s", {"h": "127.0.0.1", "s": "200"})
    assert err.getvalue().count("\n") == 1
    assert err.getvalue().rstrip().endswith(
        "[WARNING] kvsvc.cluster.registry: registry: snapshot not fresh (down)")
    assert out.getvalue().rstrip().endswith("[INFO] gunicorn.access: 127.0.0.1 200")


def own_cmdlines() -> list[bytes]:
    """Every readable /proc/<pid>/cmdline on the machine."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                out.append((entry / "cmdline").read_bytes())
            except OSError:
                pass  # gone meanwhile, or not ours to read
    return out


@pytest.mark.parametrize("access_log", [False, True])
def test_serve_logs_json_no_token_no_line_per_request(tmp_path, zmq_ctx, access_log):
    event_port, replay_port = free_ports(2)
    engine = ProtocolPublisher(zmq_ctx, event_port, replay_port).start()
    run = None
    try:
        engine.set_snapshot([stored([1, 2], None, range(8), BS)], watermark=None)
        dep = Deployment(tmp_path, event_port, replay_port,
                         {"KVSVC_ACCESS_LOG": "true" if access_log else "false"})
        run = Running(command(one(dep.svc, "ExecStart"), dep.creds), dep.env,
                      tmp_path / "serve.log")
        wait_healthy(run, dep.base)
        wait_for(lambda: requests.get(dep.base + "/ready?streams=synchronized", timeout=2).status_code == 200,
                 timeout_s=15, what="/ready 200")
        # The synchronized line may follow /ready's 200 by a moment: count lines after it.
        wait_for(lambda: "synchronized (" in run.log(), timeout_s=5, what="synchronized line")
        before = run.log().count("\n")
        query = dep.base + "/v1/internal/kv-cache/query"
        statuses = []
        for headers in ({"X-Internal-Token": TOKEN}, {"X-Internal-Token": TOKEN + "x"},
                        {"X-Internal-Token": "wrong"}, {}) * 5:
            statuses.append(requests.post(query, json={"token_ids": [1, 2, 3, 4]},
                                          headers=headers, timeout=5).status_code)
            statuses.append(requests.post(dep.base + "/v1/internal/heartbeat",
                                          json={"name": "x"}, headers=headers,
                                          timeout=5).status_code)
        statuses.append(requests.get(dep.base + "/metrics", timeout=5).status_code)
        assert statuses.count(200) == 6 and statuses.count(401) == 30
        assert statuses.count(400) == 5  # heartbeat bodies with the right token are malformed
        cmdlines = own_cmdlines()
        assert any(b"gunicorn" in c for c in cmdlines)
        assert not [c for c in cmdlines if TOKEN.encode() in c]
    finally:
        if run is not None:
            assert run.stop() == 0
        engine.close()
    text = run.log()
    assert TOKEN not in text
    lines = [json.loads(line) for line in text.splitlines()]  # every line is a JSON object
    assert all({"timestamp", "level", "logger", "message"} <= set(d) for d in lines)
    # Between the first request and the stop signal: one access line per request when the
    # access log is enabled (41), none otherwise, and no other line at all.
    stop_at = next(i for i, d in enumerate(lines) if d["message"].startswith("Handling signal"))
    during = lines[before:stop_at]
    # (/ready polls before `before` may have their access line written just after it.)
    access = [d for d in during if d["logger"] == "gunicorn.access"
              and "/health" not in d["message"] and "/ready" not in d["message"]]
    assert len(access) == (41 if access_log else 0)
    # Besides: one WARNING per refused heartbeat sender and reason (issue 13), not per request.
    assert [d["message"] for d in during if d["logger"] != "gunicorn.access"] == [
        "heartbeats from a sender that claims to be x refused: token mismatch: the sender's "
        "X-Internal-Token differs from --internal_api_token; its load is not recorded",
        "heartbeats from a sender that claims to be x refused: missing X-Internal-Token: the "
        "sender sends no token but --internal_api_token is set; its load is not recorded"]
    if not access_log:
        assert not [d for d in lines if d["logger"] == "gunicorn.access"]
    synced = [d["message"] for d in lines if d["logger"] == "kvsvc.streams.recovery"
              and "synchronized (" in d["message"]]
    assert len(synced) == 1 and synced[0].startswith(f"stream {INSTANCE}/dp0: synchronized")
