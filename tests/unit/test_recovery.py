"""The stream's recovery rules (kvsvc.streams.recovery.SnapshotRecovery, PROTOCOL.md §6, §7)
driven directly, without ZMQ: inputs are live batches, snapshot results, connection events and
times; outputs are the actions and the serving state. Block size 4, seed 1024; block contents
are named by small integers (:func:`blk`). Times are monotonic seconds from T0. Like the stream
thread, the tests' driver (:class:`Owner`) reports every requested attempt open at once
(``on_snapshot_opened``) unless a test drives the machine itself (``Stream.rules``)."""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import pytest

from kvsvc.config import KvEventsConfig, StreamConfig
from kvsvc.errors import SnapshotError, SnapshotTimeout
from kvsvc.events import DEVICE, AllBlocksCleared, Batch, BlockRemoved, BlockStored, Event
from kvsvc.index.keys import prompt_keys
from kvsvc.index.tier_index import TierIndex
from kvsvc.streams.counters import DecodeErrorReason
from kvsvc.streams.recovery import (
    BUFFER_EVENT_OVERHEAD,
    BUFFER_HASH_OVERHEAD,
    BUFFER_TOKEN_OVERHEAD,
    NO_ACTIONS,
    AbandonSnapshot,
    RequestSnapshot,
    SnapshotRecovery,
    backoff_s,
    record_bytes,
)
from kvsvc.streams.serving import ServingState
from kvsvc.streams.state import SnapshotResult, StreamId, StreamState
from tests.support.rules import Carried

BS = 4
SEED = 1024
T0 = 1000.0
ENDPOINT = "tcp://127.0.0.1:5557"
SYNC, RECOVERING, UNSYNC = (StreamState.SYNCHRONIZED, StreamState.RECOVERING,
                            StreamState.UNSYNCHRONIZED)
NOT_YET = "not synchronized yet: waiting for the first replay (snapshot or history)"
WAITING = f"{NOT_YET}; the snapshot is requested once the live channel {ENDPOINT} is connected"
LOGGER = "kvsvc.streams.recovery"


def blk(*contents: int) -> list[int]:
    """Tokens of consecutive blocks; block content ``c`` is ``[c*100, c*100+1, ...]``."""
    return [c * 100 + j for c in contents for j in range(BS)]


def store(h: int, parent: Optional[int], content: int) -> BlockStored:
    return BlockStored([h], parent, blk(content), BS, DEVICE)


#: A live batch that never fails to apply (an unknown removal is counted, not an error, §5).
NOOP: tuple[Event, ...] = (BlockRemoved([999_999], DEVICE),)


class Owner(Carried):
    """Feeds one input to the machine and, as the stream thread does once ``SnapshotAttempt.open``
    succeeded, reports each requested attempt open; returns the input's own attempt actions
    (its serving actions are carried out on the serving state, tests/support/rules.py)."""

    def __init__(self, stream: "Stream") -> None:
        def opened(action) -> None:
            assert stream.rules.on_snapshot_opened(action.attempt, stream.now) is NO_ACTIONS

        super().__init__(stream.machine, stream.serving, opened, lambda: stream.now)


class Stream:
    """One machine with its serving state, a clock, and helpers that feed it (``m``: through
    the :class:`Owner`; ``rules``: the machine with its serving actions carried out, attempts
    reported by the test itself; ``machine``: the rules themselves)."""

    def __init__(self, **limits) -> None:
        self.limits = KvEventsConfig(**limits)
        cfg = StreamConfig(instance_name="e:1", block_size=BS, endpoint=ENDPOINT,
                           replay_endpoint="tcp://127.0.0.1:5558", hash_seed=SEED)
        self.serving = ServingState(StreamId("e:1", 0), BS)
        self.machine = SnapshotRecovery(cfg, self.limits)
        self.rules = Carried(self.machine, self.serving, clock=lambda: self.now)
        self.m = Owner(self)
        self.now = T0

    # -- inputs ------------------------------------------------------------------------------

    def at(self, t: float) -> "Stream":
        self.now = T0 + t
        return self

    def connect(self) -> tuple:
        """start + SUB opened + handshake + tick: the first recovery request."""
        assert self.m.start(self.now) == NO_ACTIONS
        assert self.m.on_live_opened() == NO_ACTIONS
        assert self.m.on_live_up(self.now) == NO_ACTIONS
        return self.m.tick(self.now)

    def live(self, seq: int, events: Sequence[Event] = NOOP, wire: int = 100) -> tuple:
        return self.m.on_live_batch(seq, Batch(0.0, list(events), 0), wire, self.now)

    def reply(self, watermark: Optional[int], events: Sequence[Event] = (), *,
              empty: bool = False, attempt: Optional[int] = None,
              requested_at: Optional[float] = None) -> tuple:
        index = TierIndex(BS, SEED, self.limits.max_blocks_per_stream)
        index.apply(list(events), snapshot=True)
        result = SnapshotResult(index=index, empty=empty, watermark=None if empty else watermark,
                                messages=0 if empty else 1, wire_bytes=123)
        return self.m.on_snapshot_complete(self.m.attempt if attempt is None else attempt,
                                           result, requested_at, self.now)

    def synced(self, watermark: Optional[int], events: Sequence[Event] = (),
               buffered: Sequence[int] = ()) -> "Stream":
        """Connect, buffer live ``buffered`` seqs during the first attempt, swap at
        ``watermark``."""
        assert self.connect() == (RequestSnapshot(1, 0, True),)
        for seq in buffered:
            assert self.live(seq) == NO_ACTIONS
        assert self.reply(watermark, events) == (AbandonSnapshot(1),)
        assert self.state() == SYNC
        return self

    # -- outputs -----------------------------------------------------------------------------

    def state(self) -> StreamState:
        return self.serving.status().state

    def hits(self, *contents: int) -> tuple[bool, int, int]:
        m = self.serving.match(prompt_keys(blk(*contents), BS, SEED))
        return m.synchronized, m.device_hit_tokens, m.host_only_hit_tokens

    def counters(self):
        return self.serving.counters(self.now, self.m.buffered_bytes)

    def next_in(self) -> Optional[float]:
        """Seconds from now until the next attempt is due (``None``: none scheduled)."""
        at = self.m.view().next_attempt_at
        return None if at is None else round(at - self.now, 9)


# ---------------------------------------------------------------------- sequence rules (§6)

#: (case, recovery snapshot watermark, seqs received while it was in flight,
#:  [(live seq after the swap, outcome)]): "applied", "dropped" (covered by the snapshot),
#:  or (trigger, error) for a sequence error.
SEQUENCE_CASES = [
    ("in order", 4, (), [(5, "applied"), (6, "applied"), (7, "applied")]),
    ("gap", 4, (), [(5, "applied"),
                    (7, ("sequence_gap", "sequence gap: expected seq 6, got 7"))]),
    ("repeat", 4, (), [(5, "applied"),
                       (5, ("sequence_backwards", "sequence went backwards: expected seq 6, got 5"))]),
    ("backwards (new epoch)", 4, (), [
        (5, "applied"), (0, ("sequence_backwards", "sequence went backwards: expected seq 6, got 0"))]),
    ("duplicates after the swap", 3, (1,), [(2, "dropped"), (3, "dropped"), (4, "applied")]),
    ("a seq already seen is a repeat, not a duplicate", 3, (1,), [
        (1, ("sequence_backwards", "sequence went backwards: expected seq 4, got 1"))]),
    ("old seq with nothing seen on the connection recovers", 5, (), [
        (0, ("sequence_backwards", "sequence went backwards: expected seq 6, got 0"))]),
    ("watermark none published: next is seq 0", None, (), [(0, "applied"), (1, "applied")]),
]


@pytest.mark.parametrize("case, watermark, buffered, steps", SEQUENCE_CASES,
                         ids=[c[0] for c in SEQUENCE_CASES])
def test_sequence_rules(case, watermark, buffered, steps):
    s = Stream().synced(watermark, buffered=buffered)
    dropped = 0
    for seq, outcome in steps:
        actions = s.live(seq)
        st = s.serving.status()
        if outcome == "applied":
            assert actions is NO_ACTIONS  # the hot path: no allocation
            assert (st.state, st.sequence) == (SYNC, seq)
        elif outcome == "dropped":
            dropped += 1
            assert actions is NO_ACTIONS
            assert (st.state, s.serving.duplicates_dropped) == (SYNC, dropped)
        else:
            trigger, error = outcome
            # Invalidated, and (live channel up) a recovery snapshot from 0 requested at once.
            assert actions == (RequestSnapshot(2, 0, True),)
            assert (st.state, st.error, st.sequence, st.device_blocks) == (RECOVERING, error, None, 0)
            assert s.counters().recoveries_started[trigger] == 1
            # The batch that broke the sequence is buffered into the new attempt.
            assert s.m.view().buffered_seqs == (seq,)
            break
    assert s.serving.duplicates_dropped == dropped


def test_a_backward_jump_starts_a_new_epoch():
    s = Stream().synced(4)
    s.live(5)
    s.live(0)
    assert s.m.view().max_seen == 0  # later batches are judged against the new engine's seqs
    # While recovering, a repeat in the new epoch starts over: the snapshot may be the old one's.
    assert s.live(0) == (AbandonSnapshot(2),)
    st = s.serving.status()
    assert (st.state, st.error) == (UNSYNC, "sequence went backwards during recovery: got seq 0 "
                                            "after 0")
    assert s.next_in() == 0.1


def test_empty_snapshot_first_live_batch_is_the_baseline_whatever_its_seq():
    s = Stream()
    assert s.connect() == (RequestSnapshot(1, 0, True),)
    assert s.reply(None, empty=True) == (AbandonSnapshot(1),)
    st = s.serving.status()
    assert (st.state, st.sequence, st.recoveries) == (SYNC, None, 1)
    assert s.live(41, [store(1, None, 1)]) is NO_ACTIONS
    assert s.live(42, [store(2, 1, 2)]) is NO_ACTIONS
    assert (s.serving.status().sequence, s.hits(1, 2)) == (42, (True, 8, 0))
    assert s.live(44) == (RequestSnapshot(2, 0, True),)
    assert s.serving.status().error == "sequence gap: expected seq 43, got 44"
    # An empty snapshot never arms the probe resync (its watermark is unknown).
    s2 = Stream(resync_interval_ms=600_000)
    s2.connect()
    s2.reply(None, empty=True)
    assert s2.next_in() == 600.0


# ---------------------------------------------------------------------- recovery merge (§6, §7)

#: (case, seqs buffered during the attempt, watermark, outcome): ("synced", last seq, blocks)
#: or ("failed", error).
MERGE_CASES = [
    ("tail merged after the watermark", (0, 1, 2, 3, 4), 2, ("synced", 4, 3)),
    ("whole buffer covered", (0, 1, 2), 2, ("synced", 2, 1)),
    ("nothing buffered", (), 2, ("synced", 2, 1)),
    ("gap in the tail", (0, 1, 3), 0, ("failed", "gap after watermark 0: expected seq 2, got 3")),
    ("tail starts after a gap", (5,), 2, ("failed", "gap after watermark 2: expected seq 3, got 5")),
]


@pytest.mark.parametrize("case, buffered, watermark, outcome", MERGE_CASES,
                         ids=[c[0] for c in MERGE_CASES])
def test_snapshot_watermark_and_buffered_tail(case, buffered, watermark, outcome):
    s = Stream()
    assert s.connect() == (RequestSnapshot(1, 0, True),)
    # Each buffered seq n stores block 10+n (a root): the snapshot holds block 1 only.
    for seq in buffered:
        assert s.live(seq, [store(10 + seq, None, 10 + seq)]) is NO_ACTIONS
    assert s.state() == RECOVERING
    assert s.reply(watermark, [store(1, None, 1)]) == (AbandonSnapshot(1),)
    st = s.serving.status()
    if outcome[0] == "synced":
        _, last, blocks = outcome
        assert (st.state, st.sequence, st.device_blocks, st.recoveries) == (SYNC, last, blocks, 1)
        tail = [seq for seq in buffered if seq > watermark]
        assert [s.hits(10 + seq) for seq in tail] == [(True, 4, 0)] * len(tail)
        assert s.counters().events_applied["BlockStored"] == len(tail)
        assert s.counters().snapshot_attempts["ok"] == 1
    else:
        assert (st.state, st.error, st.recoveries) == (UNSYNC, outcome[1], 0)
        assert s.counters().snapshot_attempts["error"] == 1
        assert s.next_in() == 0.1


def test_all_blocks_cleared_batch_is_a_baseline_while_recovering():
    s = Stream()
    assert s.connect() == (RequestSnapshot(1, 0, True),)
    assert s.live(4, [store(1, None, 1)]) is NO_ACTIONS        # buffered, then abandoned
    actions = s.live(5, [AllBlocksCleared(), store(2, None, 2)])
    assert actions == (AbandonSnapshot(1),)
    st = s.serving.status()
    assert (st.state, st.sequence, st.device_blocks, st.recoveries) == (SYNC, 5, 1, 1)
    assert (s.hits(1), s.hits(2)) == ((True, 0, 0), (True, 4, 0))
    assert s.counters().events_applied == {"BlockStored": 1, "BlockRemoved": 0,
                                           "AllBlocksCleared": 1}
    assert s.live(6) is NO_ACTIONS
    # The abandoned attempt's late result is ignored.
    assert s.reply(0, [], attempt=1) == NO_ACTIONS
    assert s.serving.status().sequence == 6
    # A live batch was seen: the next resync comes after the whole interval, not the probe.
    assert s.next_in() == s.limits.resync_interval_ms / 1000.0


def test_a_targeted_all_blocks_cleared_is_not_a_baseline():
    s = Stream()
    s.connect()
    assert s.live(5, [AllBlocksCleared(DEVICE)]) is NO_ACTIONS
    assert (s.state(), s.m.view().buffered_seqs) == (RECOVERING, (5,))


#: An untargeted ``AllBlocksCleared`` batch while unsynchronized (§6). (case, the first attempt
#: failed before the batch (a backoff, no attempt in flight), the batch's events,
#: (actions, state, error, sequence, device blocks, counters {(counter, label): n}, next_in)).
#: ``UNKNOWN`` stores block 2 under parent 999, which the baseline does not hold.
UNKNOWN = (AllBlocksCleared(), store(2, 999, 2))
BASELINE_CASES = [
    ("during a backoff: becomes the baseline", True, (AllBlocksCleared(), store(2, None, 2)),
     (NO_ACTIONS, SYNC, None, 5, 1,
      {("snapshot_attempts", "timeout"): 1, ("recoveries_started", "start"): 1,
       ("events_applied", "AllBlocksCleared"): 1, ("events_applied", "BlockStored"): 1},
      30.0)),                                            # seq 5 seen: no probe resync
    ("fails to apply while recovering", False, UNKNOWN,
     ((AbandonSnapshot(1),), UNSYNC, "seq 5: BlockStored parent 0x3e7 is unknown", None, 0,
      {("decode_errors", "unknown_parent"): 1, ("recoveries_started", "index_error"): 0,
       ("snapshot_attempts", "error"): 1, ("events_applied", "AllBlocksCleared"): 0},
      0.1)),
    ("fails to apply during a backoff", True, UNKNOWN,
     (NO_ACTIONS, UNSYNC, "seq 5: BlockStored parent 0x3e7 is unknown", None, 0,
      {("decode_errors", "unknown_parent"): 1, ("recoveries_started", "index_error"): 0,
       ("snapshot_attempts", "error"): 0, ("snapshot_attempts", "timeout"): 1},
      0.05)),                                            # the backoff's end stands
]


@pytest.mark.parametrize("case, backoff, events, expected", BASELINE_CASES,
                         ids=[c[0] for c in BASELINE_CASES])
def test_all_blocks_cleared_baseline_while_unsynchronized(case, backoff, events, expected):
    s = Stream()
    assert s.connect() == (RequestSnapshot(1, 0, True),)
    if backoff:
        assert s.m.on_snapshot_failed(1, SnapshotTimeout("snapshot timeout"), s.now) == (
            AbandonSnapshot(1),)
        assert s.m.attempt is None and s.next_in() == 0.1
        s.at(0.05)
    actions, state, error, sequence, blocks, counts, next_in = expected
    assert s.live(5, events) == actions
    st = s.serving.status()
    assert (st.state, st.error, st.sequence, st.device_blocks) == (state, error, sequence, blocks)
    c = s.counters()
    assert {key: getattr(c, key[0])[key[1]] for key in counts} == counts
    assert (s.m.attempt, s.next_in()) == (None, next_in)
    assert s.m.view().buffered_seqs == ()
    if state == SYNC:
        assert (st.recoveries, s.m.view().failures, s.hits(2)) == (1, 0, (True, 4, 0))


def test_resync_watermark_behind_the_applied_seq_invalidates():
    s = Stream(resync_interval_ms=1000).synced(9, [store(1, None, 1)], buffered=(9,))
    assert s.next_in() == 1.0
    assert s.at(1.0).m.tick(s.now) == (RequestSnapshot(2, 10, False),)
    assert s.state() == SYNC  # a resync keeps serving
    actions = s.reply(2, [])
    assert actions == (AbandonSnapshot(2), RequestSnapshot(3, 0, True))
    st = s.serving.status()
    assert (st.state, st.error, st.sequence, st.device_blocks) == (
        RECOVERING, "snapshot watermark 2 is behind applied seq 9: the engine's sequence "
                    "restarted", None, 0)
    assert s.counters().recoveries_started["sequence_backwards"] == 1


def test_periodic_resync_replaces_the_index_and_counts_the_difference():
    s = Stream(resync_interval_ms=1000).synced(0, [store(1, None, 1)], buffered=(0,))
    assert s.at(1.0).m.tick(s.now) == (RequestSnapshot(2, 1, False),)
    assert s.live(1) is NO_ACTIONS        # applied and buffered into the resync
    assert s.m.view().buffered_seqs == (1,)
    assert s.reply(1, [store(1, None, 1), store(2, 1, 2)]) == (AbandonSnapshot(2),)
    st = s.serving.status()
    assert (st.state, st.sequence, st.device_blocks, st.recoveries, st.resync_differences) == (
        SYNC, 1, 2, 1, 1)
    assert s.next_in() == 1.0


def test_an_empty_reply_to_a_resync_replaces_the_index_and_forgets_the_seq(caplog):
    s = Stream(resync_interval_ms=1000).synced(4, [store(1, None, 1)], buffered=(4,))
    assert s.at(1.0).m.tick(s.now) == (RequestSnapshot(2, 5, False),)
    assert s.live(5) is NO_ACTIONS                        # applied and buffered into the resync
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        assert s.reply(None, empty=True) == (AbandonSnapshot(2),)
    # §7: empty state, watermark unknown: the engine holds nothing, so neither does the index.
    st = s.serving.status()
    assert (st.state, st.error, st.sequence, st.device_blocks, st.recoveries,
            st.resync_differences) == (SYNC, None, None, 0, 1, 1)
    assert s.counters().snapshot_attempts["ok"] == 2
    view = s.m.view()
    assert (view.expected, view.silence_check, view.buffered_seqs) == (None, None, ())
    assert s.next_in() == 1.0                             # a resync never probes
    assert [r.getMessage() for r in caplog.records] == [
        "stream e:1/dp0: resync found 1 differing blocks (lost events); index replaced (empty "
        "snapshot, baseline is the next live batch)"]
    # The first live batch is the baseline, whatever its seq.
    assert s.live(42, [store(7, None, 7)]) is NO_ACTIONS
    assert (s.serving.status().sequence, s.hits(7), s.hits(1)) == (42, (True, 4, 0),
                                                                   (True, 0, 0))


def test_buffer_overflow_fails_the_attempt():
    s = Stream(max_buffered_bytes=1024)
    assert s.connect() == (RequestSnapshot(1, 0, True),)
    ev = BlockStored([10, 11], None, blk(1, 2), BS, DEVICE)
    cost = 100 + BUFFER_EVENT_OVERHEAD + 2 * BUFFER_HASH_OVERHEAD + 8 * BUFFER_TOKEN_OVERHEAD
    assert record_bytes(Batch(0.0, [ev], 0), 100) == cost == 340
    for seq in range(3):                                  # 1,020 bytes: still fits
        assert s.live(seq, [ev]) is NO_ACTIONS
    assert s.m.buffered_bytes == 1020
    assert s.live(3, [ev]) == (AbandonSnapshot(1),)       # 1,360 > 1,024
    st = s.serving.status()
    assert (st.state, st.error) == (UNSYNC, "buffer overflow: live batches buffered during the "
                                            "snapshot exceed max_buffered_bytes=1024")
    assert (s.m.buffered_bytes, s.counters().snapshot_attempts["buffer_overflow"]) == (0, 1)
    assert s.next_in() == 0.1
    assert s.live(4, [ev]) is NO_ACTIONS  # backoff: nothing to buffer into


def test_backoff_doubles_to_five_seconds_and_resets_on_success():
    s = Stream(resync_interval_ms=60_000)
    assert s.connect() == (RequestSnapshot(1, 0, True),)
    delays = []
    for attempt in range(1, 10):
        assert s.m.on_snapshot_failed(attempt, SnapshotTimeout("snapshot timeout"), s.now) == (
            AbandonSnapshot(attempt),)
        delays.append(s.next_in())
        due = s.m.view().next_attempt_at
        assert s.m.wakeup_at() == due
        s.now = due - 0.001
        assert s.m.tick(s.now) == NO_ACTIONS
        s.now = due
        assert s.m.tick(s.now) == (RequestSnapshot(attempt + 1, 0, True),)
    assert delays == [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0, 5.0]
    assert [backoff_s(n) for n in (1, 2, 7, 100)] == [0.1, 0.2, 5.0, 5.0]
    assert s.counters().snapshot_attempts["timeout"] == 9
    assert s.serving.status().error == "snapshot timeout"
    s.live(0)
    assert s.reply(0, []) == (AbandonSnapshot(10),)
    assert s.next_in() == 60.0 and s.m.view().failures == 0
    # A failed resync keeps serving and starts the backoff again from 100 ms.
    s.now += 60.0
    assert s.m.tick(s.now) == (RequestSnapshot(11, 1, False),)
    assert s.m.on_snapshot_failed(11, SnapshotError("snapshot reply: bad"), s.now) == (
        AbandonSnapshot(11),)
    st = s.serving.status()
    assert (st.state, st.error, s.next_in()) == (SYNC, None, 0.1)


def test_stale_attempt_reports_are_ignored():
    s = Stream()
    s.connect()
    assert s.m.on_snapshot_failed(7, SnapshotTimeout("x"), s.now) == NO_ACTIONS
    assert s.reply(0, [], attempt=7) == NO_ACTIONS
    assert (s.state(), s.m.attempt) == (RECOVERING, 1)


#: An attempt the owner could not open (``SnapshotAttempt.open`` raised: no file descriptor
#: left, a terminated context): (case, resync, expected state and error after the failure,
#: the warning). Nothing says "requested": no request went out.
OPEN_FAILURE_CASES = [
    ("recovery", False, (UNSYNC, "snapshot socket: Too many open files"),
     "stream e:1/dp0: unsynchronized: snapshot socket: Too many open files; retry in 0.1s"),
    ("resync", True, (SYNC, None),
     "stream e:1/dp0: resync failed: snapshot socket: Too many open files; retry in 0.1s"),
]


@pytest.mark.parametrize("case, resync, after, warning", OPEN_FAILURE_CASES,
                         ids=[c[0] for c in OPEN_FAILURE_CASES])
def test_an_attempt_that_cannot_be_opened(case, resync, after, warning, caplog):
    s = Stream(resync_interval_ms=1000)
    m = s.rules                                           # the owner's reports, one by one
    if resync:
        s.synced(4, buffered=(4,))
        request = RequestSnapshot(2, 5, False)
        s.at(1.0)
    else:
        assert (m.start(s.now), m.on_live_opened(), m.on_live_up(s.now)) == (NO_ACTIONS,) * 3
        request = RequestSnapshot(1, 0, True)
    before = (s.state(), s.serving.status().error)
    assert before == ((SYNC, None) if resync else (UNSYNC, NOT_YET))
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        assert m.tick(s.now) == (request,)
        # Requested but not opened yet: nothing changes, nothing is logged.
        assert (s.state(), s.serving.status().error, caplog.records) == (*before, [])
        assert m.on_snapshot_failed(request.attempt, SnapshotError(
            "snapshot socket: Too many open files"), s.now) == (AbandonSnapshot(request.attempt),)
    st = s.serving.status()
    assert (st.state, st.error) == after
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [("WARNING", warning)]
    c = s.counters()
    assert (c.snapshot_attempts["error"], c.recoveries_started["start"]) == (1, 1)
    assert (m.attempt, s.next_in(), m.view().failures) == (None, 0.1, 1)
    # A report that it opened after all is stale: ignored.
    assert m.on_snapshot_opened(request.attempt, s.now) is NO_ACTIONS
    assert (s.state(), s.serving.status().error) == after
    # The retry opens: only now is it announced (a recovery: RECOVERING, at info level).
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        retry = RequestSnapshot(request.attempt + 1, request.start_seq, request.urgent)
        assert s.at(s.now - T0 + 0.1).rules.tick(s.now) == (retry,)
        assert m.on_snapshot_opened(retry.attempt, s.now) is NO_ACTIONS
    assert s.state() == (SYNC if resync else RECOVERING)
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("DEBUG", "stream e:1/dp0: resync snapshot requested (start_seq 5)") if resync else
        ("INFO", "stream e:1/dp0: recovering: snapshot requested (start_seq 0)")]


def test_an_attempt_requested_and_ended_by_one_input_is_announced_in_order(caplog):
    s = Stream().synced(4)
    assert s.live(5) is NO_ACTIONS
    # Seq 0 after 5 while synchronized: invalidate and request a recovery, then the same batch
    # (an AllBlocksCleared one) becomes the baseline, which ends that attempt before the owner
    # could open it.
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert s.rules.on_live_batch(0, Batch(0.0, [AllBlocksCleared(), store(2, None, 2)], 0),
                                     100, s.now) == (RequestSnapshot(2, 0, True),
                                                     AbandonSnapshot(2))
    assert [r.getMessage() for r in caplog.records] == [
        "stream e:1/dp0: unsynchronized: sequence went backwards: expected seq 6, got 0",
        "stream e:1/dp0: recovering: snapshot requested (start_seq 0)",
        "stream e:1/dp0: synchronized (AllBlocksCleared batch seq 0): 1 device, 0 host blocks"]
    assert s.rules.on_snapshot_opened(2, s.now) is NO_ACTIONS   # the owner opened it: stale
    st = s.serving.status()
    assert (st.state, st.sequence, st.recoveries) == (SYNC, 0, 2)
    assert s.counters().recoveries_started["sequence_backwards"] == 1


# ---------------------------------------------------------------------- the live channel

def test_no_snapshot_before_the_live_handshake():
    s = Stream()
    assert s.m.start(s.now) == NO_ACTIONS
    assert s.m.on_live_opened() == NO_ACTIONS
    assert s.m.tick(s.now) == NO_ACTIONS                 # due, but the SUB is not connected
    assert s.serving.status().error == WAITING
    assert s.m.wakeup_at() is None                       # the handshake ends the wait
    assert s.at(7.0).m.tick(s.now) == NO_ACTIONS
    assert s.serving.status().error == WAITING           # noted once
    assert s.m.on_live_up(s.now) == NO_ACTIONS
    assert s.serving.status().error == NOT_YET
    assert s.m.wakeup_at() == T0                          # still due since the start
    assert s.m.tick(s.now) == (RequestSnapshot(1, 0, True),)
    assert s.state() == RECOVERING


def test_disconnect_invalidates_and_waits_for_the_next_connection():
    s = Stream().synced(4, [store(1, None, 1)])
    assert s.m.on_live_down("disconnected", s.now) == NO_ACTIONS   # no request: live is down
    st = s.serving.status()
    assert (st.state, st.error, s.hits(1)) == (UNSYNC, "disconnected", (False, 0, 0))
    assert s.counters().recoveries_started["disconnect"] == 1
    assert s.m.view().max_seen is None
    assert s.m.on_live_opened() == NO_ACTIONS                       # the SUB is replaced
    assert s.at(0.5).m.tick(s.now) == NO_ACTIONS
    assert s.serving.status().error == (f"disconnected; the snapshot is requested once the live "
                                        f"channel {ENDPOINT} is connected")
    assert s.m.on_live_up(s.now) == NO_ACTIONS
    assert s.serving.status().error == "disconnected"
    assert s.m.tick(s.now) == (RequestSnapshot(2, 0, True),)


#: A disconnect (§6) in each state with an attempt in flight: (case, synchronized before it,
#: actions, (state, error, device blocks), counters {(counter, label): n}, next_in after it, the
#: request once the live channel is back). While recovering, the attempt fails (outcome ``error``, backoff) and no
#: recovery is counted: none was synchronized. A resync is abandoned with its serving index.
DISCONNECT_CASES = [
    ("recovering, attempt in flight", False, (AbandonSnapshot(1),), (UNSYNC, "disconnected", 0),
     {("snapshot_attempts", "error"): 1, ("recoveries_started", "disconnect"): 0}, 0.1,
     RequestSnapshot(2, 0, True)),
    ("during a resync", True, (AbandonSnapshot(2),), (UNSYNC, "disconnected", 0),
     {("snapshot_attempts", "error"): 0, ("recoveries_started", "disconnect"): 1}, 0.0,
     RequestSnapshot(3, 0, True)),
]


@pytest.mark.parametrize("case, synced, actions, after, counts, next_in, retry",
                         DISCONNECT_CASES, ids=[c[0] for c in DISCONNECT_CASES])
def test_disconnect_with_an_attempt_in_flight(case, synced, actions, after, counts, next_in,
                                              retry):
    s = Stream(resync_interval_ms=1000)
    if synced:
        s.synced(4, [store(1, None, 1)], buffered=(4,))
        assert s.at(1.0).m.tick(s.now) == (RequestSnapshot(2, 5, False),)
        assert s.live(5) is NO_ACTIONS                    # applied and buffered
        assert (s.state(), s.m.view().buffered_seqs) == (SYNC, (5,))
    else:
        assert s.connect() == (RequestSnapshot(1, 0, True),)
        assert s.live(3) is NO_ACTIONS                    # buffered
        assert (s.state(), s.m.view().buffered_seqs) == (RECOVERING, (3,))
    assert s.m.on_live_down("disconnected", s.now) == actions
    st = s.serving.status()
    assert (st.state, st.error, st.device_blocks) == after
    assert s.hits(1) == (False, 0, 0)
    c = s.counters()
    assert {key: getattr(c, key[0])[key[1]] for key in counts} == counts
    view = s.m.view()
    assert (view.attempt, view.buffered_seqs, view.max_seen, view.live_up) == (None, (), None,
                                                                               False)
    assert s.next_in() == next_in
    assert s.m.wakeup_at() == s.now + next_in
    # No request while the live channel is down; once it is back, the recovery is due within
    # BACKOFF_INITIAL_S (a new connection resets the backoff).
    assert s.m.on_live_opened() == NO_ACTIONS
    assert s.at(s.now - T0 + next_in).m.tick(s.now) == NO_ACTIONS
    assert s.m.on_live_up(s.now) == NO_ACTIONS
    assert (s.next_in(), s.m.view().failures) == (0.0, 0)
    assert s.m.tick(s.now) == (retry,)
    assert s.state() == RECOVERING


def test_a_new_connection_resets_the_backoff():
    s = Stream()
    s.connect()
    for attempt in range(1, 7):
        s.m.on_snapshot_failed(attempt, SnapshotTimeout("t"), s.now)
        if attempt < 6:
            s.at(s.now - T0 + s.next_in()).m.tick(s.now)
    assert s.next_in() == 3.2
    s.m.on_live_down("disconnected", s.now)
    s.m.on_live_opened()
    assert s.next_in() == 3.2
    assert s.m.on_live_up(s.now) == NO_ACTIONS
    assert (s.next_in(), s.m.view().failures) == (0.1, 0)


def test_the_resync_schedule():
    s = Stream(resync_interval_ms=30_000).synced(4, buffered=(4,))  # a live batch was seen
    assert s.next_in() == 30.0 and s.m.wakeup_at() == T0 + 30.0
    assert s.live(5) is NO_ACTIONS
    assert s.at(29.999).m.tick(s.now) == NO_ACTIONS
    assert s.at(30.0).m.tick(s.now) == (RequestSnapshot(2, 6, False),)
    assert s.m.wakeup_at() is None                      # the attempt has its own deadline
    assert s.reply(5, []) == (AbandonSnapshot(2),)
    assert s.next_in() == 30.0


def test_the_probe_resync_after_a_recovery_with_nothing_live_seen():
    s = Stream(resync_interval_ms=600_000).synced(4, [store(1, None, 1)])
    assert s.next_in() == 2.0                            # PROBE_RESYNC_S, not 600 s
    assert s.at(2.0).m.tick(s.now) == (RequestSnapshot(2, 5, False),)
    s.live(5)
    assert s.reply(5, [store(1, None, 1)]) == (AbandonSnapshot(2),)
    assert s.next_in() == 600.0                          # a resync never probes


# ---------------------------------------------------------------------- the silent channel

def test_silent_channel_unsynchronizes_then_recovers_on_the_next_live_batch():
    s = Stream(resync_interval_ms=1000).synced(None, [store(1, None, 1)])
    assert s.next_in() == 1.0                            # watermark none: no probe either
    assert s.at(1.0).m.tick(s.now) == (RequestSnapshot(2, 0, False),)
    # The engine published seq 0 and 1, and none arrived: the check is armed.
    assert s.reply(1, [store(2, None, 2)]) == (AbandonSnapshot(2),)
    check = s.m.view().silence_check
    assert (check.deadline, check.watermark, check.first_missing, check.live_messages) == (
        T0 + 3.0, 1, 0, 0)
    st = s.serving.status()
    assert (st.state, st.sequence, st.resync_differences) == (SYNC, 1, 2)
    assert s.m.wakeup_at() == T0 + 2.0                   # the next resync comes first
    assert s.at(2.0).m.tick(s.now) == (RequestSnapshot(3, 2, False),)
    assert s.m.wakeup_at() == T0 + 3.0
    assert s.at(2.999).m.tick(s.now) == NO_ACTIONS
    assert s.at(3.0).m.tick(s.now) == (AbandonSnapshot(3),)
    st = s.serving.status()
    assert (st.state, st.error, st.device_blocks) == (
        UNSYNC, "live channel silent: the engine published up to seq 1 (resync watermark) but "
                "no live batch arrived since seq 0; check the stream's endpoint and topic ''",
        0)
    assert s.counters().recoveries_started["live_silent"] == 1
    view = s.m.view()
    assert (view.awaiting_live, view.next_attempt_at, s.m.wakeup_at()) == (True, None, None)
    assert s.at(100.0).m.tick(s.now) == NO_ACTIONS        # no snapshot until a live batch
    # The live channel comes back: its first batch starts a recovery and is buffered.
    assert s.live(2, [store(3, 2, 3)]) == (RequestSnapshot(4, 0, True),)
    assert s.m.view().buffered_seqs == (2,)
    assert s.reply(1, [store(2, None, 2)]) == (AbandonSnapshot(4),)
    st = s.serving.status()
    assert (st.state, st.sequence, s.hits(2, 3)) == (SYNC, 2, (True, 8, 0))


def test_silence_check_passes_on_a_late_live_message():
    s = Stream(resync_interval_ms=1000).synced(0, [store(1, None, 1)], buffered=(0,))
    s.at(1.0).m.tick(s.now)
    assert s.reply(1, [store(1, None, 1), store(2, 1, 2)]) == (AbandonSnapshot(2),)
    assert s.m.view().silence_check is not None
    assert s.at(1.5).live(1) is NO_ACTIONS                # covered by the resync: dropped
    assert s.serving.duplicates_dropped == 1
    assert s.at(1.6).m.tick(s.now) == NO_ACTIONS
    assert s.m.view().silence_check is None
    assert s.at(5.0).m.tick(s.now) == (RequestSnapshot(3, 2, False),)
    assert s.state() == SYNC and s.counters().recoveries_started["live_silent"] == 0


# ---------------------------------------------------------------------- errors

def test_live_frame_and_payload_errors():
    s = Stream().synced(0)
    actions = s.m.on_live_error(DecodeErrorReason.FRAME, "seq frame is 4 bytes, expected 8",
                                None, s.now)
    assert actions == (RequestSnapshot(2, 0, True),)
    st = s.serving.status()
    assert (st.state, st.error) == (RECOVERING, "seq frame is 4 bytes, expected 8")
    # An error while an attempt runs fails it (outcome error) ...
    assert s.m.on_live_error(DecodeErrorReason.PAYLOAD, "seq 3: bad", 3, s.now) == (
        AbandonSnapshot(2),)
    assert (s.serving.status().error, s.next_in()) == ("seq 3: bad", 0.1)
    # ... and while the retry waits, only the reason changes.
    assert s.m.on_live_error(DecodeErrorReason.PAYLOAD, "seq 4: worse", 4, s.now) == NO_ACTIONS
    st = s.serving.status()
    assert (st.state, st.error, s.next_in()) == (UNSYNC, "seq 4: worse", 0.1)
    c = s.counters()
    assert (c.decode_errors["frame"], c.decode_errors["payload"]) == (1, 2)
    assert (c.recoveries_started["decode_error"], c.snapshot_attempts["error"]) == (1, 1)
    assert (s.serving.live_messages, s.m.view().max_seen) == (3, 4)


@pytest.mark.parametrize("events, reason, trigger, error", [
    ([store(2, 999, 2)], "unknown_parent", "index_error", "seq 1: BlockStored parent 0x3e7 is unknown"),
    ([store(1, None, 5)], "hash_conflict", "index_error",
     "seq 1: engine hash 0x1 already maps to another content key"),
    ([BlockStored([2], 1, blk(2, 3), 8, DEVICE)], "event", "decode_error",
     "seq 1: BlockStored block_size 8 != configured block_size 4"),
])
def test_index_errors_in_a_live_delta_recover(events, reason, trigger, error):
    s = Stream().synced(0, [store(1, None, 1)])
    assert s.live(1, events) == (RequestSnapshot(2, 0, True),)
    st = s.serving.status()
    assert (st.state, st.error, st.sequence, st.device_blocks) == (RECOVERING, error, None, 0)
    c = s.counters()
    assert (c.decode_errors[reason], c.recoveries_started[trigger]) == (1, 1)


def test_internal_error_recovers_after_the_backoff():
    s = Stream().synced(0, [store(1, None, 1)])
    assert s.m.on_internal_error("RuntimeError", s.now) == NO_ACTIONS
    st = s.serving.status()
    assert (st.state, st.error, s.hits(1)) == (UNSYNC, "internal error: RuntimeError",
                                               (False, 0, 0))
    assert s.counters().recoveries_started["internal_error"] == 1
    assert s.next_in() == 0.1
    assert s.at(0.099).m.tick(s.now) == NO_ACTIONS
    assert s.at(0.1).m.tick(s.now) == (RequestSnapshot(2, 0, True),)
    # During an attempt, the attempt is abandoned too.
    assert s.m.on_internal_error("KeyError", s.now) == (AbandonSnapshot(2),)


def test_buffer_overflow_during_a_resync_keeps_serving():
    s = Stream(max_buffered_bytes=1024, resync_interval_ms=1000).synced(0, buffered=(0,))
    assert s.at(1.0).m.tick(s.now) == (RequestSnapshot(2, 1, False),)
    for seq in (1, 2, 3):                                     # applied, 340 bytes buffered each
        ev = BlockStored([10 * seq, 10 * seq + 1], None, blk(seq, seq + 10), BS, DEVICE)
        assert s.live(seq, [ev]) is NO_ACTIONS
    ev = BlockStored([40, 41], None, blk(4, 14), BS, DEVICE)
    assert s.live(4, [ev]) == (AbandonSnapshot(2),)           # applied; 1,360 bytes > 1,024
    st = s.serving.status()
    assert (st.state, st.sequence, st.error, st.device_blocks) == (SYNC, 4, None, 8)
    assert s.counters().snapshot_attempts["buffer_overflow"] == 1
    assert s.next_in() == 0.1
