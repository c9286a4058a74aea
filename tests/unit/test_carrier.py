"""Carrying the rules' actions out on a serving state (kvsvc.streams.carrier.ActionCarrier):
serving actions and logs in order, attempt actions handed back, and a refused batch ends the
tuple (the rules' on_apply_failed answers instead)."""

from __future__ import annotations

import logging

from kvsvc.errors import StreamError
from kvsvc.events import DEVICE, BlockStored
from kvsvc.index.tier_index import TierIndex
from kvsvc.streams.actions import (
    NO_ACTIONS,
    AbandonSnapshot,
    ApplyEvents,
    CountRecovery,
    Invalidate,
    Log,
    RequestSnapshot,
    SetError,
    SwapIndex,
)
from kvsvc.streams.carrier import ActionCarrier
from kvsvc.streams.counters import RecoveryTrigger
from kvsvc.streams.serving import ServingState
from kvsvc.streams.state import StreamId, StreamState


class Rules:
    def __init__(self) -> None:
        self.refused: list[tuple[int, str, float]] = []

    def on_apply_failed(self, action: ApplyEvents, error: StreamError, now: float) -> tuple:
        self.refused.append((action.seq, str(error), now))
        return (CountRecovery(RecoveryTrigger.INDEX_ERROR), RequestSnapshot(2, 0, True))


def test_serving_actions_in_order_attempts_handed_back(caplog):
    serving = ServingState(StreamId("e:1", 0), 4)
    carrier = ActionCarrier(serving, Rules())
    index = TierIndex(4, 1024, 100)
    with caplog.at_level(logging.INFO, logger="kvsvc.test"):
        out = carrier.carry((AbandonSnapshot(1), SwapIndex(index, 3, False, 0, (), ()),
                             Log("kvsvc.test", logging.INFO, "stream %s: %d", ("x", 3)),
                             ApplyEvents(4, [BlockStored([1], None, [1, 2, 3, 4], 4, DEVICE)])),
                            5.0)
    st = serving.status()
    assert (out, st.state, st.sequence, st.device_blocks) == (
        (AbandonSnapshot(1),), StreamState.SYNCHRONIZED, 4, 1)
    assert [r.getMessage() for r in caplog.records] == ["stream x: 3"]
    assert carrier.carry((), 5.0) is NO_ACTIONS
    assert carrier.carry((SetError("e"),), 5.0) is NO_ACTIONS


def test_a_refused_batch_drops_the_rest_and_carries_the_rules_answer():
    serving = ServingState(StreamId("e:1", 0), 4)
    rules = Rules()
    carrier = ActionCarrier(serving, rules)
    carrier.carry((SwapIndex(TierIndex(4, 1024, 100), 3, False, 0, (), ()),), 1.0)
    orphan = BlockStored([2], 77, [5, 6, 7, 8], 4, DEVICE)       # unknown parent in a delta
    out = carrier.carry((ApplyEvents(4, [orphan]), Invalidate("never carried"),
                         AbandonSnapshot(9)), 2.0)
    st = serving.status()
    assert out == (RequestSnapshot(2, 0, True),)
    assert (st.state, st.error, st.device_blocks) == (
        StreamState.UNSYNCHRONIZED, f"seq 4: {rules.refused[0][1]}", 0)
    assert [(seq, now) for seq, _, now in rules.refused] == [(4, 2.0)]
    assert serving.counters(2.0, 0).recoveries_started["index_error"] == 1
