"""The §7h continuity anchor (kvsvc.streams.anchor.Anchor): one judgement of a batch's seq and
payload digest, and the §6 complete-state rule (starts_cleared)."""

from __future__ import annotations

import pytest

from kvsvc.events import DEVICE, HOST, AllBlocksCleared, BlockRemoved
from kvsvc.streams.anchor import RECENT_DIGESTS, Anchor, Judgement, starts_cleared

C, D, R, G = Judgement.CONTIGUOUS, Judgement.DUPLICATE, Judgement.RESTARTED, Judgement.GAP


@pytest.mark.parametrize("seq, digest, unknown, judged", [
    (5, 1, R, C),       # L + 1
    (7, 1, R, G),       # batches missing
    (4, 104, R, D),     # L itself, same payload
    (3, 103, R, D),
    (3, 999, R, R),     # same seq, another payload: the engine restarted
    (3, 999, D, R),     # a known other digest is a restart whatever `unknown` says
    (1, 101, R, R),     # older than the digests kept: no proof, a live batch recovers
    (1, 101, D, D),     # ... a batch a reply covers is dropped
])
def test_judge(seq, digest, unknown, judged):
    anchor = Anchor.at(4, 104, {2: 102, 3: 103})
    anchor.recent.pop(2)
    assert anchor.last == (4, 104)
    assert anchor.judge(seq, digest, unknown=unknown) is judged


def test_unknown_next_seq_takes_any_batch_and_advance_moves_the_anchor():
    anchor = Anchor.at(None, None, {})
    assert (anchor.last, anchor.judge(17, 5)) == (None, C)
    anchor.advance(17, 5)
    assert (anchor.last, anchor.judge(17, 5), anchor.judge(17, 6)) == ((17, 5), D, R)


def test_recent_digests_are_bounded():
    anchor = Anchor.at(0, 0, {})
    for seq in range(1, RECENT_DIGESTS + 10):
        anchor.advance(seq, seq)
    assert len(anchor.recent) == RECENT_DIGESTS
    big = Anchor.at(5000, 1, {s: s for s in range(3000, 5000)})
    assert min(big.recent) == 5000 - RECENT_DIGESTS + 1


def test_starts_cleared_only_for_an_untargeted_clear_first():
    assert starts_cleared([AllBlocksCleared(None), BlockRemoved([1], DEVICE)])
    assert not starts_cleared([AllBlocksCleared(HOST)])
    assert not starts_cleared([BlockRemoved([1], DEVICE), AllBlocksCleared(None)])
    assert not starts_cleared([])
