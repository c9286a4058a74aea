"""Real clusters (§15) through the real app: a real Registry on a real etcd, discovery of the
engines' streams, and simulated vLLM engines with ``--dp 2`` serving over loopback HTTP that
send no heartbeat. Their load comes only from the scrape thread reading their ``/metrics``;
DP-rank routing sends a repeated prompt to the rank that holds its prefix (the answer's cached
tokens equal the prediction), while the minimum rule sees no exact hit on the other rank.""" 

from __future__ import annotations

import json
from contextlib import ExitStack, contextmanager
from typing import Iterator

import flask

from kvsvc.config import parse_kv_events_config
from kvsvc.http.extensions import EXTENSION
from kvsvc.http.internal import QUERY_PATH, ROUTE_PATH
from kvsvc.testbed.demo import DemoOptions, discovery_config
from kvsvc.testbed.ports import free_instance_port
from kvsvc.testbed.sim import SimEngine
from kvsvc.testbed.sim.serving import ServingConfig
from tests.support.metrics import scrape
from tests.support.routes import AUTH, NS, completion, running
from tests.support.util import wait_for

BS = 4
OPTS = DemoOptions(block_size=BS, flavor="vllm", refresh_interval_ms=100)


def engine(taken: set[int], model: str = "qwen") -> SimEngine:
    port = free_instance_port(2, OPTS.event_port_offset, OPTS.replay_port_offset, avoid=taken)
    taken.update({port, port + OPTS.event_port_offset, port + OPTS.event_port_offset + 1,
                  port + OPTS.replay_port_offset, port + OPTS.replay_port_offset + 1})
    return SimEngine(f"127.0.0.1:{port}", port + OPTS.event_port_offset,
                     port + OPTS.replay_port_offset, dp_size=2, block_size=BS,
                     device_blocks=256, http_port=port, flavor="vllm",
                     serving=ServingConfig(prefill_us_per_token=10.0, decode_us_per_token=10.0,
                                           prefill_base_us=0.0, model=model))


def put(etcd, eng: SimEngine) -> None:
    """The §9 registration a vLLM instance gets (backend ``vllm``, type 0): no heartbeat."""
    etcd.put(f"/{NS}/XLLM:DEFAULT:{eng.name}", json.dumps(
        {"name": eng.name, "type": 0, "incarnation_id": f"inc-{eng.name}", "dp_size": 2,
         "backend_type": "vllm"}))


@contextmanager
def cluster(etcd_server, etcd, n: int = 2, **overrides) -> Iterator[tuple[flask.Flask,
                                                                           list[SimEngine]]]:
    with ExitStack() as stack:
        taken: set[int] = set()
        engines = []
        for _ in range(n):
            eng = engine(taken)
            eng.start()
            stack.callback(eng.close)
            engines.append(eng)
        kv = parse_kv_events_config(discovery_config(OPTS))
        app = stack.enter_context(running(etcd_server, kv, model="",
                                          load_scrape_interval_ms=100, **overrides))
        for eng in engines:
            put(etcd, eng)
        client = app.test_client()

        def synchronized() -> bool:
            r = client.post(QUERY_PATH, headers=AUTH, json={"token_ids": []})
            got = {(m["instance_name"], m["dp_rank"]) for m in r.get_json()["matches"]
                   if m["synchronized"]}
            return got == {(e.name, r) for e in engines for r in range(2)}

        wait_for(synchronized, 15.0, 0.05, "every rank's stream synchronized")
        yield app, engines


def route(app, tokens: list[int]) -> dict:
    r = app.test_client().post(ROUTE_PATH, headers=AUTH, json={"token_ids": tokens})
    assert r.status_code == 200, r.get_json()
    return r.get_json()


def answer(app, tokens: list[int]):
    r = completion(app.test_client(), {"model": "qwen", "prompt": tokens, "max_tokens": 1})
    assert r.status_code == 200, r.get_json()
    return r


def test_scraped_load_makes_vllm_engines_candidates_without_heartbeats(etcd_server, etcd):
    with cluster(etcd_server, etcd) as (app, engines):
        svc = app.extensions[EXTENSION]
        names = {e.name for e in engines}
        wait_for(lambda: {c["name"] for c in route(app, [1, 2, 3, 4])["candidates"]} == names,
                 10.0, 0.05, "both engines candidates")
        snap = svc.registry.snapshot()
        for name in names:
            load = snap.instances[name].load
            assert load is not None and load.source == "scrape"
            assert [r.dp_rank for r in load.ranks] == [0, 1]
        assert svc.load_scraper is not None and svc.load_scraper.counts()["ok"] >= 2
        # Four P candidates: one per (instance, rank).
        pairs = {(c["name"], c["dp_rank"]) for c in route(app, [1, 2, 3, 4])["candidates"]}
        assert pairs == {(n, r) for n in names for r in (0, 1)}


def test_dp_rank_routing_sends_the_prompt_to_the_rank_holding_its_prefix(etcd_server, etcd):
    with cluster(etcd_server, etcd) as (app, engines):
        prompt = list(range(500, 532))           # 8 full blocks
        wait_for(lambda: route(app, prompt)["candidates"], 10.0, 0.05, "candidates")
        first = answer(app, prompt)
        target = first.headers["x-kvsvc-prefill"]
        holder = next(e for e in engines if e.name == target)
        rank = next(r for r in (0, 1) if holder.resident(r))

        def routed_to_holder() -> dict:
            # Pending hits (§16) send it there at once; wait for the stored blocks' events.
            d = route(app, prompt)
            held = d["candidates"] and d["candidates"][0]["ranks"][0]["device_hit_tokens"] == 32
            return d if held and (d["prefill"], d["prefill_dp_rank"]) == (target, rank) else {}

        decision = wait_for(routed_to_holder, 10.0, 0.05, "the index to hold the prefix")
        best = decision["candidates"][0]
        assert (best["name"], best["dp_rank"], best["ranks"][0]["device_hit_tokens"]) == (
            target, rank, 32)
        second = answer(app, prompt)
        assert (second.headers["x-kvsvc-prefill"], second.headers["x-sim-rank"]) == (
            target, str(rank))
        cached = second.get_json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == 32 == int(second.headers["x-kvsvc-predicted-cached-tokens"])


def test_min_rule_predicts_nothing_for_a_prefix_on_one_rank(etcd_server, etcd):
    with cluster(etcd_server, etcd, n=1, dp_rank_routing=False) as (app, engines):
        prompt = list(range(700, 716))
        wait_for(lambda: route(app, prompt)["candidates"], 10.0, 0.05, "candidates")
        answer(app, prompt)
        eng = engines[0]
        rank = next(r for r in (0, 1) if eng.resident(r))

        def indexed() -> dict:
            d = route(app, prompt)
            hits = {r["dp_rank"]: r["device_hit_tokens"] for r in d["candidates"][0]["ranks"]}
            return d if hits.get(rank) == 16 else {}

        decision = wait_for(indexed, 10.0, 0.05, "the index to hold the prefix")
        assert decision["prefill_dp_rank"] is None
        cand = decision["candidates"][0]
        assert cand["dp_rank"] is None and len(cand["ranks"]) == 2
        # The exact hits: 16 on the rank that ran it, none on the other, whose minimum (§11)
        # is what the rule counts (pending blocks, §16, are recorded on every rank of an
        # instance sent no rank, and may add to both).
        exact = {r["dp_rank"]: r["device_hit_tokens"] for r in cand["ranks"]}
        assert exact == {rank: 16, 1 - rank: 0}
        r = answer(app, prompt)
        assert "x-data-parallel-rank" not in {k.lower() for k in r.headers.keys()}


def test_a_dead_metrics_endpoint_reports_no_load(etcd_server, etcd):
    with cluster(etcd_server, etcd, n=1) as (app, engines):
        eng = engines[0]
        svc = app.extensions[EXTENSION]
        wait_for(lambda: svc.registry.snapshot().instances[eng.name].load is not None,
                 10.0, 0.05, "a scraped load")
        eng.close()   # /metrics gone: scrapes fail, nothing more is reported
        scraper = svc.load_scraper
        assert scraper is not None
        wait_for(lambda: eng.name in scraper.failing(), 10.0, 0.05, "a failed scrape")
        before = svc.registry.snapshot().instances[eng.name].load
        failed = scraper.counts()["failed"]
        wait_for(lambda: scraper.counts()["failed"] >= failed + 2, 10.0, 0.05, "more failures")
        assert svc.registry.snapshot().instances[eng.name].load == before


def test_metrics_show_candidates_and_scrapes(etcd_server, etcd):
    with cluster(etcd_server, etcd, n=1) as (app, engines):
        client = app.test_client()
        wait_for(lambda: route(app, [1, 2, 3, 4])["candidates"], 10.0, 0.05, "a candidate")
        got = scrape(client)
        assert got.value("kvsvc_routing_candidates") == 1.0
        assert (got.value("kvsvc_load_scrapes_total", outcome="ok") or 0) >= 1
        engines[0].close()
        wait_for(lambda: scrape(client).value("kvsvc_load_scrape_failing",
                                              instance=engines[0].name) == 1.0,
                 10.0, 0.05, "the failing scrape shown")
