"""A simulated engine's registration in the instance registry and its heartbeats (§9), the way
an xLLM engine does it, so the service discovers it with no address list.

:class:`EtcdRegistration` owns one thread that

- grants a lease of ``lease_ttl_s`` (3 s) and puts ``[/<ns>/]XLLM:<TYPE>:<host:port>`` with the
  registration JSON (:meth:`EtcdRegistration.value`: ``name``, ``rpc_address``, ``type``,
  ``incarnation_id`` = a fresh uuid per process, ``register_ts_ms``, ``dp_size``,
  ``backend_type``: ``"xllm"``, or ``"vllm"`` / ``"sglang"`` for those flavors, as
  xllm-service's ``vllm_sidecar`` registers a vLLM instance), and, when given, the §12 profiling data ``ttft_profiling_data`` /
  ``tpot_profiling_data`` computed by the serving sim's latency model) under it;
- keeps the lease alive every ``keepalive_interval_s``; a lease that expired anyway (etcd
  restarted, a long stall) is granted again and the key re-put with the same incarnation (a
  refresh: the service keeps the streams);
- every ``heartbeat_interval_s`` posts ``POST /v1/internal/heartbeat`` with the engine's
  waiting-queue length and Device usage to the master, whose address it reads from
  ``KVSVC:SERVICE:MASTER:HTTP`` (a kvsvc master's HTTP address; not in the native mode, whose
  baidu_std heartbeats go to the master key), else ``XLLM:SERVICE:MASTER`` (re-read every ``master_refresh_s``, by default before every
  heartbeat, and after a failed one);
- with ``min_heartbeat_gap_s`` set, :meth:`EtcdRegistration.load_changed` asks for an early
  heartbeat (an engine pushing its load when its queue changes), at most one per
  ``min_heartbeat_gap_s``, so the router's queue view is not a whole interval old.

``reincarnate()`` models a process restart (new ``incarnation_id`` and ``register_ts_ms``, same
address): the service then replaces the instance's streams. ``close()`` revokes the lease
(deregistration) unless told to leave it to expire.

Errors: :class:`~kvsvc.errors.LifecycleError` when the thread does not start or stop in time.
etcd and HTTP failures are logged (one line per change of state) and retried on the next tick;
they are translated into :class:`~kvsvc.errors.EtcdError` once, in :mod:`kvsvc.cluster.etcd`.
"""

from __future__ import annotations

import enum
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import requests

from kvsvc.cluster.etcd import EtcdClient, parse_addr
from kvsvc.errors import EtcdError, LifecycleError
from kvsvc.lifecycle import BackgroundThread

log = logging.getLogger(__name__)

HEARTBEAT_PATH = "/v1/internal/heartbeat"
TOKEN_HEADER = "X-Internal-Token"
MASTER_KEY = "XLLM:SERVICE:MASTER"
#: Where a kvsvc master keeps its HTTP address (the master key names its baidu_std port when
#: it serves one, §13); read first, the master key is the fallback (other services).
MASTER_HTTP_KEY = "KVSVC:SERVICE:MASTER:HTTP"

_START_TIMEOUT_S = 5.0
_JOIN_TIMEOUT_S = 10.0


class RegisteredType(enum.IntEnum):
    """§9 instance types as registered (``XLLM:<TYPE>:...`` and the ``type`` field)."""

    DEFAULT = 0
    PREFILL = 1
    DECODE = 2
    MIX = 3


def key_prefix(namespace: str) -> str:
    """The §9 key prefix: ``/<ns>/`` with a namespace, empty without."""
    return f"/{namespace}/" if namespace else ""


@dataclass(frozen=True, slots=True)
class Load:
    """One heartbeat's load (§9).

    :param waiting_requests_num: requests waiting in the engine's queue (int >= 0).
    :param gpu_cache_usage_perc: Device usage, float in ``[0, 1]``.
    """

    waiting_requests_num: int
    gpu_cache_usage_perc: float


@dataclass(frozen=True, slots=True)
class RegistrationStats:
    """Counters since start.

    :param registrations: puts of the registration key (first one, lease re-grants,
        reincarnations).
    :param keepalives: successful lease refreshes.
    :param heartbeats_ok: heartbeats answered 200.
    :param heartbeats_failed: heartbeats not answered 200 (no master, refused, unreachable).
    :param last_heartbeat_status: HTTP status of the last heartbeat, ``None`` when none was
        answered yet.
    """

    registrations: int
    keepalives: int
    heartbeats_ok: int
    heartbeats_failed: int
    last_heartbeat_status: Optional[int]


class EtcdRegistration(BackgroundThread):
    """Registration of one instance ``host:port`` (see the module docstring) by the thread
    ``sim-etcd-<name>`` (the :class:`~kvsvc.lifecycle.BackgroundThread` contract): its etcd client
    and HTTP session are created, used and closed on that thread.

    :param etcd_addr: etcd ``host:port``.
    :param name: the instance name ``host:port`` (its HTTP address, where ``GET /health`` is
        served).
    :param dp_size: DP ranks of the instance.
    :param load: returns the current :class:`Load` (called on the registration thread).
    :param instance_type: §9 type, DEFAULT by default.
    :param namespace: §9 key namespace (empty: none).
    :param token: ``X-Internal-Token`` of the heartbeat, ``None`` when the service needs none.
    :param lease_ttl_s: lease TTL, whole seconds (§9: 3).
    :param keepalive_interval_s: lease refresh period, seconds (well under the TTL).
    :param heartbeat_interval_s: heartbeat period, seconds.
    :param etcd_timeout_s: bound of one etcd request, seconds.
    :param http_timeout_s: bound of one heartbeat request, seconds.
    :param min_heartbeat_gap_s: ``None``: heartbeats only every ``heartbeat_interval_s``;
        else :meth:`load_changed` triggers one early, at least this many seconds after the
        previous one.
    :param master_refresh_s: the master's address is re-read from etcd after this long,
        seconds (0: before every heartbeat).
    :param backend_type: the registration's ``backend_type`` (§9): ``"xllm"``, or ``"vllm"``
        as xllm-service's ``vllm_sidecar`` registers a vLLM instance (with ``type`` 0,
        DEFAULT), or ``"sglang"``.
    :param heartbeat: sends one heartbeat itself, ``heartbeat(master address, body)`` -> the
        HTTP-like status (200 accepted, 409 refused, ``None`` not delivered): the native mode's
        baidu_std ``Heartbeat`` (:func:`kvsvc.testbed.sim.native.rpc_heartbeat`); ``None``:
        ``POST /v1/internal/heartbeat``.
    :param profiling: extra registration fields, the §12 profiling data
        (``ttft_profiling_data``, ``tpot_profiling_data``:
        :func:`kvsvc.testbed.sim.serving.profiling_data`); ``None``: none registered.
    :param heartbeats: send load heartbeats (§9); off, the instance only keeps its
        registration and its lease, as a real vLLM or SGLang engine (their load is read from
        ``/metrics``, §15).
    :raises ConfigError: ``etcd_addr`` is not ``host:port``.
    :raises ValueError: ``lease_ttl_s`` < 1.
    """

    def __init__(self, etcd_addr: str, name: str, dp_size: int, load: Callable[[], Load],
                 instance_type: RegisteredType = RegisteredType.DEFAULT, namespace: str = "",
                 token: Optional[str] = None, lease_ttl_s: int = 3,
                 keepalive_interval_s: float = 1.0, heartbeat_interval_s: float = 1.0,
                 etcd_timeout_s: float = 1.0, http_timeout_s: float = 1.0,
                 min_heartbeat_gap_s: Optional[float] = None,
                 master_refresh_s: float = 0.0, backend_type: str = "xllm",
                 profiling: Optional[Mapping[str, Any]] = None,
                 heartbeats: bool = True,
                 heartbeat: Optional[Callable[[str, dict], Optional[int]]] = None) -> None:
        if lease_ttl_s < 1:
            raise ValueError("lease_ttl_s must be >= 1")
        parse_addr(etcd_addr)  # ConfigError here rather than on the thread
        super().__init__(f"sim-etcd-{name}")
        self.etcd_addr = etcd_addr
        self.name = name
        self.dp_size = dp_size
        self.backend_type = backend_type
        self.instance_type = RegisteredType(instance_type)
        self.namespace = namespace
        self.key = f"{key_prefix(namespace)}XLLM:{self.instance_type.name}:{name}"
        self._load = load
        self._token = token
        self._lease_ttl_s = int(lease_ttl_s)
        self._keepalive_interval_s = keepalive_interval_s
        self._heartbeat_interval_s = heartbeat_interval_s
        self._min_gap_s = min_heartbeat_gap_s
        self._master_refresh_s = master_refresh_s
        self._profiling = dict(profiling or {})
        self.heartbeats = heartbeats
        self._send_heartbeat = heartbeat
        # (address, monotonic time read) of the master; registration thread only.
        self._master: Optional[tuple[str, float]] = None
        self._load_dirty = threading.Event()
        self._etcd_timeout_s = etcd_timeout_s
        self._http_timeout_s = http_timeout_s
        # Guards the identity and the counters (read by other threads).
        self._lock = threading.Lock()
        self._incarnation_id = str(uuid.uuid4())
        self._register_ts_ms = int(time.time() * 1000)
        # Identity generation the thread must put; bumped by reincarnate().
        self._wanted = 1
        self._put_generation = 0
        self._put_cond = threading.Condition(self._lock)
        self._stats = RegistrationStats(0, 0, 0, 0, None)
        # Set to end the thread's wait early (close, reincarnate, load_changed).
        self._tick = threading.Event()
        self._deregister = True
        # Thread only: created by _setup, closed by _teardown.
        self._client: Optional[EtcdClient] = None
        self._http: Optional[requests.Session] = None
        self._lease_id: Optional[int] = None

    # -- identity ------------------------------------------------------------------------------

    @property
    def incarnation_id(self) -> str:
        """The current process incarnation (uuid4 string)."""
        with self._lock:
            return self._incarnation_id

    def value(self) -> dict:
        """The registration JSON object (§9) of the current incarnation."""
        with self._lock:
            return {"name": self.name, "rpc_address": self.name,
                    "type": int(self.instance_type), "incarnation_id": self._incarnation_id,
                    "register_ts_ms": self._register_ts_ms, "dp_size": self.dp_size,
                    "backend_type": self.backend_type, **self._profiling}

    def stats(self) -> RegistrationStats:
        """Counters (see :class:`RegistrationStats`)."""
        with self._lock:
            return self._stats

    def reincarnate(self, timeout_s: float = 5.0) -> str:
        """Become a new process at the same address: new ``incarnation_id`` and
        ``register_ts_ms``, re-put at once. Returns once the new value is in etcd.

        :returns: the new incarnation id.
        :raises LifecycleError: not running, or etcd did not take the put within ``timeout_s``.
        """
        with self._lock:
            if not self.running:
                raise LifecycleError(f"registration {self.name}: not running")
            self._incarnation_id = str(uuid.uuid4())
            self._register_ts_ms = max(self._register_ts_ms + 1, int(time.time() * 1000))
            self._wanted += 1
            wanted, new_id = self._wanted, self._incarnation_id
        self._tick.set()
        with self._put_cond:
            if not self._put_cond.wait_for(lambda: self._put_generation >= wanted, timeout_s):
                raise LifecycleError(f"registration {self.name}: new incarnation not put "
                                     f"within {timeout_s:.1f} s")
        log.info("sim %s: reincarnated as %s", self.name, new_id)
        return new_id

    def load_changed(self) -> None:
        """The engine's load changed: heartbeat early (within ``min_heartbeat_gap_s`` of the
        previous one). Thread-safe and cheap; a no-op without ``min_heartbeat_gap_s``."""
        if self._min_gap_s is not None and not self._load_dirty.is_set():
            self._load_dirty.set()
            self._tick.set()

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self, timeout_s: float = _START_TIMEOUT_S) -> None:
        """Start the thread; returns once it runs (the first put follows at once, retried
        while etcd is unreachable).

        :param timeout_s: bound of the start, seconds.
        :raises LifecycleError: already started, or the thread did not run in time.
        """
        super().start(timeout_s)

    def wait_registered(self, timeout_s: float = 5.0) -> None:
        """Wait until the current incarnation has been put.

        :raises LifecycleError: not within ``timeout_s``.
        """
        with self._put_cond:
            wanted = self._wanted
            if not self._put_cond.wait_for(lambda: self._put_generation >= wanted, timeout_s):
                raise LifecycleError(f"registration {self.name}: not registered within "
                                     f"{timeout_s:.1f} s")

    def close(self, timeout_s: float = _JOIN_TIMEOUT_S, *, deregister: bool = True) -> None:
        """Stop the thread. With ``deregister`` the lease is revoked (the key goes at once);
        without, it is left to expire after its TTL, like a killed process. Idempotent;
        nothing happens before :meth:`start`.

        :param timeout_s: join bound, seconds (it covers one etcd request of the thread).
        :raises LifecycleError: the thread did not stop within ``timeout_s``.
        """
        self._deregister = deregister
        super().close(timeout_s)

    # -- the thread ----------------------------------------------------------------------------

    def _wake(self) -> None:
        self._tick.set()

    def _setup(self) -> None:
        self._client = EtcdClient(self.etcd_addr, timeout_s=self._etcd_timeout_s)
        self._http = requests.Session()
        if self._token:
            self._http.headers[TOKEN_HEADER] = self._token
        self._lease_id = None

    def _loop(self) -> None:
        client, http = self._client, self._http
        assert client is not None and http is not None
        etcd_ok: Optional[bool] = None
        next_keepalive = next_heartbeat = time.monotonic()
        if not self.heartbeats:
            next_heartbeat = float("inf")
        last_heartbeat = float("-inf")
        while not self.stopping:
            now = time.monotonic()
            try:
                self._lease_id = self._register_or_keepalive(client, self._lease_id,
                                                             now >= next_keepalive)
                if etcd_ok is not True:
                    log.info("sim %s: registered as %s (lease %x)", self.name, self.key,
                             self._lease_id)
                etcd_ok = True
            except EtcdError as exc:
                if etcd_ok is not False:
                    log.warning("sim %s: etcd unavailable, registration retried: %s",
                                self.name, exc)
                etcd_ok = False
            if now >= next_keepalive:
                next_keepalive = now + self._keepalive_interval_s
            early = (self.heartbeats and self._load_dirty.is_set()
                     and self._min_gap_s is not None
                     and now >= last_heartbeat + self._min_gap_s)
            if now >= next_heartbeat or early:
                self._load_dirty.clear()
                last_heartbeat = now
                next_heartbeat = now + self._heartbeat_interval_s
                self._heartbeat(client, http)
            due = min(next_keepalive, next_heartbeat)
            if self.heartbeats and self._load_dirty.is_set() and self._min_gap_s is not None:
                due = min(due, last_heartbeat + self._min_gap_s)
            self._tick.wait(max(0.0, due - time.monotonic()))
            self._tick.clear()

    def _teardown(self) -> None:
        client, http, lease_id = self._client, self._http, self._lease_id
        self._client = self._http = self._lease_id = None
        if client is not None:
            if self._deregister and lease_id is not None:
                try:
                    client.revoke(lease_id)
                    log.info("sim %s: deregistered (lease %x revoked)", self.name, lease_id)
                except EtcdError as exc:
                    log.warning("sim %s: could not revoke lease (it expires): %s", self.name, exc)
            client.close()
        if http is not None:
            http.close()

    def _register_or_keepalive(self, client: EtcdClient, lease_id: Optional[int],
                               keepalive_due: bool) -> int:
        """Put the registration when needed (no lease yet, lease expired, new incarnation),
        else refresh the lease when due. Returns the lease id in use.

        :raises EtcdError: etcd failed; the caller retries on the next tick.
        """
        with self._lock:
            wanted = self._wanted
            need_put = self._put_generation < wanted
        if lease_id is not None and keepalive_due:
            if client.keepalive(lease_id) < 0:
                log.warning("sim %s: lease %x expired; registering again (same incarnation)",
                            self.name, lease_id)
                lease_id = None
            else:
                with self._lock:
                    self._stats = _bump(self._stats, keepalives=1)
        if lease_id is None:
            lease_id = client.grant_lease(self._lease_ttl_s)
            need_put = True
        if need_put:
            client.put(self.key, json.dumps(self.value()), lease_id=lease_id)
            with self._put_cond:
                self._put_generation = max(self._put_generation, wanted)
                self._stats = _bump(self._stats, registrations=1)
                self._put_cond.notify_all()
        return lease_id

    def _heartbeat(self, client: EtcdClient, http: requests.Session) -> None:
        """One heartbeat to the master found in etcd (§9); failures are counted and logged on
        change only."""
        status: Optional[int] = None
        address = self._master_address(client)
        if address is not None:
            load = self._load()
            body: dict[str, Any] = {"name": self.name, "incarnation_id": self.incarnation_id,
                    "load_metrics": {"waiting_requests_num": load.waiting_requests_num,
                                     "gpu_cache_usage_perc": load.gpu_cache_usage_perc},
                    "latency_metrics": {}}
            if self._send_heartbeat is not None:
                status = self._send_heartbeat(address, body)
            else:
                try:
                    status = http.post(f"http://{address}{HEARTBEAT_PATH}", json=body,
                                       timeout=self._http_timeout_s).status_code
                except requests.RequestException:
                    status = None
            if status != 200:
                self._master = None  # the master may have changed: read it again next time
        with self._lock:
            before = self._stats.last_heartbeat_status
            self._stats = _bump(self._stats, heartbeats_ok=1 if status == 200 else 0,
                                heartbeats_failed=0 if status == 200 else 1,
                                last_heartbeat_status=status)
        if status != before:
            log.info("sim %s: heartbeat answered %s", self.name,
                     status if status is not None else "nothing (no master or unreachable)")


    def master(self) -> Optional[str]:
        """The master's address as last read from etcd, ``None`` when none is known."""
        master = self._master
        return master[0] if master is not None else None

    def _master_address(self, client: EtcdClient) -> Optional[str]:
        """The master's address, read from etcd at most every ``master_refresh_s``; ``None``
        when there is none or etcd cannot be read."""
        now = time.monotonic()
        if self._master is not None and now - self._master[1] < self._master_refresh_s:
            return self._master[0]
        try:
            # HTTP heartbeats go to a kvsvc master's HTTP address (its master key names its
            # baidu_std port, §13); the native mode's baidu_std heartbeats to the master key.
            master = None
            if self._send_heartbeat is None:
                master = client.get(f"{key_prefix(self.namespace)}{MASTER_HTTP_KEY}")
            master = master or client.get(f"{key_prefix(self.namespace)}{MASTER_KEY}")
        except EtcdError:
            master = None
        self._master = (master_address(master.value), now) if master is not None else None
        return self._master[0] if self._master is not None else None


def master_address(value: bytes) -> str:
    """The master's ``host:port`` from the ``XLLM:SERVICE:MASTER`` value (§9): the plain
    address, or a JSON string or object holding it (``address``)."""
    text = value.decode("utf-8", "replace").strip()
    if text.startswith(("{", '"')):
        try:
            doc = json.loads(text)
        except ValueError:
            return text
        if isinstance(doc, str):
            return doc
        if isinstance(doc, dict) and isinstance(doc.get("address"), str):
            return doc["address"]
    return text


def _bump(stats: RegistrationStats, registrations: int = 0, keepalives: int = 0,
          heartbeats_ok: int = 0, heartbeats_failed: int = 0,
          last_heartbeat_status: Optional[int] = -1) -> RegistrationStats:
    return RegistrationStats(
        stats.registrations + registrations, stats.keepalives + keepalives,
        stats.heartbeats_ok + heartbeats_ok, stats.heartbeats_failed + heartbeats_failed,
        stats.last_heartbeat_status if last_heartbeat_status == -1 else last_heartbeat_status)
