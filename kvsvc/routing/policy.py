"""Routing policies (§11): pick the prefill (P) and decode (D) instance of one request.

Data flow: socket -> frame -> event -> index -> directory -> **policy** -> HTTP. A policy is a
pure function of in-process values (a :class:`~kvsvc.cluster.model.RegistrySnapshot`, the
directory's :class:`~kvsvc.streams.state.StreamMatch` list and the streams' identities) plus
one rotation counter per side; it never does ZMQ, etcd or network I/O (§11).

Two implementations of :class:`Policy`:

- :class:`RoundRobin` (``RR``, xllm-service's behaviour): rotates over the candidates of each
  side in name order.
- :class:`CacheAware` (``CAR``, §11 exactly): lowest ``score(P) = lambda * (1 - hit) +
  (1 - lambda) * queue_cost`` and lowest ``score(D) = gpu_cache_usage_perc + waiting / max
  waiting``; scores within :data:`TIE_EPSILON` of the minimum rotate round robin among the tied.

Candidates (§11, both policies, :func:`candidate_pools`): schedulable (not ``SUSPECT``)
instances with a current load report: received by this process at most ``max_load_age_s``
seconds before the request (:meth:`~kvsvc.cluster.model.LoadMetrics.is_current`; the time is
passed in, so a policy stays a pure function). P side: ``role`` DEFAULT or PREFILL (a MIX
instance's role is PREFILL or DECODE, see :mod:`kvsvc.cluster.registry`); D side: ``role``
DECODE. When the D side is empty only DEFAULT instances may serve (alone); when it is not, the
P is chosen among the whole P side and paired with a D (the reading of "only DEFAULT may serve
alone when there is no D" kept here). Every registered instance that is not a candidate is
listed with why (:attr:`CandidatePools.excluded`, ``excluded`` of a decision, ``/ready``'s
``not_candidates``).

The router's own load: every policy takes this worker's requests in flight
(:class:`~kvsvc.routing.in_flight.InFlightSnapshot`); CAR's ``waiting`` of a candidate is
:func:`~kvsvc.routing.in_flight.waiting_estimate` (the reported value when nothing is in flight,
§11 exactly), RR only shows the counts.

§12's SLO_AWARE and TTFT build on these (:mod:`kvsvc.routing.slo`, :mod:`kvsvc.routing.ttft`);
:func:`kvsvc.routing.policies.make_policy` builds the one ``--load_balance_policy`` names.

Parameters arrive valid: their ranges are the settings table's (:mod:`kvsvc.settings`),
checked once there. Choosing never raises (no candidate gives a :class:`Decision` with
``prefill=None``).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, Optional, Protocol, Sequence

from kvsvc.cluster.model import (
    Instance,
    InstanceState,
    InstanceType,
    RegistrySnapshot,
    instance_identity,
)
from kvsvc.index.overlay import PromptKeys
from kvsvc.settings import (
    DEFAULT_MAX_LOAD_AGE_S,
    PolicyName,
)
from kvsvc.routing.in_flight import (
    NO_IN_FLIGHT,
    InFlightSnapshot,
    rank_waiting_estimate,
    waiting_estimate,
)
from kvsvc.streams.state import StreamId, StreamMatch

log = logging.getLogger(__name__)

#: §11: scores within this of the minimum are ties.
TIE_EPSILON = 1e-9

#: Side labels of :class:`CandidateScore`.
PREFILL_SIDE = "P"
DECODE_SIDE = "D"

#: ``backend_type`` values (§9) whose engines honour the request header
#: ``X-data-parallel-rank`` (§15): vLLM and SGLang read it and run the request on that rank.
RANK_HEADER_BACKENDS = frozenset({"vllm", "sglang"})

#: Why a rank counts 0 hits (``RankHit.reason``).
REASON_MISSING = "missing"
REASON_UNSYNCHRONIZED = "unsynchronized"
REASON_STALE = "stale incarnation"
REASON_NO_TOKENS = "no tokens"
REASON_INDEX_DISABLED = "index disabled"


@dataclass(frozen=True, slots=True)
class RankHit:
    """One DP rank's part of a P candidate's hit ratio (§11).

    :ivar dp_rank: the rank, ``0 <= dp_rank < dp_size``.
    :ivar device_hit_tokens: tokens of the reusable prefix on Device (0 when ``reason`` is set).
    :ivar host_only_hit_tokens: tokens of the same prefix only on Host (0 when ``reason`` set).
    :ivar hit_ratio: ``clamp(hit_tokens / input_tokens, 0, 1)`` with :func:`hit_tokens`
        ``= device + host_weight * host_only + pending``; 0.0 when ``reason`` is set.
    :ivar reason: ``None``, or why this rank counts 0 (``missing``, ``unsynchronized``,
        ``stale incarnation``, ``no tokens``, ``index disabled``).
    :ivar completeness: what the hits are worth (§7h, §10): the stream's ``"exact"`` or
        ``"subset"`` (a subset's hits are used as they are: never more than the engine holds)
        when they come from its index (``reason`` ``None`` or ``no tokens``); ``None``
        otherwise; ``"approximate"`` for an approximate index (§14).
    :ivar pending_hit_tokens: tokens of the blocks right after the reusable prefix that this
        router sent there and whose events have not arrived (§16), apart from the two above
        (0 when ``reason`` is set).
    """

    dp_rank: int
    device_hit_tokens: int
    host_only_hit_tokens: int
    hit_ratio: float
    reason: Optional[str]
    completeness: Optional[str] = None
    pending_hit_tokens: int = 0

    def to_json(self) -> dict:
        """JSON object of this rank."""
        return {"dp_rank": self.dp_rank, "device_hit_tokens": self.device_hit_tokens,
                "host_only_hit_tokens": self.host_only_hit_tokens,
                "pending_hit_tokens": self.pending_hit_tokens,
                "hit_ratio": self.hit_ratio, "reason": self.reason,
                "completeness": self.completeness}


@dataclass(frozen=True, slots=True)
class CandidateScore:
    """One candidate as the policy saw it.

    :ivar name: instance ``host:port``.
    :ivar side: ``"P"`` or ``"D"``.
    :ivar ranks: P side: one :class:`RankHit` per DP rank (empty for RR and for D).
    :ivar hit_ratio: P side under CAR: the minimum over ranks, in [0, 1]; ``None`` otherwise.
    :ivar queue_cost: CAR: ``waiting / max waiting`` of the side, in [0, 1]; ``None`` for RR.
    :ivar score: CAR: the §11 score (lowest wins); ``None`` for RR.
    :ivar tied: CAR: within :data:`TIE_EPSILON` of the side's minimum (then rotated).
    :ivar waiting_requests_num: the instance's reported queue length.
    :ivar gpu_cache_usage_perc: the instance's reported Device usage, fraction in [0, 1].
    :ivar in_flight: requests this worker has in flight to the instance.
    :ivar in_flight_after_report: the part of ``in_flight`` dispatched after the instance's
        load report, which CAR's queue term adds to ``waiting_requests_num`` (less one after
        a report of an empty queue, :func:`waiting_estimate`).
    :ivar estimated_prefill_ms: SLO_AWARE and TTFT, P side: the instance's estimated queued
        prefill time, milliseconds (SLO_AWARE: its requests' ``estimated_prefill_time``;
        TTFT: that combined with the last load report, :mod:`kvsvc.routing.ttft`); D side of
        SLO_AWARE: the same value (the prefill redirect compares it); ``None`` otherwise.
    :ivar predicted_prefill_ms: SLO_AWARE and TTFT, P side: this request's own predicted
        prefill time there (SLO_AWARE: ``ttft(input_tokens)``; TTFT: ``ttft(uncached)``),
        milliseconds; ``None`` otherwise.
    :ivar predicted_ttft_ms: SLO_AWARE and TTFT, P side: ``estimated_prefill_ms +
        predicted_prefill_ms`` (TTFT's score), milliseconds; ``None`` otherwise.
    :ivar predicted_tpot_ms: SLO_AWARE, D side: the predicted time per output token with
        this request added (truncated to whole ms, as the source), ``None`` otherwise.
    :ivar dp_rank: P side under DP-rank routing (§15): the DP rank this candidate is, one
        candidate per (instance, rank) pair, scored with that rank's hits (``ranks`` holds
        that one rank) and load (``waiting_requests_num``, ``gpu_cache_usage_perc`` and the
        in-flight counts are the rank's: its own values when the engine reports per rank,
        else the instance's queue shared evenly); ``None`` for a candidate that is a whole
        instance (§11's minimum over its ranks).
    """

    name: str
    side: str
    ranks: tuple[RankHit, ...]
    hit_ratio: Optional[float]
    queue_cost: Optional[float]
    score: Optional[float]
    tied: bool
    waiting_requests_num: int
    gpu_cache_usage_perc: float
    in_flight: int = 0
    in_flight_after_report: int = 0
    estimated_prefill_ms: Optional[float] = None
    predicted_prefill_ms: Optional[float] = None
    predicted_ttft_ms: Optional[float] = None
    predicted_tpot_ms: Optional[float] = None
    dp_rank: Optional[int] = None

    def to_json(self) -> dict:
        """JSON object of this candidate (``POST /v1/internal/route``)."""
        return {"name": self.name, "side": self.side, "dp_rank": self.dp_rank,
                "ranks": [r.to_json() for r in self.ranks], "hit_ratio": self.hit_ratio,
                "queue_cost": self.queue_cost, "score": self.score, "tied": self.tied,
                "waiting_requests_num": self.waiting_requests_num,
                "gpu_cache_usage_perc": self.gpu_cache_usage_perc,
                "in_flight": self.in_flight,
                "in_flight_after_report": self.in_flight_after_report,
                "estimated_prefill_ms": self.estimated_prefill_ms,
                "predicted_prefill_ms": self.predicted_prefill_ms,
                "predicted_ttft_ms": self.predicted_ttft_ms,
                "predicted_tpot_ms": self.predicted_tpot_ms}


@dataclass(frozen=True, slots=True)
class Decision:
    """What a policy chose for one request.

    :ivar policy: the policy's name (``RR``, ``CAR``, ``SLO_AWARE`` or ``TTFT``).
    :ivar prefill: the chosen P instance; ``None`` when no instance can serve.
    :ivar decode: the chosen D instance; ``None`` when the D side is empty (DEFAULT alone).
    :ivar candidates: every candidate, P side first, each side best first.
    :ivar prefill_ranking: the eligible P instances best first (``prefill`` first): the proxy
        retries on the next one when the first refuses (§11 leaves the order to the policy).
    :ivar input_tokens: tokens the hit ratios were computed for (0 when unknown).
    :ivar reason: why ``prefill`` is ``None`` (empty otherwise).
    :ivar excluded: every registered instance that was not a candidate -> why
        (:attr:`CandidatePools.excluded`).
    :ivar prefill_estimates_ms: P candidate ``host:port`` -> the policy's predicted prefill
        time of this request there, milliseconds (SLO_AWARE's ``estimated_ttft``, TTFT's
        ``ttft_P(uncached)``, §12), handed to the request observers at dispatch
        (:class:`~kvsvc.routing.observer.RequestInfo`); empty for RR and CAR.
    :ivar prefill_ranks: P instance ``host:port`` -> the DP rank the request goes to there
        (its best-scored pair, §15), for the instances scored per (instance, rank) pair; the
        request is sent with ``X-data-parallel-rank`` set to it. Instances absent here get
        no rank header (the engine picks the rank).
    :ivar prompt: the prompt's content keys as the directory's query computed them
        (:meth:`kvsvc.directory.Directory.query_prompt`), set by the router: what the dispatch
        records in the chosen stream's approximate index or pending blocks (§14, §16);
        ``None`` without an index or tokens.
    """

    policy: str
    prefill: Optional[Instance]
    decode: Optional[Instance]
    candidates: tuple[CandidateScore, ...]
    prefill_ranking: tuple[Instance, ...]
    input_tokens: int
    reason: str = ""
    excluded: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    prefill_estimates_ms: Mapping[str, float] = field(
        default_factory=lambda: MappingProxyType({}))
    prefill_ranks: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    prompt: Optional[PromptKeys] = None

    @property
    def prefill_rank(self) -> Optional[int]:
        """The DP rank chosen on ``prefill`` (§15), ``None`` when the request carries none."""
        if self.prefill is None:
            return None
        return self.prefill_ranks.get(self.prefill.name)

    def prefill_candidate(self, name: str) -> Optional[CandidateScore]:
        """The P-side candidate ``name`` (``host:port``) as the request is sent there: the
        pair of its chosen DP rank under DP-rank routing (§15), else the instance; ``None``
        when it was not one."""
        rank = self.prefill_ranks.get(name)
        for cand in self.candidates:
            if cand.side == PREFILL_SIDE and cand.name == name and (
                    rank is None or cand.dp_rank == rank):
                return cand
        return None

    def to_json(self) -> dict:
        """JSON object of the decision (``POST /v1/internal/route``); ``excluded`` is an
        object ``{"host:port": "reason"}``."""
        return {"policy": self.policy,
                "prefill": self.prefill.name if self.prefill is not None else None,
                "prefill_dp_rank": self.prefill_rank,
                "decode": self.decode.name if self.decode is not None else None,
                "input_tokens": self.input_tokens,
                "candidates": [c.to_json() for c in self.candidates],
                "reason": self.reason or None,
                "excluded": dict(self.excluded)}


#: Stream id -> the identity the stream was added for (``None``: static stream, not checked).
Identities = Mapping[StreamId, Optional[str]]


class Policy(Protocol):
    """A routing policy (§11). Implementations are thread-safe: request threads call
    :meth:`choose` concurrently.

    :ivar name: ``RR``, ``CAR``, ``SLO_AWARE`` or ``TTFT``.
    :ivar max_load_age_s: ``--max_load_age_s``: the candidates' age limit (seconds).
    """

    name: str
    max_load_age_s: float

    def choose(self, token_ids: Optional[Sequence[int]], snapshot: RegistrySnapshot,
               matches: Optional[list[StreamMatch]],
               identities: Optional[Identities] = None,
               in_flight: InFlightSnapshot = NO_IN_FLIGHT, *, now: float) -> Decision:
        """Pick P and D for one request.

        :param token_ids: the prompt's token ids; ``None`` when unknown (no tokenizer), which
            gives hit ratio 0 everywhere.
        :param snapshot: the registry's snapshot.
        :param matches: the directory's answer for ``token_ids``; ``None`` with the index
            disabled (hit ratio 0).
        :param identities: stream -> identity, read *before* ``matches`` (so a stream replaced
            in between is judged by its predecessor's identity and counts 0); ``None`` or a
            ``None`` value skips the incarnation check (static streams).
        :param in_flight: this worker's requests in flight
            (:meth:`~kvsvc.routing.in_flight.InFlight.snapshot`); CAR
            adds those dispatched after each load report to ``waiting``.
        :param now: ``time.monotonic()`` seconds of the request: a load report received more
            than ``max_load_age_s`` before it does not make a candidate (passed in, so the
            choice is a pure function of its arguments).
        """
        ...


# -- candidate selection (shared) ----------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class CandidatePools:
    """The candidates of one request (§11), each pool in name order.

    :ivar prefill: the P side (DEFAULT alone when the D side is empty).
    :ivar decode: the D side.
    :ivar reason: why there is no P (empty otherwise).
    :ivar excluded: every instance of the snapshot that is in neither pool -> why, e.g.
        ``"SUSPECT"``, ``"no load report yet"``, ``"load report 12.3 s old (max_load_age_s
        10)"``, ``"role PREFILL: no decode instance to pair with"``.
    """

    prefill: tuple[Instance, ...]
    decode: tuple[Instance, ...]
    reason: str
    excluded: Mapping[str, str]


#: :attr:`CandidatePools.excluded` reasons (the age one is built by :func:`not_schedulable`).
EXCLUDED_SUSPECT = "SUSPECT"
EXCLUDED_NO_LOAD = "no load report yet"
EXCLUDED_NO_DECODE = "no decode instance to pair with (only DEFAULT serves alone)"
EXCLUDED_NO_PREFILL = "no prefill instance to pair with"


def not_schedulable(inst: Instance, now: float, max_load_age_s: float) -> Optional[str]:
    """Why ``inst`` cannot be a candidate whatever its side (§11), or None when it can:
    ``SUSPECT``, no load report, or a report that is not current at ``now``
    (:meth:`~kvsvc.cluster.model.LoadMetrics.is_current`).

    :param now: ``time.monotonic()`` seconds.
    :param max_load_age_s: seconds, > 0.
    """
    if inst.state is InstanceState.SUSPECT:
        return EXCLUDED_SUSPECT
    load = inst.load
    if load is None:   # the registry keeps only valid reports
        return EXCLUDED_NO_LOAD
    if not load.is_current(now, max_load_age_s):
        return (f"load report {load.age_s(now):.1f} s old "
                f"(max_load_age_s {max_load_age_s:g})")
    return None


def candidate_pools(snapshot: RegistrySnapshot, now: float,
                    max_load_age_s: float) -> CandidatePools:
    """Split the snapshot's candidates into P and D pools (§11), each in name order, and say
    why every other instance is not one. The one rule of routing and of ``/ready``.

    P side: role DEFAULT or PREFILL; D side: role DECODE; both: :func:`not_schedulable` is
    None. With an empty D side only DEFAULT instances remain on the P side (they serve alone;
    the others are excluded, :data:`EXCLUDED_NO_DECODE`); with an empty P side the D side
    cannot serve (:data:`EXCLUDED_NO_PREFILL`).

    :param snapshot: the registry's snapshot.
    :param now: ``time.monotonic()`` seconds of the request.
    :param max_load_age_s: ``--max_load_age_s``, seconds.
    """
    excluded: dict[str, str] = {}
    usable: list[Instance] = []
    for name in sorted(snapshot.instances):
        inst = snapshot.instances[name]
        why = not_schedulable(inst, now, max_load_age_s)
        if why is None:
            usable.append(inst)
        else:
            excluded[name] = why
    prefill = [i for i in usable if i.role in (InstanceType.DEFAULT, InstanceType.PREFILL)]
    decode = tuple(i for i in usable if i.role is InstanceType.DECODE)

    def pools(p: Sequence[Instance], d: tuple[Instance, ...], reason: str) -> CandidatePools:
        chosen = {i.name for i in p} | {i.name for i in d}
        for inst in usable:
            if inst.name not in chosen:
                why = EXCLUDED_NO_DECODE if inst.role is not InstanceType.DECODE else \
                    EXCLUDED_NO_PREFILL
                excluded[inst.name] = f"role {inst.role.name}: {why}"
        return CandidatePools(tuple(p), d, reason,
                              MappingProxyType(dict(sorted(excluded.items()))))

    if not decode:
        alone = tuple(i for i in prefill if i.type is InstanceType.DEFAULT)
        if alone:
            return pools(alone, (), "")
        reason = ("no schedulable instance with a current load report" if not usable else
                  "no decode instance and no DEFAULT instance to serve alone")
        return pools((), (), reason)
    if not prefill:
        return pools((), (), "no schedulable prefill instance")
    return pools(prefill, decode, "")


def _rotate(counter: list[int], lock: threading.Lock, n: int) -> int:
    """Next index in ``range(n)`` from a shared counter (one increment per call)."""
    with lock:
        value = counter[0]
        counter[0] = value + 1
    return value % n


# -- RR --------------------------------------------------------------------------------------------

class RoundRobin:
    """``RR``: each side rotates over its candidates in name order, one step per request
    (xllm-service's round robin; a change of the candidate set keeps the counter).

    No hit ratios are computed; the candidates carry ``None`` scores.

    :param max_load_age_s: ``--max_load_age_s``, seconds (valid: the settings table's range).
    """

    name = PolicyName.RR.value

    def __init__(self, max_load_age_s: float = DEFAULT_MAX_LOAD_AGE_S) -> None:
        self.max_load_age_s = float(max_load_age_s)
        self._lock = threading.Lock()
        self._counters = {PREFILL_SIDE: [0], DECODE_SIDE: [0]}

    def choose(self, token_ids: Optional[Sequence[int]], snapshot: RegistrySnapshot,
               matches: Optional[list[StreamMatch]],
               identities: Optional[Identities] = None,
               in_flight: InFlightSnapshot = NO_IN_FLIGHT, *, now: float) -> Decision:
        """See :meth:`Policy.choose`; ``token_ids``, ``matches`` and ``identities`` are
        ignored, ``in_flight`` is only shown in the candidates."""
        pools = candidate_pools(snapshot, now, self.max_load_age_s)
        n_tokens = len(token_ids) if token_ids is not None else 0
        if not pools.prefill:
            return Decision(self.name, None, None, (), (), n_tokens, pools.reason,
                            pools.excluded)
        start = _rotate(self._counters[PREFILL_SIDE], self._lock, len(pools.prefill))
        ranking = pools.prefill[start:] + pools.prefill[:start]
        decode = None
        d_ranking: tuple[Instance, ...] = ()
        if pools.decode:
            d_start = _rotate(self._counters[DECODE_SIDE], self._lock, len(pools.decode))
            d_ranking = pools.decode[d_start:] + pools.decode[:d_start]
            decode = d_ranking[0]
        cands = tuple(_plain(i, PREFILL_SIDE, in_flight) for i in ranking) + tuple(
            _plain(i, DECODE_SIDE, in_flight) for i in d_ranking)
        return Decision(self.name, ranking[0], decode, cands, ranking, n_tokens,
                        excluded=pools.excluded)


def _plain(inst: Instance, side: str, in_flight: InFlightSnapshot) -> CandidateScore:
    assert inst.load is not None
    return CandidateScore(inst.name, side, (), None, None, None, False,
                          inst.load.waiting_requests_num, inst.load.gpu_cache_usage_perc,
                          in_flight.total(inst.name),
                          in_flight.after(inst.name, inst.load.received_at))


# -- CAR -------------------------------------------------------------------------------------------

def _clamp01(value: float) -> float:
    return 0.0 if value < 0.0 else 1.0 if value > 1.0 else value


def hit_tokens(rank: RankHit, host_weight: float) -> float:
    """The hit term of one (instance, DP rank) (§11, §16): ``device + host_weight * host_only
    + pending`` tokens, 0 for a rank that counts nothing (``reason`` set). Pending blocks
    weigh as Device ones: the prefill in flight leaves them on Device (TTFT prices when,
    :mod:`kvsvc.routing.ttft`)."""
    if rank.reason:
        return 0.0
    return (rank.device_hit_tokens + host_weight * rank.host_only_hit_tokens
            + rank.pending_hit_tokens)


def rank_hits(instance: Instance, token_ids: Optional[Sequence[int]],
              by_stream: Optional[Mapping[tuple[str, int], StreamMatch]],
              identities: Optional[Identities], host_weight: float) -> tuple[RankHit, ...]:
    """Every DP rank's hit of ``instance`` for one prompt (§11).

    :param instance: a P candidate; ranks ``0 .. dp_size - 1``.
    :param token_ids: the prompt, ``None`` when unknown.
    :param by_stream: (instance_name, dp_rank) -> match; ``None`` with the index disabled.
    :param identities: see :meth:`Policy.choose`.
    :param host_weight: weight of Host-only hit tokens, in [0, 1].
    :returns: ``dp_size`` ranks; a rank missing, unsynchronized or of another incarnation
        counts 0 with its reason. A rank's pending hits (§16) are in its ratio, and apart in
        ``pending_hit_tokens``.
    """
    n_tokens = len(token_ids) if token_ids is not None else 0
    expected = instance_identity(instance)
    out: list[RankHit] = []
    for rank in range(max(1, instance.dp_size)):
        if by_stream is None:
            out.append(RankHit(rank, 0, 0, 0.0, REASON_INDEX_DISABLED))
            continue
        match = by_stream.get((instance.name, rank))
        if match is None:
            out.append(RankHit(rank, 0, 0, 0.0, REASON_MISSING))
            continue
        if not match.synchronized:
            out.append(RankHit(rank, 0, 0, 0.0, REASON_UNSYNCHRONIZED))
            continue
        if identities is not None:
            identity = identities.get(StreamId(instance.name, rank))
            if identity is not None and identity != expected:
                out.append(RankHit(rank, 0, 0, 0.0, REASON_STALE))
                continue
        completeness = None if match.completeness is None else str(match.completeness)
        if n_tokens == 0:
            out.append(RankHit(rank, 0, 0, 0.0, REASON_NO_TOKENS, completeness))
            continue
        # §7h: a subset stream's hits count as they are (every block in it is resident);
        # §16: pending ones count apart, in the same hit term (hit_tokens).
        dev, host = match.device_hit_tokens, match.host_only_hit_tokens
        pending = match.pending_hit_tokens
        out.append(RankHit(rank, dev, host,
                           _clamp01((dev + host_weight * host + pending) / n_tokens),
                           None, completeness, pending))
    return tuple(out)


def rank_routed(instance: Instance, enabled: bool) -> bool:
    """True when ``instance`` is scored per (instance, DP rank) pair and sent to one rank
    (§15): DP-rank routing ``enabled`` (``--dp_rank_routing``), more than one rank, and its
    ``backend_type`` in :data:`RANK_HEADER_BACKENDS`. Every other instance keeps §11's
    minimum over its ranks (with one rank that is the rank; no header is sent)."""
    return enabled and instance.dp_size > 1 and instance.backend_type in RANK_HEADER_BACKENDS


@dataclass(frozen=True, slots=True)
class PrefillEntry:
    """One P-side unit a policy scores: a whole instance (``dp_rank`` ``None``, ``ranks``
    all of its DP ranks, hit = their minimum, §11) or one (instance, rank) pair (§15:
    ``ranks`` holds that rank only).

    :ivar instance: the P candidate.
    :ivar dp_rank: the pair's rank, ``None`` for a whole instance.
    :ivar ranks: the ranks whose hits count (the minimum over them is the hit).
    """

    instance: Instance
    dp_rank: Optional[int]
    ranks: tuple[RankHit, ...]

    @property
    def hit_ratio(self) -> float:
        """The §11 hit ratio of the entry: the minimum over :attr:`ranks`."""
        return min(r.hit_ratio for r in self.ranks)

    def waiting(self, in_flight: InFlightSnapshot) -> float:
        """CAR's ``waiting`` of the entry (:func:`waiting_estimate`, per rank
        :func:`rank_waiting_estimate`)."""
        if self.dp_rank is None:
            return float(waiting_estimate(self.instance, in_flight))
        return rank_waiting_estimate(self.instance, self.dp_rank, in_flight)

    def candidate(self, in_flight: InFlightSnapshot, hit: Optional[float],
                  queue_cost: Optional[float], score: Optional[float], tied: bool,
                  **extra: Optional[float]) -> CandidateScore:
        """The entry as a :class:`CandidateScore` (a pair shows its rank's load)."""
        inst, load = self.instance, self.instance.load
        assert load is not None  # candidate_pools keeps only instances with a load
        waiting, usage = load.waiting_requests_num, load.gpu_cache_usage_perc
        total = in_flight.total(inst.name)
        after = in_flight.after(inst.name, load.received_at)
        if self.dp_rank is not None:
            own = load.rank(self.dp_rank)
            if own is not None:
                waiting, usage = own.waiting_requests_num, own.gpu_cache_usage_perc
            total = in_flight.rank_total(inst.name, self.dp_rank)
            after = in_flight.rank_after(inst.name, self.dp_rank, load.received_at)
        return CandidateScore(inst.name, PREFILL_SIDE, self.ranks, hit, queue_cost, score,
                              tied, waiting, usage, total, after, dp_rank=self.dp_rank,
                              **extra)


def prefill_entries(pool: Sequence[Instance], token_ids: Optional[Sequence[int]],
                    matches: Optional[list[StreamMatch]], identities: Optional[Identities],
                    host_weight: float, dp_rank_routing: bool) -> list[PrefillEntry]:
    """The P side's scored units, in pool order: one :class:`PrefillEntry` per rank of a
    :func:`rank_routed` instance (rank order), one per other instance."""
    by_stream = (None if matches is None else
                 {(m.instance_name, m.dp_rank): m for m in matches})
    out: list[PrefillEntry] = []
    for inst in pool:
        ranks = rank_hits(inst, token_ids, by_stream, identities, host_weight)
        if rank_routed(inst, dp_rank_routing):
            out.extend(PrefillEntry(inst, r.dp_rank, (r,)) for r in ranks)
        else:
            out.append(PrefillEntry(inst, None, ranks))
    return out


def entry_ranking(entries: Sequence[PrefillEntry], order: Sequence[int]
                  ) -> tuple[tuple[Instance, ...], Mapping[str, int]]:
    """The instances in the order of their best entry (a retry goes to another instance, not
    to another rank of the one that failed) and each pair-scored instance's best rank."""
    ranking: list[Instance] = []
    ranks: dict[str, int] = {}
    seen: set[str] = set()
    for i in order:
        e = entries[i]
        if e.instance.name in seen:
            continue
        seen.add(e.instance.name)
        ranking.append(e.instance)
        if e.dp_rank is not None:
            ranks[e.instance.name] = e.dp_rank
    return tuple(ranking), MappingProxyType(ranks)


class CacheAware:
    """``CAR`` (§11): the P candidate with the lowest ``lambda * (1 - kv_hit_ratio) +
    (1 - lambda) * queue_cost`` and the D candidate with the lowest ``gpu_cache_usage_perc +
    waiting / max waiting``; ties (within :data:`TIE_EPSILON` of the minimum) rotate among the
    tied, in name order, one counter per side, advanced only by a tie.

    With DP-rank routing (§15) an instance of a backend in :data:`RANK_HEADER_BACKENDS` is
    scored per (instance, rank) pair: that rank's hit ratio and that rank's queue
    (:func:`~kvsvc.routing.in_flight.rank_waiting_estimate`), normalised by the largest
    ``waiting`` over every P entry; the instance is ranked by its best pair, whose rank the
    decision carries (:attr:`Decision.prefill_ranks`).

    :param prefill_lambda: ``--car_prefill_lambda``, in [0, 1] (1: cache only, 0: queue only).
    :param host_hit_weight: ``--car_host_hit_weight``, weight of Host-only hit tokens, [0, 1].
    :param max_load_age_s: ``--max_load_age_s``, seconds in ``(0, 3600]``.
    :param dp_rank_routing: ``--dp_rank_routing`` (§15).

    The values arrive valid (the settings table's ranges, checked once there).
    """

    name = PolicyName.CAR.value

    def __init__(self, prefill_lambda: float = 0.5, host_hit_weight: float = 0.5,
                 max_load_age_s: float = DEFAULT_MAX_LOAD_AGE_S,
                 dp_rank_routing: bool = True) -> None:
        self.prefill_lambda = float(prefill_lambda)
        self.host_hit_weight = float(host_hit_weight)
        self.max_load_age_s = float(max_load_age_s)
        self.dp_rank_routing = bool(dp_rank_routing)
        self._lock = threading.Lock()
        self._counters = {PREFILL_SIDE: [0], DECODE_SIDE: [0]}

    def choose(self, token_ids: Optional[Sequence[int]], snapshot: RegistrySnapshot,
               matches: Optional[list[StreamMatch]],
               identities: Optional[Identities] = None,
               in_flight: InFlightSnapshot = NO_IN_FLIGHT, *, now: float) -> Decision:
        """See :meth:`Policy.choose`. ``waiting`` in both queue terms is
        :func:`waiting_estimate` (the reported value when nothing is in flight; per pair
        :func:`~kvsvc.routing.in_flight.rank_waiting_estimate`)."""
        pools = candidate_pools(snapshot, now, self.max_load_age_s)
        n_tokens = len(token_ids) if token_ids is not None else 0
        if not pools.prefill:
            return Decision(self.name, None, None, (), (), n_tokens, pools.reason,
                            pools.excluded)
        lam = self.prefill_lambda
        entries = prefill_entries(pools.prefill, token_ids, matches, identities,
                                  self.host_hit_weight, self.dp_rank_routing)
        waits = [e.waiting(in_flight) for e in entries]
        top = max(waits, default=0.0)
        queue = [w / top if top > 0 else 0.0 for w in waits]
        hits = [e.hit_ratio for e in entries]
        scores = [lam * (1.0 - h) + (1.0 - lam) * q for h, q in zip(hits, queue)]
        p_order, p_tied = self._pick(scores, PREFILL_SIDE)
        cands: list[CandidateScore] = [
            entries[i].candidate(in_flight, hits[i], queue[i], scores[i], i in p_tied)
            for i in p_order]
        ranking, ranks = entry_ranking(entries, p_order)
        decode = self._choose_decode(pools, in_flight, cands)
        return Decision(self.name, ranking[0], decode, tuple(cands), ranking, n_tokens,
                        excluded=pools.excluded, prefill_ranks=ranks)

    def _choose_decode(self, pools: CandidatePools, in_flight: InFlightSnapshot,
                       cands: list[CandidateScore]) -> Optional[Instance]:
        """§11's D choice (lowest ``gpu_cache_usage_perc + waiting / max waiting``, ties
        rotating): appends the D candidates to ``cands``, best first; the chosen D, ``None``
        when the D side is empty. Shared by CAR and TTFT (§12: "D as CAR")."""
        if not pools.decode:
            return None
        d_queue = _queue_costs(pools.decode, in_flight)
        d_scores = [_usage(inst) + q for inst, q in zip(pools.decode, d_queue)]
        d_order, d_tied = self._pick(d_scores, DECODE_SIDE)
        for i in d_order:
            inst = pools.decode[i]
            assert inst.load is not None
            cands.append(CandidateScore(inst.name, DECODE_SIDE, (), None, d_queue[i],
                                        d_scores[i], i in d_tied,
                                        inst.load.waiting_requests_num,
                                        inst.load.gpu_cache_usage_perc,
                                        in_flight.total(inst.name),
                                        in_flight.after(inst.name, inst.load.received_at)))
        return pools.decode[d_order[0]]

    def _pick(self, scores: list[float], side: str) -> tuple[list[int], set[int]]:
        """Order candidate indexes best first: the chosen tie member, then the rest by
        (score, name order). Returns the order and the set of tied indexes (empty without a
        tie)."""
        best = min(scores)
        tied = [i for i, s in enumerate(scores) if s <= best + TIE_EPSILON]
        rest = sorted((i for i in range(len(scores)) if i not in tied),
                      key=lambda i: (scores[i], i))
        if len(tied) == 1:
            return tied + rest, set()
        start = _rotate(self._counters[side], self._lock, len(tied))
        return tied[start:] + tied[:start] + rest, set(tied)


def _usage(inst: Instance) -> float:
    return inst.load.gpu_cache_usage_perc if inst.load is not None else 0.0


def _queue_costs(pool: Sequence[Instance], in_flight: InFlightSnapshot) -> list[float]:
    """§11 ``waiting / max(waiting over the pool)``, 0 when that maximum is 0 (no NaN), with
    ``waiting`` = :func:`waiting_estimate`."""
    waits = [waiting_estimate(i, in_flight) for i in pool]
    top = max(waits, default=0)
    if top == 0:
        return [0.0] * len(waits)
    return [w / top for w in waits]
