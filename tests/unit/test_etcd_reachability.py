"""``kvsvc.cluster.etcd.EtcdReachability``: an etcd outage is one WARNING when it starts, at
most one summary per interval while it lasts, one INFO when it ends (clock set by the test);
``error_kind`` names failures in a few words."""

from __future__ import annotations

import logging

import pytest
import requests
from etcd3gw import exceptions as etcd_exc

from kvsvc.cluster.etcd import EtcdReachability, error_kind

LOGGER = "kvsvc.cluster.etcd"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def lines(caplog) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOGGER]


def test_one_outage_gives_one_warning_a_summary_per_interval_and_one_recovery_line(caplog):
    clock = Clock()
    tracker = EtcdReachability("127.0.0.1:2379", summary_interval_s=60.0, clock=clock)
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    tracker.succeeded()
    assert tracker.reachable and lines(caplog) == []
    # Two threads failing every 0.5 s for 150 s: 600 failures.
    for _ in range(300):
        tracker.failed("connection refused")
        tracker.failed("connection refused")
        clock.now += 0.5
    tracker.failed("timeout")
    assert not tracker.reachable
    clock.now += 0.25
    tracker.succeeded()
    tracker.succeeded()
    assert tracker.reachable
    assert lines(caplog) == [
        (logging.WARNING, "etcd 127.0.0.1:2379 unreachable (connection refused); the registry "
                          "keeps its last view and retries"),
        (logging.WARNING, "etcd 127.0.0.1:2379 still unreachable after 60 s (241 failed "
                          "requests, last: connection refused)"),
        (logging.WARNING, "etcd 127.0.0.1:2379 still unreachable after 120 s (481 failed "
                          "requests, last: connection refused)"),
        (logging.INFO, "etcd 127.0.0.1:2379 reachable again after 150.2 s down (601 failed "
                       "requests, last: timeout)"),
    ]
    # A second outage starts its own count.
    caplog.clear()
    tracker.failed("timeout")
    clock.now += 2.0
    tracker.succeeded()
    assert lines(caplog) == [
        (logging.WARNING, "etcd 127.0.0.1:2379 unreachable (timeout); the registry keeps its "
                          "last view and retries"),
        (logging.INFO, "etcd 127.0.0.1:2379 reachable again after 2.0 s down (1 failed "
                       "requests, last: timeout)"),
    ]


def _raised(make_inner, outer):
    """The etcd3gw exception raised while handling a requests one, as etcd3gw does."""
    try:
        try:
            raise make_inner()
        except requests.RequestException as inner:
            raise outer(str(inner))
    except etcd_exc.Etcd3Exception as exc:
        return exc


@pytest.mark.parametrize("exc, kind", [
    (_raised(lambda: requests.ConnectionError(
        "HTTPConnectionPool(host='127.0.0.1', port=1): Max retries exceeded with url: /v3/kv/"
        "range (Caused by NewConnectionError(\"HTTPConnection(host='127.0.0.1', port=1): "
        "Failed to establish a new connection: [Errno 111] Connection refused\"))"),
        etcd_exc.ConnectionFailedError), "connection refused"),
    (_raised(lambda: requests.ReadTimeout("read timed out"), etcd_exc.ConnectionTimeoutError),
     "timeout"),
    (_raised(lambda: requests.ConnectionError(
        "('Connection aborted.', ConnectionResetError(104, 'Connection reset by peer'))"),
        etcd_exc.ConnectionFailedError), "connection reset"),
    (etcd_exc.ConnectionFailedError("upstream down", "Service Unavailable"),
     "HTTP Service Unavailable"),
    (etcd_exc.InternalServerError("boom", "Internal Server Error"), "HTTP Internal Server Error"),
    (ValueError("x"), "ValueError"),
])
def test_error_kind_is_short(exc, kind):
    assert error_kind(exc) == kind
