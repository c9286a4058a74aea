"""Shared fixtures of every test group (``unit/``, ``integration/``, ``e2e/``, ``fuzz/``).

- ``clean_env`` (autouse): no ``KVSVC_*`` variable of the outer environment reaches a test; it
  returns the ``monkeypatch`` so a test can set its own.
- ``no_thread_leak`` (autouse): fails a test that leaves a thread running (every thread a test
  starts must be stopped by its owner's ``close()``).
- ``zmq_ctx``: a ZMQ context per test.
- ``etcd_server``: a real etcd (``tests/support/etcd_server.py``): the session's one with a clean
  keyspace, or, for a test marked ``etcd_fresh`` (it stops, pauses or restarts etcd), a fresh one
  of its own; ``etcd``: a client of it.
- ``raw_engine``: a protocol publisher (``tests/support/publisher.py``) on free loopback ports.

Shared helpers live in the package ``tests/support/`` (bounded waits and free ports, engines built
from PROTOCOL.md, etcd, gunicorn, upstreams, ...); no test module imports another test module
(``tests/unit/test_suite_layout.py`` checks it).

Markers (registered in pyproject.toml, ``--strict-markers``): ``etcd`` (needs a real etcd: given
automatically to every test using an etcd fixture; skipped when the binary is missing, failed
instead under ``CI``), ``etcd_fresh`` (gets an etcd of its own) and ``slow`` (over ~30 s).
Tiers: ``make test-fast`` is ``tests/unit`` (no sockets, no sleeps: ``tests/unit/conftest.py``
refuses both), ``make test-rest`` every other test, ``make test`` both.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Iterator

import pytest
import zmq


def pytest_configure(config):
    """etcd3gw runs each watch on a futurist thread pool whose idle worker notices its stop flag
    only every ``MAX_IDLE_FOR`` (1 s): after a cancelled watch the thread-leak check below would
    wait up to that long for it, per test. Polled every 20 ms here, a stopped worker ends at once;
    one never stopped still stays and is still reported."""
    from futurist import _thread

    _thread.ThreadWorker.MAX_IDLE_FOR = 0.02


#: Fixtures that start or use a real etcd: a test requesting one is marked ``etcd``.
ETCD_FIXTURES = frozenset({"etcd_server", "etcd"})


def pytest_collection_modifyitems(config, items):
    """Every test using an etcd fixture carries the ``etcd`` marker, so ``-m "not etcd"`` and
    ``-m etcd`` select by what a test needs, whoever wrote it."""
    for item in items:
        if (ETCD_FIXTURES & set(getattr(item, "fixturenames", ()))
                or item.get_closest_marker("etcd_fresh") is not None):
            item.add_marker(pytest.mark.etcd)


def pytest_runtest_setup(item):
    """A test marked ``etcd`` is skipped when the etcd binary is missing, and failed instead
    under ``CI`` (CI must install ``etcd-server``; a missing dependency never goes green)."""
    if item.get_closest_marker("etcd") is not None:
        from tests.support.etcd_server import require_etcd_binary

        require_etcd_binary()


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """Settings come only from what each test passes, never from the outer environment.
    One exception: ``KVSVC_RPC_PORT=0``, so that no kvsvc a test starts (in process or as a
    child, which inherits it) binds the fixed baidu_std port 8889 (§13) beside another; the
    tests of that port pass ``rpc_port`` themselves."""
    for key in [k for k in os.environ if k.startswith("KVSVC_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("KVSVC_RPC_PORT", "0")
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


@pytest.fixture(scope="session")
def etcd_session_server():
    """One real etcd for the whole session, started on first use (``etcd_server`` hands it to
    the tests that only need a clean keyspace); stopped and removed at the end."""
    from tests.support.etcd_server import fresh_etcd

    with fresh_etcd() as server:
        yield server


@pytest.fixture
def etcd_server(request):
    """A real etcd on free loopback ports (tests/support/etcd_server.py); skipped when the
    binary is missing, failed instead under ``CI``.

    By default the session's etcd with a clean keyspace (:class:`SharedEtcd`: every key and
    lease removed before and after the test; stop/pause/restart refused). A test marked
    ``etcd_fresh`` (it stops, pauses or restarts etcd) gets a fresh server of its own with a
    temporary data dir, stopped and removed after it.
    """
    from tests.support.etcd_server import SharedEtcd, fresh_etcd

    if request.node.get_closest_marker("etcd_fresh") is None:
        shared = SharedEtcd(request.getfixturevalue("etcd_session_server"))
        shared.reset()
        try:
            yield shared
        finally:
            shared.reset()
        return
    with fresh_etcd() as server:
        yield server


@pytest.fixture
def etcd(etcd_server) -> Iterator[object]:
    """A :class:`kvsvc.cluster.etcd.EtcdClient` of ``etcd_server``, closed after the test."""
    from kvsvc.cluster.etcd import EtcdClient

    client = EtcdClient(etcd_server.addr)
    yield client
    client.close()


@pytest.fixture
def raw_engine(zmq_ctx):
    """A started :class:`tests.support.publisher.ProtocolPublisher` on free loopback ports (a protocol
    engine whose every batch the test chooses), closed after the test."""
    from tests.support.publisher import ProtocolPublisher
    from tests.support.util import free_ports

    event_port, replay_port = free_ports(2)
    pub = ProtocolPublisher(zmq_ctx, event_port, replay_port).start()
    try:
        yield pub
    finally:
        pub.close()
