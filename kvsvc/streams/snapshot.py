"""One snapshot (replay) attempt of a stream (§7), run on the stream's own thread.

The subscriber opens a :class:`SnapshotAttempt` per recovery or resync: a fresh ``DEALER``
(linger 0) connected to the stream's replay endpoint sends ``[b"", start_seq]``. Because the
socket is new for every attempt, a late reply to an attempt that already timed out can never be
taken for a reply to the current one. The subscriber registers :attr:`SnapshotAttempt.socket`
in its own poller and calls :meth:`SnapshotAttempt.receive` when it is readable, so the reply
is consumed without ever blocking live reception.

Each data message (at most ``max_message_bytes``, all with the same watermark) is decoded
(§2) and applied with ``snapshot=True`` to a private new :class:`TierIndex` (unknown parents
become orphans, §5). The end marker completes the attempt with a :class:`SnapshotResult`.
Errors: a malformed message or reply raises :class:`~kvsvc.errors.SnapshotError` (its text
says what and why); the whole reply not arriving within ``replay_timeout_ms`` raises
:class:`~kvsvc.errors.SnapshotTimeout`. After either the attempt is finished: the owner closes
it and retries later (§6).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

import zmq

from ..config import KvEventsConfig, StreamConfig
from ..errors import SnapshotError, SnapshotTimeout, StreamError
from ..index.tier_index import TierIndex
from .decoder import decode_batch
from .frame import encode_snapshot_request, parse_reply

log = logging.getLogger(__name__)

#: ``zmq.MAXMSGSIZE`` is set this far above ``max_message_bytes``: it is a memory guard only
#: (libzmq drops the connection, so the error would be a timeout); the exact limit is checked
#: in frame parsing so the error names ``max_message_bytes``.
MAXMSGSIZE_HEADROOM = 4096

#: Reply messages handled per :meth:`SnapshotAttempt.receive` call, so that a large snapshot
#: does not starve live reception and the stop check of the stream loop.
MESSAGES_PER_RECEIVE = 64

_UNSET = object()


@dataclass(frozen=True, slots=True)
class SnapshotResult:
    """A complete snapshot reply (§7).

    :param index: the private new index holding the snapshot (not yet serving).
    :param empty: True when the reply held only the end marker: the engine state is empty and
        the watermark unknown (the first live batch received afterwards is the baseline).
    :param watermark: seq of the last live batch included; ``None`` when ``empty`` or when the
        engine had published no live batch yet (next expected seq 0).
    :param messages: data messages received.
    :param wire_bytes: total bytes of all reply messages, end marker included.
    """

    index: TierIndex
    empty: bool
    watermark: Optional[int]
    messages: int
    wire_bytes: int


class SnapshotAttempt:
    """One request/reply exchange on a fresh ``DEALER``; use :meth:`open`.

    Not thread-safe: created, used and closed on the stream's thread only.

    :ivar socket: the ``DEALER``, for the owner's poller.
    :ivar start_seq: the ``start_seq`` sent (§7).
    :ivar deadline: ``time.monotonic()`` value by which the whole reply must have arrived.
    """

    def __init__(self, socket: zmq.Socket, stream: StreamConfig, limits: KvEventsConfig,
                 start_seq: int, deadline: float) -> None:
        """Internal: use :meth:`open`, which creates and connects the socket."""
        self.socket = socket
        self.start_seq = start_seq
        self.deadline = deadline
        self._stream = stream
        self._max_message_bytes = limits.max_message_bytes
        self._timeout_ms = limits.replay_timeout_ms
        self._index = TierIndex(stream.block_size, stream.hash_seed, limits.max_blocks_per_stream)
        self._watermark: object = _UNSET
        self._messages = 0
        self._wire_bytes = 0
        self._done = False

    @classmethod
    def open(cls, context: zmq.Context, stream: StreamConfig, limits: KvEventsConfig,
             start_seq: int) -> "SnapshotAttempt":
        """Create the ``DEALER``, connect it to ``stream.replay_endpoint`` and send the request.

        :param context: the ZMQ context (thread-safe; the socket belongs to the caller's thread).
        :param stream: the stream (replay endpoint, block size, seed, rank).
        :param limits: ``max_message_bytes``, ``replay_timeout_ms``, ``max_blocks_per_stream``.
        :param start_seq: last applied seq + 1, or 0 (§7).
        :raises SnapshotError: the socket could not be created, connected or written.
        """
        sock = None
        try:
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, limits.max_message_bytes + MAXMSGSIZE_HEADROOM)
            sock.connect(stream.replay_endpoint)
            # DEALER queues the request until the connection is up; NOBLOCK only guards
            # against a full queue, which a fresh socket cannot have.
            sock.send_multipart(encode_snapshot_request(start_seq), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            if sock is not None:
                sock.close(linger=0)
            raise SnapshotError(f"snapshot request to {stream.replay_endpoint} failed: {exc}") from exc
        deadline = time.monotonic() + limits.replay_timeout_ms / 1000.0
        return cls(sock, stream, limits, start_seq, deadline)

    def receive(self) -> Optional[SnapshotResult]:
        """Consume the reply messages available now (at most ``MESSAGES_PER_RECEIVE``).

        :returns: the :class:`SnapshotResult` once the end marker arrived, else ``None``.
        :raises SnapshotError: malformed message, watermark changing mid-reply, a payload that
            does not decode (§2) or cannot be applied (§5: hash conflict, block size, capacity),
            or a socket error.
        :raises SnapshotTimeout: the deadline passed before the end marker.
        """
        for _ in range(MESSAGES_PER_RECEIVE):
            try:
                frames = self.socket.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            except zmq.ZMQError as exc:
                raise SnapshotError(f"snapshot receive failed: {exc}") from exc
            result = self._on_message(frames)
            if result is not None:
                return result
        self.check_deadline(time.monotonic())
        return None

    def check_deadline(self, now: float) -> None:
        """:raises SnapshotTimeout: if ``now`` (monotonic seconds) is past the deadline."""
        if not self._done and now >= self.deadline:
            raise SnapshotTimeout(
                f"snapshot timeout: no complete reply within replay_timeout_ms={self._timeout_ms}")

    def close(self) -> None:
        """Close the ``DEALER`` (linger 0); idempotent. A late reply is dropped with it."""
        self.socket.close(linger=0)

    def _on_message(self, frames: list[bytes]) -> Optional[SnapshotResult]:
        try:
            reply = parse_reply(frames, self._max_message_bytes)
        except StreamError as exc:
            raise SnapshotError(str(exc)) from exc  # its text already says "snapshot reply"
        self._wire_bytes += reply.wire_bytes
        if reply.is_end:
            self._done = True
            empty = self._messages == 0
            watermark = None if empty else self._watermark
            return SnapshotResult(index=self._index, empty=empty, watermark=watermark,  # type: ignore[arg-type]
                                  messages=self._messages, wire_bytes=self._wire_bytes)
        if self._watermark is _UNSET:
            self._watermark = reply.watermark
        elif reply.watermark != self._watermark:
            raise SnapshotError(f"snapshot reply watermark changed from {_wm(self._watermark)} "
                                f"to {_wm(reply.watermark)}")
        self._messages += 1
        try:
            batch = decode_batch(reply.payload, self._stream.dp_rank)
            self._index.apply(batch.events, snapshot=True)
        except StreamError as exc:
            raise SnapshotError(f"snapshot reply: {exc}") from exc
        return None


def _wm(value: object) -> str:
    return "none" if value is None else str(value)
