"""The instance registry (InstanceMgr) over etcd (§9).

Keys (after the optional ``/<namespace>/`` prefix): ``XLLM:<TYPE>:<host:port>`` with a JSON value
held by the engine's lease; ``XLLM:LOADMETRICS:<host:port>`` written by the master service;
``XLLM:SERVICE:MASTER`` (see :mod:`kvsvc.election`).

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
- the election thread of :class:`kvsvc.election.MasterElection` (master key, and the
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

import enum
import logging
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from .errors import ConfigError

log = logging.getLogger(__name__)


class InstanceType(enum.IntEnum):
    """Registered instance type; the value is the JSON ``type`` field (§9)."""

    DEFAULT = 0
    PREFILL = 1
    DECODE = 2
    MIX = 3


class InstanceState(str, enum.Enum):
    """§9 instance states. ``ACTIVE`` and ``LEASE_LOST`` are schedulable, ``SUSPECT`` is not."""

    ACTIVE = "ACTIVE"
    LEASE_LOST = "LEASE_LOST"
    SUSPECT = "SUSPECT"


@dataclass(frozen=True, slots=True)
class LoadMetrics:
    """The latest load report of an instance (§9).

    :ivar waiting_requests_num: queued requests, >= 0.
    :ivar gpu_cache_usage_perc: Device KV-cache usage, a fraction in [0, 1].
    :ivar received_at: ``time.monotonic()`` seconds when this process received it (heartbeat or
        a new ``XLLM:LOADMETRICS`` revision).
    """

    waiting_requests_num: int
    gpu_cache_usage_perc: float
    received_at: float


@dataclass(frozen=True, slots=True)
class Instance:
    """One registered instance as the registry sees it (§9).

    :ivar name: ``host:port`` from the key.
    :ivar type: registered type.
    :ivar role: current role: equal to ``type`` except for MIX, which is PREFILL or DECODE by the
        MIX role rule of this module's docstring.
    :ivar incarnation_id: the process incarnation, None when the registration carries none.
    :ivar register_ts_ms: registration time in ms since the epoch, None when absent.
    :ivar dp_size: DP ranks, >= 1 (0 or absent in the value means 1).
    :ivar backend_type: ``"xllm"`` unless the value says otherwise.
    :ivar rpc_address: the engine's RPC address, None when absent.
    :ivar state: §9 state.
    :ivar load: latest load, None until one arrives.
    """

    name: str
    type: InstanceType
    role: InstanceType
    incarnation_id: Optional[str]
    register_ts_ms: Optional[int]
    dp_size: int
    backend_type: str
    rpc_address: Optional[str]
    state: InstanceState
    load: Optional[LoadMetrics]


@dataclass(frozen=True, slots=True)
class RegistrySnapshot:
    """An immutable view of the registry.

    :ivar instances: read-only mapping name -> :class:`Instance`.
    :ivar fresh: etcd reachable and listed within the last re-list period; False means the
        instances are the last known ones (readiness degraded).
    :ivar is_master: this process holds ``XLLM:SERVICE:MASTER``.
    :ivar generation: increments on every change of the snapshot.
    """

    instances: Mapping[str, Instance]
    fresh: bool
    is_master: bool
    generation: int


@dataclass(frozen=True)
class RegistrySettings:
    """Registry timings and identity. All durations in seconds.

    :ivar etcd_addr: ``host:port`` of etcd (xllm-service ``--etcd_addr``).
    :ivar namespace: key prefix ``/<namespace>/`` when non-empty.
    :ivar relist_interval_s: full re-list period (the watch only accelerates).
    :ivar lease_lost_grace_s: LEASE_LOST -> SUSPECT after this long without a heartbeat (§9: 3 s).
    :ivar suspect_removal_s: SUSPECT -> removed after this long (§9: 15 s; xllm-service
        ``--detect_disconnected_instance_interval``).
    :ivar health_probe_timeout_s: timeout of one ``GET http://<name>/health``.
    :ivar loadmetrics_interval_s: master's ``XLLM:LOADMETRICS`` write period (§9: 3 s).
    :ivar master_lease_ttl_s: TTL of the master key's lease, whole seconds >= 1.
    :ivar self_address: this service's ``host:port``, the master key's value.
    :raises ConfigError: from construction when a value is out of range.
    """

    etcd_addr: str
    namespace: str = ""
    relist_interval_s: float = 5.0
    lease_lost_grace_s: float = 3.0
    suspect_removal_s: float = 15.0
    health_probe_timeout_s: float = 1.0
    loadmetrics_interval_s: float = 3.0
    master_lease_ttl_s: int = 3
    self_address: str = ""

    def __post_init__(self) -> None:
        from .etcd import parse_addr

        parse_addr(self.etcd_addr)
        if "/" in self.namespace:
            raise ConfigError("namespace", f"must not contain '/', got {self.namespace!r}")
        for field in ("relist_interval_s", "lease_lost_grace_s", "suspect_removal_s",
                      "health_probe_timeout_s", "loadmetrics_interval_s"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(field, f"must be a number > 0, got {value!r}")
        ttl = self.master_lease_ttl_s
        if isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 1:
            raise ConfigError("master_lease_ttl_s", f"must be an int >= 1, got {ttl!r}")

    @property
    def key_prefix(self) -> str:
        """``/<namespace>/`` or ``""``: what comes before every §9 key."""
        return f"/{self.namespace}/" if self.namespace else ""


class Registry:
    """The in-process instance registry (§9). See the module docstring for threads and rules.

    :param settings: timings and identity; nothing is opened in the constructor.
    """

    def __init__(self, settings: RegistrySettings) -> None:
        raise NotImplementedError

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the etcd, timer and election threads; returns once they run and the first list
        was attempted (etcd being down is not fatal: the snapshot is then not ``fresh``).

        :raises LifecycleError: when a thread does not come up within ``timeout_s``.
        """
        raise NotImplementedError

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop every thread (joined within ``timeout_s``, logged if not), resign mastership
        (revoking the master lease) and close etcd sessions. Idempotent."""
        raise NotImplementedError

    def snapshot(self) -> RegistrySnapshot:
        """The current immutable snapshot (lock-free; safe on request threads)."""
        raise NotImplementedError

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
        raise NotImplementedError

    def wait_for(self, predicate: Callable[[RegistrySnapshot], bool],
                 timeout_s: float) -> RegistrySnapshot:
        """Block until ``predicate(snapshot)`` is true (checked on every change), return that
        snapshot.

        :raises WaitTimeout: after ``timeout_s`` seconds.
        """
        raise NotImplementedError
