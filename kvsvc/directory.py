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

Overlays (:mod:`kvsvc.index.overlay`, one LRU + TTL block set per (instance, DP rank)):

- **Approximate indexes** (§14): discovery adds one per (instance, DP rank) of a backend in
  ``discovery.approximate_backends`` (:meth:`Directory.add_approximate`) instead of a stream. No
  thread, no socket: it answers every query (``synchronized`` true, ``completeness``
  ``"approximate"``, ``sequence`` null, ``device_blocks`` the blocks it holds) from what this
  replica routed there (:meth:`Directory.record_dispatch`).
- **Pending prefixes** (§16): with ``pending`` settings every exact stream gets a pending block
  set, settled by its own live batches (the stream thread, :meth:`BlockOverlay.settle`). A query
  walks it from where the stream's reusable prefix ends and answers its blocks apart
  (``pending_hit_tokens``); an unsynchronized stream answers none.

Errors: :class:`~kvsvc.errors.LifecycleError` when a stream thread does not start or stop in time
(:meth:`Directory.close` closes every stream first and raises the first failure),
:class:`~kvsvc.errors.ConfigError` for a duplicate stream, ``ValueError`` for bad token ids.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping, Optional, Sequence

import zmq

from kvsvc.clock import MONOTONIC, Clock
from kvsvc.config import (
    DEFAULT_MAX_CONCURRENT_SNAPSHOTS,
    KvEventsConfig,
    ReplayMode,
    StreamConfig,
)
from kvsvc.errors import ConfigError, LifecycleError
from kvsvc.index.keys import chain_keys, pack_tokens
from kvsvc.index.overlay import BlockOverlay, OverlayStats, PromptKeys
from kvsvc.streams.counters import StreamCounters
from kvsvc.streams.gate import GateStats, SnapshotGate
from kvsvc.streams.state import (
    Completeness,
    StreamId,
    StreamMatch,
    StreamState,
    StreamStatus,
)
from kvsvc.streams.subscriber import StreamSubscriber

log = logging.getLogger(__name__)

#: (block_size, hash_seed): streams sharing it share the content keys of a prompt (§4).
Geometry = tuple[int, int]

#: ``error`` of a stream whose directory has not been started (no thread, no index yet).
NOT_STARTED = "not started"



@dataclass(frozen=True, slots=True)
class OverlayLimits:
    """The bounds of one kind of overlay (§14, §16).

    :ivar ttl_s: an entry's lifetime after its last use, seconds (> 0).
    :ivar max_blocks: blocks per (instance, DP rank), >= 1.
    """

    ttl_s: float
    max_blocks: int

    def new(self) -> BlockOverlay:
        """An empty overlay with these bounds."""
        return BlockOverlay(self.ttl_s, self.max_blocks)


@dataclass(frozen=True, slots=True)
class ApproximateIndex:
    """The approximate index of one (instance, DP rank) (§14).

    :ivar stream_id: its (instance, DP rank).
    :ivar overlay: the blocks routed there.
    :ivar block_size: tokens per block of its keys.
    :ivar hash_seed: the §4 seed of its keys.
    :ivar backend: its instance's backend type (metrics, the audit per backend).
    """

    stream_id: StreamId
    overlay: BlockOverlay
    block_size: int
    hash_seed: int
    backend: str

    def match(self, keys: Sequence[int], now: float) -> StreamMatch:
        """The §10 answer from the overlay: Device hits only, ``approximate``."""
        blocks = self.overlay.match(keys, now)
        sid = self.stream_id
        return StreamMatch(sid.instance_name, sid.dp_rank, True, None, blocks * self.block_size,
                           0, len(self.overlay), 0, None, Completeness.APPROXIMATE)


@dataclass(frozen=True)
class _View:
    """One immutable generation of the stream set (copy-on-write: never changed, replaced).

    :param configs: stream id -> its configuration, read-only.
    :param subscribers: stream id -> subscriber, read-only; empty until the directory has a ZMQ
        context (an owned context is only created in :meth:`Directory.start`).
    :param ordered: stream ids sorted by (instance_name, dp_rank); streams only.
    :param approximate: stream id -> its approximate index (§14), read-only.
    :param answer_ids: streams and approximate indexes sorted, the §10 answer order.
    :param geometries: distinct (block_size, hash_seed) pairs, first-seen order.
    :param matchers: per id of ``answer_ids``, the function answering a query from its keys:
        the subscriber's ``match``, an approximate index's, or a constant "not started" answer.
    :param geometry_of: per id of ``answer_ids``, its index in ``geometries``.
    :param pending_slots: (position in ``answer_ids``, pending overlay, block_size) of every
        stream with a pending overlay (§16).
    """

    configs: Mapping[StreamId, StreamConfig]
    subscribers: Mapping[StreamId, StreamSubscriber]
    ordered: tuple[StreamId, ...]
    approximate: Mapping[StreamId, ApproximateIndex]
    answer_ids: tuple[StreamId, ...]
    geometries: tuple[Geometry, ...]
    matchers: tuple[Callable[[Sequence[int]], StreamMatch], ...]
    geometry_of: tuple[int, ...]
    pending_slots: tuple[tuple[int, BlockOverlay, int], ...]

    @classmethod
    def of(cls, configs: dict[StreamId, StreamConfig],
           subscribers: dict[StreamId, StreamSubscriber],
           approximate: Optional[dict[StreamId, ApproximateIndex]] = None,
           clock: Callable[[], float] = MONOTONIC.now) -> "_View":
        """Build a view from fresh dicts (the caller must not change them afterwards)."""
        approximate = approximate if approximate is not None else {}
        ordered = tuple(sorted(configs))
        answer_ids = tuple(sorted((*configs, *approximate)))
        geometry_index: dict[Geometry, int] = {}

        def geometry(sid: StreamId) -> Geometry:
            cfg = configs.get(sid)
            if cfg is not None:
                return (cfg.block_size, cfg.hash_seed)
            approx = approximate[sid]
            return (approx.block_size, approx.hash_seed)

        for sid in answer_ids:
            geometry_index.setdefault(geometry(sid), len(geometry_index))
        # Resolved once per view, not per query: the query loop is per stream and hot (§10).
        matchers: list[Callable[[Sequence[int]], StreamMatch]] = []
        pending: list[tuple[int, BlockOverlay, int]] = []
        for i, sid in enumerate(answer_ids):
            sub = subscribers.get(sid)
            if sid in approximate:
                matchers.append(_approximate_matcher(approximate[sid], clock))
            elif sub is not None:
                matchers.append(sub.match)
                if sub.pending is not None:
                    pending.append((i, sub.pending, configs[sid].block_size))
            else:
                matchers.append(_not_started(sid))
        geometry_of = tuple(geometry_index[geometry(sid)] for sid in answer_ids)
        return cls(MappingProxyType(configs), MappingProxyType(subscribers), ordered,
                   MappingProxyType(approximate), answer_ids, tuple(geometry_index),
                   tuple(matchers), geometry_of, tuple(pending))


def _approximate_matcher(approx: ApproximateIndex, clock: Callable[[], float]
                         ) -> Callable[[Sequence[int]], StreamMatch]:
    """A matcher answering from ``approx`` at the clock's time of the query."""

    def match(keys: Sequence[int]) -> StreamMatch:
        return approx.match(keys, clock())

    return match


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
    :param pending: the bounds of every exact stream's pending overlay (§16); ``None``: no
        pending prefixes (queries answer ``pending_hit_tokens`` 0).
    :param clock: the service's clock (:mod:`kvsvc.clock`): the overlays' TTLs (approximate
        indexes, pending blocks, §14, §16) and every stream's timer rules (its subscriber's
        clock); real by default, a virtual one in tests.
    :raises ValueError: ``max_concurrent_snapshots`` < 1.
    """

    def __init__(self, config: KvEventsConfig, context: Optional[zmq.Context] = None,
                 max_concurrent_snapshots: int = DEFAULT_MAX_CONCURRENT_SNAPSHOTS,
                 pending: Optional[OverlayLimits] = None,
                 clock: Clock = MONOTONIC) -> None:
        self._limits = config
        self._pending_limits = pending
        self._clock = clock
        discovery = config.discovery
        self._approximate_limits = (
            OverlayLimits(float(discovery.approximate_ttl_s), discovery.approximate_blocks)
            if discovery is not None else OverlayLimits(120.0, 65536))
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
        self._view = _View.of(configs, subscribers, clock=self._clock.now)

    def _subscriber(self, cfg: StreamConfig, context: zmq.Context) -> StreamSubscriber:
        pending = self._pending_limits.new() if self._pending_limits is not None else None
        return StreamSubscriber(cfg, self._limits, context, gate=self._gate,
                                live_turns=self._live_turns, pending=pending, clock=self._clock)

    def _new_view(self, configs: dict[StreamId, StreamConfig],
                  subscribers: dict[StreamId, StreamSubscriber],
                  approximate: Optional[dict[StreamId, ApproximateIndex]] = None) -> _View:
        """A view of these streams, keeping the current approximate indexes unless given
        (caller holds the lock)."""
        if approximate is None:
            approximate = dict(self._view.approximate)
        return _View.of(configs, subscribers, approximate, self._clock.now)

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
                self._view = self._new_view(
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
                self._view = self._new_view(configs, {})
                if self._context is not None:
                    self._context.destroy(linger=0)
                    self._context = None
            else:
                context = self._context
                assert context is not None  # given to the constructor, never replaced
                self._view = self._new_view(configs, {sid: self._subscriber(cfg, context)
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
            clash = sid in self._view.configs or sid in self._view.approximate
            if not clash and self._context is context and self._started == started:
                configs = dict(self._view.configs)
                configs[sid] = cfg
                subscribers = dict(self._view.subscribers)
                if sub is not None:
                    subscribers[sid] = sub
                self._view = self._new_view(configs, subscribers)
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
        """Remove one stream or approximate index (§14); queries stop listing it at once, then
        a stream's thread is closed (an approximate index has none: its blocks are dropped).

        :param stream_id: the stream to remove.
        :param timeout_s: close bound, seconds.
        :returns: False when no such stream exists.
        :raises LifecycleError: its thread did not stop in time (it is removed regardless).
        """
        with self._lock:
            view = self._view
            if stream_id in view.approximate:
                approximate = dict(view.approximate)
                del approximate[stream_id]
                self._view = self._new_view(dict(view.configs), dict(view.subscribers),
                                            approximate)
                self._forget_identity(stream_id)
                log.info("approximate index %s removed", stream_id)
                return True
            if stream_id not in view.configs:
                return False
            configs = dict(view.configs)
            del configs[stream_id]
            subscribers = dict(view.subscribers)
            sub = subscribers.pop(stream_id, None)
            self._view = self._new_view(configs, subscribers)
            self._forget_identity(stream_id)
            started = self._started
        log.info("stream %s removed", stream_id)
        if sub is not None and started:
            sub.close(timeout_s=timeout_s)
        return True

    def _forget_identity(self, stream_id: StreamId) -> None:
        """Drop ``stream_id``'s identity (caller holds the lock)."""
        if stream_id in self._identities:
            self._identities = MappingProxyType(
                {k: v for k, v in self._identities.items() if k != stream_id})

    def add_approximate(self, stream_id: StreamId, *, block_size: int, hash_seed: int,
                        identity: Optional[str] = None, backend: str = "") -> StreamId:
        """Add an empty approximate index for one (instance, DP rank) without KV events (§14):
        answered at once (``synchronized``, ``approximate``, 0 hits until a request is routed
        there, :meth:`record_dispatch`), started or not. Bounded by the §8 discovery block's
        ``approximate_ttl_s`` and ``approximate_blocks``.

        :param stream_id: (instance_name, dp_rank).
        :param block_size: tokens per block of its keys (discovery's ``block_size``).
        :param hash_seed: the §4 seed of its keys.
        :param identity: its instance's incarnation (§9), kept for :meth:`identity`.
        :param backend: its instance's ``backend_type`` (metrics, the audit).
        :returns: ``stream_id``.
        :raises ConfigError: a stream or approximate index with that id exists.
        """
        approx = ApproximateIndex(stream_id, self._approximate_limits.new(), block_size,
                                  hash_seed, backend)
        with self._lock:
            view = self._view
            if stream_id in view.configs or stream_id in view.approximate:
                raise ConfigError("streams", f"stream {stream_id} already exists")
            approximate = dict(view.approximate)
            approximate[stream_id] = approx
            self._view = self._new_view(dict(view.configs), dict(view.subscribers), approximate)
            if identity is not None:
                self._identities = MappingProxyType({**self._identities, stream_id: identity})
        log.info("approximate index %s added (block_size=%d, ttl %g s, at most %d blocks, "
                 "backend %s)", stream_id, block_size, self._approximate_limits.ttl_s,
                 self._approximate_limits.max_blocks, backend or "-")
        return stream_id

    # -- request path ---------------------------------------------------------------------------

    def stream_ids(self) -> list[StreamId]:
        """Current stream and approximate index ids in answer order (instance_name, dp_rank)."""
        return list(self._current().answer_ids)

    def approximate_ids(self) -> list[StreamId]:
        """The approximate indexes' ids (§14), sorted."""
        return sorted(self._current().approximate)

    def stream_config(self, stream_id: StreamId) -> Optional[StreamConfig]:
        """The configuration ``stream_id`` runs with (static, or as discovery handed it over,
        §9), ``None`` for an unknown stream or an approximate index."""
        return self._current().configs.get(stream_id)

    def replay_modes(self) -> dict[StreamId, ReplayMode]:
        """Each current stream's configured replay mode (§8 ``replay_mode``: ``snapshot`` §7
        or ``history`` §7h), in answer order; what ``/ready`` shows beside its state."""
        view = self._current()
        return {sid: view.configs[sid].replay_mode for sid in view.ordered}

    def query(self, token_ids: Sequence[int]) -> list[StreamMatch]:
        """Each stream's reusable prefix of ``token_ids`` (§10), ordered by (instance_name,
        dp_rank): :meth:`query_prompt`'s matches."""
        return self.query_prompt(token_ids)[0]

    def query_prompt(self, token_ids: Sequence[int]) -> tuple[list[StreamMatch], PromptKeys]:
        """Each stream's and approximate index's reusable prefix of ``token_ids`` (§10, §14),
        ordered by (instance_name, dp_rank), plus the prompt's content keys (for
        :meth:`record_dispatch`).

        Tokens are packed once and content keys (§4) computed once per distinct (block_size,
        hash_seed), reusing the packed bytes; only full blocks count. An unsynchronized stream
        answers 0 hits with its error (§6). A synchronized stream with pending blocks (§16)
        answers those right after its reusable prefix in ``pending_hit_tokens``. An empty list
        gives every stream's status with zero hits.

        :param token_ids: token ids, ints in ``[0, 2**31 - 1]``.
        :raises ValueError: a token id is not such an int.
        """
        view = self._current()
        packed = pack_tokens(token_ids)
        geometries = view.geometries
        if len(geometries) == 1:  # the usual deployment: one model, one seed
            keys = chain_keys(packed, *geometries[0])
            out = [match(keys) for match in view.matchers]
            by_geometry: list[list[int]] = [keys]
        else:
            by_geometry = [chain_keys(packed, bs, seed) for bs, seed in geometries]
            out = [match(by_geometry[g]) for match, g in zip(view.matchers, view.geometry_of)]
        if view.pending_slots:
            self._add_pending(view, out, by_geometry)
        return out, PromptKeys(dict(zip(geometries, by_geometry)))

    def _add_pending(self, view: _View, out: list[StreamMatch],
                     by_geometry: list[list[int]]) -> None:
        """§16: each synchronized stream's pending blocks right after its reusable prefix, in
        ``pending_hit_tokens`` (a new answer: zero-hit answers are shared)."""
        now = self._clock.now()
        geometry_of = view.geometry_of
        for i, overlay, block_size in view.pending_slots:
            if not len(overlay):
                continue
            m = out[i]
            if not m.synchronized:
                continue
            start = (m.device_hit_tokens + m.host_only_hit_tokens) // block_size
            blocks = overlay.match(by_geometry[geometry_of[i]], now, start)
            if blocks:
                out[i] = dataclasses.replace(m, pending_hit_tokens=blocks * block_size)

    def record_dispatch(self, instance_name: str, ranks: Sequence[tuple[int, int]],
                        prompt: PromptKeys, now: Optional[float] = None) -> int:
        """A request was sent to ``instance_name``: record its prompt's full blocks (§14, §16).

        Per rank of ``ranks``: an approximate index adds (or renews) every block as resident;
        a stream with a pending overlay adds the blocks from its reusable prefix on as pending
        (those before it are exact hits already). Other ranks and unknown ids are ignored.

        :param instance_name: the P the request went to.
        :param ranks: (dp_rank, reusable prefix tokens the policy saw on it) pairs.
        :param prompt: the prompt's keys from :meth:`query_prompt`.
        :param now: monotonic seconds (default: the directory's clock).
        :returns: blocks newly added, over all ranks.
        """
        view = self._current()
        now = self._clock.now() if now is None else now
        added = 0
        for rank, prefix_tokens in ranks:
            sid = StreamId(instance_name, rank)
            approx = view.approximate.get(sid)
            if approx is not None:
                keys = prompt.keys((approx.block_size, approx.hash_seed))
                if keys:
                    added += approx.overlay.touch(keys, now)
                continue
            sub = view.subscribers.get(sid)
            if sub is None or sub.pending is None:
                continue
            cfg = view.configs[sid]
            keys = prompt.keys((cfg.block_size, cfg.hash_seed))
            if keys:
                added += sub.pending.touch(keys, now, prefix_tokens // cfg.block_size)
        return added

    def overlay_stats(self) -> dict[StreamId, tuple[str, OverlayStats]]:
        """Every overlay's counters: stream id -> (kind, stats), kind ``"approximate"`` (§14)
        or ``"pending"`` (§16), in answer order."""
        view = self._current()
        out: dict[StreamId, tuple[str, OverlayStats]] = {}
        for sid in view.answer_ids:
            approx = view.approximate.get(sid)
            if approx is not None:
                out[sid] = ("approximate", approx.overlay.stats())
                continue
            sub = view.subscribers.get(sid)
            if sub is not None and sub.pending is not None:
                out[sid] = ("pending", sub.pending.stats())
        return out

    def sweep_overlays(self, now: Optional[float] = None) -> int:
        """Drop the expired entries of every overlay (§14, §16): a dispatch sweeps its own
        overlay, this sweeps the idle ones (discovery calls it every refresh), so their memory
        and ``kvsvc_overlay_blocks`` follow the TTL.

        :param now: monotonic seconds (default: the directory's clock).
        :returns: blocks dropped.
        """
        view = self._current()
        now = self._clock.now() if now is None else now
        dropped = sum(a.overlay.sweep(now) for a in view.approximate.values())
        return dropped + sum(overlay.sweep(now) for _, overlay, _ in view.pending_slots)

    def approximate_backend(self, stream_id: StreamId) -> Optional[str]:
        """The backend of the approximate index ``stream_id``; ``None`` when it is none."""
        approx = self._current().approximate.get(stream_id)
        return approx.backend if approx is not None else None

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
