"""Mooncake trace loading and token expansion: determinism, lengths, shared prefixes giving equal
tokens, the partial trailing block, and the ideal reuse figures of shared/data/README.md."""

from __future__ import annotations

import hashlib
import json

import pytest

from kvsvc.errors import ConfigError
from kvsvc.testbed.traces import (DATA_DIR, TraceRequest, VOCAB_SIZE, ideal_hit_ratio, load_trace,
                          request_tokens, sub_block_tokens)


def test_shipped_files_match_the_recorded_sha256():
    sums = {
        "conversation_trace.jsonl": "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df",
        "synthetic_trace.jsonl": "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131",
    }
    for name, digest in sums.items():
        assert hashlib.sha256((DATA_DIR / name).read_bytes()).hexdigest() == digest
    assert (DATA_DIR / "LICENSE-APACHE").is_file()


def test_load_builtin_traces():
    conv = load_trace("conversation")
    syn = load_trace("synthetic")
    assert (len(conv), len(syn)) == (12031, 3993)
    assert conv[0] == TraceRequest(0, 6758, 500, tuple(range(14)))
    assert conv[1].hash_ids[:2] == (0, 14)
    assert load_trace("conversation") is not conv  # a new list each call
    assert load_trace("conversation") == conv


def test_ideal_hit_ratio_matches_readme():
    conv = ideal_hit_ratio(load_trace("conversation"))
    assert (conv.hit_blocks, conv.total_blocks) == (105710, 288500)
    assert (conv.hit_tokens, conv.total_tokens) == (54098411, 144793823)
    assert round(conv.block_ratio * 100, 1) == 36.6 and round(conv.token_ratio * 100, 1) == 37.4
    syn = ideal_hit_ratio(load_trace("synthetic"))
    assert round(syn.block_ratio * 100, 1) == 64.0 and round(syn.token_ratio * 100, 1) == 65.1
    assert ideal_hit_ratio([]).token_ratio == 0.0


def test_ideal_hit_ratio_small():
    reqs = [TraceRequest(0, 1100, 1, (1, 2, 3)), TraceRequest(0, 1030, 1, (1, 2, 4)),
            TraceRequest(0, 1100, 1, (1, 2, 3)), TraceRequest(0, 600, 1, (5, 2))]
    r = ideal_hit_ratio(reqs)
    assert (r.hit_blocks, r.total_blocks) == (0 + 2 + 3 + 0, 11)
    assert (r.hit_tokens, r.total_tokens) == (0 + 1024 + 1100 + 0, 3830)


def test_tokens_are_deterministic_and_in_range():
    a = sub_block_tokens(7, 2)
    assert a == sub_block_tokens(7, 2) and len(a) == 128
    assert a != sub_block_tokens(7, 3) and a != sub_block_tokens(8, 2)
    assert all(0 <= t < VOCAB_SIZE for t in a)
    # Independent of the cache: recomputed from the documented recipe.
    sub_block_tokens.cache_clear()
    assert sub_block_tokens(7, 2) == a
    raw = hashlib.shake_128(b"mooncake:7:2:128").digest(512)
    assert a[0] == int.from_bytes(raw[:4], "little") % VOCAB_SIZE


def test_request_tokens_lengths_and_partial_block():
    req = TraceRequest(0, 3 * 512 + 200, 10, (4, 9, 11, 12))
    toks = request_tokens(req)
    assert len(toks) == 1736
    assert toks[:128] == list(sub_block_tokens(4, 0))
    assert toks[512 * 3:512 * 3 + 128] == list(sub_block_tokens(12, 0))
    # 200 tokens of the last id: one full 128-block and a 72-token partial block.
    assert toks[512 * 3 + 128:] == list(sub_block_tokens(12, 1))[:72]
    assert len(toks) // 128 == 13
    exact = TraceRequest(0, 1024, 1, (4, 9))
    assert len(request_tokens(exact)) == 1024 and request_tokens(exact) == toks[:1024]
    assert len(request_tokens(TraceRequest(0, 1, 1, (4,)))) == 1


def test_shared_prefixes_give_equal_tokens():
    conv = load_trace("conversation")
    # Requests 0 and 1 share only hash id 0: their first 512 tokens are equal, the next differ.
    t0, t1 = request_tokens(conv[0]), request_tokens(conv[1])
    assert t0[:512] == t1[:512]
    assert t0[512:640] != t1[512:640]
    # Requests 66 and 133 share their first five ids (a conversation's next turn).
    assert conv[66].hash_ids[:5] == conv[133].hash_ids[:5] == (0, 1541, 1542, 1543, 1544)
    assert conv[66].hash_ids[5] != conv[133].hash_ids[5]
    a, b = request_tokens(conv[66]), request_tokens(conv[133])
    assert a[:5 * 512] == b[:5 * 512]
    assert a[5 * 512:5 * 512 + 128] != b[5 * 512:5 * 512 + 128]


def test_block_size_must_divide_512():
    req = TraceRequest(0, 600, 1, (1, 2))
    assert request_tokens(req, 64)[:64] == list(sub_block_tokens(1, 0, 64))
    with pytest.raises(ValueError):
        request_tokens(req, 100)


def test_bad_trace_files(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_trace("no-such-trace")
    assert e.value.field == "trace"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"timestamp": 0, "input_length": 2000, "output_length": 1,
                               "hash_ids": [1]}) + "\n")
    with pytest.raises(ConfigError, match="bad.jsonl:1: input_length 2000"):
        load_trace(str(bad))
    bad.write_text("{not json\n")
    with pytest.raises(ConfigError, match="not a trace record"):
        load_trace(str(bad))
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"timestamp": 5, "input_length": 513, "output_length": 2,
                                "hash_ids": [3, 4]}) + "\n\n")
    assert load_trace(str(good)) == [TraceRequest(5, 513, 2, (3, 4))]
