"""``kvsvc demo`` end to end: real simulated engines, the real service under gunicorn as a
subprocess, every answer compared with the engines' ground truth.

A small purpose-built trace (8 growing conversations, 60 requests) with tiny pools makes every
cache path happen in a few seconds: Device hits, Host offload and Host-only hits loaded back,
Host LRU eviction, and prompts larger than what the pool can take."""

from __future__ import annotations

import argparse
import io
import json
import random
import re

import pytest

from kvsvc.testbed import demo
from kvsvc.testbed.demo import DemoOptions, run_demo
from kvsvc.testbed.traces import TRACE_BLOCK_TOKENS

pytestmark = pytest.mark.etcd  # the demo starts its own etcd


def conversation_trace(path, n: int = 60, conversations: int = 8, seed: int = 1) -> str:
    """Write a Mooncake-format trace whose requests are turns of growing conversations."""
    rng = random.Random(seed)
    next_id = 1000
    history = {c: [0] for c in range(conversations)}
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            c = rng.randrange(conversations)
            for _ in range(rng.randint(1, 2)):
                history[c].append(next_id)
                next_id += 1
            ids = list(history[c])
            length = TRACE_BLOCK_TOKENS * (len(ids) - 1) + rng.randint(1, TRACE_BLOCK_TOKENS)
            f.write(json.dumps({"timestamp": 10 * i, "input_length": length,
                                "output_length": 10, "hash_ids": ids}) + "\n")
    return str(path)


@pytest.fixture
def trace(tmp_path):
    return conversation_trace(tmp_path / "conv.jsonl")


def test_demo_clean_is_exact(trace):
    out = io.StringIO()
    rep = run_demo(DemoOptions(requests=60, engines=2, trace=trace, device_blocks=48,
                               host_blocks=48), out)
    assert (rep.requests, rep.streams, rep.comparisons) == (60, 3, 180)
    assert rep.exact == 180 and rep.false_hits == 0 and rep.passed(chaos=False)
    # Ground truth of the executing ranks (deterministic: no faults, one executor).
    assert (rep.target_true_device_tokens, rep.target_true_host_only_tokens) == (57344, 27520)
    assert (rep.target_predicted_device_tokens, rep.target_predicted_host_only_tokens) == (57344, 27520)
    assert (rep.true_device_tokens, rep.true_host_only_tokens) == (
        rep.predicted_device_tokens, rep.predicted_host_only_tokens) == (187520, 72960)
    assert (rep.wait_timeouts, rep.unsynchronized_answers, rep.dropped, rep.restarts) == (0, 0, 0, 0)
    text = out.getvalue()
    assert "exact-match rate" in text and "100.00% (180/180)" in text and "PASS" in text


def test_demo_chaos_has_no_false_hit(trace):
    out = io.StringIO()
    rep = run_demo(DemoOptions(requests=60, engines=2, trace=trace, device_blocks=48,
                               host_blocks=48, chaos=True, seed=5, drop_probability=0.05), out)
    assert (rep.requests, rep.comparisons, rep.restarts) == (60, 180, 1)
    assert rep.dropped == 3
    assert rep.false_hits == 0 and rep.passed(chaos=True)
    # Every stream caught up before every request (resync every 1 s covers silent tail loss),
    # so even under chaos every answer was exact.
    assert rep.wait_timeouts == 0 and rep.exact == 180
    assert "[chaos] request 30: engine sim-0 restarted" in out.getvalue()


def test_demo_cli_arguments_and_exit_code(trace, monkeypatch):
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args(["--requests", "0", "--engines", "1", "--trace", trace])
    assert (args.requests, args.engines, args.chaos, args.trace) == (0, 1, False, trace)
    assert demo.run(args) == demo.EXIT_OK
    bad = parser.parse_args(["--trace", "no-such-trace"])
    assert demo.run(bad) == demo.EXIT_USAGE


def test_demo_vllm_late_join_is_exact_with_host_hits(trace):
    """``kvsvc demo --flavor vllm``: vLLM-form engines (map batches, int Device and raw-bytes
    CPU hashes, history replay §7h) joined late by the service (6 of the 60 requests ran
    before it started); every answer is exact and equals the truth, Host-only hits included
    (the CPU tier's byte hashes normalised to the Device int form, §2)."""
    out = io.StringIO()
    rep = run_demo(DemoOptions(requests=60, engines=2, trace=trace, device_blocks=48,
                               host_blocks=48, flavor="vllm"), out)
    assert (rep.warmup_requests, rep.requests, rep.streams, rep.comparisons) == (6, 54, 3, 162)
    assert rep.by_completeness == {"exact": 162, "subset": 0, "null": 0, "absent": 0}
    assert (rep.exact, rep.exact_mismatches, rep.false_hits, rep.subset_missed_tokens) == (
        162, 0, 0, 0)
    assert rep.passed(chaos=False)
    assert (rep.true_device_tokens, rep.true_host_only_tokens) == (
        rep.predicted_device_tokens, rep.predicted_host_only_tokens)
    # Ground truth (deterministic: no faults, one executor), Host-only hits included.
    assert (rep.true_device_tokens, rep.true_host_only_tokens) == (177920, 72320)
    assert (rep.target_true_device_tokens, rep.target_true_host_only_tokens) == (55808, 27520)
    assert (rep.target_predicted_device_tokens, rep.target_predicted_host_only_tokens) == (
        55808, 27520)
    assert (rep.wait_timeouts, rep.unsynchronized_answers) == (0, 0)
    text = out.getvalue()
    assert "answers exact / subset / unsynchronized" in text and "162 / 0 / 0" in text
    assert "exact answers equal to the truth" in text and "162/162" in text and "PASS" in text


def test_demo_vllm_chaos_catches_up_from_history(trace):
    """``kvsvc demo --flavor vllm --chaos``: dropped live batches are caught up from the engines'
    buffers and the restarted engine (new incarnation, found again by discovery with backends
    ["vllm"]) is rebuilt from seq 0: no false hit, every exact answer equal to the truth."""
    out = io.StringIO()
    rep = run_demo(DemoOptions(requests=60, engines=2, trace=trace, device_blocks=48,
                               host_blocks=48, chaos=True, seed=5, drop_probability=0.05,
                               flavor="vllm"), out)
    assert (rep.requests, rep.comparisons, rep.restarts) == (54, 162, 1)
    assert rep.dropped >= 1
    assert (rep.false_hits, rep.exact_mismatches) == (0, 0) and rep.passed(chaos=True)
    assert rep.by_completeness["subset"] == 0        # history from seq 0 was always there
    assert "[chaos] request 27: engine sim-0 restarted" in out.getvalue()


def test_demo_native_xllm_engines_answer_from_generations(trace):
    """``kvsvc demo --xllm native`` (§13): the engines heartbeat over baidu_std, the index
    stays exact, and answers through the service, written from the engines' Generations,
    equal the engines' output."""
    out = io.StringIO()
    rep = run_demo(DemoOptions(requests=30, engines=2, trace=trace, device_blocks=48,
                               host_blocks=48, xllm="native", native_answers=8), out)
    assert rep.exact == rep.comparisons == 90 and rep.false_hits == 0
    assert (rep.native_ok, rep.native_failed) == (8, 0) and rep.passed(chaos=False)
    assert re.search(r"native answers \(Generations -> SSE\) complete and equal +8/8",
                     out.getvalue())
