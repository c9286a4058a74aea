"""The history-mode recovery rules (kvsvc.streams.history.HistoryRecovery, PROTOCOL.md §7h)
driven directly, without sockets (the reply collection: tests/integration/test_history_client.py).
Block size 4, seed 1024; block content ``c`` has the tokens ``[c*100, ...]`` and engine hash
``1000 + c``. Times are monotonic seconds from T0; a live
batch's digest is given by the test (any distinct ints: the rules only compare them)."""

from __future__ import annotations

from typing import Optional, Sequence

import ormsgpack
import pytest

from kvsvc.config import KvEventsConfig, ReplayMode, StreamConfig
from kvsvc.errors import ReplayUnanswered, SnapshotError
from kvsvc.events import DEVICE, AllBlocksCleared, Batch, BlockRemoved, BlockStored, Event
from kvsvc.index.keys import prompt_keys
from kvsvc.index.tier_index import TierIndex
from kvsvc.streams.counters import DecodeErrorReason
from kvsvc.streams.anchor import RECENT_DIGESTS
from kvsvc.streams.history import HistoryRecovery
from kvsvc.streams.recovery import (
    SERVES,
    Mode,
    BACKOFF_INITIAL_S,
    LIVE_SILENCE_GRACE_S,
    NO_ACTIONS,
    AbandonSnapshot,
    RequestHistory,
)
from kvsvc.streams.serving import ServingState
from tests.support.rules import Carried
from kvsvc.streams.state import (
    CatchUpReply,
    Completeness,
    RebuildReply,
    StreamId,
    StreamState,
)

BS = 4
SEED = 1024
T0 = 1000.0
SYNC, RECOVERING, UNSYNC = (StreamState.SYNCHRONIZED, StreamState.RECOVERING,
                            StreamState.UNSYNCHRONIZED)
EXACT, SUBSET = Completeness.EXACT, Completeness.SUBSET
HELD, SERVING, LIVE_ONLY, SILENT = Mode.HELD, Mode.SERVING, Mode.LIVE_ONLY, Mode.SILENT
CFG = StreamConfig(instance_name="e:1", block_size=BS, endpoint="tcp://127.0.0.1:5557",
                   replay_endpoint="tcp://127.0.0.1:5558", hash_seed=SEED,
                   replay_mode=ReplayMode.HISTORY)


def blk(*contents: int) -> list[int]:
    return [c * 100 + j for c in contents for j in range(BS)]


def put(c: int, parent: Optional[int] = None) -> BlockStored:
    return BlockStored([1000 + c], None if parent is None else 1000 + parent, blk(c), BS, DEVICE)


def drop(c: int) -> BlockRemoved:
    return BlockRemoved([1000 + c], DEVICE)


class Stream:
    """One machine with its serving state and a clock; ``m`` is the machine. Each requested
    attempt is reported open at once, as the stream thread does."""

    def __init__(self, **limits) -> None:
        self.limits = KvEventsConfig(**limits)
        self.serving = ServingState(StreamId("e:1", 0), BS)
        # The machine with its serving actions carried out (tests/support/rules.py).
        self.m = Carried(HistoryRecovery(CFG, self.limits), self.serving, clock=lambda: self.now)
        self.now = T0
        self.requests: list[RequestHistory] = []

    def at(self, t: float) -> "Stream":
        self.now = T0 + t
        return self

    def _fed(self, actions: tuple) -> tuple:
        for action in actions:
            if type(action) is RequestHistory:
                self.requests.append(action)
                assert self.m.on_snapshot_opened(action.attempt, self.now) == NO_ACTIONS
        return actions

    def connect(self) -> tuple:
        assert self.m.start(self.now) == NO_ACTIONS
        assert self.m.on_live_opened() == NO_ACTIONS
        assert self.m.tick(self.now) == NO_ACTIONS   # no request before the handshake (§6)
        assert self.m.on_live_up(self.now) == NO_ACTIONS
        return self._fed(self.m.tick(self.now))

    def live(self, seq: int, *events: Event, digest: Optional[int] = None) -> tuple:
        d = 7_000 + seq if digest is None else digest
        return self._fed(self.m.on_live_batch(seq, Batch(0.0, list(events) or [drop(99)], 0),
                                              100, self.now, digest=d))

    def rebuild(self, first: Optional[int], batches: Sequence[Sequence[Event]] = (), *,
                exact: Optional[bool] = None, digests: Optional[dict] = None) -> tuple:
        """The end of the rebuild in flight: batches from seq ``first`` (None: empty reply)."""
        index = TierIndex(BS, SEED, self.limits.max_blocks_per_stream)
        for events in batches:
            index.apply(list(events), snapshot=True)
        n = len(batches)
        last = None if first is None else first + n - 1
        result = RebuildReply(
            index=index, first_seq=first, last_seq=last,
            last_digest=None if last is None else 7_000 + last,
            exact=first == 0 if exact is None else exact,
            digests=digests if digests is not None else
            ({} if first is None else {s: 7_000 + s for s in range(first, first + n)}),
            messages=n, wire_bytes=100)
        return self._fed(self.m.on_snapshot_complete(self.m.attempt, result, self.now, self.now))

    def catch_up(self, *batches: tuple[int, Sequence[Event]], continuous: bool = True,
                 reason: Optional[str] = None) -> tuple:
        """The catch-up in flight: its batches after the anchor, then its end."""
        actions: tuple = ()
        attempt = self.m.attempt
        for seq, events in batches:
            actions += self._fed(self.m.on_history_batch(attempt, seq, list(events), 7_000 + seq,
                                                         100, self.now))
        result = CatchUpReply(continuous=continuous, messages=len(batches) + 1, wire_bytes=100,
                              reason=reason)
        return actions + self._fed(self.m.on_snapshot_complete(attempt, result, self.now,
                                                               self.now))

    def synced(self, batches: Sequence[Sequence[Event]], first: int = 0) -> "Stream":
        assert self.connect() == (RequestHistory(1, 0, True, None),)
        assert self.rebuild(first, batches) == (AbandonSnapshot(1),)
        assert self.state() == SYNC
        return self

    def state(self) -> StreamState:
        return self.serving.status().state

    def hits(self, *contents: int) -> tuple[bool, int, int]:
        m = self.serving.match(prompt_keys(blk(*contents), BS, SEED))
        return m.synchronized, m.device_hit_tokens, m.host_only_hit_tokens

    def completeness(self) -> Optional[Completeness]:
        return self.serving.status().completeness


# ---------------------------------------------------------------------------- rebuilds


def test_rebuild_from_seq_0_is_exact_and_keeps_the_anchor():
    s = Stream().synced([[put(1)], [put(2, 1)]])
    assert (s.completeness(), s.m.anchor, s.hits(1, 2)) == (EXACT, (1, 7_001), (True, 8, 0))
    assert s.live(2, put(3, 2)) is NO_ACTIONS          # the hot path: no actions at all
    assert (s.m.anchor, s.hits(1, 2, 3)) == ((2, 7_002), (True, 12, 0))


def test_rebuild_from_f_is_a_subset_with_orphans_and_exact_after_all_blocks_cleared():
    s = Stream().synced([[put(2, 1)], [put(3)]], first=5)   # parent 1 came before seq 5
    assert (s.completeness(), s.hits(3), s.hits(1, 2)) == (SUBSET, (True, 4, 0), (True, 0, 0))
    assert s.live(7, put(4, 2)) == NO_ACTIONS     # under an orphan: no error on a subset
    assert s.live(8, put(5, 1)) == NO_ACTIONS     # unknown parent: an orphan, no error
    assert (s.state(), s.serving.status().sequence) == (SYNC, 8)
    assert s.live(9, AllBlocksCleared(None), put(6)) == NO_ACTIONS
    assert (s.completeness(), s.hits(3), s.hits(6)) == (EXACT, (True, 0, 0), (True, 4, 0))
    # Exact now: an unknown parent is an error again, and the stream rebuilds.
    actions = s.live(10, put(8, 7))
    assert actions == (RequestHistory(2, 0, True, None),)
    assert s.serving.counters(0, 0).recoveries_started["index_error"] == 1


def test_rebuild_merges_buffered_live_batches_deduplicated_by_seq():
    s = Stream()
    s.connect()
    for seq in (3, 4, 5):
        s.live(seq, put(seq))
    assert s.m.view().buffered_seqs == (3, 4, 5)
    assert s.rebuild(0, [[put(0)], [put(1)], [put(2)], [put(3)], [put(4)]]) == (AbandonSnapshot(1),)
    assert (s.serving.status().sequence, s.m.anchor) == (5, (5, 7_005))
    assert s.hits(5) == (True, 4, 0)


def test_buffered_live_batch_with_another_digest_than_replayed_fails_the_attempt():
    s = Stream()
    s.connect()
    s.live(1, put(1), digest=123)
    actions = s.rebuild(0, [[put(0)], [put(1)]])
    assert actions == (AbandonSnapshot(1),)
    st = s.serving.status()
    assert (st.state, st.error) == (UNSYNC, "live seq 1 differs from the batch replayed (the "
                                            "engine restarted)")
    assert s.m.view().next_attempt_at == s.now + BACKOFF_INITIAL_S


def test_gap_after_the_reply_fails_the_attempt():
    s = Stream()
    s.connect()
    s.live(3, put(3))
    s.rebuild(0, [[put(0)]])
    assert s.serving.status().error == "gap after the history reply: expected seq 1, got 3"


@pytest.mark.parametrize("first_live, completeness", [(0, EXACT), (5, SUBSET)])
def test_empty_reply_first_live_batch_decides(first_live, completeness):
    s = Stream()
    s.connect()
    assert s.rebuild(None) == (AbandonSnapshot(1),)
    assert (s.state(), s.completeness(), s.serving.status().sequence) == (SYNC, EXACT, None)
    assert s.live(first_live, put(1)) == NO_ACTIONS
    assert (s.completeness(), s.hits(1), s.m.anchor) == (completeness, (True, 4, 0),
                                                         (first_live, 7_000 + first_live))


# ---------------------------------------------------------------------------- catch-ups


def test_gap_catches_up_from_the_anchor_and_buffers_the_live_tail():
    s = Stream().synced([[put(1)], [put(2, 1)]])
    actions = s.live(3, put(4, 3))                   # seq 2 missing
    assert actions == (RequestHistory(2, 1, True, 7_001),)
    assert (s.state(), s.hits(1)) == (RECOVERING, (False, 0, 0))
    assert s.serving.status().error == "sequence gap: expected seq 2, got 3; catching up from seq 1"
    assert s.catch_up((2, [put(3, 2)]), (3, [put(4, 3)])) == (AbandonSnapshot(2),)
    assert (s.state(), s.hits(1, 2, 3, 4), s.m.anchor) == (SYNC, (True, 16, 0), (3, 7_003))
    assert [r.start_seq for r in s.requests] == [0, 1]
    counters = s.serving.counters(0, 0)
    assert counters.recoveries_started["sequence_gap"] == 1
    assert s.serving.status().recoveries == 2


def test_catch_up_without_continuity_rebuilds():
    s = Stream().synced([[put(1)]])
    s.live(2)
    actions = s.catch_up(continuous=False, reason="reply starts at seq 4, not at the anchor seq 0")
    assert actions == (AbandonSnapshot(2), RequestHistory(3, 0, True, None))
    st = s.serving.status()
    assert (st.state, st.device_blocks) == (RECOVERING, 0)
    assert s.serving.counters(0, 0).recoveries_started["history_mismatch"] == 1


def test_disconnect_keeps_the_index_and_catches_up_once_connected():
    s = Stream().synced([[put(1)]])
    assert s.m.on_live_down("disconnected", s.now) == NO_ACTIONS
    assert (s.state(), s.hits(1)) == (RECOVERING, (False, 0, 0))
    assert s.m.tick(s.now) == NO_ACTIONS              # not while the SUB is down
    s.m.on_live_opened()
    s.m.on_live_up(s.now)
    assert s._fed(s.m.tick(s.now)) == (RequestHistory(2, 0, True, 7_000),)
    assert s.catch_up((1, [put(2, 1)])) == (AbandonSnapshot(2),)
    assert (s.state(), s.hits(1, 2)) == (SYNC, (True, 8, 0))
    assert s.serving.counters(0, 0).recoveries_started["disconnect"] == 1


def test_live_batches_during_a_catch_up_fill_in_and_duplicates_are_dropped():
    s = Stream().synced([[put(1)]])
    s.m.on_live_down("disconnected", s.now)
    s.m.on_live_opened()
    s.m.on_live_up(s.now)
    s._fed(s.m.tick(s.now))
    assert s.live(1, put(2, 1)) == NO_ACTIONS         # buffered: the anchor is not proven yet
    assert (s.m.view().buffered_seqs, s.m.anchor) == ((1,), (0, 7_000))
    assert s.catch_up((1, [put(2, 1)]), (2, [put(3, 2)])) == (AbandonSnapshot(2),)
    assert s.live(2, put(3, 2)) == NO_ACTIONS         # the live copy of seq 2: a duplicate
    assert (s.serving.duplicates_dropped, s.hits(1, 2, 3)) == (1, (True, 12, 0))


def test_periodic_catch_up_keeps_serving_and_counts_batches_never_received():
    s = Stream(resync_interval_ms=1000).synced([[put(1)]])
    assert s.at(0.5).m.tick(s.now) == NO_ACTIONS
    assert s._fed(s.at(1.0).m.tick(s.now)) == (RequestHistory(2, 0, False, 7_000),)
    assert s.state() == SYNC
    assert s.live(1, put(2, 1)) == NO_ACTIONS         # serves and applies meanwhile
    assert s.catch_up((1, [put(2, 1)]), (2, [drop(1)])) == (AbandonSnapshot(2),)
    st = s.serving.status()
    assert (st.state, st.resync_differences, st.sequence, s.hits(1)) == (SYNC, 1, 2, (True, 0, 0))
    assert s.m.view().next_attempt_at == s.now + 1.0


def test_periodic_catch_up_failure_keeps_serving():
    s = Stream(resync_interval_ms=1000).synced([[put(1)]])
    s._fed(s.at(1.0).m.tick(s.now))
    assert s.m.on_snapshot_failed(2, SnapshotError("history reply seq 1: bad"), s.now) == \
        (AbandonSnapshot(2),)
    assert (s.state(), s.hits(1)) == (SYNC, (True, 4, 0))
    assert s.m.view().next_attempt_at == s.now + BACKOFF_INITIAL_S


def test_live_seq_backwards_rebuilds_unless_a_duplicate():
    s = Stream().synced([[put(1)], [put(2, 1)]])
    assert s.live(1, put(2, 1), digest=7_001) == NO_ACTIONS   # same seq, same bytes
    assert s.serving.duplicates_dropped == 1
    actions = s.live(1, put(2, 1), digest=555)                # a restarted engine
    assert actions == (RequestHistory(2, 0, True, None),)
    assert s.m.view().buffered_seqs == (1,)
    assert s.serving.counters(0, 0).recoveries_started["sequence_backwards"] == 1


def test_recent_digests_are_bounded():
    s = Stream().synced([[put(1)]])
    for seq in range(1, RECENT_DIGESTS + 10):
        s.live(seq)
    assert len(s.m._anchor.recent) == RECENT_DIGESTS


# ---------------------------------------------------------------------------- no replay answer


def test_no_replay_answer_serves_a_live_only_subset_from_the_first_live_batch():
    s = Stream()
    s.connect()
    s.live(4, put(1))                                 # buffered during the rebuild
    actions = s.m.on_snapshot_failed(1, ReplayUnanswered("history reply timeout: no reply"),
                                     s.now)
    assert actions == (AbandonSnapshot(1),)
    assert (s.state(), s.completeness(), s.hits(1)) == (SYNC, SUBSET, (True, 4, 0))
    assert s.m.live_only
    assert s.live(5, put(2, 9)) == NO_ACTIONS          # unknown parent: an orphan
    assert s.live(7, put(3)) == NO_ACTIONS             # a gap: a new live-only index
    assert (s.hits(1), s.hits(3)) == ((True, 0, 0), (True, 4, 0))
    # The rebuild is retried with the backoff and replaces the live-only index.
    assert s._fed(s.at(BACKOFF_INITIAL_S).m.tick(s.now)) == (RequestHistory(2, 0, False, None),)
    s.live(8, put(4))
    assert s.rebuild(0, [[put(1)], [put(3)]] + [[drop(99)]] * 6) == (AbandonSnapshot(2),)
    assert (s.completeness(), s.hits(1), s.hits(4), s.m.live_only) == (EXACT, (True, 4, 0),
                                                                        (True, 4, 0), False)


def _empty_live_only() -> Stream:
    """No replay answer and no live batch: an empty live-only index is served at once."""
    s = Stream()
    s.connect()
    assert s.m.on_snapshot_failed(1, ReplayUnanswered("no reply"), s.now) == (AbandonSnapshot(1),)
    st = s.serving.status()
    assert (st.state, st.completeness, st.sequence, st.error, st.synchronized_once,
            st.device_blocks) == (SYNC, SUBSET, None, None, True, 0)
    assert (s.m.live_only, s.m.anchor, s.hits(1)) == (True, None, (True, 0, 0))
    return s


def test_no_replay_answer_first_live_seq_0_is_exact():
    s = _empty_live_only()
    assert s.live(0, put(1)) == NO_ACTIONS
    assert (s.completeness(), s.hits(1), s.serving.status().sequence) == (EXACT, (True, 4, 0), 0)
    assert s.live(1, put(2, 1)) == NO_ACTIONS
    assert (s.completeness(), s.hits(1, 2)) == (EXACT, (True, 8, 0))


def test_no_replay_answer_without_live_batch_first_seq_above_0_is_a_subset_with_orphans():
    s = _empty_live_only()
    assert s.live(5, put(2, 9)) == NO_ACTIONS          # unknown parent: an orphan, no error
    assert s.live(6, put(3)) == NO_ACTIONS
    st = s.serving.status()
    assert (st.state, st.completeness, st.sequence) == (SYNC, SUBSET, 6)
    assert (s.hits(9, 2), s.hits(3)) == ((True, 0, 0), (True, 4, 0))
    assert s.live(8, put(4)) == NO_ACTIONS             # a gap: a new live-only index at seq 8
    assert (s.hits(3), s.hits(4), s.completeness()) == ((True, 0, 0), (True, 4, 0), SUBSET)


def test_empty_live_only_keeps_retrying_the_rebuild_which_replaces_it():
    s = _empty_live_only()
    # Not before the §6 backoff, then a rebuild from 0 (not urgent: the stream serves).
    assert s.m.tick(s.at(BACKOFF_INITIAL_S / 2).now) == NO_ACTIONS
    assert s._fed(s.at(BACKOFF_INITIAL_S).m.tick(s.now)) == (RequestHistory(2, 0, False, None),)
    # Unanswered again: still serving the empty subset; the next retry backs off further.
    assert s.m.on_snapshot_failed(2, ReplayUnanswered("no reply"), s.now) == (AbandonSnapshot(2),)
    assert (s.state(), s.completeness(), s.m.live_only) == (SYNC, SUBSET, True)
    assert s.m.tick(s.at(2 * BACKOFF_INITIAL_S).now) == NO_ACTIONS
    (request,) = s._fed(s.at(3 * BACKOFF_INITIAL_S + 0.001).m.tick(s.now))
    assert request == RequestHistory(3, 0, False, None)
    s.live(2, put(2))                                  # applied and kept for the rebuild
    assert s.hits(2) == (True, 4, 0)
    assert s.rebuild(0, [[put(1)], [put(5)], [put(2)]]) == (AbandonSnapshot(3),)
    st = s.serving.status()
    assert (st.state, st.completeness, st.sequence, s.m.live_only) == (SYNC, EXACT, 2, False)
    assert (s.hits(1), s.hits(2), s.hits(5)) == ((True, 4, 0), (True, 4, 0), (True, 4, 0))


def test_unanswered_rebuild_with_a_buffered_live_batch_starts_the_live_only_index_from_it():
    s = Stream()
    s.connect()
    s.live(3, put(1))                                  # buffered during the rebuild
    s.m.on_snapshot_failed(1, ReplayUnanswered("no reply"), s.now)
    st = s.serving.status()
    assert (st.state, st.completeness, st.sequence, s.hits(1)) == (SYNC, SUBSET, 3, (True, 4, 0))


def test_live_only_batch_refused_during_a_rebuild_retry_leaves_no_earlier_batch_to_restart_from():
    s = _empty_live_only()
    assert s._fed(s.at(BACKOFF_INITIAL_S).m.tick(s.now)) == (RequestHistory(2, 0, False, None),)
    s.live(4, put(1))                                  # applied, and kept for the retry
    assert (s.hits(1), s.m.view().buffered_seqs) == ((True, 4, 0), (4,))
    # A live batch the index refuses (another block size) while the rebuild retry is in flight:
    # the index is gone, the retry goes on.
    bad = BlockStored([1000 + 7], None, blk(7)[:2], 2, DEVICE)
    assert s.live(5, bad) == NO_ACTIONS
    assert (s.state(), s.m.attempt) == (UNSYNC, 2)
    # Unanswered: seq 4 came before the refused seq 5 and must not start an index (seq 5 may
    # have removed block 1): an empty live-only subset again.
    s.m.on_snapshot_failed(2, ReplayUnanswered("no reply"), s.now)
    st = s.serving.status()
    assert (st.state, st.completeness, st.sequence, s.hits(1)) == (SYNC, SUBSET, None,
                                                                    (True, 0, 0))


def test_live_only_decode_error_keeps_retrying_the_rebuild():
    s = _empty_live_only()
    s.live(4, put(1))
    assert s._fed(s.at(BACKOFF_INITIAL_S).m.tick(s.now)) == (RequestHistory(2, 0, False, None),)
    actions = s.m.on_live_error(DecodeErrorReason.PAYLOAD, "seq 5: not a batch", 5, s.now)
    assert actions == (AbandonSnapshot(2),)
    assert (s.state(), s.hits(1)) == (UNSYNC, (False, 0, 0))
    # The abandoned retry is asked for again at once (not only a live-only index from the
    # next live batch, which would never try the replay endpoint again).
    assert s._fed(s.m.tick(s.now)) == (RequestHistory(3, 0, True, None),)


# ---------------------------------------------------------------------------- other rules


def test_all_blocks_cleared_batch_synchronizes_an_unsynchronized_stream():
    s = Stream()
    s.connect()
    actions = s.live(9, AllBlocksCleared(None), put(1))
    assert actions == (AbandonSnapshot(1),)
    assert (s.state(), s.completeness(), s.m.anchor) == (SYNC, EXACT, (9, 7_009))


def test_silent_live_channel_unsynchronizes_until_a_live_message():
    s = Stream(resync_interval_ms=1000).synced([[put(1)]])
    s._fed(s.at(1.0).m.tick(s.now))
    s.catch_up((1, [drop(1)]))                        # found by the catch-up only
    assert s.state() == SYNC
    s.at(1.0 + LIVE_SILENCE_GRACE_S).m.tick(s.now)
    st = s.serving.status()
    assert (st.state, st.error.startswith("live channel silent")) == (UNSYNC, True)
    assert s.m.tick(s.at(10.0).now) == NO_ACTIONS    # nothing asked until a live message
    s.live(2, put(2))
    assert s._fed(s.m.tick(s.now)) == (RequestHistory(3, 1, True, 7_001),)
    assert s.catch_up((2, [put(2)])) == (AbandonSnapshot(3),)
    assert (s.state(), s.hits(2)) == (SYNC, (True, 4, 0))


def test_buffer_overflow_fails_the_attempt():
    s = Stream(max_buffered_bytes=1024)
    s.connect()
    assert s.live(0, put(1)) == NO_ACTIONS
    assert s.live(1, *[put(c) for c in range(2, 12)]) == (AbandonSnapshot(1),)
    assert s.serving.status().error.startswith("buffer overflow")


def test_truncated_rebuild_is_kept_unserved_and_catches_up_from_its_last_seq():
    s = Stream()
    s.connect()
    s.live(4, put(4))                                 # buffered: after the hole
    index = TierIndex(BS, SEED, 1000)
    index.apply([put(1)], snapshot=True)
    result = RebuildReply(index=index, first_seq=0,
                           last_seq=0, last_digest=7_000, exact=True, digests={0: 7_000},
                           messages=1, wire_bytes=10, reason="history reply skipped from seq 0 "
                           "to 3", truncated=True)
    actions = s._fed(s.m.on_snapshot_complete(1, result, s.now, s.now))
    assert actions == (AbandonSnapshot(1), RequestHistory(2, 0, True, 7_000))
    st = s.serving.status()
    assert (st.state, st.device_blocks, s.hits(1)) == (RECOVERING, 1, (False, 0, 0))
    truncated = CatchUpReply(continuous=True, messages=2, wire_bytes=10,
                             reason="history reply skipped from seq 1 to 3", truncated=True)
    s.m.on_history_batch(2, 1, [put(2, 1)], 7_001, 10, s.now)
    actions = s._fed(s.m.on_snapshot_complete(2, truncated, s.now, s.now))
    assert actions == (AbandonSnapshot(2), RequestHistory(3, 1, True, 7_001))
    assert s.catch_up((2, [put(3, 2)]), (3, [drop(99)]), (4, [put(4)])) == (AbandonSnapshot(3),)
    assert (s.state(), s.completeness(), s.hits(1, 2, 3)) == (SYNC, EXACT, (True, 12, 0))
    assert s.hits(4) == (True, 4, 0)


def test_live_batches_before_the_first_request_are_kept_for_the_rebuild():
    s = Stream()
    s.m.start(s.now)
    s.m.on_live_opened()
    assert s.live(0, put(1)) == NO_ACTIONS          # before the handshake: no request yet
    s.m.on_live_up(s.now)
    assert s._fed(s.m.tick(s.now)) == (RequestHistory(1, 0, True, None),)
    assert s.m.view().buffered_seqs == (0,)
    s.m.on_snapshot_failed(1, ReplayUnanswered("no reply"), s.now)
    assert (s.state(), s.completeness(), s.hits(1)) == (SYNC, EXACT, (True, 4, 0))


def test_restarted_engine_reaching_the_expected_seq_is_found_by_the_anchor_digest():
    s = Stream().synced([[put(1)], [put(2, 1)]])     # L = 1
    s.m.on_live_down("disconnected", s.now)
    s.m.on_live_opened()
    s.m.on_live_up(s.now)
    assert s._fed(s.m.tick(s.now)) == (RequestHistory(2, 1, True, 7_001),)
    # The new engine's seq 2 is the expected seq: buffered, not applied to the old index.
    assert s.live(2, put(5), digest=42) == NO_ACTIONS
    assert s.m.anchor == (1, 7_001)
    actions = s.catch_up(continuous=False, reason="seq 1 has another payload digest")
    assert actions == (AbandonSnapshot(2), RequestHistory(3, 0, True, None))
    assert s.serving.status().device_blocks == 0


def test_live_only_disconnect_starts_a_new_live_only_index():
    s = Stream()
    s.connect()
    s.m.on_snapshot_failed(1, ReplayUnanswered("no reply"), s.now)
    s.live(3, put(1))
    assert s.hits(1) == (True, 4, 0)
    s.m.on_live_down("disconnected", s.now)
    assert (s.state(), s.hits(1)) == (UNSYNC, (False, 0, 0))
    s.m.on_live_opened()
    s.m.on_live_up(s.now)
    assert s.live(0, put(2)) == NO_ACTIONS            # a restarted engine: seq 0, exact
    assert (s.completeness(), s.hits(1), s.hits(2)) == (EXACT, (True, 0, 0), (True, 4, 0))


def test_history_streams_decode_byte_hashes_to_the_integer_form():
    from kvsvc.streams.decoder import decode_batch
    raw, parent = bytes(range(32)), b"\x01" * 32
    payload = ormsgpack.packb({"ts": 1.0, "data_parallel_rank": 0, "events": [
        {"type": "BlockStored", "block_hashes": [raw, 5], "parent_block_hash": parent,
         "token_ids": [], "block_size": 0, "medium": "CPU"},
        ["BlockRemoved", [raw], "CPU"]]})
    as_int = int.from_bytes(raw, "big") & ((1 << 64) - 1)
    st, rm = decode_batch(payload, 0, True).events
    assert (st.block_hashes, st.parent_block_hash, rm.block_hashes) == (
        [as_int, 5], int.from_bytes(parent[-8:], "big"), [as_int])
    st, rm = decode_batch(payload, 0).events            # snapshot mode: bytes stay bytes
    assert (st.block_hashes, st.parent_block_hash, rm.block_hashes) == ([raw, 5], parent, [raw])


# ---------------------------------------------------------------------------- property: no false hit

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

OPS = st.lists(st.sampled_from(["store", "store", "store", "remove", "lose", "disconnect",
                                "restart", "clear", "answer", "answer", "fail", "tick",
                                "delay", "unanswered"]),
               min_size=5, max_size=40)


class ModelEngine:
    """A vLLM-like engine for the rules (§7h): blocks with unique hashes, a seq counter per
    process, a bounded replay buffer of (seq, events, digest), the residency after each seq."""

    def __init__(self, buffer_steps: int) -> None:
        self.epoch = 0
        self.seq = 0
        self.buffer: list[tuple[int, list[Event], int]] = []
        self.buffer_steps = buffer_steps
        self.resident: dict[int, Optional[int]] = {}   # hash -> parent hash
        self.parents: dict[int, Optional[int]] = {}    # every hash ever stored
        self.truth: dict[int, dict[int, Optional[int]]] = {}   # seq -> residency after it
        self.next_hash = 1

    def publish(self, events: list[Event]) -> tuple[int, list[Event], int]:
        seq = self.seq
        self.seq += 1
        digest = self.epoch * 1_000_000 + seq + 1
        self.buffer.append((seq, events, digest))
        del self.buffer[:-self.buffer_steps]
        self.truth[seq] = dict(self.resident)
        return seq, events, digest

    def store(self, rng_pick: int) -> list[Event]:
        h = self.next_hash
        self.next_hash += 1
        parents = sorted(self.resident)
        parent = parents[rng_pick % len(parents)] if parents and rng_pick % 3 else None
        self.resident[h] = parent
        self.parents[h] = parent
        return [BlockStored([h], parent, blk(h), BS, DEVICE)]

    def chain(self, h: int) -> list[int]:
        out = []
        cur: Optional[int] = h
        while cur is not None:
            out.append(cur)
            cur = self.parents[cur]
        return out[::-1]


def _truth_hits(residency: dict[int, Optional[int]], chain: list[int]) -> int:
    n = 0
    for h in chain:
        if h not in residency:
            break
        n += 1
    return n * BS


@settings(max_examples=100, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(OPS, st.integers(2, 8), st.lists(st.integers(0, 1000), min_size=40, max_size=40))
def test_property_no_false_hit_and_exact_means_equal(ops, buffer_steps, picks):
    """Whatever happens (lost batches, disconnects, restarts, clears, failed replies, a rolled
    buffer), a synchronized stream's answers equal the engine's residency at the stream's seq
    when ``exact``, and never exceed it when ``subset``; an unsynchronized one has no hit."""
    s = Stream(resync_interval_ms=1000)
    eng = ModelEngine(buffer_steps)
    for _ in range(picks[-1] % 12):      # history before kvsvc joins (may roll the buffer)
        eng.publish(eng.store(picks[-2]))
    s.connect()

    def answer() -> None:
        req = s.requests[-1] if s.requests else None
        if req is None or s.m.attempt != req.attempt:
            return
        if req.catch_up:
            tail = [b for b in eng.buffer if b[0] >= req.start_seq]
            if not tail or tail[0][0] != req.start_seq or tail[0][2] != req.anchor_digest:
                result = CatchUpReply(False, 0, 0, "not continuous")
                s._fed(s.m.on_snapshot_complete(req.attempt, result, s.now, s.now))
                return
            for seq, events, digest in tail[1:]:
                s._fed(s.m.on_history_batch(req.attempt, seq, events, digest, 10, s.now))
                if s.m.attempt != req.attempt:
                    return
            result = CatchUpReply(True, len(tail), 10)
        else:
            index = TierIndex(BS, SEED, 10_000)
            for _, events, _ in eng.buffer:
                index.apply(events, snapshot=True)
            b = eng.buffer
            result = RebuildReply(
                index, b[0][0] if b else None, b[-1][0] if b else None,
                b[-1][2] if b else None,
                bool(b) and b[0][0] == 0 and index.stats.orphan_blocks == 0,
                {seq: d for seq, _, d in b}, len(b), 10)
        s._fed(s.m.on_snapshot_complete(req.attempt, result, s.now, s.now))

    pending: list = []   # published, still on the wire (a PUB delivers in order)

    def deliver(batch) -> None:
        while pending:
            seq, events, digest = pending.pop(0)
            s._fed(s.m.on_live_batch(seq, Batch(0.0, events, 0), 10, s.now, digest=digest))
        seq, events, digest = batch
        s._fed(s.m.on_live_batch(seq, Batch(0.0, events, 0), 10, s.now, digest=digest))

    def reconnect() -> None:
        pending.clear()
        s._fed(s.m.on_live_down("disconnected", s.now))
        s._fed(s.m.on_live_opened())
        s._fed(s.m.on_live_up(s.now))
        s._fed(s.m.tick(s.now))

    for i, op in enumerate(ops):
        pick = picks[i]
        if op == "store":
            deliver(eng.publish(eng.store(pick)))
        elif op == "remove" and eng.resident:
            h = sorted(eng.resident)[pick % len(eng.resident)]
            del eng.resident[h]
            deliver(eng.publish([BlockRemoved([h], DEVICE)]))
        elif op == "lose":
            if eng.resident and pick % 2:
                h = sorted(eng.resident)[pick % len(eng.resident)]
                del eng.resident[h]
                eng.publish([BlockRemoved([h], DEVICE)])
            else:
                eng.publish(eng.store(pick))
        elif op == "clear":
            eng.resident.clear()
            deliver(eng.publish([AllBlocksCleared(None)] + eng.store(pick)))
        elif op == "disconnect":
            reconnect()
        elif op == "restart":
            eng.epoch += 1
            eng.seq = 0
            eng.buffer.clear()
            eng.resident.clear()
            eng.truth.clear()
            pending.clear()
            s._fed(s.m.on_live_down("disconnected", s.now))
            s._fed(s.m.on_live_opened())
            # The new process publishes before kvsvc reconnects: those never arrive live.
            for _ in range(pick % 4):
                eng.publish(eng.store(pick))
            s._fed(s.m.on_live_up(s.now))
            s._fed(s.m.tick(s.now))
        elif op == "answer":
            answer()
        elif op == "fail" and s.m.attempt is not None:
            s._fed(s.m.on_snapshot_failed(s.m.attempt, SnapshotError("bad reply"), s.now))
        elif op == "delay":
            pending.append(eng.publish(eng.store(pick)))
        elif op == "unanswered" and s.m.attempt is not None and s.requests \
                and not s.requests[-1].catch_up:
            s._fed(s.m.on_snapshot_failed(s.m.attempt, ReplayUnanswered("no reply"), s.now))
        elif op == "tick":
            s.at(s.now - T0 + 0.7)
            s._fed(s.m.tick(s.now))
        # The check: every chain ever stored, against the residency at the stream's seq.
        status = s.serving.status()
        # The rules' mode and the serving state they asked for agree (they never read it).
        assert (s.m.mode in SERVES) == (status.state is SYNC), (s.m.mode, status.state)
        held = s.m.mode in (HELD, SERVING, LIVE_ONLY, SILENT)
        assert held == (s.m.rules._index is not None)
        assert held or (status.entries, status.completeness) == (0, None)
        for h in eng.parents:
            chain = eng.chain(h)
            m = s.serving.match(prompt_keys(blk(*chain), BS, SEED))
            if not m.synchronized:
                assert m.device_hit_tokens == 0
                continue
            truth = (eng.truth.get(status.sequence, {}) if status.sequence is not None
                     else {})
            expected = _truth_hits(truth, chain)
            if m.completeness is EXACT:
                assert m.device_hit_tokens == expected, (ops[:i + 1], h, chain)
            else:
                assert m.device_hit_tokens <= expected, (ops[:i + 1], h, chain)


# ---------------------------------------------------------------------------- reply pacing


def test_reply_slice_grows_only_after_a_late_yield():
    from kvsvc.streams.pacing import BUILD_SLICE_S, REPLY_SLICE_MAX_S, reply_slice_s
    assert (BUILD_SLICE_S, REPLY_SLICE_MAX_S) == (0.0003, 0.001)
    assert reply_slice_s(0.00002) == BUILD_SLICE_S        # a prompt yield: the 0.3 ms slice
    assert reply_slice_s(0.0008) == BUILD_SLICE_S
    assert reply_slice_s(0.002) == pytest.approx(0.0005)   # a quarter of the wait
    assert reply_slice_s(0.005) == REPLY_SLICE_MAX_S       # a whole 5 ms interval: capped
    assert reply_slice_s(0.1) == REPLY_SLICE_MAX_S


def test_switch_interval_lease_gives_back_what_it_lowered_and_nothing_else():
    import sys

    from kvsvc.streams.pacing import SwitchIntervalLease
    original = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        SwitchIntervalLease(None).engage()                 # disabled: nothing changes
        assert sys.getswitchinterval() == 0.005
        a, b = SwitchIntervalLease(0.0005), SwitchIntervalLease(0.0005)
        a.engage()
        b.engage()                                         # already lowered: b owns nothing
        assert (sys.getswitchinterval(), a.engaged, b.engaged) == (0.0005, True, False)
        a.release()                                        # a ends first: back to 5 ms ...
        assert sys.getswitchinterval() == 0.005
        b.engage()                                         # ... b's next turn lowers it again
        assert (sys.getswitchinterval(), b.engaged) == (0.0005, True)
        b.release()
        b.release()                                        # idempotent
        assert sys.getswitchinterval() == 0.005
        # Changed by someone else meanwhile: left as they set it.
        a.engage()
        sys.setswitchinterval(0.002)
        a.release()
        assert sys.getswitchinterval() == 0.002
        # Never raises an interval already below the target.
        sys.setswitchinterval(0.0001)
        a.engage()
        a.release()
        assert (sys.getswitchinterval(), a.engaged) == (pytest.approx(0.0001), False)
    finally:
        sys.setswitchinterval(original)


# ---------------------------------------------------------------------------- pure merges


def test_merge_rebuild_drops_covered_batches_applies_the_tail_and_decides_exactness():
    from kvsvc.errors import SnapshotError as Err
    from kvsvc.streams.history import merge_rebuild
    index = TierIndex(BS, SEED, 1000)
    index.apply([put(1)], snapshot=True)
    reply = RebuildReply(index, 3, 3, 7_003, False, {3: 7_003}, 1, 10)
    merged = merge_rebuild(reply, [(3, Batch(0.0, [put(1)], 0), 7_003),
                                   (4, Batch(0.0, [AllBlocksCleared(), put(2)], 0), 7_004)])
    assert (merged.sequence, merged.digest, merged.completeness, len(merged.tail)) == (
        4, 7_004, EXACT, 2)
    assert index.match(prompt_keys(blk(2), BS, SEED)) == (1, 0)
    again = RebuildReply(TierIndex(BS, SEED, 1000), 3, 3, 7_003, False, {3: 7_003}, 1, 10)
    assert str(merge_rebuild(again, [(3, Batch(0.0, [put(1)], 0), 1)])) == (
        "live seq 3 differs from the batch replayed (the engine restarted)")
    gap = merge_rebuild(again, [(5, Batch(0.0, [put(1)], 0), 1)])
    assert isinstance(gap, Err) and str(gap) == "gap after the history reply: expected seq 4, got 5"
    empty = RebuildReply(TierIndex(BS, SEED, 1000), None, None, None, True, {}, 0, 10)
    first = merge_rebuild(empty, [(9, Batch(0.0, [put(1)], 0), 7_009)])
    assert (first.sequence, first.completeness) == (9, SUBSET)


def test_merge_catch_up_keeps_the_contiguous_tail_and_stops_at_a_restart_or_a_hole():
    from kvsvc.streams.anchor import Anchor
    from kvsvc.streams.history_reply import merge_catch_up
    b = Batch(0.0, [drop(99)], 0)
    anchor = Anchor.at(5, 7_005, {4: 7_004})
    merged = merge_catch_up(anchor, [(4, b, 7_004), (5, b, 1), (6, b, 7_006), (7, b, 7_007)])
    assert ([seq for seq, _, _ in merged.apply], merged.restarted, merged.gap) == ([], 5, None)
    merged = merge_catch_up(anchor, [(2, b, 1), (6, b, 7_006), (6, b, 7_006), (7, b, 7_007),
                                     (9, b, 7_009)])
    assert ([seq for seq, _, _ in merged.apply], merged.restarted, merged.gap) == ([6, 7], None, 9)
    assert anchor.last == (5, 7_005)                  # judged on a copy: the anchor is unchanged
    merged = merge_catch_up(anchor, [(6, b, 7_006), (6, b, 8)])
    assert ([seq for seq, _, _ in merged.apply], merged.restarted) == ([6], 6)
