"""One history-replay attempt of a history-mode stream (§7h): the reply collection of a vLLM or
SGLang replay endpoint, run on the stream's own thread.

A :class:`HistoryAttempt` is a :class:`~kvsvc.streams.snapshot_client.SnapshotAttempt` (the
same fresh ``DEALER`` per attempt, request ``[b"", start_seq]``, gate, sliced decode and GIL
yields) whose reply is history: every batch still in the engine's replay buffer with
``seq >= start_seq``, each as ``[b"", seq, payload]`` (or the 4-frame form with a topic, as
§7 allows), then the end marker. Per message:

- the frame is checked (§1, §7: frame count, delimiter, 8-byte seq, ``max_message_bytes`` per
  message); a data message whose seq is ``0xFFFFFFFFFFFFFFFF`` is refused;
- seqs must be contiguous, ``prev + 1``: a repeat or a jump backwards fails the attempt. A
  skipped seq ends the attempt early as ``truncated``: the engine's buffer is contiguous, but
  its ``ROUTER`` silently drops messages at its send high-water mark (libzmq's default, 1000)
  when it sends a long reply faster than its I/O thread writes it; what arrived before the hole
  is complete (D7), and the rules catch up from its last seq instead of starting over (the
  ``DEALER``'s own receive queue is unbounded for history replies, :attr:`HistoryAttempt.RCVHWM`);
- ``replay_timeout_ms`` bounds the wait for each *next* message (a 10,000-batch history may
  take longer than one timeout in total): the deadline moves on with every message. No message
  at all within it is :class:`~kvsvc.errors.ReplayUnanswered` (§7h "No replay answer").

Two kinds of attempt:

- **catch-up** (``anchor_digest`` given, ``start_seq = L``): the first message must be seq
  ``L`` with XXH3-64 payload digest ``D``; otherwise (another seq, another digest, an empty
  reply) the attempt ends at once with a :class:`~kvsvc.streams.state.HistoryResult` that is not
  ``continuous`` (the rest of the reply is not read). Once continuity is proven each later
  batch is decoded and handed to ``on_batch(seq, events, digest, wire_bytes)`` as it arrives:
  the recovery rules apply it like a live delta, so no decoded batch is held here.
- **rebuild** (``start_seq = 0``): each batch is applied as it arrives to the attempt's private
  index with the §5 snapshot rule (an unknown parent makes an orphan), paced like a snapshot
  build, so a 10,000-batch reply holds one decoded batch at a time. ``exact`` is decided here:
  the reply started at seq 0 (or a batch starting with an untargeted ``AllBlocksCleared`` made
  the index complete) and no block became an orphan after that point (D8 in docs/decisions.md).
  The digests of the last
  :data:`DIGESTS_KEPT` batches are kept to check the buffered live batches the reply covers.

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

from kvsvc.config import KvEventsConfig, StreamConfig
from kvsvc.errors import ReplayUnanswered, SnapshotError, SnapshotTimeout, StreamError
from kvsvc.events import AllBlocksCleared, Event
from kvsvc.streams.frame import parse_reply
from kvsvc.streams.gate import SnapshotGate
from kvsvc.streams import pacing
from kvsvc.streams.pacing import (
    BUILD_SLICE_S,
    BUILD_YIELD_S,
    SwitchIntervalLease,
    build_timer_slack,
)
from kvsvc.streams.snapshot_client import SnapshotAttempt
from kvsvc.streams.state import HistoryResult

#: Digests of the last replayed batches a rebuild keeps (seq -> digest), to check buffered live
#: batches that the reply covers (they must be the same batches, §7h "deduplicate by seq").
DIGESTS_KEPT = 1024

#: ``on_batch(seq, events, digest, wire_bytes)``: a catch-up's batch after the anchor.
BatchSink = Callable[[int, Sequence[Event], int, int], None]


def starts_cleared(events: Sequence[Event]) -> bool:
    """The batch starts with an untargeted ``AllBlocksCleared`` (a complete state, §6, §7h; D15)."""
    return bool(events) and type(events[0]) is AllBlocksCleared and events[0].tier is None


class HistoryAttempt(SnapshotAttempt):
    """One history request/reply exchange (see the module docstring); use :meth:`open_history`.

    Built directly (``HistoryAttempt(stream, limits, start_seq, None, None, None)`` then
    :meth:`configure`), it only handles what :meth:`feed` is given (tests of the reply rules).

    :ivar messages: data messages received so far.
    """

    RCVHWM = 0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._int_hashes = True
        self._anchor: Optional[int] = None
        self._on_batch: Optional[BatchSink] = None
        self._first_seq: Optional[int] = None
        self._last_seq: Optional[int] = None
        self._last_digest: Optional[int] = None
        self._exact = False
        self._orphans_at_exact = 0
        self._digests: dict[int, int] = {}
        self._switch = SwitchIntervalLease(pacing.REPLY_SWITCH_INTERVAL_S)
        self._slice_s = BUILD_SLICE_S

    def receive(self) -> Optional[HistoryResult]:  # type: ignore[override]
        """As :meth:`SnapshotAttempt.receive`; once the reply flows (the request is sent and
        the ``DEALER`` was readable) and ``pacing.REPLY_SWITCH_INTERVAL_S`` is set, the
        process's switch interval is lowered until :meth:`close`
        (:class:`~kvsvc.streams.pacing.SwitchIntervalLease`; off by default)."""
        if self.requested_at is not None and not self._closed:
            self._switch.engage()
        return super().receive()  # type: ignore[return-value]

    def _pace(self) -> None:
        """Yield the GIL after each build slice, as :meth:`SnapshotAttempt._pace`; a yield that
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
        """As :meth:`SnapshotAttempt.close`, and the switch interval is given back."""
        try:
            super().close()
        finally:
            self._switch.release()

    def configure(self, anchor_digest: Optional[int], on_batch: Optional[BatchSink]) -> None:
        """Make this a catch-up from ``start_seq`` proven by ``anchor_digest`` (its batches go
        to ``on_batch``), or with ``None`` a rebuild (``start_seq`` must be 0)."""
        self._anchor = anchor_digest
        self._on_batch = on_batch

    @classmethod
    def open_history(cls, context: zmq.Context, stream: StreamConfig, limits: KvEventsConfig,
                     start_seq: int, *, anchor_digest: Optional[int],
                     on_batch: Optional[BatchSink], poller: Optional[zmq.Poller] = None,
                     gate: Optional[SnapshotGate] = None,
                     urgent: bool = True) -> "HistoryAttempt":
        """Open a catch-up (``anchor_digest`` and ``on_batch`` given, ``start_seq = L``) or a
        rebuild (``None``, ``start_seq = 0``); as :meth:`SnapshotAttempt.open` otherwise.

        :raises SnapshotError: the socket could not be created, connected or written.
        """
        attempt = cls.open(context, stream, limits, start_seq, poller=poller, gate=gate,
                           urgent=urgent)
        assert isinstance(attempt, HistoryAttempt)
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
                              f"{self._last_seq})")

    def feed(self, frames: list[bytes]) -> Optional[HistoryResult]:  # type: ignore[override]
        """Handle one reply message (§7h).

        :param frames: the message's frames after the ``DEALER``.
        :returns: the :class:`HistoryResult` on the end marker, or at the first message of a
            catch-up that does not prove continuity; else ``None``.
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
        self.deadline = time.monotonic() + self._timeout_ms / 1000.0
        catch_up = self._anchor is not None
        if reply.is_end:
            self._done = True
            if catch_up and self._messages == 0:
                return self._result(False, f"empty reply (no batch from seq {self.start_seq} "
                                           "on: the engine restarted or its buffer rolled past it)")
            return self._result(True)
        seq = reply.watermark
        if seq is None:
            raise SnapshotError("history reply: a data message has seq 0xFFFFFFFFFFFFFFFF")
        last = self._last_seq
        if last is not None and seq != last + 1:
            if seq > last + 1:
                # The engine's ROUTER dropped messages at its send high-water mark (it does so
                # silently): everything up to `last` is good, the rest is asked for again.
                self._done = True
                return self._result(True, f"history reply skipped from seq {last} to {seq}",
                                    truncated=True)
            what = "repeated" if seq == last else "went backwards"
            raise SnapshotError(f"history reply seq {what}: seq {seq} after {last}")
        payload = reply.payload
        digest = xxh3_64_intdigest(payload)
        self._messages += 1
        if last is None:
            self._first_seq = seq
        self._last_seq = seq
        self._last_digest = digest
        if catch_up:
            if self._messages == 1:
                if seq != self.start_seq:
                    self._done = True
                    return self._result(False, f"reply starts at seq {seq}, not at the anchor "
                                               f"seq {self.start_seq}")
                if digest != self._anchor:
                    self._done = True
                    return self._result(False, f"seq {seq} has another payload digest than the "
                                               "batch applied (the engine restarted)")
                return None  # the anchor itself is already applied
            events = self._decode(seq, payload)
            assert self._on_batch is not None
            self._on_batch(seq, events, digest, reply.wire_bytes)
            return None
        self._build(seq, payload, digest)
        return None

    def _decode(self, seq: int, payload: bytes) -> Sequence[Event]:
        try:
            return self.decode(payload)
        except StreamError as exc:
            raise SnapshotError(f"history reply seq {seq}: {exc}") from exc

    def _build(self, seq: int, payload: bytes, digest: int) -> None:
        """A rebuild's batch: applied to the private index with the orphan rule (§7h subset)."""
        index = self._index
        if self._messages == 1:
            self._exact = seq == 0
        with build_timer_slack():
            events = self._decode(seq, payload)
            if starts_cleared(events):
                # Everything before is gone: from here on the index is the whole residency.
                self._exact = True
                self._orphans_at_exact = index.stats.orphan_blocks
            try:
                self._apply_sliced(events)
            except StreamError as exc:
                raise SnapshotError(f"history reply seq {seq}: {exc}") from exc
        digests = self._digests
        digests[seq] = digest
        digests.pop(seq - DIGESTS_KEPT, None)

    def _result(self, continuous: bool, reason: Optional[str] = None,
                truncated: bool = False) -> HistoryResult:
        catch_up = self._anchor is not None
        index = None if catch_up else self._index
        exact = (not catch_up and self._exact
                 and self._index.stats.orphan_blocks == self._orphans_at_exact)
        return HistoryResult(catch_up=catch_up, continuous=continuous, index=index,
                             first_seq=self._first_seq, last_seq=self._last_seq,
                             last_digest=self._last_digest, exact=exact,
                             digests=self._digests, messages=self._messages,
                             wire_bytes=self._wire_bytes, reason=reason, truncated=truncated)
