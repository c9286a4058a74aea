"""bench-routing's DP=2 comparison (issue 20, §15) as pure functions: the flags, the target
"hit with DP-rank routing >= 85% of the ideal" beside the minimum rule's figure, and the DP
section of the results file written apart from the routing one."""

from __future__ import annotations

import argparse

from kvsvc.testbed import bench_routing
from kvsvc.testbed.bench_routing import (
    BEGIN,
    BEGIN_DP,
    END,
    END_DP,
    MIN_RULE,
    RunResult,
    targets,
    write_section,
)


def result(policy: str, cached: int) -> RunResult:
    return RunResult("conversation", policy, requests=2, prompt_tokens=1000, cached_tokens=cached,
                     ideal_ratio=0.8, ttft_ms=[1.0, 2.0], per_engine={"a": 1, "b": 1})


def test_dp_target_compares_with_the_minimum_rule_of_the_same_bench():
    met = dict(targets([result("CAR λ=0.5", 720), result("CAR λ=0.5" + MIN_RULE, 300)]))
    (desc, ok), = [(d, ok) for d, ok in met.items() if "DP-rank routing" in d]
    assert ok and "90.0%" in desc and "37.5%" in desc
    met = dict(targets([result("TTFT", 600), result("TTFT" + MIN_RULE, 300)]))
    assert [ok for d, ok in met.items() if "DP-rank routing" in d] == [False]   # 75% < 85%
    # Without a minimum-rule run nothing is compared.
    assert not [d for d, _ in targets([result("CAR λ=0.5", 720)]) if "DP-rank" in d]


def test_flags_and_section_markers(tmp_path):
    parser = argparse.ArgumentParser()
    bench_routing.add_arguments(parser)
    opts = bench_routing.options_from_args(parser.parse_args(
        ["--flavor", "vllm", "--dp", "2", "--dp-rank-routing", "both", "--engines", "4"]))
    assert (opts.flavor, opts.dp, opts.dp_rank_routing, opts.engines) == (
        "vllm", 2, (True, False), 4)
    path = tmp_path / "RESULTS.md"
    write_section("routing", path)
    write_section("dp", path, BEGIN_DP, END_DP)
    write_section("dp2", path, BEGIN_DP, END_DP)
    assert path.read_text() == f"{BEGIN}\nrouting\n{END}\n\n{BEGIN_DP}\ndp2\n{END_DP}\n"


def test_simulated_vllm_and_sglang_send_no_heartbeats_unless_asked():
    from kvsvc.testbed.sim.cli import sends_heartbeats

    assert sends_heartbeats("auto", "xllm")
    assert not sends_heartbeats("auto", "vllm") and not sends_heartbeats("auto", "sglang")
    assert sends_heartbeats("on", "vllm") and not sends_heartbeats("off", "xllm")
