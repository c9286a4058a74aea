"""One history-replay attempt of a history-mode stream (§7h): the reply collection of a vLLM or
SGLang replay endpoint, run on the stream's own thread.

A :class:`HistoryAttempt` is a :class:`~kvsvc.streams.snapshot_client.ReplayAttempt` (the
same fresh ``DEALER`` per attempt as a snapshot, request ``[b"", start_seq]``, gate, sliced
decode and GIL yields) whose reply is history: every batch still in the engine's replay buffer
with ``seq >= start_seq``, each as ``[b"", seq, payload]`` (or the 4-frame form with a topic,
as §7 allows), then the end marker. It only collects: each message's frames are checked (§1,
§7: frame count, delimiter, 8-byte seq, ``max_message_bytes``), its payload digested
(XXH3-64), and what the message means (order, continuity, truncation, exactness) is asked of
the reply rules of :mod:`kvsvc.streams.history_reply`. The ``DEALER``'s receive queue is
unbounded for history replies (:attr:`HistoryAttempt.RCVHWM`): the engine's ``ROUTER`` drops
what does not fit.

- ``replay_timeout_ms`` bounds the wait for each *next* message (a 10,000-batch history may
  take longer than one timeout in total): the deadline moves on with every message. No message
  at all within it is :class:`~kvsvc.errors.ReplayUnanswered` (§7h "No replay answer").
- **catch-up** (``anchor_digest`` given, ``start_seq = L``): once the anchor is proven each
  later batch is decoded and handed to ``on_batch(seq, events, digest, wire_bytes)`` as it
  arrives (the recovery rules apply it like a live delta, so no decoded batch is held here);
  the attempt ends with a :class:`~kvsvc.streams.state.CatchUpReply`.
- **rebuild** (``start_seq = 0``): each batch is applied as it arrives to the attempt's private
  index with the §5 snapshot rule (an unknown parent makes an orphan), paced like a snapshot
  build, so a 10,000-batch reply holds one decoded batch at a time; it ends with a
  :class:`~kvsvc.streams.state.RebuildReply`.

Pacing: the build yields the GIL every 0.3 ms as a snapshot build does, but a yield that came
back late (a CPU-bound request thread kept the GIL for its whole 5 ms switch interval) makes
the next slice longer, up to 1 ms (:func:`~kvsvc.streams.pacing.reply_slice_s`): a 10,000-batch
rebuild against such a thread would otherwise get 0.3 ms per 5 ms. With
``pacing.REPLY_SWITCH_INTERVAL_S`` set (off: measured worse for other streams' queries) the
process's switch interval is lowered while the reply flows and given back by
:meth:`HistoryAttempt.close`.

Errors raise :class:`~kvsvc.errors.SnapshotError` with a reason starting ``history reply``;
timeouts :class:`~kvsvc.errors.SnapshotTimeout`. Not thread-safe: the stream thread's only.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import zmq
from xxhash import xxh3_64_intdigest

from kvsvc.clock import MONOTONIC, Clock
from kvsvc.config import KvEventsConfig, StreamConfig
from kvsvc.errors import ReplayUnanswered, SnapshotError, SnapshotTimeout, StreamError
from kvsvc.events import Event
from kvsvc.streams.frame import parse_reply
from kvsvc.streams.gate import SnapshotGate
from kvsvc.streams import pacing
from kvsvc.streams.pacing import (
    BUILD_SLICE_S,
    BUILD_YIELD_S,
    SwitchIntervalLease,
    build_timer_slack,
)
from kvsvc.streams.anchor import starts_cleared
from kvsvc.streams.history_reply import BATCH, PROVEN, CatchUpCheck, RebuildCheck
from kvsvc.streams.snapshot_client import ReplayAttempt
from kvsvc.streams.state import HistoryReply

#: ``on_batch(seq, events, digest, wire_bytes)``: a catch-up's batch after the anchor.
BatchSink = Callable[[int, Sequence[Event], int, int], None]


class HistoryAttempt(ReplayAttempt[HistoryReply]):
    """One history request/reply exchange (see the module docstring); use :meth:`open_history`.

    Built directly (``HistoryAttempt(stream, limits, start_seq, None, None, None)`` then
    :meth:`configure`), it only handles what :meth:`feed` is given (tests of the reply rules).

    :ivar messages: data messages received so far.
    """

    RCVHWM = 0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._int_hashes = True
        self._on_batch: Optional[BatchSink] = None
        self._check: "CatchUpCheck | RebuildCheck" = RebuildCheck()
        self._switch = SwitchIntervalLease(pacing.REPLY_SWITCH_INTERVAL_S)
        self._slice_s = BUILD_SLICE_S

    def receive(self) -> Optional[HistoryReply]:
        """As :meth:`ReplayAttempt.receive`; once the reply flows (the request is sent and
        the ``DEALER`` was readable) and ``pacing.REPLY_SWITCH_INTERVAL_S`` is set, the
        process's switch interval is lowered until :meth:`close`
        (:class:`~kvsvc.streams.pacing.SwitchIntervalLease`; off by default)."""
        if self.requested_at is not None and not self._closed:
            self._switch.engage()
        return super().receive()

    def _pace(self) -> None:
        """Yield the GIL after each build slice, as :meth:`ReplayAttempt._pace`; a yield that
        came back late (a CPU-bound thread took the GIL for its whole switch interval) makes
        the next slice longer, up to :data:`~kvsvc.streams.pacing.REPLY_SLICE_MAX_S`: a reply
        of thousands of small messages would otherwise get one 0.3 ms slice per 5 ms."""
        now = time.perf_counter()
        if now - self._slice_start >= self._slice_s:
            time.sleep(BUILD_YIELD_S)
            back = time.perf_counter()
            self._slice_s = pacing.reply_slice_s(back - now)
            self._slice_start = back

    def close(self) -> None:
        """As :meth:`ReplayAttempt.close`, and the switch interval is given back."""
        try:
            super().close()
        finally:
            self._switch.release()

    def configure(self, anchor_digest: Optional[int], on_batch: Optional[BatchSink]) -> None:
        """Make this a catch-up from ``start_seq`` proven by ``anchor_digest`` (its batches go
        to ``on_batch``), or with ``None`` a rebuild (``start_seq`` must be 0)."""
        self._check = (RebuildCheck() if anchor_digest is None
                       else CatchUpCheck(self.start_seq, anchor_digest))
        self._on_batch = on_batch

    @classmethod
    def open_history(cls, context: zmq.Context, stream: StreamConfig, limits: KvEventsConfig,
                     start_seq: int, *, anchor_digest: Optional[int],
                     on_batch: Optional[BatchSink], poller: Optional[zmq.Poller] = None,
                     gate: Optional[SnapshotGate] = None,
                     urgent: bool = True, clock: Clock = MONOTONIC) -> "HistoryAttempt":
        """Open a catch-up (``anchor_digest`` and ``on_batch`` given, ``start_seq = L``) or a
        rebuild (``None``, ``start_seq = 0``); as :meth:`ReplayAttempt.open` otherwise.

        :raises SnapshotError: the socket could not be created, connected or written.
        """
        attempt = cls.open(context, stream, limits, start_seq, poller=poller, gate=gate,
                           urgent=urgent, clock=clock)
        # No reply can have been read yet: receive() has not run.
        attempt.configure(anchor_digest, on_batch)
        return attempt

    @property
    def messages(self) -> int:
        """Data messages received so far."""
        return self._messages

    def check_deadline(self, now: float) -> None:
        """:raises ReplayUnanswered: no message at all by the deadline (§7h "No replay
        answer"); :raises SnapshotTimeout: the next message is late (per-message timeout)."""
        if self._done or now < self.deadline:
            return
        if self._messages == 0 and self._wire_bytes == 0:
            raise ReplayUnanswered(f"history reply timeout: no reply within replay_timeout_ms="
                                   f"{self._timeout_ms} (no replay answer)")
        raise SnapshotTimeout(f"history reply timeout: no next message within replay_timeout_ms="
                              f"{self._timeout_ms} after {self._messages} messages (last seq "
                              f"{self._check.last_seq})")

    def feed(self, frames: list[bytes]) -> Optional[HistoryReply]:
        """Handle one reply message (§7h; its meaning is the reply rules',
        :mod:`kvsvc.streams.history_reply`).

        :param frames: the message's frames after the ``DEALER``.
        :returns: the :class:`~kvsvc.streams.state.CatchUpReply` or
            :class:`~kvsvc.streams.state.RebuildReply` when the reply ended (the end marker, a
            hole, a catch-up that proves no continuity); else ``None``.
        :raises SnapshotError: a malformed message, seqs not contiguous, a payload that is not
            a batch (§2), or (rebuild) one that cannot be applied (§5: hash conflict, block size,
            capacity).
        """
        try:
            reply = parse_reply(frames, self._max_message_bytes)
        except StreamError as exc:
            raise SnapshotError(f"history reply: {exc}") from exc
        self._wire_bytes += reply.wire_bytes
        # The wait bound is per message (§7h).
        self.deadline = self._clock.now() + self._timeout_ms / 1000.0
        check = self._check
        if reply.is_end:
            self._done = True
            if isinstance(check, CatchUpCheck):
                return check.end(self._wire_bytes)
            return check.reply(self._index, self._wire_bytes)
        payload = reply.payload
        digest = xxh3_64_intdigest(payload)
        seq = reply.watermark
        if isinstance(check, CatchUpCheck):
            verdict = check.message(seq, digest, self._wire_bytes)
            self._messages = check.messages
            if verdict is PROVEN:
                return None  # the anchor itself is already applied
            if verdict is BATCH:
                assert seq is not None and self._on_batch is not None
                self._on_batch(seq, self._decode(seq, payload), digest, reply.wire_bytes)
                return None
            assert not isinstance(verdict, str)
            self._done = True
            return verdict
        hole = check.message(seq, digest)
        self._messages = check.messages
        if hole is not None:
            self._done = True
            return check.reply(self._index, self._wire_bytes, hole, truncated=True)
        assert seq is not None
        self._build(check, seq, payload)
        return None

    def _decode(self, seq: int, payload: bytes) -> Sequence[Event]:
        try:
            return self.decode(payload)
        except StreamError as exc:
            raise SnapshotError(f"history reply seq {seq}: {exc}") from exc

    def _build(self, check: RebuildCheck, seq: int, payload: bytes) -> None:
        """A rebuild's batch: applied to the private index with the orphan rule (§7h subset)."""
        with build_timer_slack():
            events = self._decode(seq, payload)
            if starts_cleared(events):
                check.cleared(self._index.stats.orphan_blocks)
            try:
                self._apply_sliced(events)
            except StreamError as exc:
                raise SnapshotError(f"history reply seq {seq}: {exc}") from exc
