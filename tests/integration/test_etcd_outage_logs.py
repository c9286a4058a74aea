"""An etcd outage in the log (a real etcd stopped, or paused, then back): one WARNING when it
goes (address and kind), one INFO when it is back (how long it was down), nothing per retry in
between, from the registry's etcd thread and the election alike (one shared tracker), and no
urllib3 line at all."""

from __future__ import annotations

import logging
import re

import pytest

from kvsvc.cluster.model import RegistrySettings
from kvsvc.cluster.registry import Registry
from tests.support.util import wait_for

#: Longest accepted log line (the 330-character urllib3 text must not come back).
MAX_LINE = 200


def settings(addr: str) -> RegistrySettings:
    # Short periods: many retries of both threads within a few seconds.
    return RegistrySettings(etcd_addr=addr, namespace="o", relist_interval_s=0.5,
                            master_lease_ttl_s=1, loadmetrics_interval_s=0.3,
                            self_address="svc-o:1")


def outage_lines(caplog, start: int) -> list[logging.LogRecord]:
    return [r for r in caplog.records[start:]
            if r.name.startswith(("kvsvc.", "urllib3", "requests", "etcd3gw"))
            and r.levelno >= logging.INFO and r.name != "kvsvc.testbed.etcd_launcher"]


@pytest.mark.etcd_fresh
def test_stopped_etcd_is_one_warning_and_one_recovery_line(etcd_server, caplog):
    caplog.set_level(logging.DEBUG)
    registry = Registry(settings(etcd_server.addr))
    registry.start()
    try:
        registry.wait_for(lambda s: s.fresh and s.is_master, timeout_s=10.0)
        start = len(caplog.records)
        etcd_server.stop()
        # Until the election gave up the master key (a whole lease TTL of failed keep-alives,
        # about 3 election turns) and the registry has retried its list several times.
        registry.wait_for(lambda s: not s.fresh and not s.is_master, timeout_s=15.0)
        down = outage_lines(caplog, start)
        etcd_server.start()
        registry.wait_for(lambda s: s.fresh and s.is_master, timeout_s=15.0)
        wait_for(lambda: any("reachable again" in r.getMessage()
                             for r in outage_lines(caplog, start)), timeout_s=10.0)
        lines = outage_lines(caplog, start)
    finally:
        registry.close()
    addr = re.escape(etcd_server.addr)
    messages = [r.getMessage() for r in lines]
    warnings = [r.getMessage() for r in lines if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, messages
    assert re.fullmatch(rf"etcd {addr} unreachable \(connection refused\); the registry keeps "
                        r"its last view and retries", warnings[0]), warnings
    back = [m for m in messages if "reachable again" in m]
    assert len(back) == 1 and re.fullmatch(
        rf"etcd {addr} reachable again after \d+\.\d s down \(\d+ failed requests, last: "
        r"[a-z ]+\)", back[0]), messages
    failed = int(re.search(r"\((\d+) failed", back[0]).group(1))
    # Both threads failed many times, yet the whole outage is a handful of lines: the
    # warning, the registry's not-fresh and fresh lines, mastership lost and won, the recovery.
    assert failed >= 5, back
    assert len(lines) <= 8, messages
    assert len(down) <= 4, [r.getMessage() for r in down]
    assert not [r for r in lines if not r.name.startswith("kvsvc.")], messages
    assert max(len(m) for m in messages) <= MAX_LINE, messages
    # The DEBUG level still has each failure, short.
    debug = [r.getMessage() for r in caplog.records[start:]
             if r.name.startswith("kvsvc.") and r.levelno == logging.DEBUG]
    assert any("connection refused" in m for m in debug)


@pytest.mark.etcd_fresh
def test_paused_etcd_is_one_timeout_warning(etcd_server, caplog):
    """A hung etcd (SIGSTOP): every request times out; still one line when it starts."""
    caplog.set_level(logging.INFO)
    registry = Registry(settings(etcd_server.addr))
    registry.start()
    try:
        registry.wait_for(lambda s: s.fresh and s.is_master, timeout_s=10.0)
        start = len(caplog.records)
        with etcd_server.paused():
            registry.wait_for(lambda s: not s.fresh and not s.is_master, timeout_s=20.0)
        registry.wait_for(lambda s: s.fresh and s.is_master, timeout_s=15.0)
        wait_for(lambda: any("reachable again" in r.getMessage()
                             for r in outage_lines(caplog, start)), timeout_s=10.0)
        lines = outage_lines(caplog, start)
    finally:
        registry.close()
    warnings = [r.getMessage() for r in lines if r.levelno >= logging.WARNING]
    assert warnings == [f"etcd {etcd_server.addr} unreachable (timeout); the registry keeps its "
                        "last view and retries"], [r.getMessage() for r in lines]
    assert len(lines) <= 8, [r.getMessage() for r in lines]
