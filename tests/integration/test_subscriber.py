"""The stream subscriber and its §6 recovery state machine, against a real publisher on
127.0.0.1 (tests/support/publisher.py). Block size 4, seed 1024; block contents are named by small
integers (:func:`blk`), engine hashes are arbitrary integers chosen per test."""

from __future__ import annotations

import logging
from typing import Optional

import pytest
import zmq

from kvsvc.clock import VirtualClock
from kvsvc.config import KvEventsConfig, StreamConfig
from kvsvc.errors import LifecycleError, SnapshotError, SnapshotTimeout
from kvsvc.index.keys import prompt_keys
from kvsvc.streams.recovery import BACKOFF_INITIAL_S, LIVE_SILENCE_GRACE_S, PROBE_RESYNC_S
from kvsvc.streams.frame import END_MARKER, encode_live, encode_reply, parse_snapshot_request
from kvsvc.streams.snapshot_client import SnapshotAttempt
from kvsvc.streams.state import StreamState
from kvsvc.streams.subscriber import StreamSubscriber
from tests.support.publisher import ProtocolPublisher, cleared, encode_batch, removed, stored
from tests.support.util import free_ports, wait_for
from tests.support.subscriber import BS, Harness, SEED, blk, hits

SYNC = StreamState.SYNCHRONIZED


@pytest.fixture
def h(zmq_ctx):
    harness = Harness(zmq_ctx)
    yield harness
    harness.close()


@pytest.fixture
def vh(zmq_ctx):
    """A harness whose subscribers' timers run on a virtual clock: the test moves time with
    ``vh.clock.advance`` (resync intervals, grace periods, replay timeouts take no real time)."""
    harness = Harness(zmq_ctx, VirtualClock())
    yield harness
    harness.close()


def synced_at(sub: StreamSubscriber, seq: Optional[int], timeout_s: float = 5.0):
    def check():
        st = sub.status()
        return st if st.state is SYNC and st.sequence == seq else None
    return wait_for(check, timeout_s, what=f"synchronized at seq {seq}")


def silence_check(sub: StreamSubscriber):
    """The running silent-channel check of ``sub`` (its debug view), ``None`` when none runs."""
    return sub.debug_view().recovery.silence_check


def error_contains(sub: StreamSubscriber, text: str, timeout_s: float = 5.0):
    def check():
        st = sub.status()
        return st if st.state is not SYNC and text in (st.error or "") else None
    return wait_for(check, timeout_s, what=f"error containing {text!r}")


def start_synced(h: Harness, snapshot=(), watermark=None, **kw):
    """Publisher + subscriber synchronized on ``snapshot`` at ``watermark``, subscription up."""
    pub = h.publisher(**{k: kw.pop(k) for k in ("topic", "dp_rank") if k in kw and k != "topic"})
    pub.set_snapshot(list(snapshot), watermark)
    pub.next_seq = 0 if watermark is None else watermark + 1
    sub = h.subscriber(pub, **kw)
    pub.wait_subscribed()
    synced_at(sub, watermark)
    return pub, sub


# ---------------------------------------------------------------------- snapshot basics

def test_late_join_learns_blocks_from_snapshot(h):
    pub, sub = start_synced(h, [stored([11, 12], None, blk(1, 2), BS),
                                stored([13], 12, blk(3), BS, medium="cpu")])
    assert hits(sub, 1, 2, 3) == (True, 8, 4)
    st = sub.status()
    assert (st.sequence, st.device_blocks, st.host_blocks, st.entries) == (None, 2, 1, 3)
    assert (st.recoveries, st.synchronized_once, st.error) == (1, True, None)
    # Watermark "none published": the next live batch is seq 0.
    assert pub.publish([stored([14], 13, blk(4), BS)]) == 0
    synced_at(sub, 0)
    assert hits(sub, 1, 2, 3, 4) == (True, 12, 4)
    assert pub.requests == [0]


def test_tiered_replicas_and_contiguous_prefix(h):
    pub, sub = start_synced(h, [stored([1, 2, 3], None, blk(1, 2, 3), BS)], watermark=4)
    assert hits(sub, 1, 2, 3) == (True, 12, 0)
    pub.publish([stored([1, 2], None, [], 0, medium="cpu"),          # tokenless Host replicas
                 stored([4], 3, blk(4), BS, medium="cpu_pinned")])   # Host-only child
    synced_at(sub, 5)
    assert hits(sub, 1, 2, 3, 4) == (True, 12, 4)
    pub.publish([removed([1, 2], "gpu")])   # Device copies evicted, Host copies stay
    synced_at(sub, 6)
    assert hits(sub, 1, 2, 3, 4) == (True, 4, 12)
    pub.publish([removed([2], "cpu")])      # block 2 gone from both tiers: the walk stops there
    synced_at(sub, 7)
    assert hits(sub, 1, 2, 3, 4) == (True, 0, 4)
    assert hits(sub, 1, 9) == (True, 0, 4)  # a different second block: prefix of one
    assert hits(sub, 9, 2) == (True, 0, 0)
    st = sub.status()
    assert (st.device_blocks, st.host_blocks, st.entries) == (1, 2, 3)


def test_empty_snapshot_takes_next_live_batch_as_baseline(h):
    pub = h.publisher()
    pub.empty_reply = True
    sub = h.subscriber(pub)
    pub.wait_subscribed()
    st = synced_at(sub, None)
    assert (st.device_blocks, st.entries, st.recoveries) == (0, 0, 1)
    pub.publish([stored([1], None, blk(1), BS)], seq=41)
    synced_at(sub, 41)
    pub.publish([stored([2], 1, blk(2), BS)])
    synced_at(sub, 42)
    assert hits(sub, 1, 2) == (True, 8, 0)


def test_orphans_in_snapshot_are_not_indexed(h):
    pub, sub = start_synced(h, [stored([1], None, blk(1), BS),
                                stored([2], 999, blk(2), BS),   # unknown parent: orphan
                                stored([3], 2, blk(3), BS),     # child of an orphan
                                stored([4], None, blk(4), BS)], watermark=0)
    st = sub.status()
    assert (st.device_blocks, st.entries) == (2, 4)
    assert hits(sub, 1) == (True, 4, 0)
    assert hits(sub, 4) == (True, 4, 0)
    # A live child of an orphan is an orphan too, not an unknown parent.
    pub.publish([stored([5], 3, blk(5), BS)])
    st = synced_at(sub, 1)
    assert (st.device_blocks, st.entries, st.recoveries) == (2, 5, 1)


# ---------------------------------------------------------------------- sequence handling

def test_sequence_gap_recovers_exactly(h):
    pub, sub = start_synced(h, [stored([1], None, blk(1), BS)], watermark=0)
    pub.hold_replies()
    pub.skip()                                        # seq 1 is lost
    pub.publish([stored([3], 1, blk(3), BS)])         # seq 2
    st = error_contains(sub, "sequence gap: expected seq 1, got 2")
    assert st.sequence is None and st.device_blocks == 0
    assert sub.match(prompt_keys(blk(1), BS, SEED)).to_json() == {
        "instance_name": "10.0.0.1:8000", "dp_rank": 0, "synchronized": False,
        "sequence": None, "device_hit_tokens": 0, "host_only_hit_tokens": 0,
        "reusable_prefix_tokens": 0, "device_blocks": 0, "host_blocks": 0,
        "error": "sequence gap: expected seq 1, got 2", "completeness": None,
        "pending_hit_tokens": 0}
    pub.set_snapshot([stored([1], None, blk(1), BS), stored([2], 1, blk(2), BS),
                      stored([3], 1, blk(3), BS)], watermark=2)
    pub.release_replies()
    st = synced_at(sub, 2)
    assert (st.device_blocks, st.recoveries) == (3, 2)
    assert hits(sub, 1, 2) == (True, 8, 0)
    assert hits(sub, 1, 3) == (True, 8, 0)
    assert pub.requests == [0, 0]


def test_backward_seq_after_engine_restart(h):
    pub, sub = start_synced(h, [stored([1], None, blk(1), BS)], watermark=3)
    pub.publish([stored([2], 1, blk(2), BS)])   # seq 4
    synced_at(sub, 4)
    pub.hold_replies()
    pub.publish([stored([7], None, blk(7), BS)], seq=0)   # new engine process counts from 0
    error_contains(sub, "sequence went backwards: expected seq 5, got 0")
    assert hits(sub, 1) == (False, 0, 0)
    pub.set_snapshot([stored([7], None, blk(7), BS)], watermark=0)
    pub.release_replies()
    st = synced_at(sub, 0)
    assert (st.device_blocks, st.recoveries) == (1, 2)
    assert hits(sub, 1) == (True, 0, 0)
    assert hits(sub, 7) == (True, 4, 0)
    pub.publish([stored([8], 7, blk(8), BS)])
    synced_at(sub, 1)
    assert hits(sub, 7, 8) == (True, 8, 0)


def test_snapshot_merges_buffered_batches_around_watermark(h):
    pub = h.publisher()
    pub.hold_replies()
    sub = h.subscriber(pub)
    pub.wait_subscribed()
    wait_for(lambda: pub.requests == [0], what="snapshot request")
    # Seqs 0..2 are in the snapshot (seq 1 removed block 1 again); 3 and 4 are not.
    pub.publish([stored([1], None, blk(1), BS)])
    pub.publish([removed([1])])
    pub.publish([stored([2], None, blk(2), BS)])
    pub.publish([stored([3], 2, blk(3), BS)])
    pub.publish([stored([4], 3, blk(4), BS)])
    wait_for(lambda: sub.live_messages == 5, what="5 live batches buffered")
    assert sub.status().state is StreamState.RECOVERING
    pub.set_snapshot([stored([2], None, blk(2), BS)], watermark=2)
    pub.release_replies()
    st = synced_at(sub, 4)
    assert (st.device_blocks, st.entries, st.recoveries) == (3, 3, 1)
    assert hits(sub, 2, 3, 4) == (True, 12, 0)
    assert hits(sub, 1) == (True, 0, 0)
    assert sub.duplicates_dropped == 0


def test_in_flight_duplicates_after_swap_are_dropped_but_repeats_are_not(h):
    pub = h.publisher()
    pub.hold_replies()
    sub = h.subscriber(pub)
    pub.wait_subscribed()
    wait_for(lambda: pub.requests == [0], what="snapshot request")
    # Seq 1 arrives during the recovery (buffered, then covered by the snapshot): this
    # connection has now seen seq 1.
    pub.publish([stored([2], 1, blk(2), BS)], seq=1)
    wait_for(lambda: sub.live_messages == 1, what="seq 1 received")
    pub.set_snapshot([stored([1, 2, 3, 4], None, blk(1, 2, 3, 4), BS)], watermark=3)
    pub.release_replies()
    synced_at(sub, 3)
    # Batches 2 and 3 were published before the snapshot but arrive after it: above the highest
    # seq seen on the connection and not above the watermark, so covered by the snapshot.
    pub.publish([stored([3], 2, blk(3), BS)], seq=2)
    pub.publish([stored([4], 3, blk(4), BS)], seq=3)
    pub.publish([stored([5], 4, blk(5), BS)], seq=4)
    st = synced_at(sub, 4)
    assert (sub.duplicates_dropped, st.recoveries, st.device_blocks) == (2, 1, 5)
    assert hits(sub, 1, 2, 3, 4, 5) == (True, 20, 0)
    # Seq 3 again is a repeat (not above the highest seq seen): a sequence error.
    pub.hold_replies()
    pub.publish([removed([5])], seq=3)
    error_contains(sub, "sequence went backwards: expected seq 5, got 3")
    pub.set_snapshot([stored([1, 2, 3, 4], None, blk(1, 2, 3, 4), BS)], watermark=4)
    pub.release_replies()
    st = synced_at(sub, 4)
    assert (sub.duplicates_dropped, st.recoveries, st.device_blocks) == (2, 2, 4)


def test_old_seq_with_nothing_seen_on_the_connection_recovers(h):
    """With no live batch seen on the connection, an old seq after a swap may be a publisher
    whose counter restarted after the snapshot (found by the soak): it is not dropped as
    covered, the stream recovers and serves the new state."""
    pub = h.publisher()
    pub.hold_replies()
    sub = h.subscriber(pub)
    pub.wait_subscribed()
    wait_for(lambda: pub.requests == [0], what="snapshot request")
    pub.set_snapshot([stored([1, 2], None, blk(1, 2), BS)], watermark=5)
    pub.release_replies()
    synced_at(sub, 5)
    assert hits(sub, 1, 2) == (True, 8, 0)
    # The publisher restarts its counter (new process state: nothing cached) and says so at 0.
    pub.hold_replies()
    pub.publish([stored([7], None, blk(7), BS)], seq=0)
    error_contains(sub, "sequence went backwards: expected seq 6, got 0")
    assert hits(sub, 1, 2) == (False, 0, 0)
    pub.set_snapshot([stored([7], None, blk(7), BS)], watermark=0)
    pub.release_replies()
    st = synced_at(sub, 0)
    assert (sub.duplicates_dropped, st.recoveries, st.device_blocks) == (0, 2, 1)
    assert hits(sub, 1, 2) == (True, 0, 0)
    assert hits(sub, 7) == (True, 4, 0)


def test_resync_behind_the_applied_seq_invalidates(vh):
    """A periodic resync whose watermark is behind the applied seq means the engine's counter
    restarted unseen: the serving index is stale and must go, not just the attempt."""
    pub, sub = start_synced(vh, [stored([1], None, blk(1), BS)], watermark=9,
                            resync_interval_ms=1000)
    assert hits(sub, 1) == (True, 4, 0)
    pub.hold_replies()
    pub.set_snapshot([], watermark=2)              # the restarted engine: 3 batches, no blocks
    pub.release_replies(budget=1)                  # lets exactly the resync reply through
    vh.clock.advance(1.0)                          # the resync interval
    st = error_contains(sub, "snapshot watermark 2 is behind applied seq 9", timeout_s=5.0)
    assert (st.sequence, st.device_blocks) == (None, 0)
    pub.release_replies()
    st = synced_at(sub, 2)
    assert (st.device_blocks, st.recoveries) == (0, 2)
    assert hits(sub, 1) == (True, 0, 0)


def test_gap_after_watermark_fails_attempt_then_retry(h):
    pub = h.publisher()
    pub.hold_replies()
    sub = h.subscriber(pub)
    pub.wait_subscribed()
    wait_for(lambda: pub.requests == [0], what="snapshot request")
    pub.publish([stored([1], None, blk(1), BS)])   # 0
    pub.publish([stored([2], 1, blk(2), BS)])      # 1
    pub.skip()                                     # 2 lost
    pub.publish([stored([4], None, blk(4), BS)])   # 3
    wait_for(lambda: sub.live_messages == 3, what="3 live batches buffered")
    pub.set_snapshot([stored([1], None, blk(1), BS)], watermark=0)
    pub.release_replies(1)                         # answer this attempt only
    st = error_contains(sub, "gap after watermark 0: expected seq 2, got 3")
    assert st.recoveries == 0 and hits(sub, 1) == (False, 0, 0)
    wait_for(lambda: len(pub.requests) == 2, what="retry after backoff")
    pub.set_snapshot([stored([1], None, blk(1), BS), stored([2], 1, blk(2), BS),
                      stored([3], None, blk(3), BS), stored([4], None, blk(4), BS)], watermark=3)
    pub.release_replies()
    st = synced_at(sub, 3)
    assert (st.device_blocks, st.recoveries, pub.requests) == (4, 1, [0, 0])


def test_replay_timeout_then_retry_succeeds(h):
    pub = h.publisher()
    pub.set_snapshot([stored([1], None, blk(1), BS)], watermark=None)
    pub.drop_end_marker = True
    sub = h.subscriber(pub, replay_timeout_ms=150)
    st = error_contains(sub, "timeout")
    assert st.error == "snapshot timeout: no complete reply within replay_timeout_ms=150"
    assert hits(sub, 1) == (False, 0, 0)
    pub.drop_end_marker = False
    st = synced_at(sub, None)
    assert (st.device_blocks, st.recoveries) == (1, 1)
    assert len(pub.requests) >= 2 and set(pub.requests) == {0}


def test_buffer_overflow_fails_attempt(h):
    pub = h.publisher()
    pub.hold_replies()
    sub = h.subscriber(pub, max_buffered_bytes=1024)
    pub.wait_subscribed()
    wait_for(lambda: pub.requests == [0], what="snapshot request")
    # Each batch: about 100 wire bytes + 128 (event) + 2*40 (hashes) + 8*4 (tokens) > 300.
    for i in range(4):
        pub.publish([stored([10 + 2 * i, 11 + 2 * i], None, blk(i, i + 10), BS)])
    st = error_contains(sub, "buffer overflow")
    assert st.recoveries == 0
    pub.set_snapshot([stored([10 + 2 * i, 11 + 2 * i], None, blk(i, i + 10), BS)
                      for i in range(4)], watermark=3)
    pub.release_replies()
    st = synced_at(sub, 3)
    assert (st.device_blocks, st.recoveries) == (8, 1)


# ---------------------------------------------------------------------- errors that recover

@pytest.mark.parametrize("case, expected_error", [
    ("malformed", "seq 1: payload is not valid MessagePack: invalid type Reserved"),
    ("two_frames", "live message has 2 frames, expected 3 (topic, seq, payload)"),
    ("four_frames", "live message has 4 frames, expected 3 (topic, seq, payload)"),
    ("short_seq", "seq frame is 4 bytes, expected 8"),
    ("rank", "seq 1: batch dp_rank 1 does not match the stream's rank 0"),
    ("block_size", "seq 1: BlockStored block_size 8 != configured block_size 4"),
    ("unknown_parent", "seq 1: BlockStored parent 0x3e7 is unknown"),
    ("oversize", "message exceeds max_message_bytes (2049 > 2048 bytes)"),
    # Far above the limit, ZMQ's MAXMSGSIZE guard drops the connection before we see it.
    ("guard", "disconnected"),
    ("capacity", "seq 1: index capacity exceeded"),
])
def test_stream_errors_invalidate_and_recover(h, case, expected_error):
    pub, sub = start_synced(h, [stored([1], None, blk(1), BS)], watermark=0,
                            max_message_bytes=2048, max_blocks_per_stream=3)
    assert hits(sub, 1) == (True, 4, 0)
    pub.hold_replies()
    seq1 = (1).to_bytes(8, "big")
    if case == "malformed":
        pub.send_raw([b"", seq1, b"\xc1"])
    elif case == "two_frames":
        pub.send_raw([b"", seq1])
    elif case == "four_frames":
        pub.send_raw([b"", seq1, b"\x90", b"\x90"])
    elif case == "short_seq":
        pub.send_raw([b"", b"\x00" * 4, b"\x90"])
    elif case == "rank":
        pub.publish([stored([2], 1, blk(2), BS)], dp_rank=1)
    elif case == "block_size":
        pub.publish([stored([2], 1, blk(2, 3), 8)])
    elif case == "unknown_parent":
        pub.publish([stored([2], 999, blk(2), BS)])
    elif case == "oversize":
        pub.send_raw([b"", seq1, b"\x90" * (2048 - 8 + 1)])
    elif case == "guard":
        pub.send_raw([b"", seq1, b"\x90" * (2048 + 8192)])
    elif case == "capacity":
        pub.publish([stored([2, 3, 4], 1, blk(2, 3, 4), BS)])
    st = error_contains(sub, expected_error)
    # After a disconnect the reason may also say that the snapshot waits for the new SUB.
    assert st.error.split("; the snapshot is requested once")[0] == expected_error
    assert (st.sequence, st.device_blocks, st.entries) == (None, 0, 0)
    assert hits(sub, 1) == (False, 0, 0)
    pub.set_snapshot([stored([1], None, blk(1), BS)], watermark=1)
    pub.release_replies()
    st = synced_at(sub, 1)
    assert (st.recoveries, st.device_blocks) == (2, 1)
    assert hits(sub, 1) == (True, 4, 0)
    # Live batches must flow again after the recovery. In the guard case libzmq dropped the
    # connection itself and never reconnects it: only a replaced SUB hears seq 2.
    if case == "guard":
        pub.wait_subscribed()
    pub.publish([stored([5], 1, blk(5), BS)], seq=2)
    st = synced_at(sub, 2)
    assert (st.recoveries, st.device_blocks) == (2, 2)
    assert hits(sub, 1, 5) == (True, 8, 0)


def test_all_blocks_cleared_batch_synchronizes_without_snapshot(h):
    pub = h.publisher()
    pub.hold_replies()
    sub = h.subscriber(pub)
    pub.wait_subscribed()
    wait_for(lambda: pub.requests == [0], what="snapshot request")
    pub.publish([stored([1], None, blk(1), BS)], seq=4)   # buffered, then abandoned
    pub.publish([cleared(), stored([2], None, blk(2), BS)], seq=5)
    st = synced_at(sub, 5)
    assert (st.device_blocks, st.recoveries) == (1, 1)
    assert hits(sub, 1) == (True, 0, 0)
    assert hits(sub, 2) == (True, 4, 0)
    pub.publish([stored([3], 2, blk(3), BS)])
    synced_at(sub, 6)
    assert hits(sub, 2, 3) == (True, 8, 0)
    # The abandoned attempt's late reply has no socket to land on.
    pub.set_snapshot([], watermark=0)
    pub.release_replies()
    wait_for(lambda: pub.replies_sent == 1, what="the late reply")
    pub.publish([removed([3])])
    st = synced_at(sub, 7)
    assert (st.device_blocks, st.recoveries, pub.requests) == (1, 1, [0])


def test_periodic_resync_catches_silently_dropped_tail_event(vh):
    pub, sub = start_synced(vh, [stored([1], None, blk(1), BS)], watermark=0,
                            resync_interval_ms=1000)
    # Seq 1 stores block 2 but never reaches the subscriber, and nothing follows it.
    pub.set_snapshot([stored([1], None, blk(1), BS), stored([2], 1, blk(2), BS)], watermark=1)
    pub.skip()
    vh.clock.advance(1.0)                            # the resync interval
    st = wait_for(lambda: (s := sub.status()).resync_differences == 1 and s, timeout_s=5,
                  what="resync")
    assert (st.state, st.sequence, st.device_blocks, st.recoveries) == (SYNC, 1, 2, 1)
    assert hits(sub, 1, 2) == (True, 8, 0)
    assert pub.requests[:2] == [0, 1]   # the resync asks from the next expected seq
    pub.publish([stored([3], 2, blk(3), BS)])
    synced_at(sub, 2)
    assert hits(sub, 1, 2, 3) == (True, 12, 0)


def test_silent_live_channel_unsynchronizes_until_a_live_batch_arrives(vh):
    """A live channel that never delivers (here: the engine publishes another topic, which
    ZMQ filters before kvsvc sees it) while snapshots work: the periodic resync shows batches
    up to its watermark that never arrived, none arrives within the grace period, so the
    stream stops serving (the resync index would go stale) and takes no more snapshots until
    a live batch arrives; then it recovers and is exact."""
    pub = vh.publisher(topic=b"other")
    pub.set_snapshot([stored([1], None, blk(1), BS)], watermark=None)
    sub = vh.subscriber(pub, topic="kv", resync_interval_ms=1000)
    pub.wait_subscribed()
    synced_at(sub, None)
    assert hits(sub, 1) == (True, 4, 0)
    pub.publish([removed([1])])                      # seq 0: filtered out, never received
    pub.publish([stored([2], None, blk(2), BS)])     # seq 1: likewise
    pub.set_snapshot([stored([2], None, blk(2), BS)], watermark=1)
    vh.clock.advance(1.0)                            # the resync interval: seq 1 is missing
    wait_for(lambda: silence_check(sub) is not None, what="the grace period armed")
    vh.clock.advance(LIVE_SILENCE_GRACE_S)           # ... and nothing arrives within it
    st = error_contains(sub, "live channel silent: the engine published up to seq 1")
    assert "topic 'kv'" in st.error and (st.sequence, st.device_blocks) == (None, 0)
    assert hits(sub, 2) == (False, 0, 0) and hits(sub, 1) == (False, 0, 0)
    assert "since seq 0" in st.error
    view = sub.debug_view()
    assert view.recovery.attempt is None and view.recovery.next_attempt_at is None  # none scheduled
    assert not view.attempt_open
    requests = list(pub.requests)
    assert sub.counters().recoveries_started["live_silent"] == 1
    # The engine is fixed (same topic as configured): its next batch ends the wait.
    pub.topic = b"kv"
    pub.set_snapshot([stored([2], None, blk(2), BS), stored([3], 2, blk(3), BS)], watermark=2)
    pub.publish([stored([3], 2, blk(3), BS)])        # seq 2
    st = synced_at(sub, 2)
    assert (st.device_blocks, st.recoveries, pub.requests[len(requests):]) == (2, 2, [0])
    assert hits(sub, 2, 3) == (True, 8, 0) and hits(sub, 1) == (True, 0, 0)


def test_dead_live_channel_found_by_the_probe_resync_not_a_whole_interval_later(vh):
    """Recovered from a snapshot with a watermark while nothing arrived on the live connection:
    the first resync comes after PROBE_RESYNC_S, not resync_interval_ms, so a wrong topic stops
    serving within seconds."""
    pub = vh.publisher(topic=b"other")
    pub.set_snapshot([stored([1], None, blk(1), BS)], watermark=4)
    pub.next_seq = 5
    sub = vh.subscriber(pub, topic="kv", resync_interval_ms=600_000)
    pub.wait_subscribed()
    synced_at(sub, 4)
    pub.publish([removed([1])])                      # seq 5: filtered out by ZMQ
    pub.set_snapshot([], watermark=5)
    vh.clock.advance(PROBE_RESYNC_S)                 # not the 600 s interval
    wait_for(lambda: silence_check(sub) is not None, what="the probe resync's grace period")
    assert pub.requests == [0, 5]
    vh.clock.advance(LIVE_SILENCE_GRACE_S)
    st = error_contains(sub, "live channel silent: the engine published up to seq 5")
    assert st.device_blocks == 0 and hits(sub, 1) == (False, 0, 0)
    assert pub.requests == [0, 5]                    # the recovery, then the probe resync


def test_a_second_resync_does_not_hide_a_late_batch_from_the_first_check(vh):
    """The check counts live messages from when it was armed: a batch covered by resync R1
    that arrives late, after R2 was requested and before R2's swap, still proves the channel
    alive (the swap of R2 must not reset what R1's check compares with)."""
    clock = vh.clock
    pub, sub = start_synced(vh, [stored([1], None, blk(1), BS)], watermark=0,
                            resync_interval_ms=1000)
    pub.publish([stored([2], 1, blk(2), BS)])        # seq 1, received: the connection is live
    synced_at(sub, 1)
    pub.hold_replies()
    clock.advance(1.0)
    wait_for(lambda: len(pub.requests) == 2, timeout_s=5, what="R0 requested")
    pub.set_snapshot([stored([1], None, blk(1), BS), stored([2], 1, blk(2), BS)], watermark=1)
    pub.release_replies(budget=1)                    # R0 matches: nothing to check
    wait_for(lambda: sub.counters().snapshot_attempts["ok"] == 2, what="R0 done")
    clock.advance(1.0)
    wait_for(lambda: len(pub.requests) == 3, timeout_s=5, what="R1 requested")
    snap = [stored([1], None, blk(1), BS), stored([2], 1, blk(2), BS),
            stored([3], 2, blk(3), BS)]
    pub.set_snapshot(snap, watermark=2)
    pub.skip()                                       # seq 2 published, still in flight
    pub.release_replies(budget=1)                    # R1: ahead of the applied seq 1
    wait_for(lambda: silence_check(sub) is not None, timeout_s=5, what="R1 check armed")
    armed = silence_check(sub)
    clock.advance(1.0)                               # within R1's grace period (2 s)
    wait_for(lambda: len(pub.requests) == 4, timeout_s=5, what="R2 requested")
    pub.send_raw([pub.topic, (2).to_bytes(8, "big"),
                  encode_batch([stored([3], 2, blk(3), BS)], 0)])
    wait_for(lambda: sub.duplicates_dropped == 1, timeout_s=5, what="late seq 2 received")
    pub.release_replies()                            # R2 swaps
    wait_for(lambda: sub.counters().snapshot_attempts["ok"] == 4, what="R2 swapped")
    clock.advance(LIVE_SILENCE_GRACE_S - 1.0)        # R1's grace period ends
    wait_for(lambda: silence_check(sub) is None and len(pub.requests) >= 5, timeout_s=8,
             what="check ended, R2 swapped")
    st = sub.status()
    assert (st.state, sub.counters().recoveries_started["live_silent"]) == (SYNC, 0)
    assert armed.live_messages < sub.live_messages and hits(sub, 1, 2, 3) == (True, 12, 0)


def test_resync_ahead_with_batches_arriving_late_stays_synchronized(vh):
    """The batches a resync watermark covers may arrive after the reply: within the grace
    period they prove the live channel alive (dropped as covered), no false alarm."""
    pub, sub = start_synced(vh, [stored([1], None, blk(1), BS)], watermark=0,
                            resync_interval_ms=1000)
    pub.set_snapshot([stored([1], None, blk(1), BS), stored([2], 1, blk(2), BS)], watermark=1)
    pub.skip()                                       # seq 1 lost on the wire for now
    vh.clock.advance(1.0)                            # the resync interval
    st = wait_for(lambda: (s := sub.status()).resync_differences == 1 and s, timeout_s=5,
                  what="resync ahead of the applied seq")
    assert silence_check(sub) is not None            # the grace period runs
    pub.publish([stored([3], 2, blk(3), BS)])        # seq 2 arrives within it
    synced_at(sub, 2)
    vh.clock.advance(LIVE_SILENCE_GRACE_S)           # the grace period ends
    wait_for(lambda: silence_check(sub) is None, timeout_s=5, what="check passed")
    st = sub.status()
    assert (st.state, st.recoveries, sub.counters().recoveries_started["live_silent"]) == \
        (SYNC, 1, 0)
    assert hits(sub, 1, 2, 3) == (True, 12, 0)


def test_disconnect_reported_by_monitor_invalidates(h):
    pub, sub = start_synced(h, [stored([1], None, blk(1), BS)], watermark=0,
                            replay_timeout_ms=300)
    ports = (pub.event_port, pub.replay_port)
    pub.close()
    st = error_contains(sub, "disconnected")
    assert hits(sub, 1) == (False, 0, 0)
    pub2 = h.publisher(ports)
    pub2.set_snapshot([stored([5], None, blk(5), BS)], watermark=None)
    pub2.wait_subscribed()
    st = synced_at(sub, None)
    assert (st.device_blocks, st.recoveries) == (1, 2)
    assert hits(sub, 1) == (True, 0, 0)
    assert hits(sub, 5) == (True, 4, 0)
    pub2.publish([stored([6], 5, blk(6), BS)])   # the new engine counts from 0
    synced_at(sub, 0)
    assert hits(sub, 5, 6) == (True, 8, 0)


def raw_stream(h: Harness, zmq_ctx, event_port: int, replay_port: int,
               **limits) -> StreamSubscriber:
    """A started subscriber on raw 127.0.0.1 ports (no ProtocolPublisher behind them)."""
    cfg = StreamConfig(instance_name="10.0.0.1:8000", block_size=BS,
                       endpoint=f"tcp://127.0.0.1:{event_port}",
                       replay_endpoint=f"tcp://127.0.0.1:{replay_port}", hash_seed=SEED)
    sub = StreamSubscriber(cfg, KvEventsConfig(**limits), zmq_ctx)
    h.objs.append(sub)
    sub.start()
    return sub


def test_no_snapshot_is_requested_before_the_live_channel_connects(h, zmq_ctx):
    """A snapshot taken before the SUB's subscription reaches the engine can be followed by
    batches that never arrive; with a restarted counter the gap is invisible (soak: a revived
    engine's first batch lost, its publisher restarted, the new seq 0 taken as the expected
    one). So the request waits for the live handshake, at start and after a disconnect."""
    event_port, replay_port = free_ports(2)
    router = zmq_ctx.socket(zmq.ROUTER)            # the engine's replay endpoint is up ...
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"tcp://127.0.0.1:{replay_port}")
    xpub = None

    def live_up_then_request():
        """Bind the engine's live socket; the subscription must reach it before the snapshot
        request reaches the replay socket. Returns (the XPUB, the requester's identity)."""
        sock = zmq_ctx.socket(zmq.XPUB)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            # ZMQ releases a closed socket's port asynchronously: bounded retries.
            wait_for(lambda: _bound(sock, f"tcp://127.0.0.1:{event_port}"), 5.0, what="bind")
        except AssertionError:
            sock.close(linger=0)
            raise
        assert sock.poll(5000) and sock.recv()[:1] == b"\x01"
        assert router.poll(5000), "no snapshot request after the live channel connected"
        requester, *rest = router.recv_multipart()
        assert parse_snapshot_request(rest) == 0
        return sock, requester

    try:
        sub = raw_stream(h, zmq_ctx, event_port, replay_port, replay_timeout_ms=300)
        # ... its live endpoint is not: the due first attempt says it waits, and sends nothing.
        st = error_contains(sub, "the snapshot is requested once the live channel")
        assert st.error == ("not synchronized yet: waiting for the first replay (snapshot or "
                            f"history); the snapshot is requested once the live channel "
                            f"tcp://127.0.0.1:{event_port} is connected")
        assert router.poll(0) == 0
        xpub, ident = live_up_then_request()
        # Waiting for the reply now, not for the live channel: the reason says so no more.
        assert sub.status().error == ("not synchronized yet: waiting for the first replay "
                                      "(snapshot or history)")
        router.send_multipart([ident, *encode_reply(None, encode_batch(
            [stored([1], None, blk(1), BS)]))])
        router.send_multipart([ident, *END_MARKER])
        synced_at(sub, None)
        xpub.send_multipart(encode_live(b"", 0, encode_batch([stored([2], 1, blk(2), BS)])))
        synced_at(sub, 0)
        assert hits(sub, 1, 2) == (True, 8, 0)
        # The engine's live socket goes away (the replay socket stays): no request until a
        # live socket is back, then one.
        xpub.close(linger=0)
        xpub = None
        error_contains(sub, "the snapshot is requested once the live channel")
        assert hits(sub, 1) == (False, 0, 0)
        assert router.poll(0) == 0
        xpub, ident = live_up_then_request()
        router.send_multipart([ident, *encode_reply(4, encode_batch(
            [stored([3], None, blk(3), BS)]))])
        router.send_multipart([ident, *END_MARKER])
        st = synced_at(sub, 4)
        assert (st.recoveries, hits(sub, 1), hits(sub, 3)) == (2, (True, 0, 0), (True, 4, 0))
    finally:
        if xpub is not None:
            xpub.close(linger=0)
        router.close(linger=0)


def _bound(sock: zmq.Socket, endpoint: str) -> bool:
    """Bind ``sock``; False while the port is still held (for a bounded retry)."""
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        if exc.errno != zmq.EADDRINUSE:
            raise
        return False
    return True


def _rebound(h: Harness, ports: tuple[int, int]) -> Optional[ProtocolPublisher]:
    """A publisher on ``ports``, or ``None`` while ZMQ still holds them (it releases a closed
    socket's port asynchronously)."""
    try:
        return h.publisher(ports)
    except (zmq.ZMQError, LifecycleError):  # the failed publisher closed what it had opened
        return None


def test_a_new_connection_does_not_wait_out_the_old_engines_backoff(vh):
    """Snapshots that keep failing back off to seconds; the engine is then replaced by a
    healthy one: its first snapshot is requested within the first backoff step of the new
    connection, not after what the old engine's failures earned (fresh-eyes review: 0.5-3 s).
    On a virtual clock: time moves by each backoff step only, so the new engine's snapshot
    cannot come from the old 3.2 s backoff running out."""
    pub = vh.publisher()
    ports = (pub.event_port, pub.replay_port)
    pub.set_snapshot([stored([1], None, blk(1, 2), 8)], watermark=0)   # block_size 8 != 4
    sub = vh.subscriber(pub)
    for n in range(1, 7):                            # backoff 0.1, 0.2, ... 1.6 s, then 3.2 s
        wait_for(lambda: sub.counters().snapshot_attempts["error"] >= n, what=f"failure {n}")
        if n < 6:
            vh.clock.advance(BACKOFF_INITIAL_S * 2 ** (n - 1))
    assert sub.counters().snapshot_attempts["error"] == 6
    pub.close()
    error_contains(sub, "disconnected")
    pub2 = wait_for(lambda: _rebound(vh, ports), 5.0, what="ports released by the old engine")
    pub2.set_snapshot([stored([5], None, blk(5), BS)], watermark=None)

    def next_attempt_in() -> Optional[float]:
        due = sub.debug_view().recovery.next_attempt_at
        return None if due is None else due - vh.clock.now()

    # Once the new connection is up, the next attempt is due within the first backoff step
    # (the old engine's was 3.2 s away).
    due_in = wait_for(lambda: (d := next_attempt_in()) is not None
                      and d <= BACKOFF_INITIAL_S + 1e-9 and [d],
                      what="an attempt due within the first backoff step")[0]
    vh.clock.advance(max(0.0, due_in))
    st = synced_at(sub, None)
    assert (st.device_blocks, hits(sub, 5)) == (1, (True, 4, 0))


def test_an_endpoint_that_drops_every_connection_is_retried_with_backoff(zmq_ctx, h):
    """An event endpoint that accepts TCP and closes it (a wrong port, say the engine's
    ROUTER) is reconnected with a doubling delay, not thousands of times a second (fresh-eyes
    review: ~4,000/s and a full core), and the error points at the endpoint."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.05)
    port = listener.getsockname()[1]
    accepted = [0]
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                continue
            accepted[0] += 1
            conn.close()

    thread = threading.Thread(target=serve, name="test-dropper", daemon=True)
    thread.start()
    try:
        sub = raw_stream(h, zmq_ctx, port, free_ports(1)[0])
        st = error_contains(sub, "6 live connections in a row ended within 1 s")
        assert st.error.startswith("disconnected: 6 live connections in a row ended within 1 s "
                                   f"(is tcp://127.0.0.1:{port} the engine's PUB event socket?)")
        # Delays 10, 20, 40, 80, 160 ms so far: about as many connections as failures.
        assert accepted[0] <= 8, accepted[0]
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def test_a_flapping_live_connection_gets_a_snapshot_request_per_connection_at_most(zmq_ctx, h):
    """An engine whose live socket drops every subscriber right after the handshake: each new
    connection may ask for a snapshot once (the backoff of failed snapshots is reset for a
    possibly new engine), but connections themselves back off, so requests do too (fresh-eyes
    review: 8 requests a second to a never-answering engine)."""
    import threading

    event_port, replay_port = free_ports(2)
    router = zmq_ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"tcp://127.0.0.1:{replay_port}")
    cycles = [0]
    stop = threading.Event()

    def flap():
        while not stop.is_set():
            xpub = zmq_ctx.socket(zmq.XPUB)
            xpub.setsockopt(zmq.LINGER, 0)
            try:
                if not _bound(xpub, f"tcp://127.0.0.1:{event_port}"):
                    continue
                if xpub.poll(100):   # a subscriber got through its handshake: drop it
                    cycles[0] += 1
            finally:
                xpub.close(linger=0)

    thread = threading.Thread(target=flap, name="test-flapper", daemon=True)
    thread.start()
    try:
        sub = raw_stream(h, zmq_ctx, event_port, replay_port, replay_timeout_ms=60_000)
        error_contains(sub, "5 live connections in a row ended within 1 s")
        requests = 0
        while router.poll(0):
            router.recv_multipart()
            requests += 1
        assert requests <= 6, (requests, cycles[0])
    finally:
        stop.set()
        thread.join(5)
        router.close(linger=0)


def test_topic_must_match_exactly(h):
    pub = h.publisher(topic=b"kv")
    pub.set_snapshot([], watermark=None)
    sub = h.subscriber(pub, topic="kv")
    pub.wait_subscribed()
    synced_at(sub, None)
    pub.publish([stored([1], None, blk(1), BS)], seq=0, topic=b"kvx")   # prefix match: dropped
    pub.publish([stored([2], None, blk(2), BS)], seq=0, topic=b"zz")    # filtered by ZMQ
    pub.publish([stored([3], None, blk(3), BS)], seq=0)
    synced_at(sub, 0)
    assert (sub.topic_mismatches, sub.live_messages) == (1, 1)
    assert (hits(sub, 1), hits(sub, 3)) == ((True, 0, 0), (True, 4, 0))


def test_a_wrong_topic_names_the_topics_the_engine_sends(h, caplog):
    """The stream subscribes to "kv", the engine publishes "kv-events" (a prefix match: the
    SUB receives it and drops it, §1): /ready's error says which topics the engine sends (at
    most OTHER_TOPICS_MAX distinct, escaped), one WARNING says so once; the hint goes away
    once a message with the stream's own topic arrives."""
    from kvsvc.streams.serving import OTHER_TOPICS_MAX

    caplog.set_level(logging.INFO, logger="kvsvc.streams.subscriber")
    pub = h.publisher(topic=b"kv-events")
    pub.set_snapshot([], watermark=None)
    sub = h.subscriber(pub, topic="kv")
    pub.wait_subscribed()
    synced_at(sub, None)
    pub.publish([stored([1], None, blk(1), BS)], seq=0)
    st = error_or_hint(sub, "the engine sends topic")
    assert st.error == ("no live message with topic 'kv' arrived; the engine sends topic "
                        "'kv-events' (dropped: a topic must equal the engine's exactly, §1)")
    assert st.state is SYNC     # still the snapshot's index: the hint is why it goes stale
    for i, topic in enumerate([b"kv-events", b"kv\x00\xff", b"kv2", b"kv3", b"kv4", b"kv5"]):
        pub.publish([stored([1], None, blk(1), BS)], seq=i + 1, topic=topic)
    wait_for(lambda: sub.topic_mismatches == 7, 5.0, what="7 mismatches")
    assert sub.status().error == (
        "no live message with topic 'kv' arrived; the engine sends topics 'kv-events', "
        "'kv\\x00\\xff', 'kv2', 'kv3', 'kv4', ... (dropped: a topic must equal the engine's "
        "exactly, §1)")
    assert len(sub._serving.other_topics) == OTHER_TOPICS_MAX
    logged = [r for r in caplog.records if "the engine sends topic" in r.getMessage()]
    assert [(r.levelno, r.getMessage()) for r in logged] == [(
        logging.WARNING, "stream 10.0.0.1:8000/dp0: the engine sends topic 'kv-events', not "
        "the stream's topic 'kv': its live messages are dropped (a topic must equal the "
        "engine's exactly, §1; further ones counted in topic_mismatches, their topics listed "
        "in /ready)")]
    pub.publish([stored([3], None, blk(3), BS)], seq=0, topic=b"kv")
    wait_for(lambda: sub.live_messages == 1, 5.0, what="a message with the stream's topic")
    assert sub.status().error is None


def test_an_empty_topic_sees_and_names_every_topic(h):
    """The default topic "" subscribes to every topic: an engine publishing "xllm-kv" (the
    discovery default) shows up in the error at once."""
    pub = h.publisher(topic=b"xllm-kv")
    pub.set_snapshot([], watermark=None)
    sub = h.subscriber(pub, topic="")
    pub.wait_subscribed()
    synced_at(sub, None)
    pub.publish([stored([1], None, blk(1), BS)], seq=0)
    st = error_or_hint(sub, "the engine sends topic 'xllm-kv'")
    assert st.error.startswith("no live message with topic '' arrived")


def error_or_hint(sub: StreamSubscriber, text: str, timeout_s: float = 5.0):
    def check():
        st = sub.status()
        return st if text in (st.error or "") else None
    return wait_for(check, timeout_s, what=f"error containing {text!r}")


def test_lifecycle(h, zmq_ctx):
    pub = h.publisher()
    sub = h.subscriber(pub, start=False)
    sub.close()                       # before start: a no-op
    sub2 = h.subscriber(pub)
    with pytest.raises(Exception, match="already started"):
        sub2.start()
    names = [t.name for t in __import__("threading").enumerate()]
    assert "kvsvc-stream-10.0.0.1:8000/dp0" in names
    sub2.close()
    sub2.close()                      # idempotent
    assert "kvsvc-stream-10.0.0.1:8000/dp0" not in [
        t.name for t in __import__("threading").enumerate()]


def test_failed_resync_keeps_serving(vh):
    pub, sub = start_synced(vh, [stored([1], None, blk(1), BS)], watermark=0,
                            resync_interval_ms=1000, replay_timeout_ms=100)
    pub.drop_end_marker = True
    for n in (1, 2):                                 # the interval, then the reply timeout
        vh.clock.advance(1.0)
        wait_for(lambda: len(pub.requests) == 1 + n, what=f"resync {n} requested")
        vh.clock.advance(0.1)
        wait_for(lambda: sub.counters().snapshot_attempts["timeout"] == n,
                 what=f"resync {n} timed out")
    st = sub.status()
    assert (st.state, st.error, st.sequence, st.recoveries, st.resync_differences) == (
        SYNC, None, 0, 1, 0)
    assert hits(sub, 1) == (True, 4, 0)
    pub.publish([stored([2], 1, blk(2), BS)])
    synced_at(sub, 1)
    assert hits(sub, 1, 2) == (True, 8, 0)


@pytest.mark.parametrize("batch_form, event_form", [("map", "array"), ("array2", "array"),
                                                    ("array3", "map")])
def test_wire_forms_end_to_end(h, batch_form, event_form):
    pub = h.publisher(dp_rank=2)
    pub.batch_form, pub.event_form = batch_form, event_form
    pub.events_per_message = 1   # one data message per event
    pub.set_snapshot([stored([1], None, blk(1), BS), stored([2], 1, blk(2), BS)], watermark=None)
    sub = h.subscriber(pub)
    pub.wait_subscribed()
    synced_at(sub, None)
    pub.publish([stored([3], 2, blk(3), BS, medium="cpu")])
    synced_at(sub, 0)
    assert hits(sub, 1, 2, 3) == (True, 8, 4)
    assert sub.stream_id.dp_rank == 2


# ---------------------------------------------------------------------- snapshot client

class RawReplay:
    """A bare ROUTER for driving :class:`SnapshotAttempt` frame by frame in the test thread."""

    def __init__(self, ctx):
        self.port = free_ports(1)[0]
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(f"tcp://127.0.0.1:{self.port}")

    def request(self) -> tuple[bytes, int]:
        assert self.router.poll(5000), "no snapshot request"
        ident, *rest = self.router.recv_multipart()
        return ident, parse_snapshot_request(rest)

    def close(self):
        self.router.close(linger=0)


@pytest.fixture
def raw_replay(zmq_ctx):
    replay = RawReplay(zmq_ctx)
    yield replay
    replay.close()


def open_attempt(zmq_ctx, raw_replay, start_seq=7, **limits):
    cfg = StreamConfig(instance_name="e:1", block_size=BS, endpoint="tcp://127.0.0.1:1",
                       replay_endpoint=f"tcp://127.0.0.1:{raw_replay.port}", hash_seed=SEED)
    attempt = SnapshotAttempt.open(zmq_ctx, cfg, KvEventsConfig(**limits), start_seq)
    ident, got = raw_replay.request()
    assert got == start_seq
    return attempt, ident


def run_attempt(attempt):
    """Call ``receive`` until it returns a result or raises (bounded by the attempt deadline)."""
    try:
        return wait_for(lambda: attempt.receive(), timeout_s=5, what="snapshot result")
    finally:
        attempt.close()


def test_snapshot_client_multi_message_and_four_frame_replies(zmq_ctx, raw_replay):
    attempt, ident = open_attempt(zmq_ctx, raw_replay)
    wm = (9).to_bytes(8, "big")
    raw_replay.router.send_multipart(
        [ident, b"", wm, encode_batch([stored([1], None, blk(1), BS)])])
    raw_replay.router.send_multipart(
        [ident, b"", b"topic", wm, encode_batch([stored([2], 1, blk(2), BS, medium="cpu")])])
    raw_replay.router.send_multipart([ident, *END_MARKER])
    result = run_attempt(attempt)
    assert (result.empty, result.watermark, result.messages) == (False, 9, 2)
    assert result.index.match(prompt_keys(blk(1, 2), BS, SEED)) == (1, 1)


def test_snapshot_client_empty_reply(zmq_ctx, raw_replay):
    attempt, ident = open_attempt(zmq_ctx, raw_replay, start_seq=0)
    raw_replay.router.send_multipart([ident, *END_MARKER])
    result = run_attempt(attempt)
    assert (result.empty, result.watermark, result.messages, result.index.entries) == (
        True, None, 0, 0)


@pytest.mark.parametrize("second, reason", [
    ([b"", (8).to_bytes(8, "big"), b"PAYLOAD"],
     "snapshot reply watermark changed from 9 to 8"),
    ([b"", b"\x00" * 8],
     "snapshot reply has 2 frames, expected 3 or 4"),
    ([b"", (9).to_bytes(8, "big"), b"\xc1"],
     "snapshot reply: payload is not valid MessagePack: invalid type Reserved"),
    ([b"", (9).to_bytes(8, "big"), b"\x90" * 1100],
     "snapshot reply message exceeds max_message_bytes (1108 > 1024 bytes)"),
    ([b"", (9).to_bytes(8, "big"), "BAD_RANK"],
     "snapshot reply: batch dp_rank 1 does not match the stream's rank 0"),
    ([b"", (9).to_bytes(8, "big"), "CONFLICT"],
     "snapshot reply: engine hash 0x1 already maps to another content key"),
    # A second batch glued to the first (ormsgpack alone would decode the first only).
    ([b"", (9).to_bytes(8, "big"), "TRAILING"],
     "snapshot reply: payload has 54 bytes after its batch (a payload is one batch, §2)"),
    ([b"", (9).to_bytes(8, "big"), "TRAILING_BYTE"],
     "snapshot reply: payload has 1 byte after its batch (a payload is one batch, §2)"),
])
def test_snapshot_client_malformed_replies(zmq_ctx, raw_replay, second, reason):
    attempt, ident = open_attempt(zmq_ctx, raw_replay, max_message_bytes=1024)
    wm = (9).to_bytes(8, "big")
    raw_replay.router.send_multipart([ident, b"", wm, encode_batch([stored([1], None, blk(1), BS)])])
    if second[-1] == "PAYLOAD":
        second[-1] = encode_batch([])
    elif second[-1] == "BAD_RANK":
        second[-1] = encode_batch([], 1)
    elif second[-1] == "CONFLICT":
        second[-1] = encode_batch([stored([1], None, blk(5), BS)])
    elif second[-1] == "TRAILING":
        second[-1] = encode_batch([]) + encode_batch([removed([1])])
    elif second[-1] == "TRAILING_BYTE":
        second[-1] = encode_batch([]) + b"\xc1"
    raw_replay.router.send_multipart([ident, *second])
    with pytest.raises(SnapshotError) as info:
        run_attempt(attempt)
    assert str(info.value) == reason


def test_snapshot_client_timeout(zmq_ctx, raw_replay):
    attempt, ident = open_attempt(zmq_ctx, raw_replay, replay_timeout_ms=50)
    raw_replay.router.send_multipart([ident, b"", b"\x00" * 8, encode_batch([])])
    with pytest.raises(SnapshotTimeout, match="replay_timeout_ms=50"):
        run_attempt(attempt)


def test_internal_error_in_apply_recovers_instead_of_killing_the_stream(h, monkeypatch):
    """A bug-class exception (not a StreamError) while applying a live batch must not end the
    stream thread: the index is discarded and the stream recovers by snapshot. The exception
    is forced with monkeypatch because no valid or invalid input produces one."""
    from kvsvc.index import tier_index

    pub, sub = start_synced(h, [stored([1], None, blk(1), BS)], watermark=0)
    real_apply = tier_index.TierIndex.apply
    calls = {"n": 0}

    def failing_once(self, events, *, snapshot=False):
        if not snapshot and calls["n"] == 0:
            calls["n"] += 1
            raise RuntimeError("simulated bug")
        return real_apply(self, events, snapshot=snapshot)

    pub.hold_replies()
    monkeypatch.setattr(tier_index.TierIndex, "apply", failing_once)
    pub.publish([stored([2], 1, blk(2), BS)])         # seq 1 hits the simulated bug
    st = error_contains(sub, "internal error: RuntimeError")
    assert (st.sequence, st.device_blocks) == (None, 0)
    assert hits(sub, 1) == (False, 0, 0)
    pub.set_snapshot([stored([1], None, blk(1), BS), stored([2], 1, blk(2), BS)], watermark=1)
    pub.release_replies()
    st = synced_at(sub, 1, timeout_s=10.0)
    assert (st.device_blocks, st.recoveries) == (2, 2)
    assert hits(sub, 1, 2) == (True, 8, 0)
    assert calls["n"] == 1


def test_live_reopen_backoff(zmq_ctx, caplog):
    """The live connection's reopen schedule (kvsvc.streams.live): connections that end within
    LIVE_STABLE_S of their handshake (or before one) are reopened after 10 ms doubling to 5 s,
    with the flapping hint from the third; a stable one is reopened at once and resets it."""
    from kvsvc.streams.live import LiveConnection

    port = free_ports(1)[0]
    cfg = StreamConfig(instance_name="e:1", block_size=BS, endpoint=f"tcp://127.0.0.1:{port}",
                       replay_endpoint=f"tcp://127.0.0.1:{port}", hash_seed=SEED)
    poller = zmq.Poller()
    live = LiveConnection(zmq_ctx, cfg, KvEventsConfig(), poller, "e:1/dp0")
    live.open()
    caplog.set_level(logging.WARNING, logger="kvsvc.streams.live")
    try:
        now, delays, reasons = 100.0, [], []
        for _ in range(12):
            reasons.append(live.disconnected(now))
            assert live.sub is None and live.monitor is None     # closed until the reopen
            delays.append(round(live.reopen_at - now, 6))
            now = live.reopen_at
            live.reopen()
        assert delays == [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.0, 5.0, 5.0]
        assert reasons[:2] == ["disconnected", "disconnected"]
        assert reasons[2] == (f"disconnected: 3 live connections in a row ended within 1 s (is "
                              f"tcp://127.0.0.1:{port} the engine's PUB event socket?)")
        live.handshake(now)
        assert live.disconnected(now + 0.999).startswith("disconnected: 13 live connections")
        live.reopen()
        live.handshake(now + 10.0)
        assert live.disconnected(now + 11.0) == "disconnected"   # lasted 1 s: stable
        assert (live.reopen_at, live.failures, live.sub is not None) == (now + 11.0, 0, True)
        # The hint of /ready went to the log too: one WARNING for the streak of 13, naming
        # the stream; a new streak gets its own.
        hinted = [r.getMessage() for r in caplog.records if "PUB event socket" in r.getMessage()]
        assert hinted == [f"stream e:1/dp0: 3 live connections in a row ended within 1 s (is "
                          f"tcp://127.0.0.1:{port} the engine's PUB event socket?); "
                          f"reconnecting with backoff up to 5 s"]
        assert all(r.levelno == logging.WARNING for r in caplog.records)
        for _ in range(3):
            live.reopen()
            live.disconnected(now + 12.0)
        assert sum("PUB event socket" in r.getMessage() for r in caplog.records) == 2
    finally:
        live.close()
