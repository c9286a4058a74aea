"""The instance registry (InstanceMgr) over etcd (§9).

Keys (after the optional ``/<namespace>/`` prefix): ``XLLM:<TYPE>:<host:port>`` with a JSON value
held by the engine's lease; ``XLLM:LOADMETRICS:<host:port>`` written by the master service;
``XLLM:SERVICE:MASTER`` (see :mod:`kvsvc.cluster.election`).

Threads (both owned by :class:`Registry`, started by ``start()``, stopped by ``close()``):

- **etcd thread**: lists the ``XLLM:`` prefix, then watches it from the listed revision + 1 with
  etcd3gw's watch as an accelerator; re-lists every ``relist_interval_s`` (the watch neither
  reconnects nor resumes) and restarts the watch. On etcd errors it keeps the last view, marks
  the snapshot not ``fresh`` and retries with capped exponential backoff.
- **timer thread**: drives the §9 states. A deleted key (lease expired or deregistered) makes it
  probe ``http://<name>/health`` (short timeout, never on a request thread): success ->
  ``LEASE_LOST`` (still schedulable; ``SUSPECT`` after ``lease_lost_grace_s`` without a
  heartbeat), failure -> ``SUSPECT``; ``SUSPECT`` for ``suspect_removal_s`` -> removed. Only a PUT
  of the key brings an instance back to ``ACTIVE``. Until the probe answers, the instance stays
  ``ACTIVE`` (at most ``health_probe_timeout_s``).
- the election thread of :class:`kvsvc.cluster.election.MasterElection` (master key, and the
  ``LOADMETRICS`` writes while master).

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
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Optional

import requests

from kvsvc.cluster.election import MasterElection
from kvsvc.cluster.model import (
    Instance,
    InstanceState,
    InstanceType,
    LoadMetrics,
    Malformed,
    Registration,
    RegistrySettings,
    RegistrySnapshot,
    check_load,
    parse_load,
    parse_registration,
)
from kvsvc.errors import (
    EtcdError,
    InvalidHeartbeat,
    LifecycleError,
    StaleIncarnation,
    UnknownInstance,
    WaitTimeout,
)
from kvsvc.cluster.etcd import PUT, EtcdClient, KeyValue, ListResult, WatchEvent, WatchHandle, drain

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
    last_heartbeat: Optional[float] = None
    probe_needed: bool = False        # key deleted while ACTIVE: the timer thread probes


_TYPES_BY_NAME = {t.name: t for t in InstanceType}


class Registry:
    """The in-process instance registry (§9). See the module docstring for threads and rules.

    :param settings: timings and identity; nothing is opened in the constructor.
    """

    def __init__(self, settings: RegistrySettings) -> None:
        self._settings = settings
        self._prefix = settings.key_prefix + "XLLM:"
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._wake_timer = threading.Event()
        self._etcd_up = threading.Event()
        self._timer_up = threading.Event()
        self._first_list = threading.Event()
        self._threads: list[threading.Thread] = []
        self._election = MasterElection(settings, self.snapshot, self._on_master_change)
        # Under _lock:
        self._view: dict[str, KeyValue] = {}          # instance keys as etcd holds them
        self._records: dict[str, _Record] = {}
        self._etcd_loads: dict[str, tuple[int, Optional[LoadMetrics]]] = {}  # name -> (rev, load)
        self._parsed: dict[str, tuple[int, object]] = {}  # key -> (rev, Registration | Malformed)
        self._conflicts_logged: dict[str, tuple] = {}    # name -> keys+revisions logged
        self._fresh = False
        self._last_list_ok = 0.0
        self._generation = 0
        self._snap = RegistrySnapshot(MappingProxyType({}), False, False, 0)

    # -- lifecycle ------------------------------------------------------------------------

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the etcd, timer and election threads; returns once they run and the first list
        was attempted (etcd being down is not fatal: the snapshot is then not ``fresh``).

        :raises LifecycleError: when a thread does not come up within ``timeout_s``.
        """
        if self._threads:
            raise LifecycleError("registry already started")
        self._stop.clear()
        deadline = time.monotonic() + timeout_s
        for target, name, ready in ((self._run_etcd, "kvsvc-registry-etcd", self._etcd_up),
                                    (self._run_timer, "kvsvc-registry-timer", self._timer_up)):
            thread = threading.Thread(target=target, name=name, daemon=True)
            self._threads.append(thread)
            thread.start()
            if not ready.wait(max(0.0, deadline - time.monotonic())):
                self.close()
                raise LifecycleError(f"{name} not running after {timeout_s}s")
        if not self._first_list.wait(max(0.0, deadline - time.monotonic())):
            self.close()
            raise LifecycleError(f"registry: first etcd list not attempted within {timeout_s}s")
        try:
            self._election.start(max(0.1, deadline - time.monotonic()))
        except LifecycleError:
            self.close()
            raise
        log.info("registry started on etcd %s prefix %r", self._settings.etcd_addr, self._prefix)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop every thread (joined within ``timeout_s``, logged if not), resign mastership
        (revoking the master lease) and close etcd sessions. Idempotent."""
        self._election.close(timeout_s)
        self._stop.set()
        self._wake_timer.set()
        threads, self._threads = self._threads, []
        for thread in threads:
            thread.join(timeout_s)
            if thread.is_alive():
                log.error("registry: %s did not stop within %.1fs", thread.name, timeout_s)
        for event in (self._etcd_up, self._timer_up, self._first_list, self._wake_timer):
            event.clear()

    # -- reads ----------------------------------------------------------------------------

    def snapshot(self) -> RegistrySnapshot:
        """The current immutable snapshot (lock-free; safe on request threads)."""
        return self._snap

    @property
    def master_address(self) -> Optional[str]:
        """``host:port`` of the master service as last read from etcd, or None."""
        return self._election.master_address

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
        :param waiting_requests_num: int >= 0.
        :param gpu_cache_usage_perc: float in [0, 1].
        :raises InvalidHeartbeat: (400) load values of the wrong type or range.
        :raises UnknownInstance: (409) no such instance in the registry.
        :raises StaleIncarnation: (409) the registered instance has a different incarnation.
        """
        try:
            waiting, usage = check_load(waiting_requests_num, gpu_cache_usage_perc)
        except Malformed as exc:
            raise InvalidHeartbeat(str(exc)) from None
        now = time.monotonic()
        with self._lock:
            rec = self._records.get(name)
            if rec is None:
                raise UnknownInstance(name)
            registered = rec.reg.incarnation_id
            if incarnation_id and registered and incarnation_id != registered:
                raise StaleIncarnation(name, incarnation_id, registered)
            rec.load = LoadMetrics(waiting, usage, now)
            rec.last_heartbeat = now
            self._publish()

    # -- internals shared by the threads (call with _lock held) ----------------------------

    def _publish(self) -> None:
        """Swap in a new snapshot built from the records and wake waiters (under _lock)."""
        self._generation += 1
        instances = {
            name: Instance(name=name, type=r.reg.type, role=r.role,
                           incarnation_id=r.reg.incarnation_id,
                           register_ts_ms=r.reg.register_ts_ms, dp_size=r.reg.dp_size,
                           backend_type=r.reg.backend_type, rpc_address=r.reg.rpc_address,
                           state=r.state, load=r.load)
            for name, r in sorted(self._records.items())}
        self._snap = RegistrySnapshot(instances=MappingProxyType(instances), fresh=self._fresh,
                                      is_master=self._election.is_master,
                                      generation=self._generation)
        self._changed.notify_all()

    def _on_master_change(self, is_master: bool) -> None:
        with self._lock:
            self._publish()

    def _set_fresh(self, fresh: bool, why: str) -> bool:
        if fresh == self._fresh:
            return False
        self._fresh = fresh
        if fresh:
            log.info("registry: etcd %s listed, snapshot fresh", self._settings.etcd_addr)
        else:
            log.warning("registry: snapshot not fresh (%s); keeping the last %d instances",
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
        except Malformed as exc:
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
                self._records[name] = _Record(name=name, reg=reg, key_revision=kv.mod_revision,
                                              state=InstanceState.ACTIVE, since=now,
                                              role=reg.type, load=self._etcd_load(name))
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
                rec.load = None
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
                self._wake_timer.set()
        changed |= self._assign_roles(joined)
        return changed

    def _etcd_load(self, name: str) -> Optional[LoadMetrics]:
        if self._election.is_master:
            return None
        entry = self._etcd_loads.get(name)
        return entry[1] if entry else None

    def _apply_load_kv(self, name: str, kv: Optional[KeyValue], now: float) -> bool:
        """A LOADMETRICS key listed or watched (None: deleted). The master ignores them: it is
        their writer and has the heartbeats themselves."""
        if kv is None:
            self._etcd_loads.pop(name, None)
            return False
        old = self._etcd_loads.get(name)
        if old is not None and old[0] >= kv.mod_revision:
            return False
        try:
            waiting, usage = parse_load(kv.value)
            load: Optional[LoadMetrics] = LoadMetrics(waiting, usage, now)
        except Malformed as exc:
            log.error("registry: malformed load %s (revision %d) ignored: %s", kv.key,
                      kv.mod_revision, exc)
            load = None
        self._etcd_loads[name] = (kv.mod_revision, load)
        rec = self._records.get(name)
        if load is None or rec is None or self._election.is_master:
            return False
        rec.load = load
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

    # -- etcd thread ----------------------------------------------------------------------

    def _run_etcd(self) -> None:
        s = self._settings
        client = EtcdClient(s.etcd_addr, timeout_s=max(0.5, min(2.0, s.relist_interval_s)))
        events: "queue.Queue[tuple[int, WatchEvent]]" = queue.Queue()
        watch: Optional[WatchHandle] = None
        watch_gen = 0
        backoff = _BACKOFF_MIN_S
        self._etcd_up.set()
        try:
            while not self._stop.is_set():
                try:
                    if watch is not None:
                        watch.cancel()
                        watch = None
                    try:
                        listed = client.list_prefix(self._prefix)
                    except EtcdError as exc:
                        with self._lock:
                            if self._set_fresh(False, f"etcd: {exc}"):
                                self._publish()
                        self._first_list.set()
                        self._stop.wait(backoff)
                        backoff = min(backoff * 2, max(_BACKOFF_MIN_S, s.relist_interval_s))
                        continue
                    backoff = _BACKOFF_MIN_S
                    now = time.monotonic()
                    with self._lock:
                        changed = self._apply_list(listed, now)
                        self._last_list_ok = now
                        changed |= self._set_fresh(True, "")
                        if changed:
                            self._publish()
                    self._first_list.set()
                    watch_gen += 1
                    gen = watch_gen
                    try:
                        watch = client.watch_prefix(self._prefix, listed.revision + 1,
                                                    lambda ev, g=gen: events.put((g, ev)))
                    except EtcdError as exc:
                        log.warning("registry: watch not started (re-listing instead): %s", exc)
                    deadline = now + s.relist_interval_s
                    while not self._stop.is_set():
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            break
                        pending = drain(events, min(remaining, _POLL_S))
                        batch = [ev for g, ev in pending if g == gen]
                        if batch:
                            self._apply_events(batch)
                except Exception:  # noqa: BLE001 - a bad value must not end the registry
                    # Only a bug gets here (etcd and value errors are handled above). The
                    # thread would otherwise be gone for the life of the process: /ready 503
                    # and no etcd change seen again. Drop the watch and re-list after a pause.
                    log.exception("registry: internal error; re-listing after %.1f s", backoff)
                    with self._lock:
                        if self._set_fresh(False, "internal error"):
                            self._publish()
                    self._stop.wait(backoff)
                    backoff = min(backoff * 2, max(_BACKOFF_MIN_S, s.relist_interval_s))
        finally:
            if watch is not None:
                watch.cancel()
            client.close()

    def _apply_list(self, listed: ListResult, now: float) -> bool:
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
        now = time.monotonic()
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

    # -- timer thread ---------------------------------------------------------------------

    def _run_timer(self) -> None:
        s = self._settings
        tick = min(_POLL_S, max(0.01, min(s.lease_lost_grace_s, s.suspect_removal_s) / 10))
        session = requests.Session()
        self._timer_up.set()
        try:
            while not self._stop.is_set():
                self._wake_timer.wait(tick)
                self._wake_timer.clear()
                if self._stop.is_set():
                    break
                self._probe_deleted(session)
                self._expire(time.monotonic())
        finally:
            session.close()

    def _probe_deleted(self, session: requests.Session) -> None:
        with self._lock:
            names = [n for n, r in self._records.items() if r.probe_needed]
        for name in names:
            healthy = self._probe(session, name)
            now = time.monotonic()
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

    def _probe(self, session: requests.Session, name: str) -> bool:
        try:
            reply = session.get(f"http://{name}/health",
                                timeout=self._settings.health_probe_timeout_s)
            return reply.status_code == 200
        except requests.RequestException as exc:
            log.debug("registry: probe of %s failed: %s", name, exc)
            return False

    def _expire(self, now: float) -> None:
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


_BACKOFF_MIN_S = 0.1
_POLL_S = 0.1
