"""SLO_AWARE and TTFT through the real app (Flask test client, a real Registry on a real etcd,
simulated engines serving on 127.0.0.1): the registration's profiling data reaches the
predictors, ``/v1/internal/route`` shows each candidate's predicted times, a streamed answer is
counted in the request-metrics ledger from dispatch to its end (prefill while no token was
relayed), malformed profiling data leaves the instance routable with one WARNING, and
out-of-range targets refuse start-up naming the flag."""

from __future__ import annotations

import json
import logging
from contextlib import ExitStack

import pytest

from kvsvc.cli import main
from kvsvc.http.extensions import EXTENSION, ROUTING_EXTENSION
from kvsvc.http.internal import HEARTBEAT_PATH, ROUTE_PATH
from kvsvc.routing.request_metrics import NO_REQUESTS, RequestMetricsLedger
from kvsvc.testbed.sim import SimEngine
from kvsvc.testbed.sim.serving import ServingConfig
# clean_env (autouse), etcd_server and etcd are tests/conftest.py fixtures.
from tests.support.upstreams import upstreams
from tests.support.routes import AUTH, NS, TYPES, completion, running
from tests.support.util import free_ports

#: ttft(n) = 2500.5 + 50 n ms (exact points; 200 tokens: 12500.5 ms, SLO_AWARE's whole-ms
#: truncation 12500), tpot = 1 + 0.5 batch ms.
TTFT_POINTS = [[n, 2500.5 + 50.0 * n] for n in (0, 100, 400, 1600)]
#: The P's estimate of a 200-token request, per policy.
ESTIMATE_MS = {"SLO_AWARE": 12500.0, "TTFT": 12500.5}
#: TTFT's queue is the pending prefill's remaining time on the wall clock: what elapsed
#: between the dispatch and the next decision (well under a second) is taken off it.
QUEUE_SLACK_MS = {"SLO_AWARE": 1e-6, "TTFT": 1000.0}
TPOT_POINTS = [[length, b, 1.0 + 0.5 * b] for length, b in ((10, 1), (20, 2), (40, 1), (8, 4))]


def sim(name: str) -> SimEngine:
    ev, rp, http = free_ports(3)
    return SimEngine(name, ev, rp, block_size=4, device_blocks=64, http_port=http,
                     serving=ServingConfig(prefill_us_per_token=100.0,
                                           decode_us_per_token=100.0, model="m1"))


def register(app, etcd, name: str, type_: str = "DEFAULT", **extra) -> None:
    etcd.put(f"/{NS}/XLLM:{type_}:{name}", json.dumps(
        {"name": name, "type": TYPES[type_], "incarnation_id": f"inc-{name}", **extra}))
    app.extensions[EXTENSION].registry.wait_for(lambda s: name in s.instances, timeout_s=10.0)
    r = app.test_client().post(HEARTBEAT_PATH, headers=AUTH, json={
        "name": name, "incarnation_id": f"inc-{name}",
        "load_metrics": {"waiting_requests_num": 0, "gpu_cache_usage_perc": 0.0}})
    assert r.status_code == 200, r.get_json()


def route(app, tokens: list[int]) -> dict:
    r = app.test_client().post(ROUTE_PATH, headers=AUTH, json={"token_ids": tokens})
    assert r.status_code == 200, r.get_json()
    return r.get_json()


def ledger(app):
    """The app's request-metrics ledger: the proxy's observer, or the one in its chain (the
    cached-token audit hears the same answers after it)."""
    observer = app.extensions[ROUTING_EXTENSION].proxy.observer
    chain = getattr(observer, "observers", (observer,))
    return next(o for o in chain if isinstance(o, RequestMetricsLedger))


@pytest.mark.parametrize("policy", ["SLO_AWARE", "TTFT"])
def test_a_request_in_prefill_raises_its_ps_estimate_until_its_end(etcd_server, etcd, policy):
    """The upstream sends its head and one event that is no token, then waits: the request
    stays in prefill on its P, with the estimate its decision made; the next decision sees it
    and picks the other P; the end brings the ledger back to zero."""
    with upstreams("sse", "sse") as ups, running(etcd_server,
                                                 load_balance_policy=policy) as app:
        for up in ups:
            register(app, etcd, up.name, ttft_profiling_data=TTFT_POINTS,
                     tpot_profiling_data=TPOT_POINTS)
        tokens = list(range(1, 201))
        decision = route(app, tokens)
        assert decision["policy"] == policy
        p = {c["name"]: c for c in decision["candidates"] if c["side"] == "P"}
        assert set(p) == {up.name for up in ups}
        for c in p.values():
            assert c["estimated_prefill_ms"] == 0.0
            assert c["predicted_prefill_ms"] == pytest.approx(ESTIMATE_MS[policy], abs=1e-6)
            assert c["predicted_ttft_ms"] == pytest.approx(ESTIMATE_MS[policy], abs=1e-6)
        r = completion(app.test_client(), {"model": "m1", "prompt": tokens, "max_tokens": 5,
                                           "stream": True}, buffered=False)
        first = r.headers["x-kvsvc-prefill"]
        # The answer names the chosen P's predicted TTFT (nothing queued there yet).
        assert float(r.headers["x-kvsvc-predicted-ttft-ms"]) == pytest.approx(
            ESTIMATE_MS[policy], abs=0.05)
        counted = ledger(app).snapshot().of(first)
        assert (counted.prefill_request_num, counted.prefill_token_num) == (1, 200)
        assert counted.estimated_prefill_ms == pytest.approx(ESTIMATE_MS[policy], abs=1e-6)
        second = route(app, tokens)
        assert second["prefill"] != first
        est = {c["name"]: c["estimated_prefill_ms"] for c in second["candidates"]}
        assert ESTIMATE_MS[policy] - QUEUE_SLACK_MS[policy] <= est[first] <= \
            ESTIMATE_MS[policy] + 1e-6
        assert est[second["prefill"]] == 0.0
        for up in ups:
            up.release.set()
        assert b"".join(r.response).endswith(b"data: [DONE]\n\n")
        r.close()
        assert ledger(app).snapshot().of(first) == NO_REQUESTS


def test_simulated_engines_answers_end_the_count(etcd_server, etcd):
    """SLO_AWARE against the simulated engine: streamed and non-streamed answers relayed to
    their end leave nothing counted."""
    with ExitStack() as stack:
        eng = sim("sim-a")
        eng.start()
        stack.callback(eng.close)
        app = stack.enter_context(running(etcd_server, load_balance_policy="SLO_AWARE"))
        name = f"127.0.0.1:{eng.http_port}"
        register(app, etcd, name, ttft_profiling_data=TTFT_POINTS)
        for stream in (True, False):
            r = completion(app.test_client(), {"model": "m1", "prompt": list(range(1, 41)),
                                               "max_tokens": 6, "stream": stream})
            assert (r.status_code, r.headers["x-kvsvc-prefill"]) == (200, name)
            r.close()
            assert ledger(app).snapshot().of(name) == NO_REQUESTS


def test_malformed_profiling_data_leaves_the_instance_routable(etcd_server, etcd, caplog):
    with ExitStack() as stack:
        eng = sim("sim-a")
        eng.start()
        stack.callback(eng.close)
        app = stack.enter_context(running(etcd_server, load_balance_policy="TTFT",
                                          default_prefill_tokens_per_s=4000.0))
        name = f"127.0.0.1:{eng.http_port}"
        with caplog.at_level(logging.WARNING, logger="kvsvc"):
            register(app, etcd, name, ttft_profiling_data=[[100, "fast"], [200, -3.0]],
                     tpot_profiling_data="none")
            for _ in range(3):
                decision = route(app, list(range(1, 401)))
        assert decision["prefill"] == name
        (c,) = decision["candidates"]
        assert c["predicted_prefill_ms"] == 100.0          # 400 tokens at 4000 tokens/s
        lines = [r.getMessage() for r in caplog.records if "profiling" in r.getMessage()]
        assert len(lines) == 1
        assert lines[0].startswith(f"instance {name}: profiling data unusable "
                                   "(ttft_profiling_data: 2 of 2 points dropped")
        r = completion(app.test_client(), {"model": "m1", "prompt": [1, 2, 3], "max_tokens": 2})
        assert (r.status_code, r.headers["x-kvsvc-prefill"]) == (200, name)


@pytest.mark.parametrize("argv, flag", [
    (["--target_ttft", "-5"], "--target_ttft"),
    (["--target_tpot", "700000"], "--target_tpot"),
    (["--default_prefill_tokens_per_s", "0"], "--default_prefill_tokens_per_s"),
])
def test_out_of_range_targets_refuse_start_up_naming_the_flag(argv, flag, capsys):
    assert main(["check-config", "--load_balance_policy", "SLO_AWARE", *argv]) == 2
    err = capsys.readouterr().err
    assert f"kvsvc: invalid configuration: {flag}:" in err
    assert main(["check-config", "--load_balance_policy", "TTFT"]) == 0


@pytest.mark.parametrize("argv, summary", [
    (["--load_balance_policy", "TTFT", "--default_prefill_tokens_per_s", "4000"],
     "routing: TTFT (host hit weight 0.95, default prefill 4000 tokens/s)"),
    (["--load_balance_policy", "SLO_AWARE", "--target_ttft", "800"],
     "routing: SLO_AWARE (target TTFT 800 ms, target TPOT 50 ms)"),
    (["--load_balance_policy", "CAR", "--car_prefill_lambda", "0.7"],
     "routing: CAR (lambda 0.7, host hit weight 0.5)"),
    (["--load_balance_policy", "RR"], "routing: RR (no parameters)"),
])
def test_check_config_prints_the_settings_of_the_chosen_policy(argv, summary, capsys):
    assert main(["check-config", *argv]) == 0
    assert summary in capsys.readouterr().out
