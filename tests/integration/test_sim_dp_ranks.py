"""The simulated vLLM / SGLang engines with ``--dp 2`` over real loopback HTTP (§15): a request
carrying ``X-data-parallel-rank`` runs on that rank, each rank keeps its own prefix cache,
a rank out of range is refused, and ``GET /metrics`` shows each rank's load under the
engine's own metric names and labels (parsed back with prometheus_client's text parser)."""

from __future__ import annotations

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from kvsvc.errors import LifecycleError
from kvsvc.routing.in_flight import InFlight
from kvsvc.routing.proxy import Proxy, ProxySettings
from kvsvc.testbed.sim import SimEngine
from kvsvc.testbed.sim.serving import ServingConfig
from tests.support.util import free_ports

BS = 4


def make_engine(flavor: str) -> SimEngine:
    ports = free_ports(3)
    # Rank r publishes on ports[0] + r and replays on ports[1] + r; HTTP on ports[2].
    return SimEngine("sim-dp", ports[0], ports[1], dp_size=2, block_size=BS, device_blocks=64,
                     http_port=ports[2], flavor=flavor,
                     serving=ServingConfig(prefill_us_per_token=10.0, decode_us_per_token=10.0,
                                           prefill_base_us=0.0, model="m"))


@pytest.fixture(params=["vllm", "sglang"])
def engine(request):
    ports_ok = False
    eng = None
    for _ in range(3):  # free_ports may race another test for a port: retry the start
        eng = make_engine(request.param)
        try:
            eng.start()
            ports_ok = True
            break
        except LifecycleError:   # port + 1 taken by someone else: try new ones
            eng.close()
    assert ports_ok and eng is not None
    yield eng
    eng.close()


def post(engine: SimEngine, prompt: list[int], rank: object = None) -> requests.Response:
    headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
    return requests.post(f"http://127.0.0.1:{engine.http_port}/v1/completions",
                         json={"model": "m", "prompt": prompt, "max_tokens": 1},
                         headers=headers, timeout=10)


def cached(r: requests.Response) -> int:
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_rank_header_picks_the_rank_and_caches_are_per_rank(engine):
    prompt = list(range(1000, 1012))   # three full blocks
    r = post(engine, prompt, rank=1)
    assert cached(r) == 0 and r.headers["x-sim-rank"] == "1"
    assert len(engine.resident(1)) == 3 and engine.resident(0) == {}
    # The same prompt on rank 0 finds nothing: rank 1's cache is its own.
    r = post(engine, prompt, rank=0)
    assert cached(r) == 0 and r.headers["x-sim-rank"] == "0"
    # Back on rank 1: all three blocks reused.
    assert cached(post(engine, prompt, rank=1)) == 12


@pytest.mark.parametrize("bad", ["2", "-1", "x"])
def test_rank_out_of_range_is_refused(engine, bad):
    r = post(engine, [1, 2, 3, 4], rank=bad)
    assert r.status_code == 400
    assert "X-data-parallel-rank" in r.json()["error"]["message"]
    assert engine.resident(0) == {} and engine.resident(1) == {}


def test_metrics_show_each_ranks_load_under_the_engines_names(engine):
    post(engine, list(range(64)), rank=1)   # 16 of rank 1's 64 Device blocks
    text = requests.get(f"http://127.0.0.1:{engine.http_port}/metrics", timeout=5).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    if engine.flavor.value == "vllm":
        waiting, usage, rank_label = ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                                      "engine")
    else:
        waiting, usage, rank_label = "sglang:num_queue_reqs", "sglang:token_usage", "dp_rank"
    rows = {s.labels[rank_label]: s.value for s in families[usage].samples}
    assert rows == {"0": 0.0, "1": pytest.approx(16 / 64)}
    assert {s.labels[rank_label]: s.value for s in families[waiting].samples} == {
        "0": 0.0, "1": 0.0}
    assert all(s.labels["model_name"] == "m" for s in families[waiting].samples)


def test_proxy_sends_the_chosen_rank_and_counts_it_in_flight(engine):
    ledger = InFlight()
    proxy = Proxy(ProxySettings(), ledger)
    target = f"127.0.0.1:{engine.http_port}"
    body = b'{"model": "m", "prompt": [5, 6, 7, 8], "max_tokens": 1}'
    try:
        # The client's own header is replaced by the router's choice.
        reply = proxy.forward([target], "/v1/completions", lambda _t: body,
                              {"Content-Type": "application/json",
                               "x-data-parallel-rank": "0"}, dp_ranks={target: 1})
        assert ledger.snapshot().rank_total(target, 1) == 1
        reply.body.read_all()
        assert dict(reply.headers)["x-sim-rank"] == "1"
        assert ledger.snapshot().rank_total(target, 1) == 0
        assert len(engine.resident(1)) == 1 and engine.resident(0) == {}
    finally:
        proxy.close()
