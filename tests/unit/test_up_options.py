"""``kvsvc up``'s options and banner (kvsvc.testbed.up), without starting anything: the
flavor flag's checks, and the banner naming what each engine really offers."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsvc.errors import ConfigError
from kvsvc.testbed.up import LocalCluster, SimProcess, UpOptions


def banner(opts: UpOptions) -> str:
    cluster = LocalCluster(opts)
    try:
        cluster.etcd_addr = "127.0.0.1:2379"
        cluster.engines = [SimProcess(20000, opts.dp, cluster.etcd_addr, "t",
                                      cluster.tmp / "engine-0.log")]
        return cluster.banner()
    finally:
        cluster.close()


def test_without_kv_events_the_banner_shows_no_event_or_replay_endpoint():
    text = banner(UpOptions(kv_events=False))
    assert "events tcp://" not in text and "snapshots tcp://" not in text
    assert "no KV events" in text and "--kv-events off" in text
    text = banner(UpOptions())
    assert "events tcp://127.0.0.1:30000, snapshots tcp://127.0.0.1:50000" in text


def test_a_vllm_flavor_banner_names_history_scraped_load_and_dp_rank_routing():
    text = banner(UpOptions(flavor="vllm", dp=2))
    assert "vllm, 2 DP ranks, events tcp://127.0.0.1:30000, history tcp://" in text
    assert "/metrics" in text and "X-data-parallel-rank" in text
    assert "--flavor vllm --dp 2" in text
    assert "X-data-parallel-rank" not in banner(UpOptions(flavor="vllm"))   # one rank


def test_flavor_is_checked_naming_the_flag():
    with pytest.raises(ConfigError) as info:
        UpOptions(flavor="trt").check()
    assert info.value.field == "--flavor"
    with pytest.raises(ConfigError) as info:
        UpOptions(flavor="sglang", xllm="native").check()
    assert info.value.field == "--xllm" and "--flavor xllm" in info.value.message
    UpOptions(flavor="sglang", dp=2).check()


def test_the_banner_offers_an_embeddings_line():
    assert "$URL/v1/embeddings" in banner(UpOptions())


def test_tmp_is_removed_by_close():
    cluster = LocalCluster(UpOptions())
    tmp = Path(cluster.tmp)
    cluster.close()
    assert not tmp.exists()
