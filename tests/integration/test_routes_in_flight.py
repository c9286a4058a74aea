"""In-flight accounting of proxied requests (kvsvc.routing.in_flight.InFlight) through the real app: the
Flask test client, a real Registry on a real etcd, and real upstream HTTP servers on 127.0.0.1
(tests/integration/test_proxy.Upstream). Every count is exact: one request in flight per instance while its
upstream is sending, none once the response was relayed, failed, or the client went away."""

from __future__ import annotations

import threading

import pytest

from kvsvc.http.extensions import ROUTING_EXTENSION
from kvsvc.http.internal import HEARTBEAT_PATH, ROUTE_PATH
from tests.support.upstreams import refused_name, upstreams
# clean_env (autouse) and etcd are tests/conftest.py fixtures.
from tests.support.routes import AUTH, completion, register, running
from tests.support.util import wait_for


def counts(app) -> dict[str, int]:
    return app.extensions[ROUTING_EXTENSION].in_flight.counts()


def candidates(app) -> dict[str, tuple[int, int, int]]:
    """P candidates -> (reported waiting, in flight, in flight after the load report)."""
    r = app.test_client().post(ROUTE_PATH, headers=AUTH, json={"token_ids": [1, 2, 3]})
    assert r.status_code == 200, r.get_json()
    return {c["name"]: (c["waiting_requests_num"], c["in_flight"], c["in_flight_after_report"])
            for c in r.get_json()["candidates"] if c["side"] == "P"}


def heartbeat(app, name: str, waiting: int) -> None:
    r = app.test_client().post(HEARTBEAT_PATH, headers=AUTH, json={
        "name": name, "incarnation_id": f"inc-{name}",
        "load_metrics": {"waiting_requests_num": waiting, "gpu_cache_usage_perc": 0.0}})
    assert r.status_code == 200, r.get_json()


def test_non_streamed_success_counts_none_after_the_answer(etcd_server, etcd):
    with upstreams("json") as (up,), running(etcd_server) as app:
        register(app, etcd, up.name)
        client = app.test_client()
        for _ in range(3):
            assert completion(client, {"model": "m1", "prompt": [1]}).status_code == 200
        assert counts(app) == {}
        assert candidates(app) == {up.name: (0, 0, 0)}


def test_stream_counts_one_until_fully_relayed_then_none(etcd_server, etcd):
    with upstreams("sse") as (up,), running(etcd_server) as app:
        register(app, etcd, up.name)
        r = completion(app.test_client(), {"model": "m1", "prompt": [1], "stream": True},
                       buffered=False)
        chunks = iter(r.response)
        assert next(chunks) == b"data: 0\n\n"
        assert counts(app) == {up.name: 1}
        # Sent after the instance's load report: added to its waiting.
        assert candidates(app) == {up.name: (0, 1, 1)}
        heartbeat(app, up.name, waiting=0)  # a report received after the dispatch covers it
        assert candidates(app) == {up.name: (0, 1, 0)}
        up.release.set()
        assert b"".join(chunks) == b"data: 1\n\ndata: [DONE]\n\n"
        r.close()  # the WSGI server closes the body after the last chunk
        assert counts(app) == {}


def test_error_status_and_broken_body_release_the_count(etcd_server, etcd):
    with upstreams("error", "cut") as (err, cut), running(etcd_server) as app:
        register(app, etcd, err.name, waiting=0)
        register(app, etcd, cut.name, waiting=5)
        client = app.test_client()
        r = completion(client, {"model": "m1", "prompt": [1]})
        assert (r.status_code, r.headers["x-kvsvc-prefill"]) == (500, err.name)
        assert counts(app) == {}
        heartbeat(app, err.name, waiting=10)  # now the cut upstream ranks first
        r = completion(client, {"model": "m1", "prompt": [1]})
        assert r.status_code == 502
        assert len(cut.requests) == 1
        assert counts(app) == {}


def test_retry_moves_the_count_to_the_next_candidate(etcd_server, etcd):
    dead = refused_name()
    with upstreams("sse") as (up,), running(etcd_server) as app:
        register(app, etcd, dead, waiting=0)
        register(app, etcd, up.name, waiting=4)  # queue cost 1: ranked second
        r = completion(app.test_client(), {"model": "m1", "prompt": [1], "stream": True},
                       buffered=False)
        assert r.headers["x-kvsvc-prefill"] == up.name
        chunks = iter(r.response)
        assert next(chunks) == b"data: 0\n\n"
        assert counts(app) == {up.name: 1}
        assert candidates(app) == {dead: (0, 0, 0), up.name: (4, 1, 1)}
        up.release.set()
        assert b"".join(chunks).endswith(b"[DONE]\n\n")
        r.close()
        assert counts(app) == {}
        assert app.extensions[ROUTING_EXTENSION].proxy.failures() == {dead: 1}


def test_every_attempt_refused_counts_none(etcd_server, etcd):
    dead = [refused_name(), refused_name()]
    with running(etcd_server) as app:
        for name in dead:
            register(app, etcd, name)
        r = completion(app.test_client(), {"model": "m1", "prompt": [1]})
        assert r.status_code == 502
        assert counts(app) == {}


@pytest.mark.parametrize("chunks_read", [0, 1])
def test_client_going_away_mid_stream_releases_the_count(etcd_server, etcd, chunks_read):
    with upstreams("flood") as (up,), running(etcd_server) as app:
        register(app, etcd, up.name)
        r = completion(app.test_client(), {"model": "m1", "prompt": [5], "stream": True},
                       buffered=False)
        it = iter(r.response)
        for _ in range(chunks_read):
            assert next(it).startswith(b"data: xxx")
        assert counts(app) == {up.name: 1}
        r.close()  # what the WSGI server does when the client disconnects
        assert counts(app) == {}
        r.close()  # a second close changes nothing
        assert counts(app) == {}
        wait_for(up.broken.is_set, timeout_s=10.0, what="upstream write to fail")


def test_pd_request_counts_on_its_prefill_and_decode(etcd_server, etcd):
    with upstreams("sse") as (p,), running(etcd_server) as app:
        register(app, etcd, p.name, "PREFILL")
        register(app, etcd, "127.0.0.1:1", "DECODE")
        r = completion(app.test_client(), {"model": "m1", "prompt": [1], "stream": True},
                       buffered=False)
        chunks = iter(r.response)
        assert next(chunks) == b"data: 0\n\n"
        assert counts(app) == {p.name: 1, "127.0.0.1:1": 1}
        body = app.test_client().post(ROUTE_PATH, headers=AUTH,
                                      json={"token_ids": [1]}).get_json()
        assert [(c["side"], c["in_flight"], c["in_flight_after_report"])
                for c in body["candidates"]] == [("P", 1, 1), ("D", 1, 1)]
        p.release.set()
        b"".join(chunks)
        r.close()
        assert counts(app) == {}


def test_concurrent_streams_count_exactly(etcd_server, etcd):
    with upstreams("sse") as (up,), running(etcd_server) as app:
        register(app, etcd, up.name)
        n = 6
        opened: list = []
        lock = threading.Lock()

        def one() -> None:
            r = completion(app.test_client(), {"model": "m1", "prompt": [1], "stream": True},
                           buffered=False)
            it = iter(r.response)
            next(it)
            with lock:
                opened.append((r, it))

        threads = [threading.Thread(target=one) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10.0)
        assert len(opened) == n
        assert counts(app) == {up.name: n}
        up.release.set()
        for i, (r, it) in enumerate(opened):
            b"".join(it)
            r.close()
            assert counts(app) == ({up.name: n - i - 1} if i < n - 1 else {})


def test_metric_shows_in_flight_per_instance(etcd_server, etcd):
    with upstreams("sse") as (up,), running(etcd_server) as app:
        register(app, etcd, up.name)
        register(app, etcd, "127.0.0.1:1", waiting=9)
        r = completion(app.test_client(), {"model": "m1", "prompt": [1], "stream": True},
                       buffered=False)
        chunks = iter(r.response)
        next(chunks)
        text = app.test_client().get("/metrics").get_data(as_text=True)
        lines = sorted(line for line in text.splitlines()
                       if line.startswith("kvsvc_proxy_in_flight_requests{"))
        assert lines == ['kvsvc_proxy_in_flight_requests{instance="127.0.0.1:1"} 0.0',
                         f'kvsvc_proxy_in_flight_requests{{instance="{up.name}"}} 1.0']
        up.release.set()
        b"".join(chunks)
        r.close()
        assert counts(app) == {}
