"""The instance registry's data model (§9): instance types and states, load reports, one
instance as the registry sees it, the immutable snapshot request threads read, the registry's
settings, and the parsers of the registration and load values etcd holds.

Pure values and parsers, no I/O: the registry (:mod:`kvsvc.cluster.registry`), discovery, the
election, the routing policies and the HTTP layer all read these.

Errors: :class:`~kvsvc.errors.ConfigError` (naming the field) from :class:`RegistrySettings`;
:class:`~kvsvc.errors.MalformedRegistration` (naming the field) from the parsers and from
:func:`check_load`, the one range check of a load report (etcd's ``XLLM:LOADMETRICS`` values
and heartbeats alike).
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, TypeVar

from kvsvc.address import parse_host_port
from kvsvc.errors import ConfigError, MalformedRegistration
from kvsvc.settings import DEFAULT_MAX_LOAD_AGE_S

_T = TypeVar("_T")


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
class RankLoad:
    """One DP rank's part of a load report, where the engine reports per rank (§15: vLLM's
    ``engine`` label, SGLang's ``dp_rank`` label).

    :ivar dp_rank: the rank, >= 0.
    :ivar waiting_requests_num: requests queued on that rank, >= 0.
    :ivar gpu_cache_usage_perc: that rank's Device KV-cache usage, a fraction in [0, 1].
    """

    dp_rank: int
    waiting_requests_num: int
    gpu_cache_usage_perc: float


@dataclass(frozen=True, slots=True)
class LoadMetrics:
    """The latest load report of an instance (§9, §15).

    :ivar waiting_requests_num: queued requests, >= 0 (all ranks together).
    :ivar gpu_cache_usage_perc: Device KV-cache usage, a fraction in [0, 1] (a reported value
        above 1 is kept as 1.0, :func:`check_load`).
    :ivar received_at: ``time.monotonic()`` seconds when this process received it (heartbeat, a
        new ``XLLM:LOADMETRICS`` revision or a ``/metrics`` scrape).
    :ivar ranks: per-rank values in rank order when the report had them (a scrape of an engine
        labelling its ranks, §15); empty otherwise.
    :ivar source: ``"heartbeat"``, ``"etcd"`` or ``"scrape"``.
    """

    waiting_requests_num: int
    gpu_cache_usage_perc: float
    received_at: float
    ranks: tuple[RankLoad, ...] = ()
    source: str = "heartbeat"

    def rank(self, dp_rank: int) -> Optional[RankLoad]:
        """The report's values for ``dp_rank``, ``None`` when it has no per-rank values for
        it."""
        for r in self.ranks:
            if r.dp_rank == dp_rank:
                return r
        return None

    def age_s(self, now: float) -> float:
        """Seconds since this process received the report, at ``now`` (monotonic s)."""
        return now - self.received_at

    def is_current(self, now: float, max_age_s: float) -> bool:
        """The §11 age rule, the one place it is written: a report is current for
        ``max_age_s`` (``--max_load_age_s``) seconds after it was received, both ends
        included (age ``== max_age_s`` is still current; a ``received_at`` after ``now``, as a
        test may set, counts as age 0).

        :param now: ``time.monotonic()`` seconds.
        :param max_age_s: seconds, > 0.
        """
        return now - self.received_at <= max_age_s


@dataclass(frozen=True, slots=True)
class ProfilingData:
    """An instance's registered profiling data (§12, xllm-service's ``InstanceMetaInfo``):
    the points the time predictors are fitted from.

    :ivar ttft: ``ttft_profiling_data`` points ``(tokens, ms)``: prompt tokens (int >= 0) and
        the measured time to first token, milliseconds (finite, >= 0).
    :ivar tpot: ``tpot_profiling_data`` points ``(avg_len, batch, ms)``: average sequence
        length (int >= 0), batch size (int >= 0) and the measured time per output token,
        milliseconds (finite, >= 0).
    :ivar problems: one line per field that was present but not usable as it was, e.g.
        ``"ttft_profiling_data: 2 of 5 points dropped (item 1: not [tokens, ms] numbers)"``
        (the predictors add too-few-points problems of their own).
    """

    ttft: tuple[tuple[int, float], ...] = ()
    tpot: tuple[tuple[int, int, float], ...] = ()
    problems: tuple[str, ...] = ()


#: No profiling data registered.
NO_PROFILING = ProfilingData()


@dataclass(frozen=True, slots=True)
class Instance:
    """One registered instance as the registry sees it (§9).

    :ivar name: ``host:port`` from the key.
    :ivar type: registered type.
    :ivar role: current role: equal to ``type`` except for MIX, which is PREFILL or DECODE by the
        MIX role rule (:mod:`kvsvc.cluster.registry`).
    :ivar incarnation_id: the process incarnation, None when the registration carries none.
    :ivar register_ts_ms: registration time in ms since the epoch, None when absent.
    :ivar dp_size: DP ranks, >= 1 (0 or absent in the value means 1).
    :ivar backend_type: ``"xllm"`` unless the value says otherwise.
    :ivar rpc_address: the engine's RPC address, None when absent.
    :ivar state: §9 state.
    :ivar load: latest load, None until one arrives.
    :ivar profiling: the registration's ``ttft_profiling_data`` / ``tpot_profiling_data``
        (§12), the valid points and what was wrong with the others.
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
    profiling: ProfilingData = NO_PROFILING


def _number(v: object, integer: bool) -> Optional[float]:
    """``v`` as a finite number >= 0 (an integral one when ``integer``), else None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    f = float(v) if not isinstance(v, int) or abs(v) < 2**53 else math.inf
    if not 0.0 <= f < math.inf or (integer and f != int(f)):
        return None
    return f


def parse_profiling(obj: Mapping[str, Any]) -> ProfilingData:
    """The §12 profiling fields of a registration object; never raises (bad data must not make
    an instance unroutable: its predictor falls back, :mod:`kvsvc.routing.predictor`).

    ``ttft_profiling_data``: a list of ``[tokens, ms]``; ``tpot_profiling_data``: a list of
    ``[avg_len, batch, ms]``. Counts must be integral numbers >= 0, times finite numbers >= 0;
    an item of another shape or with another value is dropped (xllm-service drops items of
    the wrong length and fails the whole registration on a wrong type) and the field gets one
    problem line naming the first bad item. A field that is absent or ``null`` is no data and
    no problem; one that is not a list is a problem.
    """
    problems: list[str] = []

    def points(name: str, width: int, shape: str) -> list[tuple[float, ...]]:
        raw = obj.get(name)
        if raw is None:
            return []
        if not isinstance(raw, list):
            problems.append(f"{name}: not a list of {shape} ({type(raw).__name__})")
            return []
        good: list[tuple[float, ...]] = []
        first_bad: Optional[int] = None
        for i, item in enumerate(raw):
            vals = ([_number(v, j < width - 1) for j, v in enumerate(item)]
                    if isinstance(item, list) and len(item) == width else [None])
            if any(v is None for v in vals):
                first_bad = i if first_bad is None else first_bad
                continue
            good.append(tuple(v for v in vals if v is not None))
        if first_bad is not None:
            problems.append(f"{name}: {len(raw) - len(good)} of {len(raw)} points dropped "
                            f"(item {first_bad}: {raw[first_bad]!r:.60} is not {shape} with "
                            "counts integral >= 0 and a time >= 0 ms)")
        return good

    ttft = tuple((int(p[0]), p[1]) for p in points("ttft_profiling_data", 2, "[tokens, ms]"))
    tpot = tuple((int(p[0]), int(p[1]), p[2])
                 for p in points("tpot_profiling_data", 3, "[avg_len, batch, ms]"))
    return ProfilingData(ttft, tpot, tuple(problems))


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
    :ivar self_address: this service's address, the master key's value: its baidu_std
        ``ip:port`` when it serves one (§13), else its HTTP ``host:port``.
    :ivar service_address: the baidu_std ``ip:port`` kept as ``XLLM:SERVICE:<ip:port>`` under
        the election lease (every replica, as xllm-service; engines connect to each),
        ``""``: no such key.
    :ivar http_address: the HTTP ``host:port`` the master writes to
        ``KVSVC:SERVICE:MASTER:HTTP`` (where HTTP heartbeats go), ``""``: not written.
    :ivar max_load_age_s: ``--max_load_age_s`` (§11): the master writes (and keeps) an
        ``XLLM:LOADMETRICS`` key only for a load report that is current by this age.
    :raises ConfigError: from construction when one of the registry's own timings is out of
        range; ``field`` is the attribute's name (``relist_interval_s``, ...). The values from
        the settings table (``etcd_addr``, ``namespace``, ``suspect_removal_s``,
        ``max_load_age_s``) arrive valid (:mod:`kvsvc.settings`).
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
    service_address: str = ""
    http_address: str = ""
    max_load_age_s: float = DEFAULT_MAX_LOAD_AGE_S

    def __post_init__(self) -> None:
        # The registry's own timings (not settings; tests and the testbed set them). The
        # values that come from the settings table (etcd_addr, namespace, suspect_removal_s,
        # max_load_age_s) arrive valid: kvsvc.settings checks them once.
        for field in ("relist_interval_s", "lease_lost_grace_s", "health_probe_timeout_s",
                      "loadmetrics_interval_s"):
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


@dataclass(frozen=True, slots=True)
class Registration:
    """A parsed, valid registration value (§9); the fields of :class:`Instance` that come from
    etcd (see :func:`parse_registration` for the defaults)."""

    type: InstanceType
    incarnation_id: Optional[str]
    register_ts_ms: Optional[int]
    dp_size: int
    backend_type: str
    rpc_address: Optional[str]
    profiling: ProfilingData = NO_PROFILING
    # PD fields xllm-service keeps for ``GetInstanceInfo`` and P/D links (§13); read leniently
    # (a wrong type gives the default): only PD uses them.
    cluster_ids: tuple[int, ...] = ()
    addrs: tuple[str, ...] = ()
    ports: tuple[int, ...] = ()
    kv_split_size: int = 1
    #: ``dp_size`` as registered (0 when absent), as xllm-service answers it.
    registered_dp_size: int = 0


def _int_list(value: object, low: int, high: int) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and low <= v <= high for v in value):
        return ()
    return tuple(value)


def _check_name(name: str) -> None:
    try:
        parse_host_port(name)
    except ValueError:
        raise MalformedRegistration(f"instance name {name!r} is not host:port") from None


def parse_registration(key_type: InstanceType, name: str, value: bytes) -> Registration:
    """Parse one ``XLLM:<TYPE>:<name>`` value (§9). Unknown fields are ignored.

    :param key_type: the TYPE of the key.
    :param name: the ``<name>`` of the key (must be ``host:port``).
    :param value: the raw value bytes (UTF-8 JSON object).
    :returns: the registration; absent ``dp_size`` (or 0) is 1, absent ``backend_type`` is
        ``"xllm"``, empty ``incarnation_id``/``rpc_address`` are None; ``cluster_ids``,
        ``addrs``, ``ports`` and ``kv_split_size`` (§13 PD, default 1) of a wrong type are
        their defaults, never refused; the §12 profiling
        fields by :func:`parse_profiling` (never refused).
    :raises MalformedRegistration: not a JSON object, a field of the wrong type, ``name``/``type``
        disagreeing with the key, a name that is not ``host:port``, ``register_ts_ms`` < 0,
        ``dp_size`` outside 0-65536.
    """
    _check_name(name)
    try:
        obj = json.loads(value)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise MalformedRegistration(f"not JSON: {type(exc).__name__}") from exc
    if not isinstance(obj, dict):
        raise MalformedRegistration("not a JSON object")

    def opt(field: str, kind: type[_T]) -> Optional[_T]:
        v = obj.get(field)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, kind):
            raise MalformedRegistration(f"{field}: expected {kind.__name__}, "
                                        f"got {type(v).__name__}")
        return v

    if opt("name", str) not in (None, name):
        raise MalformedRegistration(f"name {obj['name']!r} differs from the key's {name!r}")
    type_v = opt("type", int)
    if type_v is not None and type_v != int(key_type):
        raise MalformedRegistration(f"type {type_v} differs from the key's {key_type.name}")
    incarnation = opt("incarnation_id", str) or None
    ts = opt("register_ts_ms", int)
    if ts is not None and ts < 0:
        raise MalformedRegistration(f"register_ts_ms {ts} < 0")
    dp = opt("dp_size", int)
    if dp is not None and not 0 <= dp <= 65536:
        raise MalformedRegistration(f"dp_size {dp} out of range 0-65536")
    backend = opt("backend_type", str) or "xllm"
    rpc = opt("rpc_address", str) or None
    addrs = obj.get("addrs")
    kv_split = obj.get("kv_split_size")
    return Registration(type=key_type, incarnation_id=incarnation, register_ts_ms=ts,
                         dp_size=dp or 1, backend_type=backend, rpc_address=rpc,
                         profiling=parse_profiling(obj),
                         cluster_ids=_int_list(obj.get("cluster_ids"), 0, 2**64 - 1),
                         addrs=(tuple(addrs) if isinstance(addrs, list)
                                and all(isinstance(a, str) for a in addrs) else ()),
                         ports=_int_list(obj.get("ports"), 0, 65535),
                         kv_split_size=(kv_split if isinstance(kv_split, int)
                                        and not isinstance(kv_split, bool)
                                        and -2**31 <= kv_split < 2**31 else 1),
                         registered_dp_size=dp or 0)


def parse_load(value: bytes) -> "CheckedLoad":
    """Parse one ``XLLM:LOADMETRICS:<name>`` value (§9):
    ``{"waiting_requests_num": int, "gpu_cache_usage_perc": number}`` checked by
    :func:`check_load`.

    :returns: the checked values (usage above 1 clamped, as for a heartbeat).
    :raises MalformedRegistration: not a JSON object, or a value :func:`check_load` refuses.
    """
    try:
        obj = json.loads(value)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise MalformedRegistration(f"not JSON: {type(exc).__name__}") from exc
    if not isinstance(obj, dict):
        raise MalformedRegistration("not a JSON object")
    return check_load(obj.get("waiting_requests_num"), obj.get("gpu_cache_usage_perc"))


#: Largest ``waiting_requests_num`` accepted: a queue length, and every consumer (the CAR
#: queue term, the Prometheus gauge) must be able to take it as a float.
MAX_WAITING_REQUESTS = 2**31 - 1


@dataclass(frozen=True, slots=True)
class CheckedLoad:
    """A load report that passed :func:`check_load`.

    :ivar waiting_requests_num: queued requests, in ``[0, MAX_WAITING_REQUESTS]``.
    :ivar gpu_cache_usage_perc: Device usage, a fraction in [0, 1] (what routing uses).
    :ivar reported_usage: the usage as reported, as a float: equal to
        ``gpu_cache_usage_perc`` unless it was above 1 and clamped.
    """

    waiting_requests_num: int
    gpu_cache_usage_perc: float
    reported_usage: float

    @property
    def clamped(self) -> bool:
        """True when the reported usage was above 1 and is used as 1.0."""
        return self.reported_usage != self.gpu_cache_usage_perc


def check_load(waiting: object, usage: object, field_prefix: str = "") -> CheckedLoad:
    """The one check of a load report (§9), for ``XLLM:LOADMETRICS`` values and heartbeats.

    Usage above 1 is clamped, not refused: xllm-service's ``vllm_sidecar`` sums the per-engine
    values of a multi-engine vLLM (1.3 for two engines at 65 %), and xllm-service accepts it
    (D24 in docs/decisions.md).
    Refusing it would leave the instance with no current load (not a candidate) although it
    reports every few seconds that it is busy; as 1.0 it is "full" for the D score and still
    routable. The caller counts and logs clamped reports (:attr:`CheckedLoad.clamped`).

    :param waiting: ``waiting_requests_num``: an int (not a bool) in
        ``[0, MAX_WAITING_REQUESTS]``.
    :param usage: ``gpu_cache_usage_perc``: an int or float (not a bool), finite and >= 0;
        above 1 it is used as 1.0. NaN, infinities, negatives and ints too large for a float
        are refused.
    :param field_prefix: put before the field name in the message, e.g. ``"load_metrics."``
        for a heartbeat body.
    :returns: the checked values.
    :raises MalformedRegistration: ``"<prefix>waiting_requests_num: must be an integer in
        [0, 2147483647]"`` or ``"<prefix>gpu_cache_usage_perc: must be a finite number >= 0
        (above 1 counts as 1)"``.
    """
    if (isinstance(waiting, bool) or not isinstance(waiting, int) or waiting < 0
            or waiting > MAX_WAITING_REQUESTS):
        raise MalformedRegistration(f"{field_prefix}waiting_requests_num: must be an integer "
                                    f"in [0, {MAX_WAITING_REQUESTS}]")
    reported: Optional[float] = None
    if not isinstance(usage, bool) and isinstance(usage, (int, float)):
        try:
            reported = float(usage)  # an int too large for a float raises
        except OverflowError:
            reported = None
    if reported is None or not 0.0 <= reported < math.inf:  # NaN fails both comparisons
        raise MalformedRegistration(f"{field_prefix}gpu_cache_usage_perc: must be a finite "
                                    "number >= 0 (above 1 counts as 1)")
    return CheckedLoad(waiting, min(reported, 1.0), reported)


def instance_identity(instance: Any) -> str:
    """The identity a stream is tied to (§9): ``incarnation_id`` when the registration has a
    non-empty one, else ``register_ts_ms`` (as ``"register_ts_ms:<ms>"``, never equal to a
    uuid).

    :param instance: an :class:`Instance` (``incarnation_id``: str or None,
        ``register_ts_ms``: int ms or None).
    """
    if instance.incarnation_id:
        return str(instance.incarnation_id)
    return f"register_ts_ms:{instance.register_ts_ms}"
