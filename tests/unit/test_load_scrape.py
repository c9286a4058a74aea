"""§15 load from the engines' own Prometheus text (kvsvc.cluster.load_scrape.parse_engine_load),
on text in the format vLLM and SGLang really expose (names and labels from their sources:
vLLM's per-engine gauges labelled ``model_name`` and ``engine``, SGLang's scheduler gauges
labelled ``model_name``, ``engine_type``, ``tp_rank``, ``pp_rank`` and, with DP, ``dp_rank``),
plus the scraper's round without sockets (a fake sink, a fake fetch)."""

from __future__ import annotations

from types import MappingProxyType
from typing import Optional

import pytest

from kvsvc.cluster.load_scrape import (
    LoadScraper,
    LoadScrapeSettings,
    ScrapedLoad,
    parse_engine_load,
)
from kvsvc.settings import scrape_backends
from kvsvc.cluster.model import (
    Instance,
    InstanceState,
    InstanceType,
    RankLoad,
    RegistrySnapshot,
)
from kvsvc.errors import MalformedMetrics

# vLLM V1 with two DP engine cores in one API server (engine 0 and 1), as /metrics shows it:
# HELP/TYPE lines, other families around, histograms, a LoRA info gauge.
VLLM_DP2 = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 11023.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen2.5-7B-Instruct"} 12.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen2.5-7B-Instruct"} 9.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen2.5-7B-Instruct"} 3.0
vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen2.5-7B-Instruct"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen2.5-7B-Instruct"} 0.625
vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen2.5-7B-Instruct"} 0.125
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="0",running_lora_adapters="",waiting_lora_adapters=""} 1.7e+09
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="Qwen/Qwen2.5-7B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen2.5-7B-Instruct"} 42.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="Qwen/Qwen2.5-7B-Instruct"} 42.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="Qwen/Qwen2.5-7B-Instruct"} 3.5
"""

# An older vLLM (V0): one engine, the usage under its old name.
VLLM_OLD = """\
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="meta-llama/Llama-2-7b-hf"} 7.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="meta-llama/Llama-2-7b-hf"} 0.4
"""

# SGLang with --dp 2 --tp 2: every TP rank's scheduler reports its DP group's queue.
SGLANG_DP2_TP2 = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0",engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 4.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{dp_rank="0",engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 2.0
sglang:num_queue_reqs{dp_rank="0",engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",moe_ep_rank="0",pp_rank="0",tp_rank="1"} 2.0
sglang:num_queue_reqs{dp_rank="1",engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 5.0
sglang:num_queue_reqs{dp_rank="1",engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",moe_ep_rank="0",pp_rank="0",tp_rank="1"} 5.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{dp_rank="0",engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 0.28
sglang:token_usage{dp_rank="1",engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 0.5
"""

# SGLang without DP (the production_metrics page's form): no dp_rank label.
SGLANG_PLAIN = """\
# HELP sglang:token_usage The token usage
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28
# HELP sglang:num_queue_reqs The number of requests in the waiting queue
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
"""


def test_vllm_sums_waiting_and_averages_usage_with_per_engine_ranks():
    load = parse_engine_load(VLLM_DP2, "vllm", dp_size=2)
    assert load == ScrapedLoad(3, pytest.approx(0.375),
                               (RankLoad(0, 3, 0.625), RankLoad(1, 0, 0.125)))


def test_vllm_older_usage_name():
    assert parse_engine_load(VLLM_OLD, "vllm") == ScrapedLoad(7, pytest.approx(0.4), ())


def test_vllm_new_usage_name_wins_over_the_old_one():
    both = VLLM_OLD + ("# TYPE vllm:kv_cache_usage_perc gauge\n"
                       "vllm:kv_cache_usage_perc{model_name=\"m\"} 0.9\n")
    assert parse_engine_load(both, "vllm").gpu_cache_usage_perc == pytest.approx(0.9)


def test_sglang_counts_each_dp_groups_queue_once():
    load = parse_engine_load(SGLANG_DP2_TP2, "sglang", dp_size=2)
    assert load.waiting_requests_num == 7
    assert load.gpu_cache_usage_perc == pytest.approx(0.39)
    assert load.ranks == (RankLoad(0, 2, 0.28), RankLoad(1, 5, 0.5))


def test_sglang_without_dp_has_no_ranks():
    assert parse_engine_load(SGLANG_PLAIN, "sglang", dp_size=1) == ScrapedLoad(
        0, pytest.approx(0.28), ())


def test_per_rank_values_need_every_registered_rank():
    # Registered with 4 ranks, the text labels 2: no per-rank split (missing ranks would
    # look idle); the totals still count.
    load = parse_engine_load(VLLM_DP2, "vllm", dp_size=4)
    assert (load.waiting_requests_num, load.ranks) == (3, ())


@pytest.mark.parametrize("text, backend, needle", [
    ("this is { not prometheus", "vllm", "not Prometheus text"),
    (VLLM_OLD.replace("num_requests_waiting", "num_requests_queued"), "vllm",
     "no vllm:num_requests_waiting"),
    (SGLANG_PLAIN.replace("token_usage", "token_use"), "sglang", "no sglang:token_usage"),
    (VLLM_OLD.replace("} 7.0", "} -1.0"), "vllm", "vllm:num_requests_waiting: -1.0"),
    (VLLM_OLD.replace("} 7.0", "} 2.5"), "vllm", "whole number"),
    (VLLM_OLD.replace("} 0.4", "} NaN"), "vllm", "vllm:gpu_cache_usage_perc"),
    (VLLM_OLD, "xllm", "no load metrics known for backend 'xllm'"),
])
def test_text_without_a_load_is_refused_naming_why(text, backend, needle):
    with pytest.raises(MalformedMetrics) as info:
        parse_engine_load(text, backend)
    assert needle in str(info.value)


def test_scrape_backends_flag():
    assert scrape_backends(" vllm, sglang ,") == frozenset({"vllm", "sglang"})
    assert scrape_backends("") == frozenset()


# -- the scraper's round (no sockets) ------------------------------------------------------------

def inst(name: str, backend: str, state: InstanceState = InstanceState.ACTIVE) -> Instance:
    return Instance(name=name, type=InstanceType.DEFAULT, role=InstanceType.DEFAULT,
                    incarnation_id=f"inc-{name}", register_ts_ms=None, dp_size=2,
                    backend_type=backend, rpc_address=None, state=state, load=None)


class Sink:
    def __init__(self, *instances: Instance) -> None:
        self.snap = RegistrySnapshot(MappingProxyType({i.name: i for i in instances}),
                                     True, False, 1)
        self.got: list[tuple] = []

    def snapshot(self) -> RegistrySnapshot:
        return self.snap

    def scraped_load(self, name: str, identity: Optional[str], waiting: int, usage: float,
                     ranks: tuple[RankLoad, ...]) -> bool:
        self.got.append((name, identity, waiting, usage, ranks))
        return True


def test_a_round_reports_parsed_loads_and_logs_failures_once(caplog):
    sink = Sink(inst("v:1", "vllm"), inst("s:1", "sglang"), inst("x:1", "xllm"),
                inst("gone:1", "vllm", InstanceState.SUSPECT))
    scraper = LoadScraper(sink, LoadScrapeSettings(backends=frozenset({"vllm", "sglang"})))
    assert [i.name for i in scraper.targets(sink.snapshot())] == ["s:1", "v:1"]
    scraper._record(inst("v:1", "vllm"), parse_engine_load(VLLM_DP2, "vllm", 2), "")
    assert sink.got == [("v:1", "inc-v:1", 3, pytest.approx(0.375),
                         (RankLoad(0, 3, 0.625), RankLoad(1, 0, 0.125)))]
    with caplog.at_level("WARNING", logger="kvsvc.cluster.load_scrape"):
        scraper._record(inst("s:1", "sglang"), None, "ConnectTimeout")
        scraper._record(inst("s:1", "sglang"), None, "ConnectTimeout")
    assert [r.getMessage() for r in caplog.records].count(
        "instance s:1: load scrape of http://s:1/metrics failed (ConnectTimeout); no load "
        "reported until it answers") == 1
    assert scraper.failing() == {"s:1": "ConnectTimeout"}
    assert scraper.counts() == {"ok": 1, "failed": 2}
    assert len(sink.got) == 1   # a failed scrape reports nothing
