"""Minimal KV-event publishers for tests, written from PROTOCOL.md §1, §2, §7 and §7h with raw
pyzmq: :class:`ProtocolPublisher` (a snapshot-mode engine, §7) and :class:`HistoryPublisher`
(a vLLM/SGLang-style engine answering with history, §7h).

:class:`ProtocolPublisher` binds an ``XPUB`` (live batches; an ``XPUB`` is a ``PUB`` that also
reports subscriptions, §1 allows either, and it lets tests wait for a subscriber on a condition
instead of sleeping) and a ``ROUTER`` (snapshot requests). The ``ROUTER`` is served by the
publisher's own thread from a settable snapshot state; the ``XPUB`` is used from the caller's
thread under a lock.

Event helpers build map-form event dicts (§2); :func:`to_array_event` turns one into the
tagged-array form.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, Optional, Sequence

import ormsgpack
import zmq

from kvsvc.errors import LifecycleError
from kvsvc.streams.frame import END_MARKER, encode_live, encode_reply, parse_snapshot_request

_FIELD_ORDER = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": ("medium",),
}


def stored(hashes: Sequence[Any], parent: Any, tokens: Sequence[int], block_size: int,
           medium: Optional[str] = None, **extra: Any) -> dict:
    """A map-form ``BlockStored`` event (§2); ``extra`` adds fields such as ``lora_id``."""
    ev = {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent,
          "token_ids": list(tokens), "block_size": block_size, "lora_id": None, "medium": medium}
    ev.update(extra)
    return ev


def removed(hashes: Sequence[Any], medium: Optional[str] = None) -> dict:
    """A map-form ``BlockRemoved`` event (§2)."""
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium}


def cleared(medium: Optional[str] = None) -> dict:
    """A map-form ``AllBlocksCleared`` event (§2); ``medium`` restricts it to one tier."""
    ev: dict = {"type": "AllBlocksCleared"}
    if medium is not None:
        ev["medium"] = medium
    return ev


def to_array_event(ev: dict) -> list:
    """The tagged-array form ``[type, field1, ...]`` of a map-form event, trailing absent
    fields omitted (§2)."""
    order = _FIELD_ORDER[ev["type"]]
    values = [ev.get(name) for name in order]
    last = max((i for i, name in enumerate(order) if name in ev), default=-1)
    return [ev["type"], *values[:last + 1]]


def encode_batch(events: Sequence[dict], dp_rank: Optional[int] = 0, *, form: str = "array3",
                 event_form: str = "map", ts: float = 1.0) -> bytes:
    """One MessagePack batch (§2).

    :param form: ``"array3"`` ``[ts, events, rank]``, ``"array2"`` ``[ts, events]`` or
        ``"map"`` ``{"ts", "events", "data_parallel_rank"}``.
    :param event_form: ``"map"`` or ``"array"`` (tagged arrays).
    """
    evs = [to_array_event(e) for e in events] if event_form == "array" else list(events)
    if form == "array3":
        obj: Any = [ts, evs, dp_rank]
    elif form == "array2":
        obj = [ts, evs]
    elif form == "map":
        obj = {"ts": ts, "events": evs, "data_parallel_rank": dp_rank}
    else:
        raise ValueError(form)
    return ormsgpack.packb(obj)


class ReplyBudget:
    """How many more replay requests a test publisher answers: ``reply_budget`` ``None``
    answers all, 0 holds every request until :meth:`release_replies`."""

    reply_budget: Optional[int] = None

    def hold_replies(self) -> None:
        """Answer no replay request until :meth:`release_replies`."""
        self.reply_budget = 0

    def release_replies(self, budget: Optional[int] = None) -> None:
        """Answer held and later requests: ``budget`` more of them, or all (``None``)."""
        self.reply_budget = budget

    def _may_reply(self) -> bool:
        """True when one more request may be answered now (it is then spent)."""
        if self.reply_budget == 0:
            return False
        if self.reply_budget is not None:
            self.reply_budget -= 1
        return True


class ProtocolPublisher(ReplyBudget):
    """A fake engine stream: live ``XPUB`` on ``event_port``, snapshot ``ROUTER`` on
    ``replay_port``, both on 127.0.0.1.

    Snapshot knobs (read by the publisher thread when it answers, so set them before the
    request or while replies are held): ``snapshot_events`` (event dicts, sent in
    messages of ``events_per_message``), ``watermark`` (``None`` = no live batch published
    yet), ``empty_reply`` (end marker only), ``reply_delay_s``, ``drop_end_marker``,
    ``reply_budget`` (how many more requests to answer; ``None`` = all, 0 = hold every
    request until :meth:`release_replies`).

    :ivar requests: ``start_seq`` of every snapshot request received, in order.
    :ivar replies_sent: snapshot replies sent (whole replies, end marker or not).
    """

    def __init__(self, ctx: zmq.Context, event_port: int, replay_port: int, topic: bytes = b"",
                 dp_rank: int = 0) -> None:
        self.ctx = ctx
        self.event_port = event_port
        self.replay_port = replay_port
        self.endpoint = f"tcp://127.0.0.1:{event_port}"
        self.replay_endpoint = f"tcp://127.0.0.1:{replay_port}"
        self.topic = topic
        self.dp_rank = dp_rank
        self.next_seq = 0
        self.batch_form = "array3"
        self.event_form = "map"
        # Snapshot state.
        self.snapshot_events: list[dict] = []
        self.watermark: Optional[int] = None
        self.empty_reply = False
        self.events_per_message = 64
        self.reply_delay_s = 0.0
        self.drop_end_marker = False
        self.reply_budget: Optional[int] = None
        self.requests: list[int] = []
        self.replies_sent = 0
        self._lock = threading.Lock()
        self._pub: Optional[zmq.Socket] = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._start_error: Optional[BaseException] = None

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout_s: float = 5.0) -> "ProtocolPublisher":
        """Bind the ``XPUB`` (here) and start the ``ROUTER`` thread; returns once it serves.

        :raises LifecycleError: the thread did not start or could not bind in time.
        """
        pub = self.ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.LINGER, 0)
        # Verbose: every (re)subscription is reported, also one that arrives while an old
        # connection's subscription to the same topic is still being torn down.
        pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        try:
            pub.bind(self.endpoint)
        except zmq.ZMQError:
            pub.close(linger=0)   # e.g. the port still held by a just-closed predecessor
            raise
        self._pub = pub
        self._thread = threading.Thread(target=self._run, name=f"test-publisher-{self.replay_port}",
                                        daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s) or self._start_error is not None:
            self.close()
            raise LifecycleError(f"publisher did not start: {self._start_error}")
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread, close both sockets; idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            assert not self._thread.is_alive(), "publisher thread did not stop"
        with self._lock:
            if self._pub is not None:
                self._pub.close(linger=0)
                self._pub = None

    def __enter__(self) -> "ProtocolPublisher":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ live channel

    def wait_subscribed(self, timeout_s: float = 5.0) -> None:
        """Wait until a subscription (of any topic) reaches the ``XPUB``.

        :raises AssertionError: none within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        with self._lock:
            assert self._pub is not None
            while time.monotonic() < deadline:
                if self._pub.poll(20, zmq.POLLIN):
                    msg = self._pub.recv()
                    if msg[:1] == b"\x01":
                        return
        raise AssertionError("no subscriber reached the publisher")

    def publish(self, events: Sequence[dict], seq: Optional[int] = None, *,
                topic: Optional[bytes] = None, dp_rank: Any = "default") -> int:
        """Send one live batch (§1) and return its seq.

        :param seq: explicit seq (the counter continues after it), default the next one.
        :param topic: override the topic frame.
        :param dp_rank: override the batch's rank (``None`` for a nil rank).
        """
        payload = encode_batch(events, self.dp_rank if dp_rank == "default" else dp_rank,
                               form=self.batch_form, event_form=self.event_form)
        with self._lock:
            if seq is None:
                seq = self.next_seq
            self.next_seq = seq + 1
            self._send(encode_live(self.topic if topic is None else topic, seq, payload))
        return seq

    def set_send_hwm(self, messages: int) -> None:
        """Set the live PUB's send high-water mark (0: unbounded, nothing is ever dropped)."""
        with self._lock:
            assert self._pub is not None, "publisher not started"
            self._pub.setsockopt(zmq.SNDHWM, messages)

    def skip(self, n: int = 1) -> None:
        """Advance the seq counter without sending (a batch lost on the wire)."""
        with self._lock:
            self.next_seq += n

    def send_raw(self, frames: Sequence[bytes]) -> None:
        """Send arbitrary frames on the live socket (malformed input)."""
        with self._lock:
            self._send(list(frames))

    def _send(self, frames: list[bytes]) -> None:
        assert self._pub is not None, "publisher not started"
        self._pub.send_multipart(frames)

    def set_snapshot(self, events: Sequence[dict], watermark: Optional[int]) -> None:
        """Set the snapshot state (events and watermark) in one step."""
        with self._lock:
            self.snapshot_events = list(events)
            self.watermark = watermark
            self.empty_reply = False

    # ------------------------------------------------------------------ replay thread

    def _run(self) -> None:
        router = None
        try:
            router = _bind_router(self)
            if router is None:
                return
            pending: list[tuple[float, bytes]] = []  # (due time, peer identity)
            while not self._stop.is_set():
                if router.poll(10, zmq.POLLIN):
                    frames = router.recv_multipart()
                    ident, rest = frames[0], frames[1:]
                    start_seq = parse_snapshot_request(rest)
                    self.requests.append(start_seq)
                    pending.append((time.monotonic() + self.reply_delay_s, ident))
                now = time.monotonic()
                while pending and pending[0][0] <= now and self._may_reply():
                    _, ident = pending.pop(0)
                    self._reply(router, ident)
        finally:
            if router is not None:
                router.close(linger=0)

    def _reply(self, router: zmq.Socket, ident: bytes) -> None:
        with self._lock:
            events = list(self.snapshot_events)
            watermark = self.watermark
            empty = self.empty_reply
        if not empty:
            step = max(1, self.events_per_message)
            chunks = [events[i:i + step] for i in range(0, len(events), step)] or [[]]
            for chunk in chunks:
                payload = encode_batch(chunk, self.dp_rank, form=self.batch_form,
                                       event_form=self.event_form)
                router.send_multipart([ident, *encode_reply(watermark, payload)])
        if not self.drop_end_marker:
            router.send_multipart([ident, *END_MARKER])
        self.replies_sent += 1


class HistoryPublisher(ReplyBudget):
    """A fake vLLM/SGLang engine stream (§7h), written from the protocol of vLLM's
    ``ZmqEventPublisher``: a ``PUB`` bound on ``event_port`` (live ``[topic, seq, payload]``,
    seq counting from 0 per process) and, unless ``replay=False``, a ``ROUTER`` on
    ``replay_port`` answering ``[b"", start_seq]`` with *history*: every batch of its bounded
    buffer (the last ``buffer_steps`` published) with ``seq >= start_seq``, each
    ``[b"", seq, payload]`` with the payload exactly as published (``topic_frame=True``: the
    4-frame form ``[b"", topic, seq, payload]``), then the end marker. Nothing says that older
    batches were dropped. The reply is sent under the publish lock, as the engine sends it from
    its publishing thread: no live batch goes out while a reply is sent. Its ``ROUTER`` keeps
    libzmq's default send high-water mark and drops silently beyond it, as the engine's does.

    Batch forms (``form``): ``"vllm"`` (the map ``{"ts", "events", "data_parallel_rank"}``,
    map events), ``"vllm-array"`` (``[ts, events, dp_rank]`` with tagged-array events, vLLM
    before mid-2026) and ``"sglang"`` (``[ts, events, attn_dp_rank]``, tagged arrays).

    Knobs: :meth:`publish` (``live=False``: into the buffer only, a batch lost on the wire or
    published before a subscription reached the ``PUB``), :meth:`restart` (a new process:
    sockets rebound, seq 0, empty buffer), :meth:`hold_replies` / :meth:`release_replies`,
    ``stall_after`` (send that many data messages of the next reply, then nothing),
    ``pause_every`` / ``pause_s`` (a pause after every n reply messages), ``omit`` (seqs left
    out of the next reply, as a ``ROUTER`` drops them at its high-water mark), ``reply_frames``
    (a callable ``start_seq -> list of frame lists`` replacing the next reply: bad input).

    :ivar requests: ``start_seq`` of every replay request received, in order.
    :ivar replies_sent: replies sent (whole, end marker or not).
    """

    def __init__(self, ctx: zmq.Context, event_port: int, replay_port: int, *,
                 topic: bytes = b"", dp_rank: int = 0, buffer_steps: int = 10_000,
                 form: str = "vllm", replay: bool = True, topic_frame: bool = False) -> None:
        self.ctx = ctx
        self.event_port = event_port
        self.replay_port = replay_port
        self.endpoint = f"tcp://127.0.0.1:{event_port}"
        self.replay_endpoint = f"tcp://127.0.0.1:{replay_port}"
        self.topic = topic
        self.dp_rank = dp_rank
        self.buffer_steps = buffer_steps
        self.form = form
        self.replay = replay
        self.topic_frame = topic_frame
        self.next_seq = 0
        self.buffer: collections.deque = collections.deque(maxlen=buffer_steps)
        self.requests: list[int] = []
        self.replies_sent = 0
        self.reply_budget: Optional[int] = None
        self.stall_after: Optional[int] = None
        self.pause_every = 0
        self.pause_s = 0.0
        self.reply_frames: Optional[Callable[[int], list[list[bytes]]]] = None
        self.omit: set[int] = set()
        self._lock = threading.Lock()
        self._pub: Optional[zmq.Socket] = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._start_error: Optional[BaseException] = None

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout_s: float = 5.0) -> "HistoryPublisher":
        """Bind the ``PUB`` (and the ``ROUTER`` on the replay thread); returns once serving.

        :raises LifecycleError: the replay thread did not start or could not bind in time.
        """
        pub = self.ctx.socket(zmq.XPUB)  # a PUB that reports subscriptions (wait_subscribed)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        pub.setsockopt(zmq.SNDHWM, 0)
        try:
            pub.bind(self.endpoint)
        except zmq.ZMQError:
            pub.close(linger=0)
            raise
        self._pub = pub
        self._stop.clear()
        self._ready.clear()
        self._start_error = None
        if self.replay:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name=f"test-history-publisher-{self.replay_port}")
            self._thread.start()
            if not self._ready.wait(timeout_s) or self._start_error is not None:
                self.close()
                raise LifecycleError(f"publisher did not start: {self._start_error}")
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the replay thread and close both sockets; idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            assert not self._thread.is_alive(), "publisher thread did not stop"
            self._thread = None
        with self._lock:
            if self._pub is not None:
                self._pub.close(linger=0)
                self._pub = None

    def rebind(self, timeout_s: float = 5.0) -> None:
        """A network blip: both sockets closed and bound again (the subscriber sees a
        disconnect); the seq counter and the buffer stay (the same engine process)."""
        self._rebind(timeout_s)

    def _rebind(self, timeout_s: float) -> None:
        self.close(timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.start(timeout_s)
                return
            except (zmq.ZMQError, LifecycleError):
                # The port may still be held by the socket just closed (the ZMQ reaper).
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def restart(self, timeout_s: float = 5.0) -> None:
        """A new engine process on the same ports: sockets closed and bound again (the
        subscriber sees a disconnect), seq 0, an empty buffer."""
        with self._lock:
            self.next_seq = 0
            self.buffer.clear()
        self._rebind(timeout_s)

    def __enter__(self) -> "HistoryPublisher":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ live channel

    def wait_subscribed(self, timeout_s: float = 5.0) -> None:
        """Wait until a subscription reaches the ``PUB``. :raises AssertionError: none."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            assert self._pub is not None
            while time.monotonic() < deadline:
                if self._pub.poll(20, zmq.POLLIN):
                    if self._pub.recv()[:1] == b"\x01":
                        return
        raise AssertionError("no subscriber reached the publisher")

    def payload(self, events: Sequence[dict]) -> bytes:
        """The batch of ``events`` in this publisher's form (``ts`` is the wall clock, as an
        engine sends it: equal events published twice have different payload bytes)."""
        ts = time.time()
        if self.form == "vllm":
            return encode_batch(events, self.dp_rank, form="map", ts=ts)
        if self.form in ("vllm-array", "sglang"):
            return encode_batch(events, self.dp_rank, form="array3", event_form="array", ts=ts)
        raise ValueError(self.form)

    def publish(self, events: Sequence[dict], *, live: bool = True) -> int:
        """Publish one batch: next seq, into the replay buffer, and (``live``) on the ``PUB``.

        :returns: its seq.
        """
        payload = self.payload(events)
        with self._lock:
            seq = self.next_seq
            self.next_seq += 1
            if live:
                assert self._pub is not None, "publisher not started"
                self._pub.send_multipart(encode_live(self.topic, seq, payload))
            self.buffer.append((seq, payload))
        return seq

    # ------------------------------------------------------------------ replay thread

    def _run(self) -> None:
        router = None
        try:
            router = _bind_router(self)
            if router is None:
                return
            pending: list[tuple[bytes, int]] = []
            while not self._stop.is_set():
                if router.poll(10, zmq.POLLIN):
                    frames = router.recv_multipart()
                    start_seq = parse_snapshot_request(frames[1:])
                    self.requests.append(start_seq)
                    pending.append((frames[0], start_seq))
                while pending and not self._stop.is_set() and self._may_reply():
                    ident, start_seq = pending.pop(0)
                    self._reply(router, ident, start_seq)
        finally:
            if router is not None:
                router.close(linger=0)

    def _reply(self, router: zmq.Socket, ident: bytes, start_seq: int) -> None:
        custom = self.reply_frames
        with self._lock:
            if custom is not None:
                self.reply_frames = None
                for frames in custom(start_seq):
                    router.send_multipart([ident, *frames])
                self.replies_sent += 1
                return
            sent = 0
            omit, self.omit = self.omit, set()
            for seq, payload in list(self.buffer):
                if seq < start_seq or seq in omit:
                    continue
                if self.stall_after is not None and sent >= self.stall_after:
                    self.stall_after = None
                    self.replies_sent += 1
                    return  # stalls: no more messages, no end marker
                seq_frame = seq.to_bytes(8, "big")
                frames = ([b"", self.topic, seq_frame, payload] if self.topic_frame
                          else [b"", seq_frame, payload])
                router.send_multipart([ident, *frames])
                sent += 1
                if self.pause_every and sent % self.pause_every == 0:
                    time.sleep(self.pause_s)
            router.send_multipart([ident, *((b"", b"", END_MARKER[1], b"") if self.topic_frame
                                             else END_MARKER)])
            self.replies_sent += 1


def _bind_router(owner) -> Optional[zmq.Socket]:
    """Bind ``owner``'s replay ``ROUTER`` (linger 0) on its replay thread; on failure keep the
    error in ``owner._start_error`` and return ``None``. Sets ``owner._ready`` either way, so
    ``start()`` returns once the thread's bind has succeeded or failed."""
    router = None
    try:
        router = owner.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(owner.replay_endpoint)
        return router
    except zmq.ZMQError as exc:
        owner._start_error = exc
        if router is not None:
            router.close()
        return None
    finally:
        owner._ready.set()
