"""The live connection of one stream (§1): a ``SUB`` and its monitor, on the stream's thread.

:class:`LiveConnection` creates the ``SUB`` (subscribed to the stream's topic, ``MAXMSGSIZE``
guard, fast reconnect options), a monitor socket on it (connect, handshake and disconnect
events) and registers both in the owner's poller. It receives live messages as ``memoryview``
frames without copying (:meth:`LiveConnection.recv`) and replaces the ``SUB`` after a disconnect:
libzmq does not reconnect a connection it dropped itself (a message over ``MAXMSGSIZE`` is such a
protocol error), which would leave the stream synchronized by snapshot but deaf to every later
live batch.

Reopen backoff: a connection that ends :data:`LIVE_STABLE_S` or more after its handshake is
replaced at once; after one that ended sooner (or before its handshake) the ``SUB`` is closed at
once and reopened after a delay doubling from :data:`LIVE_REOPEN_MIN_S` to
:data:`LIVE_REOPEN_MAX_S`: a wrong endpoint (say the engine's ``ROUTER``) would otherwise be
reconnected thousands of times a second, since each reopened socket connects at once. After
:data:`LIVE_FLAP_HINT` such connections in a row the disconnect reason (the stream's error in
``/ready``) says so, asking whether the endpoint is the engine's ``PUB``, and one WARNING per
streak logs the same.

Not thread-safe: created, used and closed on the stream's thread only.
"""

from __future__ import annotations

import logging
from typing import Optional

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvsvc.config import KvEventsConfig, StreamConfig
from kvsvc.streams.snapshot_client import MAXMSGSIZE_HEADROOM

log = logging.getLogger(__name__)

#: Reconnect interval of the live ``SUB`` (ms): the first retry after a refused connect,
#: doubling on each failure up to the max (libzmq's default is a constant 100 ms). Recovery
#: waits for this connection, so a refused connect (an engine re-binding its port) is retried
#: soon, backing off for an engine that is down.
LIVE_RECONNECT_IVL_MS = 10
LIVE_RECONNECT_IVL_MAX_MS = 500
#: A live connection that ends sooner than this (seconds) after its handshake, or before one,
#: failed: the next reopen of the ``SUB`` waits, from ``LIVE_REOPEN_MIN_S`` doubling to
#: ``LIVE_REOPEN_MAX_S`` (D2 in docs/decisions.md).
LIVE_STABLE_S = 1.0
LIVE_REOPEN_MIN_S = 0.01
LIVE_REOPEN_MAX_S = 5.0
#: After this many failed live connections in a row, the stream's error says so (and the log,
#: once per streak).
LIVE_FLAP_HINT = 3

#: Monitor events the owner acts on.
HANDSHAKE_SUCCEEDED = zmq.EVENT_HANDSHAKE_SUCCEEDED
DISCONNECTED = zmq.EVENT_DISCONNECTED


class LiveConnection:
    """The ``SUB`` + monitor of one stream, with its reopen backoff (see the module docstring).

    :param context: the ZMQ context (sockets are created on the calling thread, the owner's).
    :param stream: endpoint and topic.
    :param limits: ``max_message_bytes`` (the ``MAXMSGSIZE`` guard sits above it).
    :param poller: the owner's poller; the ``SUB`` and monitor are registered in it while open.
    :param name: the stream's name for log lines.

    :ivar sub: the ``SUB``, ``None`` while closed until a delayed reopen.
    :ivar monitor: its monitor socket, ``None`` likewise.
    :ivar reopen_at: monotonic seconds when the ``SUB`` is to be replaced; ``None``: not due.
    :ivar failures: failed live connections in a row.
    """

    def __init__(self, context: zmq.Context, stream: StreamConfig, limits: KvEventsConfig,
                 poller: zmq.Poller, name: str) -> None:
        self._context = context
        self._stream = stream
        self._topic = stream.topic.encode("utf-8")
        self._max_message_bytes = limits.max_message_bytes
        self._poller = poller
        self._name = name
        self.sub: Optional[zmq.Socket] = None
        self.monitor: Optional[zmq.Socket] = None
        self.reopen_at: Optional[float] = None
        self.failures = 0
        self._reopen_delay = 0.0
        # When the current SUB's handshake succeeded (None: not yet).
        self._up_at: Optional[float] = None

    def open(self) -> None:
        """Create, connect and register the ``SUB`` and its monitor.

        :raises zmq.ZMQError: a socket could not be created or connected.
        """
        sub = self._context.socket(zmq.SUB)
        self.sub = sub
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes + MAXMSGSIZE_HEADROOM)
        sub.setsockopt(zmq.RECONNECT_IVL, LIVE_RECONNECT_IVL_MS)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, LIVE_RECONNECT_IVL_MAX_MS)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        self.monitor = sub.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self._up_at = None
        sub.connect(self._stream.endpoint)
        self._poller.register(sub, zmq.POLLIN)
        self._poller.register(self.monitor, zmq.POLLIN)

    def close(self) -> None:
        """Unregister and close the ``SUB`` and its monitor; idempotent."""
        if self.sub is None:
            return
        for sock in (self.sub, self.monitor):
            if sock is not None:
                try:
                    self._poller.unregister(sock)
                except KeyError:
                    pass
        if self.monitor is not None:
            try:
                self.sub.disable_monitor()
            except zmq.ZMQError:
                pass
            self.monitor.close(linger=0)
        self.sub.close(linger=0)
        self.sub = None
        self.monitor = None

    def reopen(self) -> None:
        """Replace the ``SUB`` (the delayed or immediate reopen after a disconnect)."""
        self.reopen_at = None
        self.close()
        self.open()
        # Once per failure streak at info: a flapping endpoint must not flood the log.
        (log.info if self.failures <= 1 else log.debug)(
            "stream %s: live socket reopened to %s", self._name, self._stream.endpoint)

    def next_event(self) -> Optional[int]:
        """The next pending monitor event (:data:`HANDSHAKE_SUCCEEDED`, :data:`DISCONNECTED`,
        or another ``zmq.EVENT_*``) without blocking; ``None`` when none is pending or the
        ``SUB`` is closed until its delayed reopen."""
        if self.monitor is None:
            return None
        try:
            return int(recv_monitor_message(self.monitor, flags=zmq.NOBLOCK)["event"])
        except zmq.Again:
            return None

    def handshake(self, now: float) -> None:
        """The ``SUB``'s ZMTP handshake succeeded at ``now`` (monotonic seconds)."""
        # Make the socket attach the new pipe now, which writes the subscription to it, rather
        # than at its next use.
        self.sub.getsockopt(zmq.EVENTS)  # type: ignore[union-attr]
        self._up_at = now
        log.info("stream %s: connected to %s", self._name, self._stream.endpoint)

    def disconnected(self, now: float) -> str:
        """Schedule the ``SUB``'s replacement after a disconnect and return the reason: a
        connection that lasted :data:`LIVE_STABLE_S` is replaced at once; after one that did
        not, the socket is closed now and reopened after a doubling delay."""
        stable = self._up_at is not None and now - self._up_at >= LIVE_STABLE_S
        self._up_at = None
        if stable:
            self.failures, self._reopen_delay = 0, 0.0
            self.reopen_at = now
            return "disconnected"
        self.failures += 1
        self._reopen_delay = min(max(self._reopen_delay * 2, LIVE_REOPEN_MIN_S),
                                 LIVE_REOPEN_MAX_S)
        self.reopen_at = now + self._reopen_delay
        self.close()
        if self.failures < LIVE_FLAP_HINT:
            return "disconnected"
        hint = (f"{self.failures} live connections in a row ended within {LIVE_STABLE_S:g} s "
                f"(is {self._stream.endpoint} the engine's PUB event socket?)")
        if self.failures == LIVE_FLAP_HINT:
            # Once per streak, with the same hint as /ready: swapped event and replay
            # endpoints look exactly like this, and the log is where an operator looks first.
            log.warning("stream %s: %s; reconnecting with backoff up to %g s", self._name, hint,
                        LIVE_REOPEN_MAX_S)
        return f"disconnected: {hint}"

    def recv(self) -> Optional[list[memoryview]]:
        """One live message without blocking: its frames as ``memoryview``s of the received
        ZMQ frames, or ``None`` when none is pending (or the ``SUB`` is closed).

        ``recv_multipart`` asks the socket for ``RCVMORE`` after every frame and copies each
        one; here the ``more`` flag comes with the frame and the payload is decoded in place.
        The whole message is received before any of it is judged, so a message with a wrong
        frame count never desynchronises the next.
        """
        if self.sub is None:
            return None
        recv = self.sub.recv
        try:
            frame = recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        frames = [frame.buffer]
        while frame.more:
            # ZMQ delivers a multipart message atomically: the rest is already here.
            frame = recv(zmq.NOBLOCK, copy=False)
            frames.append(frame.buffer)
        return frames
