"""The history reply collection (kvsvc.streams.history_client.HistoryAttempt, PROTOCOL.md §7h)
fed frames directly, without a socket: a rebuild's exactness, a catch-up's proof of continuity,
contiguous seqs, a hole, the per-message timeout. An integration test: building a reply's index
paces itself with real GIL yields (time.sleep). Block size 4, seed 1024; block content ``c`` has
the tokens ``[c*100, ...]`` and engine hash ``1000 + c``."""

from __future__ import annotations

from typing import Optional

import ormsgpack
import pytest

from kvsvc.config import KvEventsConfig, ReplayMode, StreamConfig
from kvsvc.errors import ReplayUnanswered, SnapshotError, SnapshotTimeout
from kvsvc.index.keys import prompt_keys
from kvsvc.streams.frame import END_MARKER
from kvsvc.streams.history_client import HistoryAttempt

BS = 4
SEED = 1024
CFG = StreamConfig(instance_name="e:1", block_size=BS, endpoint="tcp://127.0.0.1:5557",
                   replay_endpoint="tcp://127.0.0.1:5558", hash_seed=SEED,
                   replay_mode=ReplayMode.HISTORY)


def blk(*contents: int) -> list[int]:
    return [c * 100 + j for c in contents for j in range(BS)]


def _attempt(start_seq: int, anchor: Optional[int] = None, sink=None, **limits) -> HistoryAttempt:
    a = HistoryAttempt(CFG, KvEventsConfig(**limits), start_seq, None, None, None)
    a.configure(anchor, sink)
    return a


def _msg(seq: int, *events: dict) -> tuple[list[bytes], bytes]:
    payload = ormsgpack.packb([1.0, list(events), 0])
    return [b"", seq.to_bytes(8, "big"), payload], payload


def _ev(c: int, parent: Optional[int] = None) -> dict:
    return {"type": "BlockStored", "block_hashes": [1000 + c],
            "parent_block_hash": None if parent is None else 1000 + parent,
            "token_ids": blk(c), "block_size": BS}


def test_client_rebuild_from_0_is_exact_and_from_f_a_subset():
    a = _attempt(0)
    assert a.feed(_msg(0, _ev(1))[0]) is None
    assert a.feed(_msg(1, _ev(2, 1))[0]) is None
    r = a.feed(list(END_MARKER))
    assert (r.first_seq, r.last_seq, r.exact, r.messages, sorted(r.digests)) == (0, 1, True, 2, [0, 1])
    assert r.index.match(prompt_keys(blk(1, 2), BS, SEED)) == (2, 0)
    b = _attempt(0)
    b.feed(_msg(5, _ev(2, 1))[0])                     # parent unknown: an orphan
    r = b.feed(list(END_MARKER))
    assert (r.first_seq, r.exact, r.index.stats.orphan_blocks) == (5, False, 1)
    c = _attempt(0)
    c.feed(_msg(5, _ev(2, 1))[0])
    c.feed(_msg(6, {"type": "AllBlocksCleared"}, _ev(3))[0])
    assert c.feed(list(END_MARKER)).exact is True     # complete from seq 6 on


def test_client_catch_up_proves_continuity_by_seq_and_digest():
    from xxhash import xxh3_64_intdigest
    got = []
    frames, payload = _msg(3, _ev(1))
    a = _attempt(3, xxh3_64_intdigest(payload), lambda *args: got.append(args[:1] + args[2:]))
    assert a.feed(frames) is None
    f4, p4 = _msg(4, _ev(2, 1))
    assert a.feed([b"", b"kv", f4[1], p4]) is None    # the 4-frame form with a topic
    r = a.feed(list(END_MARKER))
    assert (r.continuous, got) == (True, [(4, xxh3_64_intdigest(p4), len(p4) + 10)])
    other = _attempt(3, 12345, got.append)
    r = other.feed(frames)
    assert (r.continuous, r.reason) == (False, "seq 3 has another payload digest than the batch "
                                               "applied (the engine restarted)")
    late = _attempt(2, 12345, got.append)
    assert late.feed(frames).reason == "reply starts at seq 3, not at the anchor seq 2"
    empty = _attempt(2, 12345, got.append)
    assert empty.feed(list(END_MARKER)).continuous is False


@pytest.mark.parametrize("seqs, error", [
    ((0, 1, 0), "history reply seq went backwards: seq 0 after 1"),
    ((0, 0), "history reply seq repeated: seq 0 after 0"),
])
def test_client_refuses_seqs_that_are_not_contiguous(seqs, error):
    a = _attempt(0)
    with pytest.raises(SnapshotError) as exc:
        for i, seq in enumerate(seqs):
            a.feed(_msg(seq, _ev(10 + i))[0])
    assert str(exc.value) == error


def test_client_ends_a_reply_with_a_hole_as_truncated():
    a = _attempt(0)
    a.feed(_msg(0, _ev(1))[0])
    a.feed(_msg(1, _ev(2, 1))[0])
    r = a.feed(_msg(5, _ev(3))[0])                    # seq 2..4 dropped by the engine's ROUTER
    assert (r.truncated, r.last_seq, r.exact, r.reason) == (
        True, 1, True, "history reply skipped from seq 1 to 5")
    assert r.index.match(prompt_keys(blk(1, 2), BS, SEED)) == (2, 0)


def test_client_timeout_is_per_message():
    a = _attempt(0, replay_timeout_ms=100)
    a.deadline = 10.0
    with pytest.raises(ReplayUnanswered):
        a.check_deadline(10.0)
    a.feed(_msg(0, _ev(1))[0])
    first = a.deadline
    a.check_deadline(first - 0.001)                   # the wait restarted with the message
    with pytest.raises(SnapshotTimeout) as exc:
        a.check_deadline(first)
    assert not isinstance(exc.value, ReplayUnanswered)
    assert str(exc.value) == ("history reply timeout: no next message within "
                              "replay_timeout_ms=100 after 1 messages (last seq 0)")
