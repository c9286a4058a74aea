"""The KV-event directory: every configured stream's subscriber, queried together (§10).

The directory owns one :class:`~kvsvc.streams.subscriber.StreamSubscriber` per kept stream
(§8 ``max_streams``). Its stream set is an immutable :class:`_View` swapped under a lock
(copy-on-write), so discovery (§9) can add and remove streams at run time while request threads
keep reading the view they took, without a lock held during a query. Request threads never touch
ZMQ (§6): :meth:`Directory.query` only hashes tokens and reads each stream's in-memory index.

Snapshot attempts (§6, §7) of all streams share one :class:`~kvsvc.streams.gate.SnapshotGate`
of ``max_concurrent_snapshots`` permits: decoding and indexing a snapshot is pure CPU under the
GIL, and a request thread waits for the GIL behind every stream thread that holds it, so when
many streams recover at once (a deploy, a network blip) they take turns instead of all
competing with the request path (``bench/load_recovering.py``).

Live batches are likewise applied one stream thread at a time (:attr:`Directory.live_turns`, a
lock the directory hands to every subscriber, held for one turn of at most
``LIVE_MESSAGES_PER_TURN`` messages). pyzmq releases the GIL around every frame it receives;
with many busy stream threads each release would hand the GIL to another stream thread and
back, a context switch per frame. Request threads never take that lock, so they get the GIL
whenever the draining thread waits on its socket.

Errors: :class:`~kvsvc.errors.LifecycleError` when a stream thread does not start or stop in time
(:meth:`Directory.close` closes every stream first and raises the first failure),
:class:`~kvsvc.errors.ConfigError` for a duplicate stream, ``ValueError`` for bad token ids.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping, Optional, Sequence

import zmq

from kvsvc.config import (
    DEFAULT_MAX_CONCURRENT_SNAPSHOTS,
    KvEventsConfig,
    ReplayMode,
    StreamConfig,
)
from kvsvc.errors import ConfigError, LifecycleError
from kvsvc.index.keys import chain_keys, pack_tokens
from kvsvc.streams.counters import StreamCounters
from kvsvc.streams.gate import GateStats, SnapshotGate
from kvsvc.streams.state import StreamId, StreamMatch, StreamState, StreamStatus
from kvsvc.streams.subscriber import StreamSubscriber

log = logging.getLogger(__name__)

#: (block_size, hash_seed): streams sharing it share the content keys of a prompt (§4).
Geometry = tuple[int, int]

#: ``error`` of a stream whose directory has not been started (no thread, no index yet).
NOT_STARTED = "not started"



@dataclass(frozen=True)
class _View:
    """One immutable generation of the stream set (copy-on-write: never changed, replaced).

    :param configs: stream id -> its configuration, read-only.
    :param subscribers: stream id -> subscriber, read-only; empty until the directory has a ZMQ
        context (an owned context is only created in :meth:`Directory.start`).
    :param ordered: stream ids sorted by (instance_name, dp_rank), the §10 answer order.
    :param geometries: distinct (block_size, hash_seed) pairs, first-seen order.
    :param matchers: per stream of ``ordered``, the function answering a query from that
        stream's keys: the subscriber's ``match``, or a constant "not started" answer.
    :param geometry_of: per stream of ``ordered``, its index in ``geometries``.
    """

    configs: Mapping[StreamId, StreamConfig]
    subscribers: Mapping[StreamId, StreamSubscriber]
    ordered: tuple[StreamId, ...]
    geometries: tuple[Geometry, ...]
    matchers: tuple[Callable[[Sequence[int]], StreamMatch], ...]
    geometry_of: tuple[int, ...]

    @classmethod
    def of(cls, configs: dict[StreamId, StreamConfig],
           subscribers: dict[StreamId, StreamSubscriber]) -> "_View":
        """Build a view from fresh dicts (the caller must not change them afterwards)."""
        ordered = tuple(sorted(configs))
        geometry_index: dict[Geometry, int] = {}
        for sid in ordered:
            geometry_index.setdefault((configs[sid].block_size, configs[sid].hash_seed),
                                      len(geometry_index))
        # Resolved once per view, not per query: the query loop is per stream and hot (§10).
        matchers = tuple(subscribers[sid].match if sid in subscribers else _not_started(sid)
                         for sid in ordered)
        geometry_of = tuple(geometry_index[(configs[sid].block_size, configs[sid].hash_seed)]
                            for sid in ordered)
        return cls(MappingProxyType(configs), MappingProxyType(subscribers), ordered,
                   tuple(geometry_index), matchers, geometry_of)


def _not_started(sid: StreamId) -> Callable[[Sequence[int]], StreamMatch]:
    """A matcher for a stream without a subscriber yet: 0 hits, error ``"not started"``."""
    answer = StreamMatch(sid.instance_name, sid.dp_rank, False, None, 0, 0, 0, 0, NOT_STARTED)

    def match(keys: Sequence[int]) -> StreamMatch:
        return answer

    return match


def _stream_id(cfg: StreamConfig) -> StreamId:
    return StreamId(cfg.instance_name, cfg.dp_rank)


class Directory:
    """All streams of one service, started and stopped together, queried in one call (§10).

    :param config: the validated §8 config; its ``kept_streams()`` are the initial streams and
        its limits apply to every stream.
    :param context: ZMQ context for the stream sockets. Given: the subscribers are constructed
        here (nothing started). ``None``: the directory creates its own context in
        :meth:`start` (after a gunicorn fork, never before: a ZMQ context does not survive
        ``fork``), constructs the subscribers then, and destroys the context in :meth:`close`.
        Until then each stream answers unsynchronized with error ``"not started"``.
    :param max_concurrent_snapshots: snapshot attempts (request, receive, build) running at
        once across all streams, >= 1; the others queue first come, first served before
        sending their request (:class:`~kvsvc.streams.gate.SnapshotGate`). The service
        passes ``ServiceSettings.max_concurrent_snapshots``.
    :raises ValueError: ``max_concurrent_snapshots`` < 1.
    """

    def __init__(self, config: KvEventsConfig, context: Optional[zmq.Context] = None,
                 max_concurrent_snapshots: int = DEFAULT_MAX_CONCURRENT_SNAPSHOTS) -> None:
        self._limits = config
        self._gate = SnapshotGate(max_concurrent_snapshots)
        self._live_turns = threading.Lock()
        self._context = context
        self._owns_context = context is None
        # Guards the _view swap and _started only; queries take the view and work outside it.
        self._lock = threading.Lock()
        self._started = False
        # Stream id -> the instance incarnation it was added for (§9, §11); replaced, never
        # mutated (copy-on-write like the view). Static streams have none.
        self._identities: Mapping[StreamId, str] = MappingProxyType({})
        # §8 validation rejects duplicate (instance_name, dp_rank) pairs already.
        configs = {_stream_id(cfg): cfg for cfg in config.kept_streams()}
        subscribers = ({} if context is None else
                       {sid: self._subscriber(cfg, context) for sid, cfg in configs.items()})
        self._view = _View.of(configs, subscribers)

    def _subscriber(self, cfg: StreamConfig, context: zmq.Context) -> StreamSubscriber:
        return StreamSubscriber(cfg, self._limits, context, gate=self._gate,
                                live_turns=self._live_turns)

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self, timeout_s: float = 5.0) -> None:
        """Start every stream's thread (each connects and requests a snapshot at once, §6).

        :param timeout_s: bound of each stream's start, seconds.
        :raises LifecycleError: already started, or a stream did not start in time; then the
            streams already started are closed again (and an owned context destroyed) first.
        """
        with self._lock:
            if self._started:
                raise LifecycleError("directory already started")
            if self._owns_context:
                self._context = zmq.Context()
                self._view = _View.of(
                    dict(self._view.configs),
                    {sid: self._subscriber(cfg, self._context)
                     for sid, cfg in self._view.configs.items()})
            view = self._view
            self._started = True
        started: list[StreamSubscriber] = []
        try:
            for sid in view.ordered:
                sub = view.subscribers[sid]
                sub.start(timeout_s=timeout_s)
                started.append(sub)
        except BaseException:
            log.error("directory start failed after %d of %d streams; closing those",
                      len(started), len(view.ordered))
            for sub in reversed(started):
                self._close_quietly(sub, timeout_s)
            self._stop()
            raise
        log.info("directory started: %d streams, %d key geometries",
                 len(view.ordered), len(view.geometries))

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop every stream (each joined within ``timeout_s``) and destroy an owned context.

        Idempotent; closing a directory that is not running does nothing. Afterwards it can be
        started again. ``start`` and ``close`` must not run concurrently with each other.

        :raises LifecycleError: a stream thread did not stop in time (the others are closed
            first).
        """
        with self._lock:
            if not self._started:
                return
            # Not running from here on: a concurrent add_stream() sees this and undoes itself
            # instead of adding a started stream this close() would miss.
            self._started = False
            view = self._view
        failure: Optional[LifecycleError] = None
        for sid in view.ordered:
            try:
                view.subscribers[sid].close(timeout_s=timeout_s)
            except LifecycleError as exc:  # logged by the stream's close()
                failure = failure or exc
        self._stop()
        log.info("directory closed: %d streams", len(view.ordered))
        if failure is not None:
            raise failure

    def _stop(self) -> None:
        """Mark stopped and replace the used subscribers (a thread starts only once) so that
        the directory can be started again: fresh ones on a given context; none with an owned
        context, which is destroyed (every socket was closed by its stream thread; linger 0
        covers a thread whose close timed out)."""
        with self._lock:
            self._started = False
            configs = dict(self._view.configs)
            if self._owns_context:
                self._view = _View.of(configs, {})
                if self._context is not None:
                    self._context.destroy(linger=0)
                    self._context = None
            else:
                context = self._context
                assert context is not None  # given to the constructor, never replaced
                self._view = _View.of(configs, {sid: self._subscriber(cfg, context)
                                                for sid, cfg in configs.items()})

    @staticmethod
    def _close_quietly(sub: StreamSubscriber, timeout_s: float) -> None:
        try:
            sub.close(timeout_s=timeout_s)
        except LifecycleError:
            pass  # logged by the stream's close(); the stream is being dropped anyway

    # -- run-time changes (discovery, §9) --------------------------------------------------------

    def add_stream(self, cfg: StreamConfig, timeout_s: float = 5.0,
                   identity: Optional[str] = None) -> StreamId:
        """Add one stream, started at once when the directory runs. It answers 0 hits until its
        first snapshot (§6, §9).

        :param cfg: the stream's configuration (limits are the directory's).
        :param timeout_s: start bound, seconds.
        :param identity: the incarnation of the instance the stream belongs to (discovery, §9:
            ``kvsvc.cluster.discovery.instance_identity``); kept for :meth:`identity`.
        :returns: the new stream's id.
        :raises ConfigError: a stream with the same (instance_name, dp_rank) exists.
        :raises LifecycleError: the stream did not start in time (it is not added).
        """
        sid = _stream_id(cfg)
        with self._lock:
            if sid in self._view.configs:
                raise ConfigError("streams", f"stream {sid} already exists")
            context, started = self._context, self._started
        sub = self._subscriber(cfg, context) if context is not None else None
        if sub is not None and started:
            # Outside the lock: start() waits for a thread, and queries must never wait on it.
            sub.start(timeout_s=timeout_s)
        with self._lock:
            # Re-check: another add of the same id, or a start()/close(), may have run meanwhile.
            clash = sid in self._view.configs
            if not clash and self._context is context and self._started == started:
                configs = dict(self._view.configs)
                configs[sid] = cfg
                subscribers = dict(self._view.subscribers)
                if sub is not None:
                    subscribers[sid] = sub
                self._view = _View.of(configs, subscribers)
                if identity is not None:
                    self._identities = MappingProxyType({**self._identities, sid: identity})
                added = True
            else:
                added = False
        if not added:
            if sub is not None and started:
                self._close_quietly(sub, timeout_s)
            if clash:
                raise ConfigError("streams", f"stream {sid} already exists")
            raise LifecycleError(f"directory started or stopped while adding stream {sid}")
        log.info("stream %s added (block_size=%d, replay_mode=%s, running=%s)", sid,
                 cfg.block_size, cfg.replay_mode.value, started)
        return sid

    def remove_stream(self, stream_id: StreamId, timeout_s: float = 5.0) -> bool:
        """Remove one stream; queries stop listing it at once, then its thread is closed.

        :param stream_id: the stream to remove.
        :param timeout_s: close bound, seconds.
        :returns: False when no such stream exists.
        :raises LifecycleError: its thread did not stop in time (it is removed regardless).
        """
        with self._lock:
            view = self._view
            if stream_id not in view.configs:
                return False
            configs = dict(view.configs)
            del configs[stream_id]
            subscribers = dict(view.subscribers)
            sub = subscribers.pop(stream_id, None)
            self._view = _View.of(configs, subscribers)
            if stream_id in self._identities:
                self._identities = MappingProxyType(
                    {k: v for k, v in self._identities.items() if k != stream_id})
            started = self._started
        log.info("stream %s removed", stream_id)
        if sub is not None and started:
            sub.close(timeout_s=timeout_s)
        return True

    # -- request path ---------------------------------------------------------------------------

    def stream_ids(self) -> list[StreamId]:
        """Current stream ids in answer order (instance_name, dp_rank)."""
        return list(self._current().ordered)

    def stream_config(self, stream_id: StreamId) -> Optional[StreamConfig]:
        """The configuration ``stream_id`` runs with (static, or as discovery handed it over,
        §9), ``None`` for an unknown stream."""
        return self._current().configs.get(stream_id)

    def replay_modes(self) -> dict[StreamId, ReplayMode]:
        """Each current stream's configured replay mode (§8 ``replay_mode``: ``snapshot`` §7
        or ``history`` §7h), in answer order; what ``/ready`` shows beside its state."""
        view = self._current()
        return {sid: view.configs[sid].replay_mode for sid in view.ordered}

    def query(self, token_ids: Sequence[int]) -> list[StreamMatch]:
        """Each stream's reusable prefix of ``token_ids`` (§10), ordered by (instance_name,
        dp_rank).

        Tokens are packed once and content keys (§4) computed once per distinct (block_size,
        hash_seed), reusing the packed bytes; only full blocks count. An unsynchronized stream
        answers 0 hits with its error (§6). An empty list gives every stream's status with zero
        hits.

        :param token_ids: token ids, ints in ``[0, 2**31 - 1]``.
        :raises ValueError: a token id is not such an int.
        """
        view = self._current()
        packed = pack_tokens(token_ids)
        geometries = view.geometries
        if len(geometries) == 1:  # the usual deployment: one model, one seed
            keys = chain_keys(packed, *geometries[0])
            return [match(keys) for match in view.matchers]
        by_geometry = [chain_keys(packed, bs, seed) for bs, seed in geometries]
        return [match(by_geometry[g]) for match, g in zip(view.matchers, view.geometry_of)]

    def statuses(self) -> list[StreamStatus]:
        """Every stream's status, ordered by (instance_name, dp_rank)."""
        view = self._current()
        out: list[StreamStatus] = []
        for sid in view.ordered:
            sub = view.subscribers.get(sid)
            out.append(sub.status() if sub is not None else StreamStatus(
                stream=sid, state=StreamState.UNSYNCHRONIZED, error=NOT_STARTED, sequence=None,
                device_blocks=0, host_blocks=0, entries=0, synchronized_once=False,
                recoveries=0, resync_differences=0))
        return out

    def counters(self) -> dict[StreamId, StreamCounters]:
        """Each stream's metric counters (:class:`StreamCounters`, for ``/metrics``), copied
        under each stream's lock; a stream without a subscriber (directory not started) is
        absent."""
        return {sid: sub.counters() for sid, sub in self._current().subscribers.items()}

    def subscriber(self, stream_id: StreamId) -> Optional[StreamSubscriber]:
        """The subscriber of ``stream_id``; ``None`` for an unknown stream or before the
        directory has a ZMQ context (an owned one is created in :meth:`start`)."""
        return self._current().subscribers.get(stream_id)

    @property
    def live_turns(self) -> threading.Lock:
        """The lock the stream threads take in turns to handle live messages; holding it
        pauses live application on every stream (tests, debugging)."""
        return self._live_turns

    @property
    def context(self) -> Optional[zmq.Context]:
        """The ZMQ context of the stream sockets: the given one, or the owned one while
        started (``None`` before :meth:`start` and after :meth:`close`)."""
        return self._context

    def snapshot_gate(self) -> GateStats:
        """Counters of the snapshot gate (permits, in use, queued, most ever in use)."""
        return self._gate.stats()

    def ready(self) -> bool:
        """True when every stream has been synchronized at least once (True with no streams)."""
        return all(st.synchronized_once for st in self.statuses())

    def identity(self, stream_id: StreamId) -> Optional[str]:
        """The instance incarnation ``stream_id`` was added for (§9), ``None`` for a static or
        unknown stream. §11: a stream whose identity differs from its instance's current one
        counts as 0 hits."""
        with self._lock:
            return self._identities.get(stream_id)

    def __len__(self) -> int:
        return len(self._current().ordered)

    def _current(self) -> _View:
        # One reference read under the lock; the view itself is immutable.
        with self._lock:
            return self._view
