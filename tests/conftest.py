"""Shared fixtures of every test group (``unit/``, ``integration/``, ``e2e/``, ``fuzz/``).

- ``clean_env`` (autouse): no ``KVSVC_*`` variable of the outer environment reaches a test; it
  returns the ``monkeypatch`` so a test can set its own.
- ``no_thread_leak`` (autouse): fails a test that leaves a thread running (every thread a test
  starts must be stopped by its owner's ``close()``).
- ``zmq_ctx``: a ZMQ context per test.
- ``etcd_server``: a real etcd on free loopback ports (``tests/etcd_server.py``); ``etcd``: a
  client of it.
- ``raw_engine``: a protocol publisher (``tests/publisher.py``) on free loopback ports.

Support modules beside this file: ``util.py`` (bounded waits, free ports), ``publisher.py``
(engines built from PROTOCOL.md), ``etcd_server.py``.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Iterator

import pytest
import zmq


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """Settings come only from what each test passes, never from the outer environment."""
    for key in [k for k in os.environ if k.startswith("KVSVC_")]:
        monkeypatch.delenv(key)
    return monkeypatch


@pytest.fixture
def zmq_ctx():
    """A fresh ZMQ context, terminated after the test (sockets left open would hang term, so
    linger is 0 and term is bounded by closing every socket the context still has)."""
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture(autouse=True)
def no_thread_leak():
    """Fail the test if it leaves new threads alive (waits up to 5 s for them to finish)."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 5.0
    while True:
        leaked = [t for t in threading.enumerate()
                  if t not in before and t.is_alive() and not t.name.startswith("pydevd")]
        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert not leaked, f"threads left running: {[t.name for t in leaked]}"


@pytest.fixture
def etcd_server():
    """A real etcd on free loopback ports with a temporary data dir (tests/etcd_server.py);
    skipped when the binary is missing, failed instead under ``CI``. Stopped and removed after."""
    from tests.etcd_server import EtcdServer, require_etcd_binary

    server = EtcdServer(require_etcd_binary())
    try:
        server.start()
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def etcd(etcd_server) -> Iterator[object]:
    """A :class:`kvsvc.cluster.etcd.EtcdClient` of ``etcd_server``, closed after the test."""
    from kvsvc.cluster.etcd import EtcdClient

    client = EtcdClient(etcd_server.addr)
    yield client
    client.close()


@pytest.fixture
def raw_engine(zmq_ctx):
    """A started :class:`tests.publisher.ProtocolPublisher` on free loopback ports (a protocol
    engine whose every batch the test chooses), closed after the test."""
    from tests.publisher import ProtocolPublisher
    from tests.util import free_ports

    event_port, replay_port = free_ports(2)
    pub = ProtocolPublisher(zmq_ctx, event_port, replay_port).start()
    try:
        yield pub
    finally:
        pub.close()
