"""Stream discovery (§9): the registry's instances, turned into the directory's streams by rule.

Two layers:

- :func:`plan_streams` is a pure function from a registry snapshot and the §8 ``discovery``
  block to a :class:`Plan`: which (instance, DP rank) streams should exist, with which endpoints
  and which instance identity, and which instances are excluded and why. It never logs, never
  does I/O, and is unit-tested without etcd.
- :class:`Discovery` owns one thread (``kvsvc-discovery``, a
  :class:`~kvsvc.lifecycle.BackgroundThread`) that every ``refresh_interval_ms`` reads
  ``registry.snapshot()`` (the in-process snapshot; it never talks to etcd itself and never
  runs on a request thread), plans, and applies the difference to the
  :class:`~kvsvc.directory.Directory`: a stream whose configuration and identity are unchanged is
  kept (its index too); a new incarnation, address or DP size replaces the instance's streams
  (the new ones answer 0 hits until their first snapshot, §6); a stream no longer planned is
  removed. One log line per change, naming the stream.

Rules of the plan (§9):

- Only instances whose ``backend_type`` (``"xllm"`` when the registration has none; compared
  without regard to case) is in ``discovery.backends`` (§8, default ``["xllm"]``); each stream
  gets its backend's ``discovery.replay_modes`` entry as its ``replay_mode`` (§7 snapshot or
  §7h history). Types DEFAULT and PREFILL always, MIX only while its current role is prefill,
  never DECODE. An instance that would be subscribed but for its backend is listed in
  :attr:`Plan.other_backends`; :class:`Discovery` logs it once (which backend, and how to
  enable it) and ``/ready`` shows it.
- ``SUSPECT`` instances (and removed ones, absent from the snapshot) have no streams;
  ``LEASE_LOST`` instances keep theirs.
- Instance ``host:port`` with ``dp_size`` n (0 means 1): rank r gets
  ``tcp://host:(port + event_port_offset + r)`` and ``tcp://host:(port + replay_port_offset + r)``.
- A port above 65535 excludes that instance. An endpoint used twice (event or replay, across
  every stream of every eligible instance, the instance's own included) excludes every instance
  involved; events are never mixed between instances (D26 in docs/decisions.md).
- ``max_streams``: instances in name order; an instance whose ranks do not all fit is skipped
  whole (later, smaller ones may still fit), exactly like static streams (§8).
- Identity: the registration's ``incarnation_id``, else its ``register_ts_ms``
  (:func:`~kvsvc.cluster.model.instance_identity`); the router compares it with a stream's
  to apply §11.
- Approximate indexes (§14): an instance whose backend is in ``discovery.approximate_backends``
  gets one approximate index per DP rank instead of streams (no endpoints, so no port or
  collision rule), under the same eligibility, SUSPECT and ``max_streams`` rules (an
  approximate index counts as a stream there: it costs as much memory). It follows the
  instance's lifecycle like a stream: a new incarnation or DP size replaces it (empty again),
  SUSPECT or removal drops it. Each kvsvc replica fills its own from its own routing only.

Errors: :class:`~kvsvc.errors.LifecycleError` from ``start()`` (already started, not running
in time) and ``close()`` (the thread, e.g. waiting on a stream's start or stop, did not stop in
time). A stream that cannot be added (its thread did not start) is logged and retried on the
next refresh; one whose thread does not stop is removed from the view regardless (logged).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, Optional, Protocol

from kvsvc.address import MAX_PORT, check_tcp_endpoint, parse_host_port, tcp_endpoint
from kvsvc.cluster.model import (
    Instance,
    InstanceState,
    InstanceType,
    RegistrySnapshot,
    instance_identity,
)
from kvsvc.config import Backend, DiscoveryConfig, KvEventsConfig, StreamConfig
from kvsvc.directory import Directory
from kvsvc.errors import ConfigError, LifecycleError
from kvsvc.lifecycle import BackgroundThread
from kvsvc.streams.state import StreamId

log = logging.getLogger(__name__)

#: ``backend_type`` values kvsvc can index (§9), lower case, as the registration carries them.
_BACKENDS = {b.value: b for b in Backend}

_JOIN_TIMEOUT_S = 10.0


class SnapshotSource(Protocol):
    """What discovery reads: the registry's in-process snapshot (§9), never etcd."""

    def snapshot(self) -> RegistrySnapshot:
        """The current immutable registry snapshot (cheap; called every refresh)."""
        ...


@dataclass(frozen=True, slots=True)
class PlannedStream:
    """One stream the plan wants.

    :param config: its configuration (endpoints from the port rule, discovery's block size,
        topic and hash seed).
    :param identity: its instance's :func:`instance_identity`.
    :param dp_size: its instance's DP size (a change replaces every rank's stream).
    :param backend: its instance's backend type; the config's ``replay_mode`` is that
        backend's (§8 ``discovery.replay_modes``).
    """

    config: StreamConfig
    identity: str
    dp_size: int
    backend: Backend = Backend.XLLM

    @property
    def stream_id(self) -> StreamId:
        """(instance_name, dp_rank)."""
        return StreamId(self.config.instance_name, self.config.dp_rank)


@dataclass(frozen=True, slots=True)
class PlannedApproximate:
    """One approximate index the plan wants (§14).

    :param stream_id: its (instance, DP rank).
    :param identity: its instance's :func:`instance_identity`.
    :param dp_size: its instance's DP size.
    :param backend: its instance's backend type.
    """

    stream_id: StreamId
    identity: str
    dp_size: int
    backend: Backend


@dataclass(frozen=True, slots=True)
class Plan:
    """The outcome of :func:`plan_streams`.

    :param streams: stream id -> planned stream, read-only.
    :param excluded: instance name -> why an otherwise eligible instance has no streams
        (port overflow, endpoint collision naming the other instance, bad name,
        ``max_streams``), read-only. Instances that are simply not subscribed (DECODE, other
        backends, MIX acting as decode, SUSPECT) are not listed.
    :param other_backends: instance name -> its ``backend_type`` as registered, for the
        instances that act as prefill and are not SUSPECT but whose backend is not in
        ``discovery.backends`` nor ``discovery.approximate_backends`` (or not one kvsvc can
        index), read-only, sorted by name.
    :param approximate: stream id -> planned approximate index (§14), read-only.
    """

    streams: Mapping[StreamId, PlannedStream]
    excluded: Mapping[str, str]
    other_backends: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    approximate: Mapping[StreamId, PlannedApproximate] = field(
        default_factory=lambda: MappingProxyType({}))

    def instance_names(self) -> list[str]:
        """Names of the instances with streams, sorted."""
        return sorted({sid.instance_name for sid in self.streams})


def _acts_as_prefill(instance: Instance) -> bool:
    """§9/§11: DEFAULT and PREFILL always; MIX only while its current role is prefill."""
    if instance.type in (InstanceType.DEFAULT, InstanceType.PREFILL):
        return True
    if instance.type == InstanceType.MIX:
        return instance.role == InstanceType.PREFILL
    return False


def backend_named(backend_type: str) -> Optional[Backend]:
    """The :class:`~kvsvc.config.Backend` a registered ``backend_type`` names (§9; the
    registry fills in ``"xllm"`` when the registration has none), compared without regard to
    case and surrounding blanks (``"VLLM"`` is vLLM); ``None`` for a backend kvsvc cannot
    index (``"trtllm"``, ...)."""
    return _BACKENDS.get(backend_type.strip().lower())


def plan_streams(snapshot: RegistrySnapshot, discovery: DiscoveryConfig,
                 limits: KvEventsConfig) -> Plan:
    """The streams the registry snapshot calls for (§9 rules, see the module docstring).

    Pure: no logging, no I/O; the same input gives the same plan.

    :param snapshot: the registry's snapshot (``instances``: name -> Instance).
    :param discovery: the §8 ``discovery`` block (offsets, block size, topic, hash seed).
    :param limits: the §8 document; only ``max_streams`` is used.
    :returns: the planned streams and the excluded instances with reasons.
    """
    excluded: dict[str, str] = {}
    # name -> list of (StreamConfig) for eligible instances, before collisions and the cut.
    candidates: dict[str, list[StreamConfig]] = {}
    identities: dict[str, tuple[str, int]] = {}
    backends: dict[str, Backend] = {}
    other_backends: dict[str, str] = {}
    # name -> its planned approximate indexes (§14), before the max_streams cut.
    approximate: dict[str, list[PlannedApproximate]] = {}
    listed = frozenset(discovery.backends)
    listed_approximate = frozenset(discovery.approximate_backends)
    for name in sorted(snapshot.instances):
        inst = snapshot.instances[name]
        if inst.state == InstanceState.SUSPECT or not _acts_as_prefill(inst):
            continue
        backend = backend_named(inst.backend_type)
        if backend is None or (backend not in listed and backend not in listed_approximate):
            other_backends[name] = inst.backend_type
            continue
        try:
            addr = parse_host_port(inst.name)
        except ValueError:
            addr = None
        if addr is None or inst.name != name:
            excluded[name] = f"instance name {inst.name!r} is not host:port"
            continue
        host, port = addr.host, addr.port
        dp_size = inst.dp_size if inst.dp_size and inst.dp_size > 0 else 1
        if backend in listed_approximate:
            identity = instance_identity(inst)
            approximate[name] = [PlannedApproximate(StreamId(name, r), identity, dp_size,
                                                    backend) for r in range(dp_size)]
            continue
        top = port + max(discovery.event_port_offset, discovery.replay_port_offset) + dp_size - 1
        if top > MAX_PORT:
            excluded[name] = (f"port overflow: rank {dp_size - 1} would use port {top} "
                              f"> {MAX_PORT}")
            continue
        endpoints = [(tcp_endpoint(host, port + discovery.event_port_offset + r),
                      tcp_endpoint(host, port + discovery.replay_port_offset + r))
                     for r in range(dp_size)]
        try:
            # The §8 endpoint rule, checked here so that building the configs cannot fail.
            check_tcp_endpoint(endpoints[0][0])
        except ValueError as exc:
            # The wording the log and /ready's discovery.excluded have always shown (it was
            # pydantic's when the config model checked the endpoint).
            excluded[name] = f"no connectable endpoint for host {host!r}: Value error, {exc}"
            continue
        mode = discovery.replay_mode(backend)
        configs = [StreamConfig(
            instance_name=name, dp_rank=r, block_size=discovery.block_size, endpoint=ep,
            replay_endpoint=replay_ep, topic=discovery.topic, hash_seed=discovery.hash_seed,
            replay_mode=mode)
            for r, (ep, replay_ep) in enumerate(endpoints)]
        candidates[name] = configs
        identities[name] = (instance_identity(inst), dp_size)
        backends[name] = backend

    # Endpoint collisions, across every eligible instance's event and replay endpoints.
    owners: dict[str, str] = {}
    collided: dict[str, str] = {}
    for name, configs in candidates.items():
        for cfg in configs:
            for ep in (cfg.endpoint, cfg.replay_endpoint):
                other = owners.get(ep)
                if other is None:
                    owners[ep] = name
                    continue
                if other == name:
                    collided.setdefault(name, f"endpoint collision: {ep} used twice by {name}")
                else:
                    collided.setdefault(name, f"endpoint collision: {ep} also used by {other}")
                    collided.setdefault(other, f"endpoint collision: {ep} also used by {name}")
    excluded.update(collided)

    streams: dict[StreamId, PlannedStream] = {}
    planned_approximate: dict[StreamId, PlannedApproximate] = {}
    for name in sorted({*candidates, *approximate}):
        if name in collided:
            continue
        size = len(candidates[name]) if name in candidates else len(approximate[name])
        if len(streams) + len(planned_approximate) + size > limits.max_streams:
            excluded[name] = (f"max_streams={limits.max_streams} reached: {size} "
                              f"streams skipped")
            continue
        if name in approximate:
            for pa in approximate[name]:
                planned_approximate[pa.stream_id] = pa
            continue
        identity, dp_size = identities[name]
        for cfg in candidates[name]:
            streams[StreamId(name, cfg.dp_rank)] = PlannedStream(cfg, identity, dp_size,
                                                                 backends[name])
    return Plan(MappingProxyType(streams), MappingProxyType(dict(sorted(excluded.items()))),
                MappingProxyType(other_backends), MappingProxyType(planned_approximate))


#: Labels of discovery's metrics (kvsvc.http.metrics): fixed sets.
CHANGE_KINDS = ("added", "replaced", "removed", "add_failed")
EXCLUSION_KINDS = ("bad_name", "port_overflow", "bad_host", "endpoint_collision", "max_streams")
_EXCLUSION_PREFIXES = (("instance name", "bad_name"), ("port overflow", "port_overflow"),
                       ("no connectable endpoint", "bad_host"),
                       ("endpoint collision", "endpoint_collision"),
                       ("max_streams", "max_streams"))


def exclusion_kind(reason: str) -> str:
    """The :data:`EXCLUSION_KINDS` label of a :func:`plan_streams` exclusion reason."""
    for prefix, kind in _EXCLUSION_PREFIXES:
        if reason.startswith(prefix):
            return kind
    raise ValueError(f"unknown exclusion reason {reason!r}")


@dataclass(frozen=True, slots=True)
class ApplyResult:
    """What one :meth:`Discovery.refresh` changed.

    :param added: streams added for a new instance or rank.
    :param replaced: streams replaced (new incarnation, address or DP size).
    :param removed: streams removed (instance gone, SUSPECT, no longer eligible or excluded).
    :param kept: streams left as they were (index kept).
    :param failed: streams that could not be added; retried on the next refresh.
    """

    added: tuple[StreamId, ...]
    replaced: tuple[StreamId, ...]
    removed: tuple[StreamId, ...]
    kept: int
    failed: tuple[StreamId, ...]

    @property
    def changed(self) -> bool:
        """True when any stream was added, replaced or removed."""
        return bool(self.added or self.replaced or self.removed)


class Discovery(BackgroundThread):
    """The discovery thread ``kvsvc-discovery`` (§9): registry snapshot -> plan -> directory,
    every ``refresh_interval_ms``.

    :param registry: a :class:`SnapshotSource` (the :class:`~kvsvc.cluster.registry.Registry`);
        only its in-process snapshot is read.
    :param directory: the directory whose streams discovery manages. Static streams must not
        be configured together with discovery (§8), so every stream in it is discovery's.
    :param discovery_cfg: the §8 ``discovery`` block.
    :param limits: the §8 document (``max_streams``).
    :param stream_timeout_s: bound of one stream's start or stop, seconds.
    """

    def __init__(self, registry: SnapshotSource, directory: Directory,
                 discovery_cfg: DiscoveryConfig, limits: KvEventsConfig,
                 stream_timeout_s: float = 5.0) -> None:
        super().__init__("kvsvc-discovery")
        self._registry = registry
        self._directory = directory
        self._cfg = discovery_cfg
        self._limits = limits
        self._stream_timeout_s = stream_timeout_s
        # Discovery thread only (and refresh() callers while the thread is not running).
        self._applied: dict[StreamId, PlannedStream] = {}
        self._applied_approximate: dict[StreamId, PlannedApproximate] = {}
        self._excluded: Mapping[str, str] = MappingProxyType({})
        # The last plan's instances skipped for their backend (name -> backend_type).
        self._other_backends: Mapping[str, str] = MappingProxyType({})
        # The streams of the first plan made from a fresh snapshot (readiness' warm-up set).
        self._first_plan: Optional[frozenset[StreamId]] = None
        self._refresh_lock = threading.Lock()
        self._refreshes = 0
        # Metrics counters (kvsvc.http.metrics), under _counter_lock (never held across a refresh,
        # which may wait for a stream's start): stream changes by kind and exclusions started
        # (an instance newly excluded, or for a new reason) by kind.
        self._counter_lock = threading.Lock()
        self._changes = dict.fromkeys(CHANGE_KINDS, 0)
        self._exclusions = dict.fromkeys(EXCLUSION_KINDS, 0)

    @property
    def refreshes(self) -> int:
        """Completed refreshes since construction (lets tests wait for one more)."""
        with self._refresh_lock:
            return self._refreshes

    def excluded(self) -> Mapping[str, str]:
        """The last plan's excluded instances: name -> reason (read-only)."""
        return self._excluded

    def other_backends(self) -> Mapping[str, str]:
        """The last plan's instances without streams because of their backend (§9): name ->
        ``backend_type`` as registered (read-only; :attr:`Plan.other_backends`)."""
        return self._other_backends

    def first_plan(self) -> Optional[frozenset[StreamId]]:
        """The streams of the first plan made from a ``fresh`` registry snapshot (one taken
        after a successful etcd list), ``None`` before one: the streams ``/ready`` waits for
        to synchronize once (§10)."""
        return self._first_plan

    def counters(self) -> tuple[dict[str, int], dict[str, int]]:
        """Copies of (stream changes by :data:`CHANGE_KINDS`, exclusions started by
        :data:`EXCLUSION_KINDS`) since construction (a short lock, never a refresh's)."""
        with self._counter_lock:
            return dict(self._changes), dict(self._exclusions)

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self, timeout_s: float = 5.0) -> None:
        """Start the thread; it refreshes at once, then every ``refresh_interval_ms``.

        :param timeout_s: bound of the wait for the thread to run, seconds.
        :raises LifecycleError: already started, or the thread did not run in time.
        """
        super().start(timeout_s)
        log.info("discovery started (refresh every %d ms, event_port_offset %d, "
                 "replay_port_offset %d, backends %s)", self._cfg.refresh_interval_ms,
                 self._cfg.event_port_offset, self._cfg.replay_port_offset,
                 describe_backends(self._cfg))

    def close(self, timeout_s: float = _JOIN_TIMEOUT_S) -> None:
        """Stop the thread and join it. The streams stay in the directory (the directory's own
        close stops them). Idempotent; a no-op before :meth:`start`.

        :param timeout_s: join bound, seconds.
        :raises LifecycleError: the thread did not stop within ``timeout_s`` (a refresh may be
            waiting on a stream's start or stop, or on the snapshot source).
        """
        was_started = self.started
        super().close(timeout_s)
        if was_started:
            log.info("discovery stopped")

    def _loop(self) -> None:
        interval_s = self._cfg.refresh_interval_ms / 1000.0
        while not self.stopping:
            try:
                self.refresh()
            except Exception:  # keep discovering: the next refresh starts from scratch
                log.exception("discovery refresh failed; retrying in %d ms",
                              self._cfg.refresh_interval_ms)
            self._sleep(interval_s)

    # -- one refresh ---------------------------------------------------------------------------

    def refresh(self) -> ApplyResult:
        """Plan from the registry's current snapshot and apply the difference to the directory
        (runs on the discovery thread; callable directly while the thread is not running).

        :returns: what changed.
        """
        with self._refresh_lock:
            snapshot = self._registry.snapshot()
            plan = plan_streams(snapshot, self._cfg, self._limits)
            result = self._apply(plan)
            if self._first_plan is None and snapshot.fresh:
                self._first_plan = frozenset(plan.streams)
            self._log_exclusions(plan.excluded)
            self._log_other_backends(plan.other_backends)
            # Idle overlays expire here too (§14, §16): a dispatch only sweeps its own.
            self._directory.sweep_overlays()
            self._refreshes += 1
            with self._counter_lock:
                for kind, sids in (("added", result.added), ("replaced", result.replaced),
                                   ("removed", result.removed), ("add_failed", result.failed)):
                    self._changes[kind] += len(sids)
            return result

    def _apply(self, plan: Plan) -> ApplyResult:
        applied = self._applied
        replaced = [sid for sid, ps in plan.streams.items()
                    if sid in applied and applied[sid] != ps]
        removed = [sid for sid in applied if sid not in plan.streams]
        kept = sum(1 for sid, ps in plan.streams.items() if applied.get(sid) == ps)
        # Removals first, so that a max_streams cut never runs over while replacing.
        for sid in sorted(removed):
            old = applied.pop(sid)
            self._remove(sid)
            log.info("discovery: stream %s removed (instance %s gone, suspect or no longer "
                     "eligible; identity %s)", sid, sid.instance_name, old.identity)
        for sid in sorted(replaced):
            old = applied.pop(sid)
            new = plan.streams[sid]
            self._remove(sid)
            log.info("discovery: stream %s replaced: identity %s -> %s, dp_size %d -> %d, "
                     "endpoints %s|%s -> %s|%s (no hits until its first snapshot)", sid,
                     old.identity, new.identity, old.dp_size, new.dp_size, old.config.endpoint,
                     old.config.replay_endpoint, new.config.endpoint, new.config.replay_endpoint)
        added: list[StreamId] = []
        failed: list[StreamId] = []
        for sid in sorted(plan.streams):
            if sid in applied:
                continue
            ps = plan.streams[sid]
            try:
                self._directory.add_stream(ps.config, timeout_s=self._stream_timeout_s,
                                           identity=ps.identity)
            except (LifecycleError, ConfigError) as exc:
                log.error("discovery: stream %s could not be added (%s); retrying next refresh",
                          sid, exc)
                failed.append(sid)
                continue
            applied[sid] = ps
            if sid not in replaced:
                added.append(sid)
                log.info("discovery: stream %s added (identity %s, dp_size %d, backend %s, "
                         "replay_mode %s, endpoints %s|%s)", sid, ps.identity, ps.dp_size,
                         ps.backend.value, ps.config.replay_mode.value, ps.config.endpoint,
                         ps.config.replay_endpoint)
        a_added, a_replaced, a_removed, a_kept = self._apply_approximate(plan)
        return ApplyResult(tuple(sorted((*added, *a_added))),
                           tuple(sorted((*(s for s in replaced if s in applied), *a_replaced))),
                           tuple(sorted((*removed, *a_removed))), kept + a_kept, tuple(failed))

    def _apply_approximate(self, plan: Plan) -> tuple[list[StreamId], list[StreamId],
                                                      list[StreamId], int]:
        """The approximate indexes' part of :meth:`_apply` (§14): (added, replaced, removed,
        kept). A replaced one starts empty: a new incarnation has an empty cache."""
        applied = self._applied_approximate
        removed = sorted(sid for sid in applied if sid not in plan.approximate)
        replaced = sorted(sid for sid, pa in plan.approximate.items()
                          if sid in applied and applied[sid] != pa)
        kept = sum(1 for sid, pa in plan.approximate.items() if applied.get(sid) == pa)
        for sid in removed:
            old = applied.pop(sid)
            self._directory.remove_stream(sid)
            log.info("discovery: approximate index %s removed (instance %s gone, suspect or no "
                     "longer eligible; identity %s)", sid, sid.instance_name, old.identity)
        for sid in replaced:
            old = applied.pop(sid)
            self._directory.remove_stream(sid)
            log.info("discovery: approximate index %s replaced: identity %s -> %s, dp_size %d "
                     "-> %d (empty again)", sid, old.identity, plan.approximate[sid].identity,
                     old.dp_size, plan.approximate[sid].dp_size)
        added: list[StreamId] = []
        for sid in sorted(plan.approximate):
            if sid in applied:
                continue
            pa = plan.approximate[sid]
            try:
                self._directory.add_approximate(sid, block_size=self._cfg.block_size,
                                                hash_seed=self._cfg.hash_seed,
                                                identity=pa.identity, backend=pa.backend.value)
            except ConfigError as exc:   # its stream is still there: next refresh
                log.error("discovery: approximate index %s could not be added (%s); retrying "
                          "next refresh", sid, exc)
                continue
            applied[sid] = pa
            if sid not in replaced:
                added.append(sid)
                log.info("discovery: approximate index %s added (identity %s, dp_size %d, "
                         "backend %s, §14)", sid, pa.identity, pa.dp_size, pa.backend.value)
        return added, replaced, removed, kept

    def _remove(self, sid: StreamId) -> None:
        try:
            self._directory.remove_stream(sid, timeout_s=self._stream_timeout_s)
        except LifecycleError:
            # Removed from the view regardless; only its thread lingers (already logged there).
            log.error("discovery: stream %s thread did not stop within %.1f s", sid,
                      self._stream_timeout_s)

    def _log_exclusions(self, excluded: Mapping[str, str]) -> None:
        """One line per instance whose exclusion starts, changes reason, or ends."""
        before = self._excluded
        for name, reason in excluded.items():
            if before.get(name) != reason:
                with self._counter_lock:
                    self._exclusions[exclusion_kind(reason)] += 1
                log.warning("discovery: instance %s excluded: %s", name, reason)
        for name in before:
            if name not in excluded:
                log.info("discovery: instance %s no longer excluded", name)
        self._excluded = excluded

    def _log_other_backends(self, skipped: Mapping[str, str]) -> None:
        """One WARNING per instance newly skipped for its backend (or registered again with
        another one), saying how to enable it; one INFO when it is no longer skipped."""
        before = self._other_backends
        listed = ", ".join(b.value for b in self._cfg.backends)
        for name, backend_type in skipped.items():
            if before.get(name) == backend_type:
                continue
            known = backend_named(backend_type)
            if known is None:
                log.warning("discovery: instance %s not subscribed: kvsvc cannot index "
                            "backend_type %r (it indexes %s); routing counts it with 0 "
                            "cache hits", name, backend_type,
                            ", ".join(b.value for b in Backend))
            else:
                log.warning("discovery: instance %s not subscribed: backend_type %r is not "
                            "in discovery.backends [%s]; add \"%s\" to discovery.backends in "
                            "the kv_events_config_file to index it (replay mode %s, §9), "
                            "or to discovery.approximate_backends if it publishes no KV "
                            "events (§14); until then routing counts it with 0 cache hits", name,
                            backend_type, listed, known.value,
                            self._cfg.replay_mode(known).value)
        for name in before:
            if name not in skipped:
                log.info("discovery: instance %s no longer skipped for its backend", name)
        self._other_backends = skipped


def describe_backends(discovery: DiscoveryConfig) -> str:
    """``"xllm (snapshot), vllm (history)"``: the §8 ``discovery.backends`` with each one's
    replay mode, in the configured order (logs and ``kvsvc check-config``)."""
    text = ", ".join(f"{b.value} ({discovery.replay_mode(b).value})" for b in discovery.backends)
    if discovery.approximate_backends:
        approx = ", ".join(b.value for b in discovery.approximate_backends)
        text = f"{text or 'none'}; approximate index (§14): {approx}"
    return text
