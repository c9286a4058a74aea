"""A simulated xLLM engine: one :class:`~kvsvc.testbed.sim.block_manager.BlockManager` per DP rank,
publishing its KV events (§1, §2) and serving snapshots (§7) byte-exactly on loopback ZMQ
sockets, with fault switches for tests, ``kvsvc demo --chaos`` and soaks.

Threads and sockets. Each DP rank has one I/O thread ``sim-<name>/dp<r>`` (:class:`_RankIO`, a
:class:`~kvsvc.lifecycle.BackgroundThread`) that owns the rank's ``XPUB`` (live events, bound on ``event_port + rank``) and ``ROUTER`` (snapshots, bound on
``replay_port + rank``); no other thread touches them. :meth:`SimEngine.execute` runs on the
caller's thread: under the rank's state lock it mutates the block manager, assigns the next seq
and queues the encoded message; it then wakes the I/O thread (a socketpair byte) and waits until
the message was handed to the socket (or dropped by a fault), so :meth:`SimEngine.last_seq` is
the last published seq when ``execute`` returns.

Consistency (§7). A snapshot is copied under the same lock that assigns seqs and mutates the
cache, so its watermark ``W`` is exactly the last assigned seq and the copy is the state after
batch ``W``. Every batch up to ``W`` is already queued at that moment, and the I/O thread sends
the queue before the snapshot reply, so live ``W`` always leaves before a snapshot including it.
Encoding the snapshot happens outside the lock, so serving one blocks ``execute`` only for the
copy. Delayed replies are scheduled, not slept on, so live publishing never stalls.

Flavors (:mod:`kvsvc.testbed.sim.flavors`). ``xllm`` (the default) is described above. ``vllm``
and ``sglang`` publish their own batch forms and answer the replay request with *history*
(§7h): each rank keeps its last ``buffer_steps`` published batches (``(seq, payload)``, appended
by the I/O thread as it publishes them, dropped-by-fault ones included: the engine sent them,
the network lost them) and the I/O thread answers ``[b"", start_seq]`` with every kept batch
whose seq >= start_seq, then the end marker, before it publishes anything else (vLLM's
publisher thread does the same). With ``replay_endpoint=False`` no ``ROUTER`` is bound.

Errors: :class:`~kvsvc.errors.LifecycleError` when an I/O thread does not start (ports taken),
does not stop in time, or a message is not published in time; ``ValueError`` / ``IndexError``
for bad arguments.
"""

from __future__ import annotations

import collections
import itertools
import logging
import random
import socket
import threading
import time
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import ormsgpack
import zmq

from kvsvc.errors import LifecycleError
from kvsvc.events import DEVICE, HOST
from kvsvc.lifecycle import BackgroundThread
from kvsvc.testbed.sim.block_manager import BlockManager, SnapshotBlock, stored_event
from kvsvc.testbed.sim.flavors import Flavor, encode_batch
from kvsvc.testbed.sim.health import HealthServer
from kvsvc.testbed.sim.native import NativeFront, ServiceClient
from kvsvc.testbed.sim.results import ExecResult, RankStats
from kvsvc.testbed.sim.serving import Serving, ServingConfig, TextTokenizer

log = logging.getLogger(__name__)

#: ``seq`` / watermark value meaning "none" (§7): end marker, or no live batch published yet.
NO_SEQ = 0xFFFF_FFFF_FFFF_FFFF
_NO_SEQ_BYTES = NO_SEQ.to_bytes(8, "big")

#: Kinds accepted by :meth:`SimEngine.inject_malformed`.
MALFORMED_KINDS = ("two_frames", "four_frames", "short_seq", "bad_msgpack", "bad_event")

_START_TIMEOUT_S = 5.0
_CLOSE_TIMEOUT_S = 5.0
_PUBLISH_TIMEOUT_S = 5.0
_BIND_RETRY_S = 3.0
_IDLE_POLL_MS = 100


def _array_header(n: int) -> bytes:
    """MessagePack array header for ``n`` elements, minimal form (as ormsgpack writes it)."""
    if n < 16:
        return bytes([0x90 | n])
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def pack_batch(ts: float, encoded_events: Sequence[bytes], dp_rank: int) -> bytes:
    """The §2 batch ``[ts, events, dp_rank]`` from already-encoded event maps.

    Byte-identical to ``ormsgpack.packb([ts, events, dp_rank])``; lets snapshot chunks be sized
    without encoding twice.

    :param ts: float seconds.
    :param encoded_events: each one MessagePack-encoded event map.
    :param dp_rank: the rank (int).
    """
    return (b"\x93" + ormsgpack.packb(float(ts)) + _array_header(len(encoded_events))
            + b"".join(encoded_events) + ormsgpack.packb(dp_rank))


# Batch header (0x93 + float64 + array32 header) plus a rank int, upper bound.
_BATCH_OVERHEAD = 1 + 9 + 5 + 9


def encode_snapshot(blocks: Sequence[SnapshotBlock], block_size: int, dp_rank: int,
                    max_message_bytes: int, ts: Optional[float] = None) -> list[bytes]:
    """Payloads of a snapshot reply (§7): ``BlockStored`` events of ``blocks`` in order.

    A block on Device is sent with medium ``gpu`` and its tokens; a block on both tiers adds a
    tokenless ``cpu`` replica right after it; a Host-only block is sent with medium ``cpu`` and
    its tokens. Events are packed into batches whose whole data message (8-byte watermark frame
    plus payload) stays within ``max_message_bytes`` when possible (one event alone may exceed
    it only if it is bigger than the limit). There is always at least one payload (possibly with
    no events), so the watermark always reaches the receiver.

    :param blocks: residency, parents before children.
    :param max_message_bytes: bound of one data message, bytes.
    :returns: list of MessagePack batches.
    """
    if ts is None:
        ts = time.time()
    budget = max_message_bytes - 8 - _BATCH_OVERHEAD
    payloads: list[bytes] = []
    chunk: list[bytes] = []
    size = 0
    for b in blocks:
        tokens = list(b.tokens)
        encoded = []
        if b.tiers & DEVICE:
            encoded.append(ormsgpack.packb(stored_event([b.hash], b.parent, tokens, block_size, "gpu")))
            if b.tiers & HOST:
                encoded.append(ormsgpack.packb(stored_event([b.hash], b.parent, [], block_size, "cpu")))
        else:
            encoded.append(ormsgpack.packb(stored_event([b.hash], b.parent, tokens, block_size, "cpu")))
        for e in encoded:
            if chunk and size + len(e) > budget:
                payloads.append(pack_batch(ts, chunk, dp_rank))
                chunk, size = [], 0
            chunk.append(e)
            size += len(e)
    if chunk or not payloads:
        payloads.append(pack_batch(ts, chunk, dp_rank))
    return payloads


@dataclass(slots=True)
class _Outgoing:
    frames: list[bytes]
    seq: Optional[int]
    drop: bool
    ticket: int
    # History flavors (§7h): the payload the engine keeps in its replay buffer under ``seq``
    # once it is published (also when the network drops it: the engine still has it).
    buffered: Optional[bytes] = None


class _Rank:
    """Mutable state of one DP rank; every field is guarded by ``lock`` (``cond``'s lock)
    except ``exec_lock``, which serialises execute/restart of the rank."""

    def __init__(self, rank: int, bm: BlockManager, seed: int, buffer_steps: int = 0) -> None:
        self.rank = rank
        self.bm = bm
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.exec_lock = threading.Lock()
        self.next_seq = 0
        self.published: Optional[int] = None
        # History flavors (§7h): the last ``buffer_steps`` published (seq, payload), oldest
        # first; appended by the I/O thread as it publishes, read by it to answer replays.
        self.history: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=max(1, buffer_steps))
        self.outq: collections.deque[_Outgoing] = collections.deque()
        # Tickets of queued messages and of the last one handed to the socket (or dropped).
        self.enqueued = 0
        self.flushed = 0
        self.drop_next = 0
        self.drop_probability = 0.0
        self.rng = random.Random(seed * 1_000_003 + rank)
        self.snapshot_delays: collections.deque[float] = collections.deque()
        self.snapshot_truncations: collections.deque[int] = collections.deque()
        self.subscriptions = 0
        # disconnect(): the I/O thread closes and re-binds the XPUB; generation counts it done.
        self.reconnect_requested = False
        self.pub_generation = 0
        self.n_published = 0
        self.n_dropped = 0
        self.n_snapshots = 0
        self.n_malformed = 0
        self.n_restarts = 0
        self.io: Optional[_RankIO] = None


class _RankIO(BackgroundThread):
    """The I/O thread ``sim-<label>`` of one rank (the :class:`~kvsvc.lifecycle.BackgroundThread`
    contract): owns its ``XPUB`` and ``ROUTER`` sockets (no ``ROUTER`` with ``replay=False``)
    and the read end of its wake-up socketpair (created, used and closed on the thread).
    ``start()`` returns once its sockets are bound; ``close()`` sends what is queued, stops the thread and joins it.

    :param label: ``<engine>/dp<r>`` for thread names and logs.
    :param bind_retry_s: how long a bind retries a port still held (after a restart), seconds.
    :param flavor: ``xllm`` answers snapshots (§7), ``vllm``/``sglang`` history (§7h).
    :param replay: False binds no replay ``ROUTER``.
    """

    def __init__(self, state: _Rank, ctx: zmq.Context, event_ep: str, replay_ep: str,
                 topic: bytes, block_size: int, max_snapshot_message_bytes: int, label: str,
                 bind_retry_s: float = 0.0, flavor: Flavor = Flavor.XLLM,
                 replay: bool = True) -> None:
        super().__init__(f"sim-{label}")
        self._state = state
        self._flavor = flavor
        self._replay = replay
        self._bind_retry_s = bind_retry_s
        self._ctx = ctx
        self._event_ep = event_ep
        self._replay_ep = replay_ep
        self._topic = topic
        self._block_size = block_size
        self._max_snapshot = max_snapshot_message_bytes
        self._label = label
        # The write end is used by every thread that wakes this one, under _wake_lock.
        self._wake_lock = threading.Lock()
        self._wake_w: Optional[socket.socket] = None
        # Thread only: the sockets, the wake-up read end and the delayed snapshot replies
        # as (due monotonic time, messages).
        self._wake_r: Optional[socket.socket] = None
        self._pub: Optional[zmq.Socket] = None
        self._router: Optional[zmq.Socket] = None
        self._poller: Optional[zmq.Poller] = None
        self._delayed: list[tuple[float, list[list[bytes]]]] = []

    def start(self, timeout_s: float = _START_TIMEOUT_S) -> None:
        """Bind the sockets on the I/O thread; return once they are bound.

        :param timeout_s: bound of the start, seconds, extended by ``bind_retry_s``.
        :raises LifecycleError: already started, a bind failed, or the thread did not come up
            within ``timeout_s + bind_retry_s``.
        """
        super().start(timeout_s + self._bind_retry_s)

    def close(self, timeout_s: float = _CLOSE_TIMEOUT_S) -> None:
        """Send the queued live messages, stop the thread and join it. Idempotent.

        :param timeout_s: join bound, seconds.
        :raises LifecycleError: the thread is still alive after ``timeout_s``.
        """
        super().close(timeout_s)

    def wake(self) -> None:
        """Wake the I/O thread (thread-safe; a no-op before start and once closed)."""
        with self._wake_lock:
            if self._wake_w is not None:
                try:
                    self._wake_w.send(b"\0")
                except (BlockingIOError, OSError):
                    pass  # a full pipe already wakes the thread

    def _wake(self) -> None:
        self.wake()

    def _bind(self, sock: zmq.Socket, endpoint: str, retry_s: Optional[float] = None) -> None:
        # A restarted rank re-binds the ports its predecessor just released; the ZMQ I/O thread
        # may still hold them for a moment.
        deadline = time.monotonic() + (self._bind_retry_s if retry_s is None else retry_s)
        while True:
            try:
                sock.bind(endpoint)
                return
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE or time.monotonic() >= deadline:
                    raise
                time.sleep(0.02)

    def _setup(self) -> None:
        wake_r, wake_w = socket.socketpair()
        wake_r.setblocking(False)
        wake_w.setblocking(False)
        self._wake_r = wake_r
        with self._wake_lock:
            self._wake_w = wake_w
        self._pub = self._new_pub()
        self._bind(self._pub, self._event_ep)
        poller = self._poller = zmq.Poller()
        poller.register(self._pub, zmq.POLLIN)
        poller.register(wake_r.fileno(), zmq.POLLIN)
        if self._replay:
            router = self._router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.SNDHWM, 0)
            self._bind(router, self._replay_ep)
            poller.register(router, zmq.POLLIN)
        log.info("sim %s: %s flavor publishing on %s, %s", self._label, self._flavor.value,
                 self._event_ep,
                 ("no replay endpoint" if not self._replay else
                  f"{'history' if self._flavor.history else 'snapshots'} on {self._replay_ep}"))

    def _loop(self) -> None:
        assert self._poller is not None and self._pub is not None
        assert self._wake_r is not None
        poller, router, wake_fd = self._poller, self._router, self._wake_r.fileno()
        while not self.stopping:
            timeout = _IDLE_POLL_MS
            if self._delayed:
                due = min(d for d, _ in self._delayed)
                timeout = max(0, min(timeout, int((due - time.monotonic()) * 1000) + 1))
            ready = dict(poller.poll(timeout))
            if wake_fd in ready:
                self._drain_wake()
            if self._state.reconnect_requested:
                self._pub = self._rebind_pub(poller, self._pub)
            pub = self._pub
            self._flush_live(pub)
            if pub in ready:
                self._read_subscriptions(pub)
            if router is not None and router in ready:
                if self._flavor.history:
                    self._serve_history(router, pub)
                else:
                    self._serve_snapshots(router, pub)
            if self._delayed and router is not None:
                self._send_due(router)
        # Messages queued before close() still leave (execute() waits for them).
        self._flush_live(self._pub)

    def _teardown(self) -> None:
        for s in (self._pub, self._router):
            if s is not None:
                s.close(linger=0)
        self._pub = self._router = self._poller = None
        with self._wake_lock:
            if self._wake_w is not None:
                self._wake_w.close()
                self._wake_w = None
        if self._wake_r is not None:
            self._wake_r.close()
            self._wake_r = None
        with self._state.cond:
            self._state.subscriptions = 0
            self._state.cond.notify_all()

    def _new_pub(self) -> zmq.Socket:
        pub = self._ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 0)  # never drop silently: drops are explicit faults
        pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        pub.setsockopt(zmq.XPUB_VERBOSER, 1)
        return pub

    def _rebind_pub(self, poller: zmq.Poller, pub: zmq.Socket) -> zmq.Socket:
        """The ``disconnect`` fault: close the ``XPUB`` (every subscriber sees its connection
        drop) and bind a new one on the same endpoint. Seq and cache are kept; live messages
        sent before the subscribers reconnect are lost, as on a real network cut."""
        poller.unregister(pub)
        pub.close(linger=0)
        pub = self._new_pub()
        # The port was released a moment ago; the ZMQ I/O thread may still hold it briefly.
        self._bind(pub, self._event_ep, max(self._bind_retry_s, _BIND_RETRY_S))
        poller.register(pub, zmq.POLLIN)
        with self._state.cond:
            self._state.reconnect_requested = False
            self._state.subscriptions = 0
            self._state.pub_generation += 1
            self._state.cond.notify_all()
        log.info("sim %s: live socket closed and re-bound on %s (disconnect fault)", self._label,
                 self._event_ep)
        return pub

    def _drain_wake(self) -> None:
        assert self._wake_r is not None
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _flush_live(self, pub: zmq.Socket) -> None:
        st = self._state
        with st.lock:
            if not st.outq:
                return
            items = list(st.outq)
            st.outq.clear()
        for item in items:
            if not item.drop:
                pub.send_multipart(item.frames)
        with st.cond:
            for item in items:
                if item.buffered is not None and item.seq is not None:
                    st.history.append((item.seq, item.buffered))
                st.flushed = max(st.flushed, item.ticket)
                if item.seq is not None:
                    st.published = item.seq
                    if item.drop:
                        st.n_dropped += 1
                    else:
                        st.n_published += 1
            st.cond.notify_all()

    def _read_subscriptions(self, pub: zmq.Socket) -> None:
        while True:
            try:
                msg = pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if not msg or msg[0] not in (0, 1) or not self._topic.startswith(msg[1:]):
                continue
            with self._state.lock:
                self._state.subscriptions += 1 if msg[0] == 1 else -1
            log.debug("sim %s: %s %r", self._label, "subscribe" if msg[0] else "unsubscribe", msg[1:])

    def _next_request(self, router: zmq.Socket, kind: str) -> Optional[tuple[bytes, int]]:
        """The next queued replay request ``[ident, b"", start_seq]`` (§7) as (ident,
        start_seq), skipping malformed ones with a warning; ``None`` when none is queued."""
        while True:
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return None
            if len(frames) == 3 and frames[1] == b"" and len(frames[2]) == 8:
                return frames[0], int.from_bytes(frames[2], "big")
            log.warning("sim %s: ignoring malformed %s request (%d frames)",
                        self._label, kind, len(frames))

    def _serve_snapshots(self, router: zmq.Socket, pub: zmq.Socket) -> None:
        st = self._state
        while (request := self._next_request(router, "snapshot")) is not None:
            ident, start = request
            with st.lock:
                blocks = st.bm.snapshot()
                watermark = st.next_seq - 1 if st.next_seq > 0 else NO_SEQ
                delay = st.snapshot_delays.popleft() if st.snapshot_delays else 0.0
                truncate = st.snapshot_truncations.popleft() if st.snapshot_truncations else None
                st.n_snapshots += 1
            # Live batches up to the watermark were queued under the lock: send them first.
            self._flush_live(pub)
            wm = watermark.to_bytes(8, "big")
            payloads = encode_snapshot(blocks, self._block_size, st.rank, self._max_snapshot)
            messages = [[ident, b"", wm, p] for p in payloads]
            if truncate is not None:
                messages = messages[:truncate]
            else:
                messages.append([ident, b"", _NO_SEQ_BYTES, b""])
            log.info("sim %s: snapshot requested from seq %d: watermark %s, %d blocks, %d data "
                     "messages%s%s", self._label, start,
                     "none" if watermark == NO_SEQ else watermark, len(blocks), len(payloads),
                     f", truncated to {truncate}" if truncate is not None else "",
                     f", delayed {delay:.3f} s" if delay else "")
            if delay > 0:
                self._delayed.append((time.monotonic() + delay, messages))
            else:
                for m in messages:
                    router.send_multipart(m)

    def _serve_history(self, router: zmq.Socket, pub: zmq.Socket) -> None:
        """§7h: answer each replay request ``[b"", start_seq]`` with every buffered batch whose
        seq >= start_seq as ``[b"", seq, payload]`` (the payload as published), then the end
        marker; nothing is said about batches already rolled out of the buffer. Runs on the
        publishing thread after the live queue was sent, so no live batch leaves during a
        reply. A delay fault stalls this thread (live publishing too, as on a busy engine); a
        truncation fault sends only the first messages and no end marker."""
        st = self._state
        while (request := self._next_request(router, "replay")) is not None:
            ident, start = request
            self._flush_live(pub)
            with st.lock:
                batches = [(s, p) for s, p in st.history if s >= start]
                delay = st.snapshot_delays.popleft() if st.snapshot_delays else 0.0
                truncate = st.snapshot_truncations.popleft() if st.snapshot_truncations else None
                st.n_snapshots += 1
            messages = [[ident, b"", s.to_bytes(8, "big"), p] for s, p in batches]
            if truncate is not None:
                messages = messages[:truncate]
            else:
                messages.append([ident, b"", _NO_SEQ_BYTES, b""])
            log.info("sim %s: history requested from seq %d: %d batches%s%s%s", self._label,
                     start, len(batches),
                     f" (seqs {batches[0][0]}..{batches[-1][0]})" if batches else "",
                     f", truncated to {truncate}" if truncate is not None else "",
                     f", delayed {delay:.3f} s" if delay else "")
            if delay > 0 and self._sleep(delay):
                return
            for m in messages:
                router.send_multipart(m)

    def _send_due(self, router: zmq.Socket) -> None:
        now = time.monotonic()
        keep = []
        for due, messages in self._delayed:
            if due <= now:
                for m in messages:
                    router.send_multipart(m)
            else:
                keep.append((due, messages))
        self._delayed = keep


class SimEngine:
    """A simulated engine instance with ``dp_size`` DP ranks (see the module docstring).

    Rank ``r`` publishes on ``tcp://host:(event_port + r)`` and serves snapshots on
    ``tcp://host:(replay_port + r)`` (§1 port rule). Nothing is bound before :meth:`start`.

    :param name: instance name, used in logs and thread names.
    :param event_port: live port of rank 0.
    :param replay_port: snapshot port of rank 0.
    :param dp_size: number of DP ranks (>= 1).
    :param block_size: tokens per block.
    :param device_blocks: Device pool per rank, blocks.
    :param host_blocks: Host pool per rank, blocks (0 = no Host tier).
    :param topic: ZMQ topic frame (bytes or str, UTF-8).
    :param context: ZMQ context to use; ``None`` creates one, terminated by :meth:`close`.
    :param host: bind address.
    :param max_snapshot_message_bytes: bound of one snapshot data message (default 1 MiB).
    :param seed: seeds the drop-probability fault (per rank), for reproducible chaos.
    :param http_port: when given, the instance's HTTP port: :meth:`start` serves ``GET /health``
        on ``host:http_port`` (:class:`~kvsvc.testbed.sim.health.HealthServer`, §9 probe) until
        :meth:`close`; kept as the attribute ``http_port`` (``None`` without an HTTP port).
    :param serving: when given (with ``http_port``), the same port also serves OpenAI
        requests with this latency model (:mod:`kvsvc.testbed.sim.serving`); its waiting queue is
        :meth:`waiting_requests`.
    :param tokenizer: text tokenizer of the served requests (a
        :class:`~kvsvc.routing.prompt.PromptTokenizer`), ``None`` for the built-in byte scheme.
    :param flavor: the wire form and replay behaviour (:mod:`kvsvc.testbed.sim.flavors`):
        ``xllm`` (snapshots, §7), ``vllm`` or ``sglang`` (history, §7h).
    :param buffer_steps: history flavors: batches kept per rank for replay (vLLM's
        ``buffer_steps``, default 10,000); older ones are forgotten silently.
    :param replay_endpoint: False: no ``ROUTER`` is bound (an engine started without
        ``replay_endpoint``: replay requests are never answered).
    :param vllm_array: vLLM only: publish the older tagged-array batch form.
    :param native: xLLM only, with ``serving``: the native mode of an xLLM engine with service
        routing (:mod:`kvsvc.testbed.sim.native`): requests over ``XllmAPIService`` on the
        HTTP port (baidu_std or HTTP+JSON), every token pushed to the service with
        ``Generations``; kept as the attribute ``native`` (a
        :class:`~kvsvc.testbed.sim.native.NativeFront`, ``None`` without).
    :param kv_events: False: publish no KV events (today's xLLM engines publish none; the
        ranks still bind their sockets, nothing is ever sent on them).
    :raises ValueError: bad sizes or ports, ``serving`` without ``http_port``, or
        ``vllm_array`` with another flavor, ``native`` without serving or with another flavor.
    """

    def __init__(self, name: str, event_port: int, replay_port: int, dp_size: int = 1,
                 block_size: int = 128, device_blocks: int = 4096, host_blocks: int = 0,
                 topic: Union[bytes, str] = b"", context: Optional[zmq.Context] = None,
                 host: str = "127.0.0.1", max_snapshot_message_bytes: int = 1 << 20,
                 seed: int = 0, http_port: Optional[int] = None,
                 serving: Optional[ServingConfig] = None,
                 tokenizer: Optional[TextTokenizer] = None,
                 flavor: Union[Flavor, str] = Flavor.XLLM, buffer_steps: int = 10_000,
                 replay_endpoint: bool = True, vllm_array: bool = False,
                 native: bool = False, kv_events: bool = True) -> None:
        if dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        for label, port in (("event_port", event_port), ("replay_port", replay_port)):
            if not 1 <= port or port + dp_size - 1 > 65535:
                raise ValueError(f"{label} {port} + dp_size {dp_size} out of range")
        if max_snapshot_message_bytes < 1024:
            raise ValueError("max_snapshot_message_bytes must be >= 1024")
        if buffer_steps < 1:
            raise ValueError(f"buffer_steps must be >= 1, got {buffer_steps}")
        self.flavor = Flavor(flavor)
        if vllm_array and self.flavor is not Flavor.VLLM:
            raise ValueError(f"vllm_array (--vllm-array) is a vLLM wire form: it needs flavor "
                             f"vllm, got {self.flavor.value}")
        self.buffer_steps = buffer_steps
        self.replay_endpoint = replay_endpoint
        self.vllm_array = vllm_array
        self.name = name
        self.event_port = event_port
        self.replay_port = replay_port
        self.dp_size = dp_size
        self.block_size = block_size
        self.host = host
        self.topic = topic.encode() if isinstance(topic, str) else bytes(topic)
        self.max_snapshot_message_bytes = max_snapshot_message_bytes
        self._given_ctx = context
        self._ctx: Optional[zmq.Context] = None
        self._ranks = [_Rank(r, BlockManager(block_size, device_blocks, host_blocks), seed,
                             buffer_steps if self.flavor.history else 0)
                       for r in range(dp_size)]
        self._rr = itertools.count()
        self._rr_lock = threading.Lock()
        self._started = False
        if serving is not None and http_port is None:
            raise ValueError("serving needs an http_port")
        self.serving = (Serving(self, serving, tokenizer, self.flavor.value)
                        if serving is not None else None)
        if native and (self.serving is None or self.flavor is not Flavor.XLLM):
            raise ValueError("native mode is an xLLM engine's: it needs flavor xllm and serving")
        self.kv_events = kv_events
        self.native = (NativeFront(name, self.serving, ServiceClient())
                       if native and self.serving is not None else None)
        self.http_port = http_port
        self._health = (HealthServer(host, http_port, name, self.serving,
                                     serving.max_connections if serving is not None else 256,
                                     self.native)
                        if http_port is not None else None)

    # ---- lifecycle -----------------------------------------------------------------------

    def endpoints(self, rank: int) -> tuple[str, str]:
        """``(event endpoint, replay endpoint)`` of ``rank``, connectable (``tcp://host:port``)."""
        self._rank(rank)
        return (f"tcp://{self.host}:{self.event_port + rank}",
                f"tcp://{self.host}:{self.replay_port + rank}")

    def start(self) -> None:
        """Bind every rank's sockets and start their I/O threads.

        :raises LifecycleError: a rank did not come up (e.g. its port is taken); the ranks that
            did are closed again.
        """
        if self._started:
            return
        self._ctx = self._given_ctx if self._given_ctx is not None else zmq.Context()
        try:
            for st in self._ranks:
                self._start_io(st)
            if self._health is not None:
                self._health.start()
        except BaseException:
            try:
                self.close()
            except LifecycleError:
                log.exception("sim %s: could not close after a failed start", self.name)
            raise
        self._started = True

    def _start_io(self, st: _Rank, bind_retry_s: float = 0.0) -> None:
        assert self._ctx is not None
        ev, rp = self.endpoints(st.rank)
        io = _RankIO(st, self._ctx, ev, rp, self.topic, self.block_size,
                     self.max_snapshot_message_bytes, f"{self.name}/dp{st.rank}", bind_retry_s,
                     self.flavor, self.replay_endpoint)
        io.start()
        st.io = io

    def close(self) -> None:
        """Stop the HTTP port and every rank (queued live messages are sent first) and release
        the context if this engine created it. Idempotent. Every thread is asked to stop even
        when one of them does not.

        :raises LifecycleError: a thread did not stop in time (the first such error; the
            others are logged); the context is then left to the garbage collector.
        """
        errors: list[LifecycleError] = []
        if self._health is not None:
            try:
                self._health.close()
            except LifecycleError as exc:
                errors.append(exc)
        for st in self._ranks:
            if st.io is not None:
                try:
                    st.io.close()
                except LifecycleError as exc:
                    errors.append(exc)
                st.io = None
        if self._ctx is not None and self._given_ctx is None and not errors:
            # term() would block on the sockets of a thread that did not stop.
            self._ctx.term()
        self._ctx = None
        self._started = False
        if errors:
            raise errors[0]

    def __enter__(self) -> "SimEngine":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- requests and state --------------------------------------------------------------

    def _rank(self, rank: int) -> _Rank:
        if not 0 <= rank < self.dp_size:
            raise IndexError(f"{self.name}: rank {rank} out of range 0..{self.dp_size - 1}")
        return self._ranks[rank]

    def execute(self, token_ids: Sequence[int], rank: Optional[int] = None) -> ExecResult:
        """Run one request on a rank and publish its events as one batch (one seq).

        Returns once the batch was handed to the socket (or dropped by a fault).

        :param token_ids: prompt token ids, each in ``[0, 2**31 - 1]``.
        :param rank: DP rank, ``None`` for round robin over the ranks.
        :raises LifecycleError: the rank is not running or did not publish within 5 s.
        """
        if rank is None:
            with self._rr_lock:
                rank = next(self._rr) % self.dp_size
        st = self._rank(rank)
        with st.exec_lock:
            io = st.io
            if io is None:
                raise LifecycleError(f"sim {self.name}/dp{rank}: not running")
            with st.lock:
                ex = st.bm.execute(token_ids)
                seq = None
                if ex.events and self.kv_events:
                    seq, ticket = self._publish_locked(st, ex.events)
            if seq is not None:
                io.wake()
                self._wait_flushed(st, ticket, f"seq {seq}")
        return ExecResult(rank, seq, ex.device_hit_tokens, ex.host_only_hit_tokens, ex.stored_blocks)

    def _publish_locked(self, st: _Rank, events: list[dict]) -> tuple[int, int]:
        """Assign the next seq to ``events`` and queue them in the flavor's form; the caller
        holds ``st.lock``. Returns ``(seq, ticket)``."""
        seq = st.next_seq
        st.next_seq += 1
        payload = encode_batch(self.flavor, time.time(), events, st.rank, self.vllm_array)
        ticket = self._enqueue(st, [self.topic, seq.to_bytes(8, "big"), payload], seq,
                               self._decide_drop(st),
                               payload if self.flavor.history else None)
        return seq, ticket

    @staticmethod
    def _enqueue(st: _Rank, frames: list[bytes], seq: Optional[int], drop: bool,
                 buffered: Optional[bytes] = None) -> int:
        # Caller holds st.lock.
        st.enqueued += 1
        st.outq.append(_Outgoing(frames, seq, drop, st.enqueued, buffered))
        return st.enqueued

    def clear_cache(self, rank: int) -> Optional[int]:
        """Reset the rank's prefix cache the way an operator's cache reset does: every block
        is forgotten and one batch ``[AllBlocksCleared]`` is published (vLLM's
        ``reset_prefix_cache``; §7h: a subset stream becomes exact on it).

        :returns: the batch's seq (consumed even when a drop fault loses the message).
        :raises LifecycleError: the rank is not running or did not publish within 5 s.
        """
        st = self._rank(rank)
        with st.exec_lock:
            io = st.io
            if io is None:
                raise LifecycleError(f"sim {self.name}/dp{rank}: not running")
            with st.lock:
                st.bm.clear()
                seq, ticket = self._publish_locked(st, [{"type": "AllBlocksCleared"}])
            io.wake()
            self._wait_flushed(st, ticket, f"seq {seq}")
        log.info("sim %s/dp%d: cache reset (AllBlocksCleared at seq %d)", self.name, rank, seq)
        return seq

    def _wait_flushed(self, st: _Rank, ticket: int, what: str) -> None:
        with st.cond:
            if not st.cond.wait_for(lambda: st.flushed >= ticket, _PUBLISH_TIMEOUT_S):
                raise LifecycleError(f"sim {self.name}/dp{st.rank}: {what} not published within "
                                     f"{_PUBLISH_TIMEOUT_S} s")

    @staticmethod
    def _decide_drop(st: _Rank) -> bool:
        if st.drop_next > 0:
            st.drop_next -= 1
            return True
        return st.drop_probability > 0 and st.rng.random() < st.drop_probability

    def last_seq(self, rank: int) -> Optional[int]:
        """Last published (or fault-dropped) seq of ``rank`` since its process (re)start, or
        ``None`` before the first one."""
        st = self._rank(rank)
        with st.lock:
            return st.published

    def true_prefix(self, rank: int, token_ids: Sequence[int]) -> tuple[int, int]:
        """§10 ground truth on ``rank`` now: ``(device_hit_tokens, host_only_hit_tokens)``."""
        st = self._rank(rank)
        with st.lock:
            return st.bm.true_prefix(token_ids)

    def resident(self, rank: int) -> dict[int, int]:
        """Resident blocks of ``rank``: ``{engine hash: DEVICE | HOST bits}``."""
        st = self._rank(rank)
        with st.lock:
            return st.bm.resident()

    def device_usage(self) -> float:
        """Device usage of the whole instance, ``gpu_cache_usage_perc`` of a heartbeat (§9):
        resident Device blocks over the Device pools of every rank, a float in ``[0, 1]``
        (0.0 with empty pools)."""
        used = capacity = 0
        for st in self._ranks:
            with st.lock:
                used += st.bm.device_count
                capacity += st.bm.device_capacity
        return used / capacity if capacity else 0.0

    def rank_device_usage(self, rank: int) -> float:
        """Device usage of one rank: its resident Device blocks over its Device pool, a float
        in ``[0, 1]`` (0.0 with an empty pool); what vLLM's ``vllm:kv_cache_usage_perc`` and
        SGLang's ``sglang:token_usage`` show per rank (§15).

        :raises IndexError: no such rank.
        """
        st = self._rank(rank)
        with st.lock:
            used, capacity = st.bm.device_count, st.bm.device_capacity
        return used / capacity if capacity else 0.0

    def waiting_requests(self) -> int:
        """Requests waiting in the engine's queue, ``waiting_requests_num`` of a heartbeat
        (§9): served requests not yet prefilling (:mod:`kvsvc.testbed.sim.serving`); 0 when the engine
        does not serve (direct :meth:`execute` calls run at once)."""
        return self.serving.waiting_requests() if self.serving is not None else 0

    def subscriptions(self, rank: int) -> int:
        """Live subscriptions matching this engine's topic currently held by ``rank``'s XPUB
        (lets a caller wait until a subscriber really listens instead of sleeping). A SUB that
        reconnects by itself after :meth:`restart` is not reported again by libzmq's XPUB; only
        new connections are."""
        st = self._rank(rank)
        with st.lock:
            return st.subscriptions

    def stats(self, rank: int) -> RankStats:
        """Counters of ``rank`` (see :class:`RankStats`)."""
        st = self._rank(rank)
        with st.lock:
            return RankStats(st.n_published, st.n_dropped, st.n_snapshots, st.n_malformed,
                             st.n_restarts)

    # ---- fault switches (thread-safe) ----------------------------------------------------

    def drop_next(self, rank: int, n: int = 1) -> None:
        """Drop the next ``n`` live batches of ``rank``; their seqs are consumed (a gap)."""
        st = self._rank(rank)
        with st.lock:
            st.drop_next += n

    def set_drop_probability(self, p: float, rank: Optional[int] = None) -> None:
        """Drop each live batch with probability ``p`` (seeded RNG per rank; seq consumed).

        :param rank: one rank, or ``None`` for every rank.
        :raises ValueError: ``p`` outside ``[0, 1]``.
        """
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"drop probability {p} outside [0, 1]")
        for st in self._ranks if rank is None else [self._rank(rank)]:
            with st.lock:
                st.drop_probability = p

    def restart(self, rank: Optional[int] = None) -> None:
        """Simulate a new engine process: close and re-bind the rank's sockets, clear its cache
        and start its seq at 0 again. Snapshot faults still pending are forgotten.

        :param rank: one rank, or ``None`` for every rank (the whole instance).
        :raises LifecycleError: a rank could not re-bind its ports.
        """
        for st in self._ranks if rank is None else [self._rank(rank)]:
            with st.exec_lock:
                if st.io is not None:
                    st.io.close()
                    st.io = None
                with st.cond:
                    st.bm.clear()
                    st.next_seq = 0
                    st.published = None
                    st.history.clear()
                    st.outq.clear()
                    st.flushed = st.enqueued
                    st.snapshot_delays.clear()
                    st.snapshot_truncations.clear()
                    st.reconnect_requested = False
                    st.n_restarts += 1
                    st.cond.notify_all()
                log.info("sim %s/dp%d: restarted (cache cleared, seq back to 0)", self.name, st.rank)
                if self._ctx is not None:
                    self._start_io(st, _BIND_RETRY_S)

    def restart_publisher(self, rank: int) -> None:
        """Restart only the seq counter of ``rank`` (next batch is seq 0); the cache is kept
        (history flavors: the replay buffer of the old publisher is gone too)."""
        st = self._rank(rank)
        with st.exec_lock, st.cond:
            st.next_seq = 0
            st.published = None
            st.history.clear()
            st.cond.notify_all()
        log.info("sim %s/dp%d: publisher counter restarted", self.name, rank)

    def disconnect(self, rank: int, timeout_s: float = 5.0) -> None:
        """Cut the live connections of ``rank``: its I/O thread closes the ``XPUB`` and binds a
        new one on the same port (subscribers see ``EVENT_DISCONNECTED``, then reconnect). The
        cache and the seq counter are kept; batches published before a subscriber has
        reconnected do not reach it. Returns once the new socket is bound.

        :raises LifecycleError: the rank is not running or did not re-bind within ``timeout_s``.
        """
        st = self._rank(rank)
        with st.exec_lock:
            io = st.io
            if io is None:
                raise LifecycleError(f"sim {self.name}/dp{rank}: not running")
            with st.cond:
                generation = st.pub_generation
                st.reconnect_requested = True
            io.wake()
            with st.cond:
                if not st.cond.wait_for(lambda: st.pub_generation > generation, timeout_s):
                    raise LifecycleError(f"sim {self.name}/dp{rank}: live socket not re-bound "
                                         f"within {timeout_s} s")

    def delay_snapshots(self, rank: int, seconds: float, count: int = 1) -> None:
        """Delay the next ``count`` snapshot replies of ``rank`` by ``seconds`` each (the reply
        describes the state when the request arrived; live publishing goes on meanwhile)."""
        st = self._rank(rank)
        with st.lock:
            st.snapshot_delays.extend([float(seconds)] * count)

    def truncate_snapshots(self, rank: int, data_messages: int, count: int = 1) -> None:
        """Make the next ``count`` snapshot replies of ``rank`` send only their first
        ``data_messages`` data messages and no end marker."""
        st = self._rank(rank)
        with st.lock:
            st.snapshot_truncations.extend([int(data_messages)] * count)

    def inject_malformed(self, rank: int, kind: str) -> Optional[int]:
        """Send one malformed live message on ``rank`` (after any queued batch).

        Kinds: ``two_frames`` (topic, seq), ``four_frames`` (an extra empty frame),
        ``short_seq`` (a 4-byte seq frame) consume no seq; ``bad_msgpack`` (payload ``0xc1``,
        never valid MessagePack) and ``bad_event`` (a valid batch holding an event of unknown
        ``type``) consume the next seq without changing the cache.

        :returns: the consumed seq, or ``None``.
        :raises ValueError: unknown kind.
        :raises LifecycleError: the rank is not running or did not send within 5 s.
        """
        if kind not in MALFORMED_KINDS:
            raise ValueError(f"unknown malformed kind {kind!r}; one of {MALFORMED_KINDS}")
        st = self._rank(rank)
        with st.exec_lock:
            io = st.io
            if io is None:
                raise LifecycleError(f"sim {self.name}/dp{rank}: not running")
            with st.lock:
                seq = None
                if kind in ("bad_msgpack", "bad_event"):
                    seq = st.next_seq
                    st.next_seq += 1
                seq_bytes = (st.next_seq if seq is None else seq).to_bytes(8, "big")
                good = ormsgpack.packb([time.time(), [], rank])
                frames = {
                    "two_frames": [self.topic, seq_bytes],
                    "four_frames": [self.topic, seq_bytes, good, b""],
                    "short_seq": [self.topic, seq_bytes[4:], good],
                    "bad_msgpack": [self.topic, seq_bytes, b"\xc1"],
                    "bad_event": [self.topic, seq_bytes,
                                  ormsgpack.packb([time.time(), [{"type": "BlockMoved"}], rank])],
                }[kind]
                ticket = self._enqueue(st, frames, seq, False)
                st.n_malformed += 1
            log.info("sim %s/dp%d: injecting malformed message %s", self.name, rank, kind)
            io.wake()
            self._wait_flushed(st, ticket, f"malformed {kind}")
        return seq
