"""The instance registry (InstanceMgr) over etcd (§9).

Keys (after the optional ``/<namespace>/`` prefix): ``XLLM:<TYPE>:<host:port>`` with a JSON value
held by the engine's lease; ``XLLM:LOADMETRICS:<host:port>`` written by the master service;
``XLLM:SERVICE:MASTER`` (see :mod:`kvsvc.cluster.election`).

Threads, each a :class:`~kvsvc.lifecycle.BackgroundThread` (the one start/close contract),
all three owned by :class:`Registry`, started by ``start()`` and stopped by ``close()``:

- **etcd thread** ``kvsvc-registry-etcd`` (owns its :class:`~kvsvc.cluster.etcd.EtcdClient`
  and watch): lists the ``XLLM:`` prefix, then watches it from the listed revision + 1 with
  etcd3gw's watch as an accelerator; re-lists every ``relist_interval_s`` (the watch neither
  reconnects nor resumes) and restarts the watch. On etcd errors it keeps the last view, marks
  the snapshot not ``fresh`` and retries with capped exponential backoff (0.1 s doubling up to
  ``relist_interval_s``). An unexpected error (a bug) is logged, marks the snapshot not fresh
  and is retried the same way, so the thread never ends on its own. Its client and the
  election's share one :class:`~kvsvc.cluster.etcd.EtcdReachability`: an outage is one
  WARNING when it starts, a summary at most once a minute, one INFO when it ends.
- **timer thread** ``kvsvc-registry-timer`` (owns its :class:`~kvsvc.cluster.probe.HealthProbe`):
  drives the §9 states. A deleted key (lease expired or deregistered) makes it
  probe ``http://<name>/health`` (short timeout, never on a request thread): success ->
  ``LEASE_LOST`` (still schedulable; ``SUSPECT`` after ``lease_lost_grace_s`` without a
  heartbeat), failure -> ``SUSPECT``; ``SUSPECT`` for ``suspect_removal_s`` -> removed. Only a PUT
  of the key brings an instance back to ``ACTIVE``. Until the probe answers, the instance stays
  ``ACTIVE`` (at most ``health_probe_timeout_s``). It ticks every
  ``min(0.1, max(0.01, min(lease_lost_grace_s, suspect_removal_s) / 10))`` s and is woken at
  once when a key is deleted.
- the election thread ``kvsvc-election`` of :class:`kvsvc.cluster.election.MasterElection`
  (master key, and the ``LOADMETRICS`` writes while master).

Loads (§9, §11, §15): an instance's load is the last accepted heartbeat, the last
``/metrics`` scrape (:meth:`Registry.scraped_load`, fed by
:class:`~kvsvc.cluster.load_scrape.LoadScraper`) or, on a replica that is not master, the last
new ``XLLM:LOADMETRICS`` revision, dated when this process received it
(``LoadMetrics.received_at``); the routing policies take it only while it is current
(``max_load_age_s``). A refused heartbeat changes nothing, so a load the instance keeps
contradicting ages out. When this replica becomes master it drops every load it read from etcd
and uses only the heartbeats it accepts. A ``gpu_cache_usage_perc`` above 1 is used as 1.0,
counted per instance (:meth:`Registry.load_clamped_counts`) and logged once per instance.

Request threads only call :meth:`Registry.snapshot` (a lock-free read of an immutable reference)
and :meth:`Registry.heartbeat` (a short critical section, no I/O).

MIX role rule (xllm-service's ``add_instance_to_index``, made deterministic): a MIX instance gets
its role when it joins (first seen, or a new incarnation): ``PREFILL`` when at least one other
schedulable (not ``SUSPECT``) instance currently acts as decode (type DECODE, or MIX in role
DECODE), else ``DECODE``. Instances joining in one batch are processed in name order. The role
is kept across refreshes and heartbeats. After every membership change (join, SUSPECT, removal)
the registry restores xllm-service's invariants when only MIX instances can do it: if no
schedulable instance acts as decode and a MIX acts as prefill while another schedulable instance
also acts as prefill, the MIX prefill with the greatest name flips to ``DECODE``; if no
schedulable instance acts as prefill and more than one acts as decode of which one is a MIX,
the MIX decode with the smallest name flips to ``PREFILL``. Every flip is logged.

Errors: :class:`~kvsvc.errors.LifecycleError` from ``start()`` and ``close()`` (see there);
heartbeats raise the :class:`~kvsvc.errors.HeartbeatRejected` family; malformed values in etcd
(:class:`~kvsvc.errors.MalformedRegistration`) are logged once per key revision and skipped.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Optional

from kvsvc.clock import MONOTONIC, Clock
from kvsvc.cluster.election import MasterElection
from kvsvc.cluster.etcd import (
    PUT,
    EtcdClient,
    EtcdReachability,
    KeyValue,
    ListResult,
    WatchEvent,
    WatchHandle,
    drain,
)
from kvsvc.cluster.model import (
    CheckedLoad,
    Instance,
    InstanceState,
    InstanceType,
    LoadMetrics,
    RankLoad,
    Registration,
    RegistrySettings,
    RegistrySnapshot,
    check_load,
    instance_identity,
    parse_load,
    parse_registration,
)
from kvsvc.cluster.probe import HealthProbe
from kvsvc.errors import (
    EtcdError,
    EtcdUnavailable,
    InvalidHeartbeat,
    LifecycleError,
    MalformedRegistration,
    StaleIncarnation,
    UnknownInstance,
    WaitTimeout,
)
from kvsvc.lifecycle import BackgroundThread

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Record:
    """Mutable per-instance state; touched only under ``Registry._lock``."""

    name: str
    reg: Registration
    key_revision: int
    state: InstanceState
    since: float                      # monotonic s when ``state`` was entered
    role: InstanceType
    load: Optional[LoadMetrics] = None
    load_from_etcd: bool = False      # ``load`` is an XLLM:LOADMETRICS value, not a heartbeat
    last_heartbeat: Optional[float] = None
    probe_needed: bool = False        # key deleted while ACTIVE: the timer thread probes


#: First retry delay after a failed etcd list, seconds (doubled up to ``relist_interval_s``).
_BACKOFF_MIN_S = 0.1
#: Longest wait of the etcd thread between two looks at its watch queue, and longest tick of
#: the timer thread, seconds.
_POLL_S = 0.1


_TYPES_BY_NAME = {t.name: t for t in InstanceType}

#: Where a load report came from (the ``source`` of :meth:`Registry.load_clamped_counts`).
SOURCE_HEARTBEAT = "heartbeat"
SOURCE_ETCD = "etcd"
SOURCE_SCRAPE = "scrape"


class Registry:
    """The in-process instance registry (§9). See the module docstring for threads and rules.

    :param settings: timings and identity; nothing is opened in the constructor.
    :param clock: the time of the §9 state timers and of the load reports' ``received_at``
        (:mod:`kvsvc.clock`; a virtual clock in tests). Waits of callers (:meth:`start`,
        :meth:`wait_for`) and the re-list period stay on real time: they pace I/O.
    """

    def __init__(self, settings: RegistrySettings, clock: Clock = MONOTONIC) -> None:
        self._settings = settings
        self.clock = clock
        self._prefix = settings.key_prefix + "XLLM:"
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        # One tracker for both etcd clients: one outage, one set of log lines.
        self._reachability = EtcdReachability(settings.etcd_addr)
        self._etcd_thread = _EtcdThread(self, settings, self._prefix, self._reachability)
        self._timer_thread = _TimerThread(self, settings)
        self._election = MasterElection(settings, self.snapshot, self._on_master_change,
                                        self._reachability)
        self._started = False
        # Under _lock:
        self._view: dict[str, KeyValue] = {}          # instance keys as etcd holds them
        self._records: dict[str, _Record] = {}
        self._etcd_loads: dict[str, tuple[int, Optional[LoadMetrics]]] = {}  # name -> (rev, load)
        # key -> (revision, Registration or the MalformedRegistration it raised)
        self._parsed: dict[str, tuple[int, object]] = {}
        self._conflicts_logged: dict[str, tuple] = {}    # name -> keys+revisions logged
        self._clamped: dict[tuple[str, str], int] = {}   # (name, source) -> clamped reports
        self._fresh = False
        self._last_list_ok = 0.0
        self._generation = 0
        self._snap = RegistrySnapshot(MappingProxyType({}), False, False, 0)

    # -- lifecycle ------------------------------------------------------------------------

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the etcd, timer and election threads, in that order; returns once all three
        run and the first etcd list was attempted (etcd being down is not fatal: the snapshot
        is then not ``fresh``). On a failure the threads already started are closed again.

        :param timeout_s: bound of the whole start, seconds.
        :raises LifecycleError: already started, or a thread (or the first list attempt) not
            there within ``timeout_s``; the message names the thread.
        """
        if self._started:
            raise LifecycleError("registry: already started")
        self._started = True
        deadline = time.monotonic() + timeout_s

        def remaining() -> float:
            return max(0.0, deadline - time.monotonic())

        try:
            self._etcd_thread.start(remaining())
            self._timer_thread.start(remaining())
            if not self._etcd_thread.first_list_attempted.wait(remaining()):
                raise LifecycleError(f"{self._etcd_thread.thread_name}: first etcd list not "
                                     f"attempted within {timeout_s:g} s")
            self._election.start(max(0.1, remaining()))
        except LifecycleError:
            try:
                self.close(timeout_s)
            except LifecycleError:
                pass  # logged by the thread's close; the start failure is the one to report
            raise
        log.info("registry started on etcd %s prefix %r", self._settings.etcd_addr, self._prefix)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the election thread (it resigns mastership, revoking the master lease), then
        the etcd thread and the timer thread, each joined within ``timeout_s``; each closes
        what it owns (etcd clients, the watch, the probe's session). All three are closed even
        when one does not stop. Idempotent; a no-op before :meth:`start`.

        :param timeout_s: join bound of each thread, seconds.
        :raises LifecycleError: the first thread that did not stop within ``timeout_s``
            (after the others were closed); a later close tries it again.
        """
        failure: Optional[LifecycleError] = None
        for part in (self._election, self._etcd_thread, self._timer_thread):
            try:
                part.close(timeout_s)
            except LifecycleError as exc:
                failure = failure or exc
        if failure is not None:
            raise failure
        self._started = False

    # -- reads ----------------------------------------------------------------------------

    def snapshot(self) -> RegistrySnapshot:
        """The current immutable snapshot (lock-free; safe on request threads)."""
        return self._snap

    def registration(self, name: str) -> Optional[Registration]:
        """The parsed registration value of instance ``name`` (§9; its PD fields for
        ``GetInstanceInfo`` and P/D links, §13), ``None`` when the registry holds no such
        instance."""
        with self._lock:
            rec = self._records.get(name)
            return rec.reg if rec is not None else None

    @property
    def master_address(self) -> Optional[str]:
        """``host:port`` of the master service as last read from etcd, or None."""
        return self._election.master_address

    def last_listed_at(self) -> Optional[float]:
        """Monotonic time (s) of the last successful etcd list, ``None`` before the first
        (readiness: nothing to route on until one; its age says how stale a not ``fresh``
        snapshot is). Lock-free: one float read."""
        listed = self._last_list_ok
        return listed if listed > 0.0 else None

    def wait_for(self, predicate: Callable[[RegistrySnapshot], bool],
                 timeout_s: float) -> RegistrySnapshot:
        """Block until ``predicate(snapshot)`` is true (checked on every change), return that
        snapshot.

        :raises WaitTimeout: after ``timeout_s`` seconds.
        """
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                snap = self._snap
                if predicate(snap):
                    return snap
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise WaitTimeout(f"registry condition not met within {timeout_s}s; "
                                      f"last snapshot generation {snap.generation}")
                self._changed.wait(remaining)

    # -- heartbeats (request threads) -----------------------------------------------------

    def heartbeat(self, name: str, incarnation_id: Optional[str], waiting_requests_num: int,
                  gpu_cache_usage_perc: float) -> None:
        """Record a heartbeat's load (§9); visible in the next :meth:`snapshot` at once.

        A heartbeat keeps a ``LEASE_LOST`` instance from becoming ``SUSPECT`` for another
        ``lease_lost_grace_s``; it never changes the state itself (only a PUT does).

        :param name: instance ``host:port``.
        :param incarnation_id: the sender's incarnation; None/empty is accepted (cannot be judged).
        :param waiting_requests_num: an int (not a bool) from 0 to
            :data:`~kvsvc.cluster.model.MAX_WAITING_REQUESTS` (2**31 - 1).
        :param gpu_cache_usage_perc: an int or float (not a bool), finite and >= 0; above 1 it
            is recorded as 1.0, counted (:meth:`load_clamped_counts`) and logged once per
            instance.
        :raises InvalidHeartbeat: a load value of the wrong type or out of range, checked
            by :func:`~kvsvc.cluster.model.check_load`; the message names the field
            (``load_metrics.waiting_requests_num: must be an integer in [0, 2147483647]``,
            ``load_metrics.gpu_cache_usage_perc: must be a finite number >= 0 (above 1
            counts as 1)``). A refused heartbeat changes nothing: the last load keeps its
            ``received_at`` and stops being current after ``max_load_age_s`` (§11).
        :raises UnknownInstance: no such instance in the registry.
        :raises StaleIncarnation: the registered instance has a different incarnation.
        """
        try:
            checked = check_load(waiting_requests_num, gpu_cache_usage_perc,
                                 field_prefix="load_metrics.")
        except MalformedRegistration as exc:
            # Refused before the lock: the last load keeps its received_at and ages out.
            raise InvalidHeartbeat(str(exc)) from None
        now = self.clock.now()
        with self._lock:
            rec = self._records.get(name)
            if rec is None:
                raise UnknownInstance(name)
            registered = rec.reg.incarnation_id
            if incarnation_id and registered and incarnation_id != registered:
                raise StaleIncarnation(name, incarnation_id, registered)
            self._count_clamped(name, SOURCE_HEARTBEAT, checked)
            rec.load = LoadMetrics(checked.waiting_requests_num, checked.gpu_cache_usage_perc,
                                   now, (), SOURCE_HEARTBEAT)
            rec.load_from_etcd = False
            rec.last_heartbeat = now
            self._publish()

    def scraped_load(self, name: str, identity: Optional[str], waiting_requests_num: int,
                     gpu_cache_usage_perc: float, ranks: tuple[RankLoad, ...] = ()) -> bool:
        """Record the load a ``/metrics`` scrape read (§15): a load report like a heartbeat's
        (dated now, current for ``max_load_age_s``, and, like a heartbeat, keeping a
        ``LEASE_LOST`` instance from becoming ``SUSPECT``: the engine answered).

        :param name: instance ``host:port``.
        :param identity: :func:`~kvsvc.cluster.model.instance_identity` of the instance as
            the scraper saw it; a record of another identity (replaced meanwhile) is left
            alone: the scrape may have reached the old process.
        :param waiting_requests_num: queued requests, checked as a heartbeat's.
        :param gpu_cache_usage_perc: KV usage, checked (and clamped above 1) as a heartbeat's.
        :param ranks: per-rank values (:class:`~kvsvc.cluster.model.RankLoad`), rank order.
        :returns: True when recorded; False for an unknown or replaced instance or values
            :func:`~kvsvc.cluster.model.check_load` refuses (nothing changes then).
        """
        try:
            checked = check_load(waiting_requests_num, gpu_cache_usage_perc)
        except MalformedRegistration:
            return False
        now = self.clock.now()
        with self._lock:
            rec = self._records.get(name)
            if rec is None:
                return False
            if identity is not None and identity != instance_identity(rec.reg):
                return False
            self._count_clamped(name, SOURCE_SCRAPE, checked)
            rec.load = LoadMetrics(checked.waiting_requests_num, checked.gpu_cache_usage_perc,
                                   now, tuple(ranks), SOURCE_SCRAPE)
            rec.load_from_etcd = False
            rec.last_heartbeat = now
            self._publish()
        return True

    def load_clamped_counts(self) -> dict[tuple[str, str], int]:
        """Load reports whose ``gpu_cache_usage_perc`` was above 1 and is used as 1.0
        (:func:`~kvsvc.cluster.model.check_load`), per (instance, source), for the instances
        currently in the registry; source :data:`SOURCE_HEARTBEAT` or :data:`SOURCE_ETCD`."""
        with self._lock:
            return dict(self._clamped)

    # -- internals shared by the threads (call with _lock held) ----------------------------

    def _publish(self) -> None:
        """Swap in a new snapshot built from the records and wake waiters (under _lock)."""
        if self._clamped:   # forget the counts of removed instances
            self._clamped = {k: v for k, v in self._clamped.items() if k[0] in self._records}
        self._generation += 1
        instances = {
            name: Instance(name=name, type=r.reg.type, role=r.role,
                           incarnation_id=r.reg.incarnation_id,
                           register_ts_ms=r.reg.register_ts_ms, dp_size=r.reg.dp_size,
                           backend_type=r.reg.backend_type, rpc_address=r.reg.rpc_address,
                           state=r.state, load=r.load, profiling=r.reg.profiling)
            for name, r in sorted(self._records.items())}
        self._snap = RegistrySnapshot(instances=MappingProxyType(instances), fresh=self._fresh,
                                      is_master=self._election.is_master,
                                      generation=self._generation)
        self._changed.notify_all()

    def _count_clamped(self, name: str, source: str, checked: CheckedLoad) -> None:
        """Count a clamped report, logging the first one of each instance (under _lock)."""
        if not checked.clamped:
            return
        key = (name, source)
        if not any(k[0] == name for k in self._clamped):
            log.warning("registry: %s reports gpu_cache_usage_perc %g (%s), above 1: used as "
                        "1.0 (a sidecar summing several engines?); further ones only counted "
                        "in kvsvc_load_clamped_total", name, checked.reported_usage, source)
        self._clamped[key] = self._clamped.get(key, 0) + 1

    def _on_master_change(self, is_master: bool) -> None:
        """The election's callback (its thread, after ``is_master`` changed). A new master
        drops the loads it read from etcd (§11): they are the previous master's, which may be
        dead and may have been refusing the very heartbeats that would have updated them. From
        now on only heartbeats accepted here give loads (``_apply_load_kv`` ignores etcd's
        while master)."""
        with self._lock:
            if is_master:
                dropped = [n for n, r in self._records.items() if r.load_from_etcd]
                for name in dropped:
                    rec = self._records[name]
                    rec.load, rec.load_from_etcd = None, False
                if dropped:
                    log.info("registry: master now; dropped the loads of %d instances read "
                             "from etcd (only heartbeats accepted here count)", len(dropped))
            self._publish()

    def _set_fresh(self, fresh: bool, why: str, level: int = logging.WARNING) -> bool:
        """Set ``fresh``, logging a change at INFO (fresh) or ``level`` (not fresh)."""
        if fresh == self._fresh:
            return False
        self._fresh = fresh
        if fresh:
            log.info("registry: etcd %s listed, snapshot fresh", self._settings.etcd_addr)
        else:
            log.log(level, "registry: snapshot not fresh (%s); keeping the last %d instances",
                    why, len(self._records))
        return True

    def _split_key(self, key: str) -> tuple[str, str]:
        """(kind, name) of a key under the prefix: kind is a TYPE name, ``LOADMETRICS``, or
        ``""`` for keys this registry does not use."""
        if not key.startswith(self._prefix):
            return "", ""
        kind, sep, name = key[len(self._prefix):].partition(":")
        if not sep or kind not in (*_TYPES_BY_NAME, "LOADMETRICS"):
            return "", ""
        return kind, name

    def _registration(self, kv: KeyValue) -> object:
        """Parse (cached by revision) and log a malformed value once per revision."""
        cached = self._parsed.get(kv.key)
        if cached is not None and cached[0] == kv.mod_revision:
            return cached[1]
        kind, name = self._split_key(kv.key)
        try:
            result: object = parse_registration(_TYPES_BY_NAME[kind], name, kv.value)
        except MalformedRegistration as exc:
            log.error("registry: malformed registration %s (revision %d) ignored: %s",
                      kv.key, kv.mod_revision, exc)
            result = exc
        self._parsed[kv.key] = (kv.mod_revision, result)
        return result

    def _reconcile(self, now: float) -> bool:
        """Bring the records in line with the etcd view (§9). Returns True if anything changed."""
        self._parsed = {k: v for k, v in self._parsed.items() if k in self._view}
        by_name: dict[str, list[tuple[KeyValue, object]]] = {}
        for key, kv in self._view.items():
            kind, name = self._split_key(key)
            by_name.setdefault(name, []).append((kv, self._registration(kv)))
        changed = False
        joined: list[str] = []
        for name, entries in sorted(by_name.items()):
            if len(entries) > 1:
                # One name under two TYPE keys: no way to tell which is current.
                rec = self._records.pop(name, None)
                sig = tuple(sorted((kv.key, kv.mod_revision) for kv, _ in entries))
                if self._conflicts_logged.get(name) != sig:
                    log.error("registry: %s registered under %d keys %s; ignored", name,
                              len(entries), [kv.key for kv, _ in entries])
                    self._conflicts_logged[name] = sig
                changed |= rec is not None
                continue
            kv, reg = entries[0]
            rec = self._records.get(name)
            if not isinstance(reg, Registration):
                if rec is not None:
                    del self._records[name]
                    log.info("registry: %s removed (malformed registration)", name)
                    changed = True
                continue
            if rec is None:
                etcd_load = self._etcd_load(name)
                self._records[name] = _Record(name=name, reg=reg, key_revision=kv.mod_revision,
                                              state=InstanceState.ACTIVE, since=now,
                                              role=reg.type, load=etcd_load,
                                              load_from_etcd=etcd_load is not None)
                joined.append(name)
                log.info("registry: %s joined as %s (incarnation %s, dp_size %d, backend %s)",
                         name, reg.type.name, reg.incarnation_id, reg.dp_size, reg.backend_type)
                changed = True
                continue
            if rec.key_revision == kv.mod_revision and rec.state is InstanceState.ACTIVE:
                if rec.probe_needed:
                    rec.probe_needed = False   # the key is back before the probe ran
                continue
            replaced = (reg.type != rec.reg.type or reg.incarnation_id != rec.reg.incarnation_id
                        or (reg.incarnation_id is None
                            and reg.register_ts_ms != rec.reg.register_ts_ms))
            if replaced:
                log.info("registry: %s replaced (incarnation %s -> %s, register_ts_ms %s -> %s)",
                         name, rec.reg.incarnation_id, reg.incarnation_id,
                         rec.reg.register_ts_ms, reg.register_ts_ms)
                # The old process's load says nothing about the new one.
                rec.load, rec.load_from_etcd = None, False
                rec.last_heartbeat = None
                rec.role = reg.type
                joined.append(name)
            elif reg != rec.reg:
                log.info("registry: %s registration updated (dp_size %d -> %d)", name,
                         rec.reg.dp_size, reg.dp_size)
            if rec.state is not InstanceState.ACTIVE:
                log.info("registry: %s %s -> ACTIVE (key put again)", name, rec.state.value)
                rec.state = InstanceState.ACTIVE
                rec.since = now
            rec.reg = reg
            rec.key_revision = kv.mod_revision
            rec.probe_needed = False
            changed = True
        for name, rec in self._records.items():
            if name not in by_name and rec.state is InstanceState.ACTIVE and not rec.probe_needed:
                log.info("registry: %s key deleted; probing http://%s/health", name, name)
                rec.probe_needed = True
                self._timer_thread.wake_now()
        changed |= self._assign_roles(joined)
        return changed

    def _etcd_load(self, name: str) -> Optional[LoadMetrics]:
        if self._election.is_master:
            return None
        entry = self._etcd_loads.get(name)
        return entry[1] if entry else None

    def _apply_load_kv(self, name: str, kv: Optional[KeyValue], now: float) -> bool:
        """A LOADMETRICS key listed or watched (None: deleted). The master ignores them: it is
        their writer and has the heartbeats themselves.

        A value is dated ``now`` when this process first sees its revision (a re-list of the
        same revision does not make it younger) and ages by the §11 rule like a heartbeat; a
        deleted key leaves the last value to age out."""
        if kv is None:
            self._etcd_loads.pop(name, None)
            return False
        old = self._etcd_loads.get(name)
        if old is not None and old[0] >= kv.mod_revision:
            return False
        checked: Optional[CheckedLoad] = None
        try:
            checked = parse_load(kv.value)
            load: Optional[LoadMetrics] = LoadMetrics(
                checked.waiting_requests_num, checked.gpu_cache_usage_perc, now, (),
                SOURCE_ETCD)
        except MalformedRegistration as exc:
            log.error("registry: malformed load %s (revision %d) ignored: %s", kv.key,
                      kv.mod_revision, exc)
            load = None
        self._etcd_loads[name] = (kv.mod_revision, load)
        rec = self._records.get(name)
        if load is None or rec is None or self._election.is_master:
            return False
        assert checked is not None
        self._count_clamped(name, SOURCE_ETCD, checked)
        rec.load, rec.load_from_etcd = load, True
        return True

    def _assign_roles(self, joined: list[str]) -> bool:
        """MIX role rule (module docstring). Returns True if a role changed."""
        changed = False
        for name in sorted(joined):
            rec = self._records[name]
            if rec.reg.type is not InstanceType.MIX:
                rec.role = rec.reg.type
                continue
            decoding = any(r.role is InstanceType.DECODE and r.state is not InstanceState.SUSPECT
                           for n, r in self._records.items() if n != name)
            rec.role = InstanceType.PREFILL if decoding else InstanceType.DECODE
            log.info("registry: %s (MIX) takes role %s", name, rec.role.name)
            changed = True
        live = [r for r in self._records.values() if r.state is not InstanceState.SUSPECT]
        decoders = [r for r in live if r.role is InstanceType.DECODE]
        prefills = [r for r in live if r.role is not InstanceType.DECODE]
        mix_p = sorted((r for r in prefills if r.reg.type is InstanceType.MIX),
                       key=lambda r: r.name)
        mix_d = sorted((r for r in decoders if r.reg.type is InstanceType.MIX),
                       key=lambda r: r.name)
        if not decoders and mix_p and len(prefills) > 1:
            flip, role = mix_p[-1], InstanceType.DECODE
        elif not prefills and mix_d and len(decoders) > 1:
            flip, role = mix_d[0], InstanceType.PREFILL
        else:
            return changed
        log.info("registry: %s (MIX) flips %s -> %s", flip.name, flip.role.name, role.name)
        flip.role = role
        return True

    # -- what the etcd thread reports (it holds no lock when calling) --------------------

    def _list_failed(self, why: str, level: int = logging.WARNING) -> None:
        """A list failed (etcd error, or a bug while applying it): keep the view, not fresh.
        ``level``: of the not-fresh line (INFO when the reachability tracker already warned)."""
        with self._lock:
            if self._set_fresh(False, why, level):
                self._publish()

    def _listed(self, listed: ListResult, now: float) -> None:
        """A successful list at ``now`` (monotonic s): reconcile, mark fresh, publish."""
        with self._lock:
            changed = self._apply_list(listed, now)
            self._last_list_ok = now
            changed |= self._set_fresh(True, "")
            if changed:
                self._publish()

    def _apply_list(self, listed: ListResult, now: float) -> bool:
        """Replace the view by a full list and reconcile (under _lock). True if anything
        visible changed."""
        view: dict[str, KeyValue] = {}
        changed = False
        loads: set[str] = set()
        for kv in listed.kvs:
            kind, name = self._split_key(kv.key)
            if kind == "LOADMETRICS":
                loads.add(name)
                changed |= self._apply_load_kv(name, kv, now)
            elif kind:
                view[kv.key] = kv
        for name in [n for n in self._etcd_loads if n not in loads]:
            self._apply_load_kv(name, None, now)
        self._view = view
        return self._reconcile(now) or changed

    def _apply_events(self, batch: list[WatchEvent]) -> None:
        """Apply watched changes newer than the view's revisions, reconcile and publish."""
        now = self.clock.now()
        with self._lock:
            changed = False
            touched = False
            for ev in batch:
                kind, name = self._split_key(ev.key)
                if kind == "LOADMETRICS":
                    kv = (KeyValue(ev.key, ev.value, ev.mod_revision) if ev.kind == PUT else None)
                    changed |= self._apply_load_kv(name, kv, now)
                elif kind:
                    old = self._view.get(ev.key)
                    if old is not None and old.mod_revision >= ev.mod_revision:
                        continue
                    if ev.kind == PUT:
                        self._view[ev.key] = KeyValue(ev.key, ev.value, ev.mod_revision)
                    else:
                        self._view.pop(ev.key, None)
                    touched = True
            if touched:
                changed |= self._reconcile(now)
            if changed:
                self._publish()

    # -- what the timer thread runs ----------------------------------------------------------

    def _probe_deleted(self, probe: HealthProbe) -> None:
        """Probe every instance whose key was deleted while ACTIVE (no lock held while probing)."""
        with self._lock:
            names = [n for n, r in self._records.items() if r.probe_needed]
        for name in names:
            healthy = probe.healthy(name)
            now = self.clock.now()
            with self._lock:
                rec = self._records.get(name)
                if rec is None or not rec.probe_needed or rec.state is not InstanceState.ACTIVE:
                    continue   # the key came back (or the instance went) while probing
                rec.probe_needed = False
                rec.state = InstanceState.LEASE_LOST if healthy else InstanceState.SUSPECT
                rec.since = now
                log.info("registry: %s ACTIVE -> %s (lease gone, /health %s)", name,
                         rec.state.value, "ok" if healthy else "failed")
                self._assign_roles([])
                self._publish()

    def _expire(self, now: float) -> None:
        """The §9 timers at ``now`` (monotonic s): LEASE_LOST -> SUSPECT after
        ``lease_lost_grace_s`` without a heartbeat, SUSPECT -> removed after
        ``suspect_removal_s``; and the freshness watchdog."""
        s = self._settings
        with self._lock:
            changed = False
            for name in sorted(self._records):
                rec = self._records[name]
                if rec.state is InstanceState.LEASE_LOST:
                    last = max(rec.since, rec.last_heartbeat or rec.since)
                    if now - last >= s.lease_lost_grace_s:
                        rec.state, rec.since = InstanceState.SUSPECT, now
                        log.info("registry: %s LEASE_LOST -> SUSPECT (no heartbeat for %.1fs)",
                                 name, now - last)
                        changed = True
                elif rec.state is InstanceState.SUSPECT and now - rec.since >= s.suspect_removal_s:
                    del self._records[name]
                    log.info("registry: %s removed (SUSPECT for %.1fs)", name, now - rec.since)
                    changed = True
            # Watchdog: the etcd thread marks failures at once; this catches a wedged list.
            if self._fresh and now - self._last_list_ok > 2 * s.relist_interval_s + 2.0:
                changed |= self._set_fresh(False, "no successful etcd list for two periods")
            if changed:
                self._assign_roles([])
                self._publish()



class _EtcdThread(BackgroundThread):
    """``kvsvc-registry-etcd``: list, watch, re-list (module docstring). Owns its etcd client,
    its watch and the watch's event queue; hands what it reads to its :class:`Registry`.

    :ivar first_list_attempted: set once the first list since :meth:`start` was tried
        (successful or not); :meth:`Registry.start` waits for it.
    """

    def __init__(self, registry: Registry, settings: RegistrySettings, prefix: str,
                 reachability: EtcdReachability) -> None:
        super().__init__("kvsvc-registry-etcd")
        self._registry = registry
        self._settings = settings
        self._prefix = prefix
        self._reachability = reachability
        self.first_list_attempted = threading.Event()
        # This thread only (the watch's etcd3gw thread only puts into the queue):
        self._client: Optional[EtcdClient] = None
        self._watch: Optional[WatchHandle] = None
        # (watch generation, event); generation -1 is the wake-up sentinel of close().
        self._events: "queue.Queue[tuple[int, Optional[WatchEvent]]]" = queue.Queue()

    def _setup(self) -> None:
        s = self._settings
        self.first_list_attempted.clear()
        self._client = EtcdClient(s.etcd_addr, timeout_s=max(0.5, min(2.0, s.relist_interval_s)),
                                  reachability=self._reachability)

    def _wake(self) -> None:
        self._events.put((-1, None))

    def _loop(self) -> None:
        registry, client, s, prefix = self._registry, self._client, self._settings, self._prefix
        assert client is not None
        events = self._events
        watch_gen = 0
        backoff = _BACKOFF_MIN_S
        while not self.stopping:
            try:
                self._cancel_watch()
                try:
                    listed = client.list_prefix(prefix)
                except EtcdError as exc:
                    # Unreachable: the shared reachability tracker has warned already.
                    registry._list_failed(f"etcd: {exc}", logging.INFO
                                          if isinstance(exc, EtcdUnavailable) else logging.WARNING)
                    self.first_list_attempted.set()
                    self._sleep(backoff)
                    backoff = min(backoff * 2, max(_BACKOFF_MIN_S, s.relist_interval_s))
                    continue
                backoff = _BACKOFF_MIN_S
                now = registry.clock.now()
                registry._listed(listed, now)
                self.first_list_attempted.set()
                watch_gen += 1
                gen = watch_gen

                def on_event(ev: WatchEvent, g: int = gen) -> None:
                    events.put((g, ev))   # on etcd3gw's thread: hand over only

                try:
                    self._watch = client.watch_prefix(prefix, listed.revision + 1, on_event)
                except EtcdError as exc:
                    log.log(logging.DEBUG if isinstance(exc, EtcdUnavailable) else logging.WARNING,
                            "registry: watch not started (re-listing instead): %s", exc)
                deadline = time.monotonic() + s.relist_interval_s
                while not self.stopping:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    pending = drain(events, min(remaining, _POLL_S))
                    batch = [ev for g, ev in pending if g == gen and ev is not None]
                    if batch:
                        registry._apply_events(batch)
            except Exception:  # noqa: BLE001 - a bad value must not end the registry
                # Only a bug gets here (etcd and value errors are handled above). The thread
                # would otherwise be gone for the life of the process: /ready 503 and no etcd
                # change seen again. Drop the watch and re-list after a pause.
                log.exception("registry: internal error; re-listing after %.1f s", backoff)
                registry._list_failed("internal error")
                self._sleep(backoff)
                backoff = min(backoff * 2, max(_BACKOFF_MIN_S, s.relist_interval_s))

    def _cancel_watch(self) -> None:
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.cancel()

    def _teardown(self) -> None:
        self._cancel_watch()
        client, self._client = self._client, None
        if client is not None:
            client.close()


class _TimerThread(BackgroundThread):
    """``kvsvc-registry-timer``: the §9 state timers and the /health probes (module
    docstring). Owns its :class:`~kvsvc.cluster.probe.HealthProbe`."""

    def __init__(self, registry: Registry, settings: RegistrySettings) -> None:
        super().__init__("kvsvc-registry-timer")
        self._registry = registry
        self._settings = settings
        self._poke = threading.Event()
        self._probe: Optional[HealthProbe] = None

    def wake_now(self) -> None:
        """Run the next tick at once (a key was deleted: probe it now). Any thread."""
        self._poke.set()

    def _setup(self) -> None:
        self._probe = HealthProbe(self._settings.health_probe_timeout_s)
        self._registry.clock.add_waker(self._poke.set)   # a virtual clock's jump: a tick now

    def _wake(self) -> None:
        self._poke.set()

    def _loop(self) -> None:
        registry, probe, s = self._registry, self._probe, self._settings
        assert probe is not None
        tick = min(_POLL_S, max(0.01, min(s.lease_lost_grace_s, s.suspect_removal_s) / 10))
        while not self.stopping:
            self._poke.wait(tick)
            self._poke.clear()
            if self.stopping:
                break
            registry._probe_deleted(probe)
            registry._expire(registry.clock.now())

    def _teardown(self) -> None:
        self._registry.clock.remove_waker(self._poke.set)
        probe, self._probe = self._probe, None
        if probe is not None:
            probe.close()
