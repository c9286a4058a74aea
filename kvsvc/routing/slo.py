"""``SLO_AWARE`` (§12): xllm-service's SLO-aware selection, reproduced decision by decision from
xLLM-AI/xllm-service @73d5e00 (``scheduler/loadbalance_policy/slo_aware_policy.cpp``,
``scheduler/managers/instance_mgr.cpp`` ``select_instance_pair_on_slo``,
``update_request_metrics``, ``flip_prefill_to_decode``, ``flip_decode_to_prefill``,
``get_next_instance_pair``, ``add_instance_to_index``, ``remove_instance_from_index``).

Inputs: each candidate's :class:`~kvsvc.routing.predictor.TimePredictor` (its registered
profiling data) and its request metrics (:mod:`kvsvc.routing.request_metrics`, the router's own
traffic); ``--target_ttft`` ``T`` and ``--target_tpot`` ``S`` (ms). Arithmetic as the source's:
predictions are truncated to whole milliseconds (``int64_t``), the thresholds are ``float``
(32-bit, emulated by :func:`f32`), averages divide integers truncating toward zero.

A request without token ids (``SloAwarePolicy::select_instances_pair``): round robin over each
side's index, one step per request (``get_next_instance_pair``). Otherwise, with ``P`` the P
index and ``D`` the D index, in index order:

1. ``min_p`` = the first P with the lowest ``estimated_prefill_time`` (strict ``<``);
   ``avg_p`` = their sum divided by ``|P|``.
2. For each D: ``tpot_d = trunc(predict_tpot(decode_token_num + n, decode_request_num + 1))``
   with ``n`` the prompt's tokens; ``target_d`` = the first D with ``tpot_d <= S``; ``min_d`` =
   the first D with the lowest ``tpot_d``. The D is ``target_d``, else ``min_d``.
3. Prefill redirect: when ``min_p``'s time ``> T``, ``target_d != min_d``, ``tpot(min_d) <
   S * (|D| - 1) / |D|`` and ``min_d``'s own ``estimated_prefill_time`` is below ``min_p``'s,
   the P is ``min_d`` (a lightly loaded decode instance prefills), else ``min_p``. The
   request's ``estimated_ttft`` is ``trunc(predict_ttft(n))`` on that P (added to its
   ``estimated_prefill_time`` at dispatch, :attr:`~kvsvc.routing.policy.Decision.
   prefill_estimates_ms`).
4. ``flip_prefill_to_decode(P)`` when no D met ``S`` and (``avg_p < T (|P| - 1) / |P|`` or
   ``|D| < |P|``), and ``|P| > 1``.
5. ``flip_decode_to_prefill(D)`` when a request's end leaves its D with no decode request and
   ``|D| > 1`` (:meth:`SloAware.on_decode_idle`, called by the ledger).

What a flip does, as in the source: the instance leaves its index (swapped with the last entry,
which takes its place) and is added again by the registration rule: a PREFILL, DECODE or
DEFAULT instance goes back to the end of the same index (only the order changes); a MIX takes
role PREFILL when the D index is not empty, else DECODE. So at 73d5e00
``flip_prefill_to_decode`` never changes a role (it is only reached with a D, and a MIX then
lands in P again), while ``flip_decode_to_prefill`` turns a MIX decode into a prefill (another
D remains). A role change is kept here, in process (the source writes nothing to etcd either):
an override of the MIX's role applied on top of the registry's snapshot for that incarnation,
dropped when the registry itself gives the instance another role than the one flipped from
(its invariant repairs win, :mod:`kvsvc.cluster.registry`). Each role change is logged (INFO);
a reorder is logged at DEBUG.

The indexes: the source appends an instance at registration; here an instance is appended
(in name order) when it becomes a candidate of that side (§11 candidates: schedulable with a
current load report) and swapped out when it stops being one. Requests routed with no D
(DEFAULT serving alone, where the source's ``select_instance_pair_on_slo`` fails with "No
decode instance found!") take ``min_p`` and no redirect or flip (docs/routing.md).

The choice never does network I/O; it reads the ledger's snapshot and mutates only this
policy's indexes (like the source's select, an audit decision through
``/v1/internal/route`` runs the same rules). The targets arrive valid (the settings table's
ranges, checked once there); choosing never raises.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import struct
import threading
from types import MappingProxyType
from typing import Any, Optional, Sequence

from kvsvc.cluster.model import (
    Instance,
    InstanceType,
    RegistrySnapshot,
    instance_identity,
)
from kvsvc.routing.in_flight import NO_IN_FLIGHT, InFlightSnapshot
from kvsvc.routing.policy import (
    DECODE_SIDE,
    PREFILL_SIDE,
    CandidatePools,
    CandidateScore,
    Decision,
    Identities,
    candidate_pools,
)
from kvsvc.routing.predictor import PredictorCache
from kvsvc.routing.request_metrics import (
    EMPTY_REQUEST_METRICS,
    RequestMetricsLedger,
    RequestMetricsSnapshot,
)
from kvsvc.settings import (
    DEFAULT_MAX_LOAD_AGE_S,
    DEFAULT_TARGET_TPOT_MS,
    DEFAULT_TARGET_TTFT_MS,
    PolicyName,
)
from kvsvc.streams.state import StreamMatch

log = logging.getLogger(__name__)


def f32(x: float) -> float:
    """``x`` rounded to a C ``float`` (IEEE 754 binary32), as the source's thresholds are."""
    return float(struct.unpack("f", struct.pack("f", x))[0])


def trunc_div(a: int, b: int) -> int:
    """C integer division: ``a / b`` truncated toward zero (``b > 0``)."""
    q = abs(a) // b
    return q if a >= 0 else -q


def to_ms(x: float) -> int:
    """A prediction as the source's ``int64_t``: truncated toward zero; 0 for NaN."""
    return int(x) if math.isfinite(x) else 0




class _Index:
    """One side's index in the source's order (module docstring); under the policy's lock."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def remove(self, name: str) -> bool:
        """``remove_instance_from_index``: swap with the last entry, drop the last."""
        try:
            i = self.names.index(name)
        except ValueError:
            return False
        self.names[i] = self.names[-1]
        self.names.pop()
        return True

    def sync(self, members: Sequence[str]) -> None:
        """Drop names that are no longer members (swap-remove), append new ones in order."""
        keep = set(members)
        for name in [n for n in self.names if n not in keep]:
            self.remove(name)
        known = set(self.names)
        self.names.extend(n for n in members if n not in known)


class SloAware:
    """``SLO_AWARE`` (§12, module docstring). Thread-safe.

    :param ledger: the service's request-metrics ledger (its idle listener is registered
        here: ``flip_decode_to_prefill``).
    :param target_ttft_ms: ``--target_ttft``, integer ms in [0, 3600000].
    :param target_tpot_ms: ``--target_tpot``, integer ms in [0, 600000].
    :param max_load_age_s: ``--max_load_age_s``, seconds in ``(0, 3600]``.

    The values arrive valid (the settings table's ranges, checked once there).
    """

    name = PolicyName.SLO_AWARE.value

    def __init__(self, ledger: Optional[RequestMetricsLedger] = None,
                 target_ttft_ms: int = DEFAULT_TARGET_TTFT_MS,
                 target_tpot_ms: int = DEFAULT_TARGET_TPOT_MS,
                 max_load_age_s: float = DEFAULT_MAX_LOAD_AGE_S) -> None:
        self.target_ttft_ms = int(target_ttft_ms)
        self.target_tpot_ms = int(target_tpot_ms)
        self.max_load_age_s = float(max_load_age_s)
        self.ledger = ledger
        self.predictors = PredictorCache(self.name, "predicts 0 ms there (§12)")
        self._lock = threading.Lock()
        self._p = _Index()
        self._d = _Index()
        self._rr = {PREFILL_SIDE: 0, DECODE_SIDE: 0}
        # MIX role overrides from flips: name -> (identity, role flipped from, role now).
        self._roles: dict[str, tuple[str, InstanceType, InstanceType]] = {}
        # What the last choice saw: name -> (type, identity) of the candidates, for flips.
        self._kinds: dict[str, tuple[InstanceType, str]] = {}
        if ledger is not None:
            ledger.add_idle_listener(self.on_decode_idle)

    # -- roles and indexes --------------------------------------------------------------------

    def _apply_roles(self, snapshot: RegistrySnapshot) -> RegistrySnapshot:
        """The snapshot with this policy's MIX role overrides applied (under the lock)."""
        if not self._roles:
            return snapshot
        out = dict(snapshot.instances)
        for name in list(self._roles):
            identity, was, now_role = self._roles[name]
            inst = out.get(name)
            if (inst is None or inst.type is not InstanceType.MIX
                    or instance_identity(inst) != identity or inst.role is not was):
                # Gone, replaced, or the registry moved it itself: its rule wins.
                del self._roles[name]
                continue
            out[name] = dataclasses.replace(inst, role=now_role)
        return dataclasses.replace(snapshot, instances=MappingProxyType(out))

    def _pools(self, snapshot: RegistrySnapshot, now: float) -> CandidatePools:
        """Candidates with overrides applied; syncs both indexes (under the lock)."""
        pools = candidate_pools(self._apply_roles(snapshot), now, self.max_load_age_s)
        self._p.sync([i.name for i in pools.prefill])
        self._d.sync([i.name for i in pools.decode])
        self._kinds = {i.name: (i.type, instance_identity(i))
                       for i in (*pools.prefill, *pools.decode)}
        self.predictors.forget_except(set(snapshot.instances))
        return pools

    def _readd(self, name: str, flipped_to: InstanceType) -> None:
        """``add_instance_to_index`` after a flip (under the lock)."""
        kind, identity = self._kinds.get(name, (InstanceType.DEFAULT, ""))
        if kind is InstanceType.MIX:
            role = InstanceType.PREFILL if self._d.names else InstanceType.DECODE
            was = InstanceType.DECODE if flipped_to is InstanceType.PREFILL else \
                InstanceType.PREFILL
            (self._p if role is InstanceType.PREFILL else self._d).names.append(name)
            if role is flipped_to:
                self._roles[name] = (identity, was, role)
                log.info("SLO_AWARE: %s (MIX) flips %s -> %s", name, was.name, role.name)
            else:
                log.debug("SLO_AWARE: %s (MIX) flip to %s keeps role %s (index reordered)",
                          name, flipped_to.name, role.name)
            return
        side = self._d if kind is InstanceType.DECODE else self._p
        side.names.append(name)
        log.debug("SLO_AWARE: %s (%s) flip to %s reorders its index only", name, kind.name,
                  flipped_to.name)

    def _flip_prefill_to_decode(self, name: str) -> None:
        """``flip_prefill_to_decode`` (under the lock)."""
        if len(self._p.names) <= 1 or not self._p.remove(name):
            return
        self._readd(name, InstanceType.DECODE)

    def on_decode_idle(self, name: str) -> None:
        """``flip_decode_to_prefill``, called by the ledger when a request's end leaves D
        ``name`` with no decode request: only with more than one D in the index."""
        with self._lock:
            if len(self._d.names) <= 1 or not self._d.remove(name):
                return
            self._readd(name, InstanceType.PREFILL)

    def index_order(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The P and D indexes as the next choice starts from (for tests and audits)."""
        with self._lock:
            return tuple(self._p.names), tuple(self._d.names)

    # -- the choice ---------------------------------------------------------------------------

    def choose(self, token_ids: Optional[Sequence[int]], snapshot: RegistrySnapshot,
               matches: Optional[list[StreamMatch]],
               identities: Optional[Identities] = None,
               in_flight: InFlightSnapshot = NO_IN_FLIGHT, *, now: float) -> Decision:
        """See :meth:`kvsvc.routing.policy.Policy.choose` and the module docstring;
        ``matches`` and ``identities`` are not used (SLO_AWARE ignores the KV cache)."""
        metrics = self.ledger.snapshot() if self.ledger is not None else EMPTY_REQUEST_METRICS
        n_tokens = len(token_ids) if token_ids is not None else 0
        with self._lock:
            pools = self._pools(snapshot, now)
            if not pools.prefill:
                return Decision(self.name, None, None, (), (), n_tokens, pools.reason,
                                pools.excluded)
            by_name = {i.name: i for i in (*pools.prefill, *pools.decode)}
            if not token_ids:
                return self._round_robin(by_name, pools, metrics, in_flight, n_tokens)
            return self._on_slo(by_name, pools, metrics, in_flight, n_tokens)

    def _round_robin(self, by_name: dict[str, Instance], pools: CandidatePools,
                     metrics: RequestMetricsSnapshot, in_flight: InFlightSnapshot,
                     n_tokens: int) -> Decision:
        """``get_next_instance_pair`` over both indexes (under the lock)."""
        p_names = self._p.names
        start = self._rr[PREFILL_SIDE] % len(p_names)
        self._rr[PREFILL_SIDE] = start + 1
        ranking = tuple(by_name[n] for n in p_names[start:] + p_names[:start])
        cands = [self._cand(by_name[n], PREFILL_SIDE, metrics, in_flight) for n in
                 p_names[start:] + p_names[:start]]
        decode = None
        if self._d.names:
            d_names = self._d.names
            d_start = self._rr[DECODE_SIDE] % len(d_names)
            self._rr[DECODE_SIDE] = d_start + 1
            order = d_names[d_start:] + d_names[:d_start]
            decode = by_name[order[0]]
            cands += [self._cand(by_name[n], DECODE_SIDE, metrics, in_flight) for n in order]
        return Decision(self.name, ranking[0], decode, tuple(cands), ranking, n_tokens,
                        excluded=pools.excluded)

    def _cand(self, inst: Instance, side: str, metrics: RequestMetricsSnapshot,
              in_flight: InFlightSnapshot, **extra: Any) -> CandidateScore:
        assert inst.load is not None  # candidate_pools keeps only instances with a load
        est = float(to_ms(metrics.of(inst.name).estimated_prefill_ms))
        return CandidateScore(inst.name, side, (), None, None, None, False,
                              inst.load.waiting_requests_num, inst.load.gpu_cache_usage_perc,
                              in_flight.total(inst.name),
                              in_flight.after(inst.name, inst.load.received_at),
                              estimated_prefill_ms=est, **extra)

    def _on_slo(self, by_name: dict[str, Instance], pools: CandidatePools,
                metrics: RequestMetricsSnapshot, in_flight: InFlightSnapshot,
                n_tokens: int) -> Decision:
        """``select_instance_pair_on_slo`` (under the lock; module docstring, steps 1-4)."""
        T, S = self.target_ttft_ms, self.target_tpot_ms
        p_names, d_names = list(self._p.names), list(self._d.names)

        def est(name: str) -> int:
            return to_ms(metrics.of(name).estimated_prefill_ms)

        def ttft(name: str) -> int:
            return to_ms(self.predictors.get(by_name[name]).predict_ttft(n_tokens))

        # Step 1: the P with the lowest estimated prefill time (first one on a tie).
        min_p, min_p_time, total = "", math.inf, 0
        for name in p_names:
            t = est(name)
            total += t
            if t < min_p_time:
                min_p, min_p_time = name, t
        avg_p = trunc_div(total, len(p_names))
        # Step 2: the D side.
        tpots: dict[str, int] = {}
        target_d, min_d, min_tpot = "", "", math.inf
        for name in d_names:
            m = metrics.of(name)
            t = to_ms(self.predictors.get(by_name[name]).predict_tpot(
                m.decode_token_num + n_tokens, m.decode_request_num + 1))
            tpots[name] = t
            if t <= S and not target_d:
                target_d = name
            if t < min_tpot:
                min_d, min_tpot = name, t
        decode_name = target_d or min_d
        # Step 3: P, or the prefill redirect to a lightly loaded D.
        prefill_name = min_p
        redirected = False
        if d_names:
            tpot_threshold = f32(f32(len(d_names) - 1.0) / len(d_names))
            if (min_p_time > T and target_d != min_d
                    and f32(min_tpot) < f32(S * tpot_threshold)
                    and est(min_d) < min_p_time):
                prefill_name, redirected = min_d, True
        # Candidates and ranking (the chosen P first, then the others by estimated time).
        others = sorted((n for n in p_names if n != prefill_name),
                        key=lambda n: (est(n), p_names.index(n)))
        ranking_names = [prefill_name, *others]
        estimates = {n: float(ttft(n)) for n in ranking_names}
        cands = []
        for name in ranking_names:
            own = estimates[name]
            cands.append(self._cand(by_name[name], PREFILL_SIDE, metrics, in_flight,
                                    predicted_prefill_ms=own,
                                    predicted_ttft_ms=float(est(name)) + own))
        for name in sorted(d_names, key=lambda n: (n != decode_name, tpots[n],
                                                    d_names.index(n))):
            cands.append(self._cand(by_name[name], DECODE_SIDE, metrics, in_flight,
                                    predicted_tpot_ms=float(tpots[name])))
        # Step 4: flip a prefill to decode when no D meets the TPOT target.
        if d_names and not target_d:
            ttft_threshold = f32(f32(len(p_names) - 1.0) / len(p_names))
            if f32(avg_p) < f32(T * ttft_threshold) or len(d_names) < len(p_names):
                self._flip_prefill_to_decode(prefill_name)
        if redirected:
            log.debug("SLO_AWARE: prefill redirected to decode instance %s (min prefill %s "
                      "estimated %d ms > target %d ms)", prefill_name, min_p, min_p_time, T)
        return Decision(self.name, by_name[prefill_name],
                        by_name[decode_name] if decode_name else None, tuple(cands),
                        tuple(by_name[n] for n in ranking_names), n_tokens,
                        excluded=pools.excluded,
                        prefill_estimates_ms=MappingProxyType(estimates))
