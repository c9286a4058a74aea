"""History-mode streams (PROTOCOL.md §7h, §2) against a vLLM-style publisher on 127.0.0.1
(tests/support/publisher.py ``HistoryPublisher``): late joins, catch-ups, rebuilds, subsets, the
live-only subset, hash forms, SGLang batches, a 10,000-batch reply and bad replies. Block size
4, seed 1024; block content ``c`` is the tokens ``[c*100, ...]`` and engine hash ``1000 + c``."""

from __future__ import annotations

import logging
import time
from typing import Optional

import ormsgpack
import pytest

from kvsvc.clock import VirtualClock
from kvsvc.config import ReplayMode
from kvsvc.index.keys import prompt_keys
from kvsvc.streams.frame import END_MARKER
from kvsvc.streams.recovery import LIVE_SILENCE_GRACE_S
from kvsvc.streams.state import Completeness, StreamState
from kvsvc.streams.subscriber import StreamSubscriber
from tests.support.subscriber import BS, SEED, blk, hits
from tests.support.subscriber import Harness as SnapshotHarness
from tests.support.publisher import HistoryPublisher, cleared, removed, stored
from tests.support.util import wait_for

SYNC, RECOVERING = StreamState.SYNCHRONIZED, StreamState.RECOVERING
EXACT, SUBSET = Completeness.EXACT, Completeness.SUBSET
U64 = (1 << 64) - 1


def put(c: int, parent: Optional[int] = None, medium: Optional[str] = None) -> dict:
    """``BlockStored`` of block content ``c`` (hash ``1000 + c``) under block ``parent``."""
    return stored([1000 + c], None if parent is None else 1000 + parent, blk(c), BS, medium)


def drop(*contents: int, medium: Optional[str] = None) -> dict:
    return removed([1000 + c for c in contents], medium)


class Harness(SnapshotHarness):
    """The subscriber tests' harness with vLLM-style publishers and history-mode streams."""

    publisher_class = HistoryPublisher
    stream_options = {"replay_mode": ReplayMode.HISTORY}


@pytest.fixture
def h(zmq_ctx):
    harness = Harness(zmq_ctx)
    yield harness
    harness.close()


@pytest.fixture
def vh(zmq_ctx):
    """As ``h``, with the subscribers' timers on a virtual clock (``vh.clock.advance``)."""
    harness = Harness(zmq_ctx, VirtualClock())
    yield harness
    harness.close()


def synced_at(sub: StreamSubscriber, seq: Optional[int], timeout_s: float = 10.0) -> None:
    """Wait until the stream is synchronized with last applied seq ``seq``."""
    wait_for(lambda: (lambda st: st.state is SYNC and st.sequence == seq)(sub.status()),
             timeout_s, what=f"synchronized at seq {seq}: {sub.status()}")


def test_late_join_whole_history_is_exact(h):
    pub = h.publisher()
    pub.publish([put(1)])
    pub.publish([put(2, 1)])
    pub.publish([put(3)])
    pub.publish([drop(3)])
    sub = h.subscriber(pub)
    synced_at(sub, 3)
    st = sub.status()
    assert (st.completeness, st.device_blocks, pub.requests) == (EXACT, 2, [0])
    assert hits(sub, 1, 2) == (True, 8, 0)
    assert hits(sub, 3) == (True, 0, 0)
    pub.wait_subscribed()
    pub.publish([put(4, 2)])
    synced_at(sub, 4)
    assert hits(sub, 1, 2, 4) == (True, 12, 0)
    assert sub.match(prompt_keys(blk(1), BS, SEED)).completeness is EXACT


def test_rolled_buffer_gives_a_subset_without_false_hits_then_exact(h):
    pub = h.publisher(buffer_steps=3)
    pub.publish([put(1)])
    pub.publish([put(2, 1)])
    pub.publish([put(5)])          # seq 2: the buffer holds seq 2..4 only
    pub.publish([put(6, 2)])       # parent unknown in the subset: an orphan
    pub.publish([drop(5)])
    sub = h.subscriber(pub)
    synced_at(sub, 4)
    st = sub.status()
    assert (st.completeness, st.device_blocks, st.host_blocks) == (SUBSET, 0, 0)
    # The engine holds 1, 2, 6: missed hits, never a false one.
    assert hits(sub, 1, 2, 6) == (True, 0, 0)
    assert hits(sub, 5) == (True, 0, 0)
    pub.wait_subscribed()
    pub.publish([put(7, 6)])       # under an orphan: an orphan too, no error
    pub.publish([put(8)])
    synced_at(sub, 6)
    assert hits(sub, 8) == (True, 4, 0)
    assert sub.match(prompt_keys(blk(8), BS, SEED)).completeness is SUBSET
    assert sum(sub.counters().decode_errors.values()) == 0
    pub.publish([cleared(), put(9)])
    synced_at(sub, 7)
    assert sub.status().completeness is EXACT
    assert (hits(sub, 8), hits(sub, 9)) == ((True, 0, 0), (True, 4, 0))
    assert pub.requests == [0]


def test_gap_catches_up_from_the_anchor_without_a_rebuild(h):
    pub = h.publisher()
    pub.publish([put(1)])
    pub.publish([put(2, 1)])
    sub = h.subscriber(pub)
    synced_at(sub, 1)
    pub.wait_subscribed()
    pub.hold_replies()
    pub.publish([put(3, 2)], live=False)   # seq 2 lost on the wire
    pub.publish([drop(1)])                 # seq 3: a gap
    wait_for(lambda: sub.status().state is RECOVERING, what="recovering")
    # Removals may be missing meanwhile: no hit at all.
    assert hits(sub, 2)[0] is False and sub.status().completeness is None
    wait_for(lambda: len(pub.requests) == 2, what="catch-up request")
    pub.release_replies()
    synced_at(sub, 3)
    assert pub.requests == [0, 1]          # start_seq = L, no request from 0
    assert hits(sub, 1, 2, 3) == (True, 0, 0)   # block 1 removed by seq 3
    st = sub.status()
    assert (st.completeness, st.device_blocks) == (EXACT, 2)
    counters = sub.counters()
    assert counters.recoveries_started["sequence_gap"] == 1
    assert counters.recoveries_started["history_mismatch"] == 0


def test_disconnect_catches_up_without_a_rebuild(h):
    pub = h.publisher()
    pub.publish([put(1)])
    sub = h.subscriber(pub)
    synced_at(sub, 0)
    pub.wait_subscribed()
    pub.hold_replies()
    pub.rebind()                            # the SUB sees a disconnect; same engine
    wait_for(lambda: sub.counters().recoveries_started["disconnect"] == 1, what="disconnect")
    assert hits(sub, 1)[0] is False
    pub.publish([put(2, 1)], live=False)    # published while kvsvc was away
    pub.publish([drop(1)], live=False)
    wait_for(lambda: len(pub.requests) == 2, what="catch-up request")
    pub.release_replies()
    synced_at(sub, 2)
    assert pub.requests == [0, 0]           # L = 0: the anchor, not a rebuild
    assert sub.counters().recoveries_started["history_mismatch"] == 0
    assert sub.status().device_blocks == 1
    pub.publish([put(3, 2)])
    synced_at(sub, 3)
    assert sub.status().device_blocks == 2


def test_engine_restart_detected_by_the_digest(h):
    pub = h.publisher()
    for c in (1, 2, 3, 4):
        pub.publish([put(c)])
    sub = h.subscriber(pub)
    synced_at(sub, 3)
    pub.wait_subscribed()
    pub.hold_replies()
    pub.restart()
    # The new process publishes L + 2 = 5 batches before kvsvc asks: its seq 3 exists.
    for c in (11, 12, 13, 14, 15):
        pub.publish([put(c)], live=False)
    wait_for(lambda: len(pub.requests) == 2, what="catch-up request")
    assert pub.requests == [0, 3]
    pub.release_replies()
    synced_at(sub, 4)
    assert pub.requests == [0, 3, 0]
    assert sub.counters().recoveries_started["history_mismatch"] == 1
    assert sub.status().completeness is EXACT
    assert (hits(sub, 4), hits(sub, 15)) == ((True, 0, 0), (True, 4, 0))


def test_empty_reply_then_first_live_seq_0_is_exact(h):
    pub = h.publisher()
    sub = h.subscriber(pub)
    synced_at(sub, None)
    pub.wait_subscribed()
    pub.publish([put(1)])
    synced_at(sub, 0)
    assert (sub.status().completeness, hits(sub, 1)) == (EXACT, (True, 4, 0))


def test_empty_reply_then_first_live_seq_above_0_is_a_subset(h):
    pub = h.publisher(buffer_steps=0)       # keeps no history: every reply is empty
    pub.publish([put(1)], live=False)
    pub.publish([put(2, 1)], live=False)
    sub = h.subscriber(pub)
    synced_at(sub, None)
    pub.wait_subscribed()
    pub.publish([put(3, 2)])                # seq 2: parent unknown, an orphan
    pub.publish([put(4)])
    synced_at(sub, 3)
    assert sub.status().completeness is SUBSET
    assert (hits(sub, 1, 2, 3), hits(sub, 4)) == ((True, 0, 0), (True, 4, 0))


def test_periodic_catch_up_finds_a_lost_tail_batch(vh):
    pub = vh.publisher()
    pub.publish([put(1)])
    sub = vh.subscriber(pub, resync_interval_ms=1000)
    synced_at(sub, 0)
    pub.wait_subscribed()
    pub.publish([drop(1)], live=False)     # the last batch, lost: a stale index meanwhile
    vh.clock.advance(1.0)                  # the resync interval
    wait_for(lambda: sub.status().resync_differences == 1, 5.0, what="periodic catch-up")
    assert pub.requests == [0, 0]
    assert hits(sub, 1) == (True, 0, 0)
    st = sub.status()
    assert (st.state, st.sequence, st.completeness, st.device_blocks) == (SYNC, 1, EXACT, 0)


def test_cpu_tier_byte_hashes_meet_device_int_hashes(h):
    pub = h.publisher()
    raw = bytes(range(24, 56))                       # a 32-byte block hash
    as_int = int.from_bytes(raw, "big") & U64        # vLLM's Device event form
    pub.publish([stored([as_int], None, blk(1), BS, "GPU")])
    # The CPU offloading connector: tokenless, raw hash bytes, medium "CPU".
    pub.publish([stored([raw], None, [], 0, "CPU")])
    pub.publish([removed([as_int], "GPU")])
    sub = h.subscriber(pub)
    synced_at(sub, 2)
    assert hits(sub, 1) == (True, 0, 4)              # Host-only after the Device removal
    pub.wait_subscribed()
    pub.publish([removed([raw], "CPU")])
    synced_at(sub, 3)
    assert hits(sub, 1) == (True, 0, 0)


@pytest.mark.parametrize("form", ["sglang", "vllm-array"])
def test_tagged_array_batches_with_a_rank(h, form):
    pub = h.publisher(form=form, dp_rank=1, topic_frame=True)
    pub.publish([put(1)])
    pub.publish([put(2, 1)])
    sub = h.subscriber(pub)
    synced_at(sub, 1)
    assert (hits(sub, 1, 2), sub.status().completeness) == ((True, 8, 0), EXACT)


def test_10000_batch_history_within_the_per_message_timeout(h):
    pub = h.publisher()
    # 2,500 roots of 4 blocks each, one block per batch (the bench measures 16 per batch).
    for root in range(2500):
        base = 10 * root
        pub.publish([stored([base + 1], None, blk(base + 1), BS)])
        for j in range(2, 5):
            pub.publish([stored([base + j], base + j - 1, blk(base + j), BS)])
    pub.pause_every, pub.pause_s = 2500, 0.2        # the whole reply takes >= 0.8 s
    started = time.monotonic()
    sub = h.subscriber(pub, replay_timeout_ms=500)
    synced_at(sub, 9999, timeout_s=60.0)
    elapsed = time.monotonic() - started
    logging.getLogger(__name__).info("10,000-batch history: synchronized in %.2f s", elapsed)
    # The successful replies, as the stream measured them (request to swap), lasted longer
    # than one replay_timeout_ms in all: the bound is per message, not per reply. (The wall
    # time alone proved nothing: the publisher's pauses make it exceed 0.5 s.)
    counters = sub.counters()
    assert counters.snapshot_seconds_sum > 0.5, counters
    st = sub.status()
    assert (st.device_blocks, st.completeness, pub.requests[0]) == (10_000, EXACT, 0)
    # On a loaded machine the engine's ROUTER may drop messages of its long reply at its send
    # high-water mark: then the stream catches up from the last seq it got, never rebuilds.
    assert all(start > 0 for start in pub.requests[1:]), pub.requests
    assert hits(sub, 24991, 24992, 24993, 24994) == (True, 16, 0)


def _u64(v: int) -> bytes:
    return v.to_bytes(8, "big")


def _batch(*events: dict) -> bytes:
    return ormsgpack.packb({"ts": 1.0, "events": list(events), "data_parallel_rank": 0})


BAD_REPLIES = {
    "seq backwards": ([[b"", _u64(0), _batch(put(1))], [b"", _u64(1), _batch(put(2, 1))],
                       [b"", _u64(0), _batch(put(1))], list(END_MARKER)],
                      "history reply seq went backwards: seq 0 after 1"),
    "seq repeated": ([[b"", _u64(0), _batch(put(1))], [b"", _u64(0), _batch(put(1))],
                      list(END_MARKER)], "history reply seq repeated: seq 0 after 0"),
    "not a batch": ([[b"", _u64(0), ormsgpack.packb("hello")], list(END_MARKER)],
                    "history reply seq 0: batch is str, expected an array or a map"),
    "over the limit": ([[b"", _u64(0), _batch(put(1), *[drop(c) for c in range(2, 60)])],
                        list(END_MARKER)], "exceeds max_message_bytes"),
}


@pytest.mark.parametrize("case", sorted(BAD_REPLIES))
def test_bad_history_reply_fails_the_attempt_and_retries(h, case):
    frames, reason = BAD_REPLIES[case]
    pub = h.publisher()
    pub.publish([put(1)])
    pub.publish([put(2, 1)])
    pub.reply_frames = lambda start_seq: frames
    sub = h.subscriber(pub, max_message_bytes=1024)
    wait_for(lambda: reason in (sub.status().error or ""), what=f"error {reason!r}")
    st = sub.status()
    assert (st.state, st.completeness, hits(sub, 1)[0]) == (StreamState.UNSYNCHRONIZED, None,
                                                             False)
    synced_at(sub, 1)                                 # the retry gets a good reply
    assert pub.requests == [0, 0]
    assert sub.counters().snapshot_attempts["error"] == 1
    assert hits(sub, 1, 2) == (True, 8, 0)


def test_stall_past_the_per_message_timeout_retries(h):
    pub = h.publisher()
    pub.publish([put(1)])
    pub.publish([put(2, 1)])
    pub.stall_after = 1
    sub = h.subscriber(pub, replay_timeout_ms=200)
    wait_for(lambda: "no next message within replay_timeout_ms=200 after 1 messages"
             in (sub.status().error or ""), what="stall reason")
    assert hits(sub, 1)[0] is False
    synced_at(sub, 1)
    assert (pub.requests, sub.counters().snapshot_attempts["timeout"]) == ([0, 0], 1)


def test_periodic_catch_up_with_a_bad_reply_keeps_serving(vh, caplog):
    pub = vh.publisher()
    pub.publish([put(1)])
    sub = vh.subscriber(pub, resync_interval_ms=1000)
    synced_at(sub, 0)
    pub.wait_subscribed()
    pub.publish([put(2, 1)])
    synced_at(sub, 1)
    # The anchor is right, the batch after it is not MessagePack.
    anchor = pub.buffer[1][1]
    pub.reply_frames = lambda start_seq: [[b"", _u64(1), anchor], [b"", _u64(2), b"\xc1"],
                                          list(END_MARKER)]
    vh.clock.advance(1.0)                  # the resync interval
    wait_for(lambda: sub.counters().snapshot_attempts["error"] == 1, 5.0, what="bad resync")
    assert (sub.status().state, hits(sub, 1, 2)) == (SYNC, (True, 8, 0))
    assert "payload is not valid MessagePack" in caplog.text
    assert pub.requests == [0, 1]


def test_no_replay_endpoint_serves_a_live_only_subset(h):
    pub = h.publisher(replay=False)
    pub.publish([put(1)], live=False)
    sub = h.subscriber(pub, replay_timeout_ms=200)
    synced_at(sub, None)            # no answer, nothing received: an empty live-only subset
    pub.wait_subscribed()
    pub.publish([put(2, 1)])        # seq 1: its parent is unknown, an orphan
    pub.publish([put(3)])
    synced_at(sub, 2)
    assert (sub.status().completeness, hits(sub, 3), hits(sub, 1, 2)) == \
        (SUBSET, (True, 4, 0), (True, 0, 0))
    pub.publish([put(4)], live=False)   # a gap: the live-only index starts again at seq 4
    pub.publish([put(5)])
    synced_at(sub, 4)
    assert (hits(sub, 3), hits(sub, 5)) == ((True, 0, 0), (True, 4, 0))
    assert sub.counters().recoveries_started["sequence_gap"] == 1


def _idle_live_only(h) -> tuple[HistoryPublisher, StreamSubscriber]:
    """An engine without replay endpoint that publishes nothing: the stream is synchronized
    (ready, §10) with an empty live-only subset, expected seq unknown, 0 hits; the rebuild is
    retried meanwhile."""
    pub = h.publisher(replay=False)
    sub = h.subscriber(pub, replay_timeout_ms=200)
    synced_at(sub, None)
    st = sub.status()
    assert (st.completeness, st.synchronized_once, st.device_blocks, st.error) == \
        (SUBSET, True, 0, None)
    assert hits(sub, 1) == (True, 0, 0)
    assert sub.counters().snapshot_attempts["timeout"] >= 1
    return pub, sub


def test_no_replay_endpoint_idle_engine_is_ready_then_first_live_seq_0_is_exact(h):
    pub, sub = _idle_live_only(h)
    pub.wait_subscribed()
    pub.publish([put(1)])
    synced_at(sub, 0)
    assert (sub.status().completeness, hits(sub, 1)) == (EXACT, (True, 4, 0))
    pub.publish([put(2, 1)])
    synced_at(sub, 1)
    assert (sub.status().completeness, hits(sub, 1, 2)) == (EXACT, (True, 8, 0))


def test_no_replay_endpoint_idle_engine_is_ready_then_first_live_seq_5_is_a_subset(h):
    pub, sub = _idle_live_only(h)
    for c in range(1, 6):
        pub.publish([put(c)], live=False)     # seqs 0..4 never reached kvsvc
    pub.wait_subscribed()
    pub.publish([put(6, 5)])                  # seq 5: its parent is unknown, an orphan
    pub.publish([put(7)])
    synced_at(sub, 6)
    assert (sub.status().completeness, hits(sub, 5, 6), hits(sub, 7), hits(sub, 1)) == \
        (SUBSET, (True, 0, 0), (True, 4, 0), (True, 0, 0))
    assert sum(sub.counters().decode_errors.values()) == 0


def test_reply_with_a_hole_keeps_what_arrived_and_catches_up(h):
    pub = h.publisher()
    for c in range(1, 7):
        pub.publish([put(c, c - 1 if c > 1 else None)])
    pub.omit = {3, 4}                        # dropped by the engine's ROUTER
    sub = h.subscriber(pub)
    synced_at(sub, 5)
    assert pub.requests == [0, 2]            # the rebuild up to seq 2, then a catch-up from it
    assert (sub.status().completeness, hits(sub, 1, 2, 3, 4, 5, 6)) == (EXACT, (True, 24, 0))


def test_silent_live_channel_stops_serving(vh):
    pub = vh.publisher(topic=b"kv-events")       # the stream's topic "" sees other topics only
    pub.publish([put(1)])
    sub = vh.subscriber(pub, resync_interval_ms=1000)
    synced_at(sub, 0)
    pub.wait_subscribed()
    pub.publish([drop(1)])                       # dropped for its topic (§1): never applied live
    vh.clock.advance(1.0)                        # the resync interval: seq 1 was never applied
    wait_for(lambda: sub.status().resync_differences == 1, what="the catch-up")
    vh.clock.advance(LIVE_SILENCE_GRACE_S)       # ... and no live batch within the grace period
    wait_for(lambda: sub.counters().recoveries_started["live_silent"] == 1, 8.0,
             what="live channel silent")
    st = sub.status()
    assert (st.state, hits(sub, 1)[0], st.resync_differences) == (StreamState.UNSYNCHRONIZED,
                                                                   False, 1)
    assert "live channel silent" in st.error and "kv-events" in st.error
