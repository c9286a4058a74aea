"""``TTFT`` (§12, kvsvc's own): the P with the lowest predicted time to first token,

    ``predicted_ttft(P) = queued_ms(P) + prefill_ms(P, uncached)``

with ``uncached = input_tokens - device_hit - host_weight * host_only_hit - pending_hit`` from
CAR's hit terms (:func:`~kvsvc.routing.policy.rank_hits`, :func:`~kvsvc.routing.policy.hit_tokens`:
the minimum over DP ranks, subset hits as they are, 0 hits for a missing, unsynchronized or stale
rank), i.e. ``input_tokens * (1 - hit_ratio)``. ``host_weight`` is TTFT's own,
``--ttft_host_hit_weight`` (default 0.95, D30): the share of a token's prefill a Host -> Device
load saves (§12 reuses CAR's unitless weight, 0.5 by default, which prices a Host-only prefix
at half the time it saves). Pending hits (§16: blocks this router sent to
P whose events have not arrived) are priced as available when the own prefill computing them
ends: with pending hits, ``queued_ms(P)`` is at least the own backlog (below), which ends
with that prefill (it was dispatched before this request, on the same FCFS lane).
The D is chosen as CAR does (§11); scores within :data:`~kvsvc.routing.policy.TIE_EPSILON` ms
of the minimum rotate among the tied. Cache reuse and queueing are weighed in one unit, time:
no lambda to tune.

``prefill_ms(P, n)``: the instance's TTFT predictor ``c0 + c1 n + c2 n^2``
(:mod:`kvsvc.routing.predictor`, clamped at 0) when its ``ttft_profiling_data`` gives a fit,
else ``n / default_prefill_tokens_per_s`` seconds (``--default_prefill_tokens_per_s``).

``queued_ms(P)``, the prefill work ahead of the request (docs/routing.md), in ms: the
router's own requests still in prefill on P (dispatched, no first token relayed yet: the
request-metrics ledger, :mod:`kvsvc.routing.request_metrics`), each with the prefill time
predicted when it was dispatched, plus the requests of other senders that P's last load report
(``waiting_requests_num`` ``W``, received at ``t_r``) shows:

    ``queued_ms(P) = own_backlog_ms + foreign * unit_ms``

- ``own_backlog_ms``: one prefill runs at a time, first come first served, so the own
  pending requests are replayed in dispatch order on a virtual clock that starts at P's last
  relayed first token (the prefill lane was free then): each starts at the later of the
  clock and its dispatch and lasts its prediction; what remains after ``now`` is the backlog.
  A streamed request whose predicted end has passed without a first token is still running:
  it ends at ``now`` at the earliest. A non-streamed one relays nothing before its end, so
  past its predicted end it is taken to be decoding and adds nothing.
- ``foreign``: the requests in ``W`` that are not this router's,
  ``max(0, W - (own(t_r) - 1))`` where ``own(t_r)`` counts the own requests in prefill
  at ``t_r`` (pending ones dispatched before it, and recent ones whose prefill ended after
  it); one of those was prefilling, which ``W`` does not count. The report is not used for
  the own requests: it is up to a heartbeat old, and a queue that drained since would be
  priced in full.
- ``unit_ms``: the mean predicted prefill time of the own requests on P (pending and
  recent), else ``prefill_ms(P, input_tokens)`` of the request being routed (a queued request
  of unknown size costs a full prefill of this size).

The work term (``--ttft_work_weight`` ``w``, default 6, D29; 0 is §12 exactly): a
candidate's score is ``predicted_ttft(P) + w * (prefill_ms(P, uncached) - min over candidates
of the same)``. The predicted TTFT is the request's own; the prefill a colder candidate must
compute beyond the best-cached one's is also time every request queued behind it there waits
(the prefix the request would have reused is recomputed, the lane busy meanwhile) and cache
the cluster gives up, which the request's own TTFT does not count: by default a request
leaves the engine holding its prefix only when its predicted TTFT elsewhere is lower by more
than six times the prefill the move recomputes. With the same hit everywhere the term is 0.
``predicted_ttft_ms`` stays the TTFT; ``score`` is what was compared.

Nothing here does I/O; the choice reads the ledger's snapshot (copied under its lock) and the
registry's.
"""

from __future__ import annotations

import logging
import math
import time
from types import MappingProxyType
from typing import Optional, Sequence

from kvsvc.cluster.model import Instance, RegistrySnapshot
from kvsvc.routing.in_flight import NO_IN_FLIGHT, InFlightSnapshot
from kvsvc.routing.policy import (
    PREFILL_SIDE,
    CacheAware,
    CandidateScore,
    Decision,
    Identities,
    RankHit,
    candidate_pools,
    entry_ranking,
    hit_tokens,
    prefill_entries,
)
from kvsvc.routing.predictor import TTFT_FIELD, PredictorCache, TimePredictor, growing_ttft
from kvsvc.routing.request_metrics import (
    EMPTY_REQUEST_METRICS,
    PendingPrefill,
    PrefillEnd,
    RequestMetricsLedger,
)
from kvsvc.settings import (
    DEFAULT_MAX_LOAD_AGE_S,
    DEFAULT_PREFILL_TOKENS_PER_S,
    DEFAULT_TTFT_HOST_HIT_WEIGHT,
    DEFAULT_TTFT_WORK_WEIGHT,
    PolicyName,
)
from kvsvc.streams.state import StreamMatch

log = logging.getLogger(__name__)


def uncached_tokens(n_tokens: int, ranks: Sequence[RankHit], host_weight: float) -> float:
    """``input_tokens - device_hit - host_weight * host_only_hit - pending_hit`` of the rank
    with the fewest hits (CAR's minimum over DP ranks, :func:`~kvsvc.routing.policy.hit_tokens`;
    a rank with a ``reason`` counts no hit), in ``[0, n_tokens]``; computed from the tokens,
    not from the ratio, so it is exact."""
    worst = 0.0
    for r in ranks:
        worst = max(worst, n_tokens - min(hit_tokens(r, host_weight), float(n_tokens)))
    return worst


def pending_hit_tokens(ranks: Sequence[RankHit]) -> int:
    """The pending hits (§16) the TTFT price counts on: the fewest over the ranks."""
    return min((0 if r.reason else r.pending_hit_tokens for r in ranks), default=0)


def prefill_ms(predictor: TimePredictor, tokens: float, default_tokens_per_s: float) -> float:
    """Predicted prefill time of ``tokens`` tokens, ms >= 0: the TTFT fit when there is one
    (clamped at 0), else ``tokens / default_tokens_per_s`` seconds."""
    if predictor.has_ttft:
        return max(0.0, predictor.predict_ttft(tokens))
    return 1000.0 * tokens / default_tokens_per_s

def own_backlog_ms(pending: Sequence[PendingPrefill], recent: Sequence[PrefillEnd],
                   now: float) -> float:
    """The own pending prefills still ahead at ``now`` (module docstring), ms >= 0.

    :param pending: the router's requests still in prefill on P, oldest first.
    :param recent: P's recent streamed prefill ends (the last first token anchors the clock).
    :param now: ``time.monotonic()`` seconds.
    """
    clock = -math.inf
    for end in reversed(recent):
        if end.first_token:
            clock = end.ended_at
            break
    for p in pending:
        finish = max(clock, p.dispatched_at) + p.estimated_prefill_ms / 1000.0
        if finish < now and p.streamed:
            finish = now  # overran its prediction: still running, ends now at the earliest
        # A non-streamed one past its predicted end is taken to have prefilled by then (it
        # is decoding, its first token unheard): the lane was its own until that end.
        clock = finish
    return max(0.0, (clock - now) * 1000.0)


def queued_ms(inst: Instance, pending: Sequence[PendingPrefill], full_prefill_ms: float,
              recent: Sequence[PrefillEnd] = (), now: Optional[float] = None,
              dp_rank: Optional[int] = None) -> float:
    """``own_backlog_ms + foreign * unit_ms`` (module docstring), milliseconds >= 0.

    :param inst: the candidate (with its load report; without one ``W`` is 0).
    :param pending: the router's own requests still in prefill there, oldest first.
    :param full_prefill_ms: ``prefill_ms`` of the routed request's whole prompt there (the
        unit when nothing of the router's was seen there).
    :param recent: the instance's recent streamed prefill ends, oldest first.
    :param now: ``time.monotonic()`` seconds (default: the clock now).
    :param dp_rank: one DP rank of ``inst`` (§15: ``pending`` and ``recent`` are that rank's):
        ``W`` is the rank's own reported queue when the report has per-rank values, else the
        instance's shared evenly over its ranks.
    """
    now = time.monotonic() if now is None else now
    load = inst.load
    own = own_backlog_ms(pending, recent, now)
    if load is None:
        return own
    waiting: float = load.waiting_requests_num
    if dp_rank is not None:
        rank_load = load.rank(dp_rank)
        waiting = (rank_load.waiting_requests_num if rank_load is not None
                   else waiting / max(1, inst.dp_size))
    if waiting <= 0:
        return own
    t_r = load.received_at
    at_report = sum(1 for p in pending if p.dispatched_at <= t_r)
    for e in reversed(recent):  # oldest first, ended_at non-decreasing: stop at the report
        if e.ended_at <= t_r:
            break
        at_report += e.dispatched_at <= t_r
    foreign = max(0.0, waiting - max(0, at_report - 1))
    if not foreign:
        return own
    seen = [p.estimated_prefill_ms for p in pending] + [e.estimated_prefill_ms for e in recent]
    unit = sum(seen) / len(seen) if seen else full_prefill_ms
    return own + foreign * unit


class TtftPolicy(CacheAware):
    """``TTFT`` (§12, module docstring). Thread-safe.

    :param ledger: the service's request-metrics ledger (the queued prefill estimate).
    :param host_hit_weight: ``--ttft_host_hit_weight`` (D30), [0, 1]: the share of a
        token's prefill a Host-only hit saves.
    :param default_prefill_tokens_per_s: ``--default_prefill_tokens_per_s``, ``(0, 1e9]``.
    :param max_load_age_s: ``--max_load_age_s``, seconds in ``(0, 3600]``.
    :param dp_rank_routing: ``--dp_rank_routing``: score (instance, DP rank) pairs of the
        backends that honour a rank (§15), each with its rank's hits, own pending prefills
        and reported queue.
    :param work_weight: ``--ttft_work_weight`` ``w`` >= 0 (default 6, D29): a candidate's
        score is its predicted TTFT plus ``w`` times the prefill it adds beyond the
        best-cached candidate's (module docstring); 0: §12's predicted TTFT alone.

    The values arrive valid (the settings table's ranges, checked once there).
    """

    name = PolicyName.TTFT.value

    def __init__(self, ledger: Optional[RequestMetricsLedger] = None,
                 host_hit_weight: float = DEFAULT_TTFT_HOST_HIT_WEIGHT,
                 default_prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S,
                 max_load_age_s: float = DEFAULT_MAX_LOAD_AGE_S,
                 dp_rank_routing: bool = True,
                 work_weight: float = DEFAULT_TTFT_WORK_WEIGHT) -> None:
        super().__init__(0.5, host_hit_weight, max_load_age_s, dp_rank_routing)
        self.work_weight = float(work_weight)
        self.default_prefill_tokens_per_s = float(default_prefill_tokens_per_s)
        self.ledger = ledger
        self.predictors = PredictorCache(
            self.name, f"assumes {self.default_prefill_tokens_per_s:g} tokens/s there "
                       "(--default_prefill_tokens_per_s, §12)", fields=(TTFT_FIELD,), check=growing_ttft)

    def choose(self, token_ids: Optional[Sequence[int]], snapshot: RegistrySnapshot,
               matches: Optional[list[StreamMatch]],
               identities: Optional[Identities] = None,
               in_flight: InFlightSnapshot = NO_IN_FLIGHT, *, now: float) -> Decision:
        """See :meth:`kvsvc.routing.policy.Policy.choose` and the module docstring. Each P
        candidate's ``score`` is its predicted TTFT (ms); ``hit_ratio`` CAR's."""
        pools = candidate_pools(snapshot, now, self.max_load_age_s)
        n_tokens = len(token_ids) if token_ids is not None else 0
        if not pools.prefill:
            return Decision(self.name, None, None, (), (), n_tokens, pools.reason,
                            pools.excluded)
        self.predictors.forget_except(set(snapshot.instances))
        metrics = self.ledger.snapshot() if self.ledger is not None else EMPTY_REQUEST_METRICS
        entries = prefill_entries(pools.prefill, token_ids, matches, identities,
                                  self.host_hit_weight, self.dp_rank_routing)
        rows: list[tuple[float, float, float]] = []   # (score, queue, own) per entry
        for e in entries:
            inst = e.instance
            predictor = self.predictors.get(inst)
            own = prefill_ms(predictor, uncached_tokens(n_tokens, e.ranks, self.host_hit_weight),
                             self.default_prefill_tokens_per_s)
            pending, recent = metrics.pending_of(inst.name), metrics.recent_of(inst.name)
            if e.dp_rank is not None:
                # §15: one rank is one prefill lane; a request sent without a rank may be on
                # any of them, so it counts on each.
                pending = tuple(p for p in pending if p.dp_rank in (None, e.dp_rank))
                recent = tuple(r for r in recent if r.dp_rank in (None, e.dp_rank))
            queue = queued_ms(inst, pending,
                              prefill_ms(predictor, n_tokens, self.default_prefill_tokens_per_s),
                              recent, now, e.dp_rank)
            if pending_hit_tokens(e.ranks):
                # §16: pending blocks exist once the own prefill computing them ends; one lane
                # FCFS puts that prefill ahead of this one, so the own backlog is the wait (it
                # is within queue already unless the queue model changes: kept explicit).
                queue = max(queue, own_backlog_ms(pending, recent, now))
            rows.append((queue + own, queue, own))
        scores = [r[0] for r in rows]
        if self.work_weight and rows:
            # The work term (module docstring): the prefill a candidate adds beyond the
            # best-cached one delays the requests that queue behind it there.
            least = min(r[2] for r in rows)
            scores = [r[0] + self.work_weight * (r[2] - least) for r in rows]
        order, tied = self._pick(scores, PREFILL_SIDE)
        cands: list[CandidateScore] = [
            entries[i].candidate(in_flight, entries[i].hit_ratio, None, scores[i], i in tied,
                                 estimated_prefill_ms=rows[i][1],
                                 predicted_prefill_ms=rows[i][2], predicted_ttft_ms=rows[i][0])
            for i in order]
        ranking, ranks = entry_ranking(entries, order)
        estimates: dict[str, float] = {}
        for i in order:  # the best entry of each instance: the rank the request goes to
            estimates.setdefault(entries[i].instance.name, rows[i][2])
        decode = self._choose_decode(pools, in_flight, cands)
        return Decision(self.name, ranking[0], decode, tuple(cands), ranking, n_tokens,
                        excluded=pools.excluded, prefill_estimates_ms=MappingProxyType(estimates),
                        prefill_ranks=ranks)

