"""Predicted vs actual cached tokens (issue 14, §10-§12): for every proxied answer, the reusable
prefix the router predicted for the chosen P when it routed the request, against the cached
tokens the engine itself reports (``usage.prompt_tokens_details.cached_tokens``: vLLM, xLLM
and the simulated engine report it).

The rule (:func:`audit`, no I/O, tested without sockets):

- **predicted** = the minimum over the chosen P's DP ranks of ``device_hit_tokens +
  host_only_hit_tokens + pending_hit_tokens`` as the policy saw them (pending: §16, the blocks
  this router sent there whose events had not arrived; recorded apart as ``pending``) (:class:`~kvsvc.routing.policy.RankHit`; a rank
  missing, unsynchronized, of a stale incarnation or without tokens counts 0, §11). Host-only
  tokens count whole here: the engine reports the tokens it did not recompute, whatever tier
  they came from (the ``--car_host_hit_weight`` only prices them for the policy). A decision
  without per-rank hits (RR computes none) predicts nothing and is not audited.
- **actual** = the engine's ``cached_tokens``; an answer without it is not audited.
- **diff** = actual - predicted, tokens: negative is an over-prediction (the engine reused
  less than the router counted on), positive an under-prediction.
- Within one block (``|diff| <= block_size``) is a hit of the prediction: the index and the
  engine both count whole blocks, and an engine may recompute the last block of a fully cached
  prompt (vLLM keeps at least one prompt token to compute).
- A larger miss names its likely cause (:data:`CAUSES`), the first that applies:

  ``not tokenized`` / ``index disabled``: the router had no tokens or no index (predicted 0);
  ``tokenizer mismatch``: the engine's ``prompt_tokens`` differs from the router's count;
  ``stream unsynchronized``: a rank of the P was missing, unsynchronized or stale (counted 0);
  ``stream subset``: a rank's stream answered ``subset`` (§7h; hits may be missing);
  ``evicted between query and prefill``: the engine reports fewer (blocks freed after the
  query, while the request queued);
  ``other DP rank``: the engine reports more, within the best rank's hits (the minimum over
  ranks is what routing counts; the engine ran it on a better rank);
  ``stored between query and prefill``: the engine reports more on synchronized exact streams
  (an earlier request with the same prefix was prefilled, or its events applied, after the
  query). On an exact stream nothing else can explain a miss: the bench counts these.
  ``approximate index``: a rank's hits came from an approximate index (§14: what this replica
  routed there, not what the engine holds), so either direction is the approximation's error;
  ``pending prefix not cached``: the engine reused less than predicted, but at least the exact
  part: the pending blocks (§16) were not there yet (the prefill computing them had not
  stored them, was cancelled, or ran after this one).
- A prediction that counts pending blocks is never ``exact`` (the exact-streams target is
  about exact hits); its outcomes are counted apart (``pending_outcomes``).
- Every audited answer is also counted per backend (the P's ``backend_type``, §9) and by the
  completeness of its prediction (``exact``, ``subset``, ``approximate``, or ``none`` when a
  rank counted 0 for a reason): §14's measure of the approximate index's quality per backend.

:class:`CacheAudit` applies the rule to every answer it hears through the proxy's request
observer seam (:class:`~kvsvc.routing.observer.RequestObserver`, ``on_end(usage)``; the other
events are ignored), keeps counters per instance, a histogram of ``diff`` and the last
``recent`` records (:meth:`CacheAudit.snapshot`), read by ``GET /metrics`` and
``POST /v1/internal/route`` (``recent_cache_predictions``). Thread-safe; a large miss on a
synchronized exact stream is logged at INFO (one line naming the instance), the others at DEBUG.

Errors: none raised; a malformed ``usage`` is not audited (counted ``no_usage``).
"""

from __future__ import annotations

import bisect
import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

from kvsvc.config import KvEventsConfig
from kvsvc.routing.observer import RequestInfo
from kvsvc.routing.policy import (
    REASON_INDEX_DISABLED,
    REASON_NO_TOKENS,
    Decision,
    RankHit,
)

log = logging.getLogger(__name__)

CAUSE_NOT_TOKENIZED = "not tokenized"
CAUSE_INDEX_DISABLED = "index disabled"
CAUSE_TOKENIZER = "tokenizer mismatch"
CAUSE_UNSYNCHRONIZED = "stream unsynchronized"
CAUSE_SUBSET = "stream subset"
CAUSE_EVICTED = "evicted between query and prefill"
CAUSE_OTHER_RANK = "other DP rank"
CAUSE_STORED = "stored between query and prefill"
CAUSE_APPROXIMATE = "approximate index"
CAUSE_PENDING = "pending prefix not cached"
#: Every cause of a miss beyond one block, in the order they are tried.
CAUSES = (CAUSE_NOT_TOKENIZED, CAUSE_INDEX_DISABLED, CAUSE_TOKENIZER, CAUSE_UNSYNCHRONIZED,
          CAUSE_SUBSET, CAUSE_APPROXIMATE, CAUSE_PENDING, CAUSE_EVICTED, CAUSE_OTHER_RANK,
          CAUSE_STORED)

#: The ``completeness`` label of the per-backend counts: what the prediction came from.
COMPLETENESS_EXACT = "exact"
COMPLETENESS_SUBSET = "subset"
COMPLETENESS_APPROXIMATE = "approximate"
COMPLETENESS_PENDING = "pending"
COMPLETENESS_NONE = "none"
COMPLETENESS_LABELS = (COMPLETENESS_EXACT, COMPLETENESS_SUBSET, COMPLETENESS_APPROXIMATE,
                       COMPLETENESS_PENDING, COMPLETENESS_NONE)

OUTCOME_WITHIN = "within_block"
OUTCOME_OVER = "over"
OUTCOME_UNDER = "under"
#: ``outcome`` labels: within one block, over-predicted (engine reused less), under-predicted.
OUTCOMES = (OUTCOME_WITHIN, OUTCOME_OVER, OUTCOME_UNDER)

#: Why an answer was not audited (``reason`` label).
UNAUDITED_NO_PREDICTION = "no_prediction"
UNAUDITED_NO_USAGE = "no_usage"
UNAUDITED_REASONS = (UNAUDITED_NO_PREDICTION, UNAUDITED_NO_USAGE)

#: Upper bounds of the ``diff`` histogram, tokens (negative: over-predicted).
DIFF_BUCKETS_TOKENS = (-16384.0, -4096.0, -1024.0, -256.0, -128.0, -1.0, 0.0, 128.0, 256.0,
                       1024.0, 4096.0, 16384.0)
#: Records kept for ``recent_cache_predictions``.
DEFAULT_RECENT = 32
#: Block size when the instance's streams are not configured (§8's default).
DEFAULT_BLOCK_SIZE = 128

_UNSYNC_REASONS_NOT = (None, REASON_NO_TOKENS, REASON_INDEX_DISABLED)


@dataclass(frozen=True, slots=True)
class Prediction:
    """What routing predicted for the chosen P (:func:`prediction`).

    :ivar instance: the P, ``host:port``.
    :ivar predicted_tokens: min over ranks of Device + Host-only + pending hit tokens.
    :ivar best_rank_tokens: max over ranks of the same (for ``other DP rank``).
    :ivar input_tokens: the router's token count of the prompt (0: not tokenized).
    :ivar rank_reasons: each rank's reason for counting 0 (``None``: counted), rank order.
    :ivar subset: a rank's stream answered ``subset`` (§7h).
    :ivar approximate: a rank's hits came from an approximate index (§14).
    :ivar pending_tokens: the pending part of ``predicted_tokens`` (§16): the rank counted
        in it, its ``pending_hit_tokens``.
    """

    instance: str
    predicted_tokens: int
    best_rank_tokens: int
    input_tokens: int
    rank_reasons: tuple[Optional[str], ...]
    subset: bool
    approximate: bool = False
    pending_tokens: int = 0

    @property
    def exact(self) -> bool:
        """Every rank synchronized, exact, of the current incarnation and with tokens, and no
        pending hit counted: the predictions the target "within one block for >= 99%" is
        about."""
        return (not self.subset and not self.approximate and not self.pending_tokens
                and all(r is None for r in self.rank_reasons))

    @property
    def completeness(self) -> str:
        """The per-backend label (:data:`COMPLETENESS_LABELS`): ``none`` when a rank counted
        0 for a reason, else ``approximate``, ``subset`` or ``exact``."""
        if not all(r is None for r in self.rank_reasons):
            return COMPLETENESS_NONE
        if self.approximate:
            return COMPLETENESS_APPROXIMATE
        if self.pending_tokens:
            return COMPLETENESS_PENDING
        return COMPLETENESS_SUBSET if self.subset else COMPLETENESS_EXACT


@dataclass(frozen=True, slots=True)
class PredictionRecord:
    """One audited answer.

    :ivar instance: the P that answered.
    :ivar predicted: predicted cached tokens.
    :ivar actual: the engine's ``cached_tokens``.
    :ivar diff: ``actual - predicted``, tokens.
    :ivar outcome: one of :data:`OUTCOMES`.
    :ivar cause: one of :data:`CAUSES` when outside one block, else ``None``.
    :ivar exact: the prediction came from synchronized exact streams (:attr:`Prediction.exact`).
    :ivar input_tokens: the router's token count.
    :ivar engine_prompt_tokens: the engine's ``prompt_tokens`` (``None`` when absent).
    :ivar policy: the deciding policy.
    :ivar at: ``time.time()`` of the answer's end, seconds.
    :ivar completeness: what the prediction came from (:attr:`Prediction.completeness`).
    :ivar backend: the P's ``backend_type`` (§9), ``""`` when unknown.
    :ivar pending: the pending part of ``predicted`` (§16), tokens.
    """

    instance: str
    predicted: int
    actual: int
    diff: int
    outcome: str
    cause: Optional[str]
    exact: bool
    input_tokens: int
    engine_prompt_tokens: Optional[int]
    policy: str
    at: float
    completeness: str = COMPLETENESS_EXACT
    backend: str = ""
    pending: int = 0

    def to_json(self) -> dict:
        """One entry of ``recent_cache_predictions``."""
        return {"instance": self.instance, "predicted": self.predicted,
                "pending": self.pending, "actual": self.actual,
                "diff": self.diff, "outcome": self.outcome, "cause": self.cause,
                "exact": self.exact, "completeness": self.completeness,
                "backend": self.backend, "input_tokens": self.input_tokens,
                "engine_prompt_tokens": self.engine_prompt_tokens, "policy": self.policy,
                "at": round(self.at, 3)}


def prediction(decision: Optional[Decision], instance: str) -> Optional[Prediction]:
    """What ``decision`` predicted for P ``instance``; ``None`` when it holds no per-rank hits
    for it (RR, an instance that was not a P candidate, no decision)."""
    if decision is None:
        return None
    cand = decision.prefill_candidate(instance)
    if cand is None or not cand.ranks:
        return None
    ranks: Sequence[RankHit] = cand.ranks
    tokens = [r.device_hit_tokens + r.host_only_hit_tokens + r.pending_hit_tokens
              for r in ranks]
    worst = min(range(len(ranks)), key=tokens.__getitem__)
    kinds = {str(getattr(r, "completeness", None) or "") for r in ranks}
    return Prediction(instance, tokens[worst], max(tokens), decision.input_tokens,
                      tuple(r.reason for r in ranks), "subset" in kinds, "approximate" in kinds,
                      ranks[worst].pending_hit_tokens)


def _int(value: Any) -> Optional[int]:
    return value if type(value) is int and value >= 0 else None


def usage_tokens(usage: Optional[Mapping[str, Any]]) -> tuple[Optional[int], Optional[int]]:
    """``(cached_tokens, prompt_tokens)`` of an OpenAI ``usage`` object, each ``None`` when
    absent or not a non-negative int."""
    if not isinstance(usage, Mapping):
        return None, None
    details = usage.get("prompt_tokens_details")
    cached = _int(details.get("cached_tokens")) if isinstance(details, Mapping) else None
    return cached, _int(usage.get("prompt_tokens"))


def audit(pred: Prediction, cached_tokens: int, engine_prompt_tokens: Optional[int],
          block_size: int, policy: str = "", at: Optional[float] = None,
          backend: str = "") -> PredictionRecord:
    """Compare one prediction with the engine's answer (the rule of the module docstring).

    :param pred: the prediction for the P that answered.
    :param cached_tokens: the engine's ``cached_tokens`` (>= 0).
    :param engine_prompt_tokens: the engine's ``prompt_tokens``, ``None`` when absent.
    :param block_size: tokens per block of the P's streams (>= 1): the tolerance.
    :param policy: the deciding policy (recorded).
    :param at: ``time.time()`` of the answer (now when ``None``).
    :param backend: the P's ``backend_type`` (recorded, counted per backend).
    """
    diff = cached_tokens - pred.predicted_tokens
    cause: Optional[str] = None
    if abs(diff) <= block_size:
        outcome = OUTCOME_WITHIN
    else:
        outcome = OUTCOME_OVER if diff < 0 else OUTCOME_UNDER
        reasons = set(pred.rank_reasons)
        if pred.input_tokens == 0 or REASON_NO_TOKENS in reasons:
            cause = CAUSE_NOT_TOKENIZED
        elif REASON_INDEX_DISABLED in reasons:
            cause = CAUSE_INDEX_DISABLED
        elif engine_prompt_tokens is not None and engine_prompt_tokens != pred.input_tokens:
            cause = CAUSE_TOKENIZER
        elif any(r not in _UNSYNC_REASONS_NOT for r in reasons):
            cause = CAUSE_UNSYNCHRONIZED
        elif pred.subset:
            cause = CAUSE_SUBSET
        elif pred.approximate:
            cause = CAUSE_APPROXIMATE
        elif (diff < 0 and pred.pending_tokens
              and cached_tokens >= pred.predicted_tokens - pred.pending_tokens - block_size):
            cause = CAUSE_PENDING
        elif diff < 0:
            cause = CAUSE_EVICTED
        elif cached_tokens <= pred.best_rank_tokens + block_size \
                and pred.best_rank_tokens > pred.predicted_tokens:
            cause = CAUSE_OTHER_RANK
        else:
            cause = CAUSE_STORED
    return PredictionRecord(pred.instance, pred.predicted_tokens, cached_tokens, diff, outcome,
                            cause, pred.exact, pred.input_tokens, engine_prompt_tokens, policy,
                            time.time() if at is None else at, pred.completeness, backend,
                            pred.pending_tokens)


def block_sizes(kv_config: Optional[KvEventsConfig]) -> Callable[[str], int]:
    """``instance -> block_size`` of its streams (§8): a static stream's own, else the
    discovery block's, else :data:`DEFAULT_BLOCK_SIZE`."""
    static: dict[str, int] = {}
    default = DEFAULT_BLOCK_SIZE
    if kv_config is not None:
        for s in kv_config.streams:
            static[s.instance_name] = max(static.get(s.instance_name, 0), s.block_size)
        if kv_config.discovery is not None:
            default = kv_config.discovery.block_size
    return lambda name: static.get(name, default)


@dataclass(frozen=True)
class AuditSnapshot:
    """The audit's counters at one instant (copied under its lock).

    :ivar outcomes: ``(instance, outcome)`` -> answers audited.
    :ivar exact_outcomes: the same for the answers predicted from synchronized exact streams.
    :ivar causes: ``(instance, cause)`` -> misses beyond one block.
    :ivar by_backend: ``(backend, completeness, outcome)`` -> answers audited (§14: the
        approximate index's quality per backend).
    :ivar backend_abs_error: ``(backend, completeness)`` -> sum of ``|diff|``, tokens.
    :ivar unaudited: reason -> answers not audited (:data:`UNAUDITED_REASONS`).
    :ivar bucket_counts: per :data:`DIFF_BUCKETS_TOKENS` bound then +Inf, non-cumulative.
    :ivar diff_sum: sum of ``diff`` over audited answers, tokens.
    :ivar abs_error_sum: sum of ``|diff|``, tokens.
    :ivar recent: the last records, oldest first.
    """

    outcomes: Mapping[tuple[str, str], int]
    exact_outcomes: Mapping[tuple[str, str], int]
    causes: Mapping[tuple[str, str], int]
    unaudited: Mapping[str, int]
    bucket_counts: tuple[int, ...]
    diff_sum: float
    abs_error_sum: int
    recent: tuple[PredictionRecord, ...]
    by_backend: Mapping[tuple[str, str, str], int] = field(default_factory=dict)
    backend_abs_error: Mapping[tuple[str, str], int] = field(default_factory=dict)

    @property
    def audited(self) -> int:
        """Answers audited."""
        return sum(self.outcomes.values())

    @property
    def exact_audited(self) -> int:
        """Audited answers predicted from synchronized exact streams."""
        return sum(self.exact_outcomes.values())

    @property
    def exact_within(self) -> int:
        """The part of :attr:`exact_audited` within one block."""
        return sum(n for (_, outcome), n in self.exact_outcomes.items()
                   if outcome == OUTCOME_WITHIN)


class CacheAudit:
    """The request observer applying :func:`audit` to every answer (module docstring).

    :param block_size_of: ``instance -> tokens per block`` (:func:`block_sizes`).
    :param recent: records kept for :meth:`snapshot` (>= 0).
    :param backend_of: ``instance -> backend_type`` (§9; the service reads the registry's
        snapshot), ``""`` when unknown.
    """

    def __init__(self, block_size_of: Callable[[str], int] = lambda name: DEFAULT_BLOCK_SIZE,
                 recent: int = DEFAULT_RECENT,
                 backend_of: Callable[[str], str] = lambda name: "") -> None:
        self._block_size_of = block_size_of
        self._backend_of = backend_of
        self._by_backend: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self._backend_abs: collections.Counter[tuple[str, str]] = collections.Counter()
        self._lock = threading.Lock()
        self._outcomes: collections.Counter[tuple[str, str]] = collections.Counter()
        self._exact_outcomes: collections.Counter[tuple[str, str]] = collections.Counter()
        self._causes: collections.Counter[tuple[str, str]] = collections.Counter()
        self._unaudited: collections.Counter[str] = collections.Counter()
        self._buckets = [0] * (len(DIFF_BUCKETS_TOKENS) + 1)
        self._diff_sum = 0.0
        self._abs_sum = 0
        self._recent: collections.deque[PredictionRecord] = collections.deque(maxlen=recent)

    # -- the observer seam (only the end matters) ---------------------------------------------

    def on_dispatch(self, info: RequestInfo) -> None:
        """Ignored: the prediction travels with the attempt (``info.decision``)."""

    def on_first_token(self, info: RequestInfo) -> None:
        """Ignored."""

    def on_token(self, info: RequestInfo) -> None:
        """Ignored."""

    def on_tokens(self, info: RequestInfo, n: int) -> None:
        """Ignored."""

    def on_cancel(self, info: RequestInfo, reason: str) -> None:
        """Ignored: an answer that did not end has no usage to compare."""

    def on_end(self, info: RequestInfo, usage: Optional[dict]) -> None:
        """Audit one answer of ``info.prefill`` against ``usage``."""
        pred = prediction(info.decision, info.prefill)
        cached, prompt = usage_tokens(usage)
        if pred is None or cached is None:
            with self._lock:
                self._unaudited[UNAUDITED_NO_PREDICTION if pred is None
                                else UNAUDITED_NO_USAGE] += 1
            return
        self.record(audit(pred, cached, prompt, self._block_size_of(info.prefill),
                          info.policy, backend=self._backend_of(info.prefill)))

    def record(self, rec: PredictionRecord) -> None:
        """Count one audited answer (:meth:`on_end` calls it)."""
        with self._lock:
            self._outcomes[(rec.instance, rec.outcome)] += 1
            if rec.cause is not None:
                self._causes[(rec.instance, rec.cause)] += 1
            self._buckets[bisect.bisect_left(DIFF_BUCKETS_TOKENS, rec.diff)] += 1
            self._diff_sum += rec.diff
            self._abs_sum += abs(rec.diff)
            if rec.exact:
                self._exact_outcomes[(rec.instance, rec.outcome)] += 1
            self._by_backend[(rec.backend, rec.completeness, rec.outcome)] += 1
            self._backend_abs[(rec.backend, rec.completeness)] += abs(rec.diff)
            self._recent.append(rec)
        if rec.cause is not None:
            (log.info if rec.exact else log.debug)(
                "cache prediction for %s missed by %d tokens (predicted %d, engine cached %d): "
                "%s", rec.instance, rec.diff, rec.predicted, rec.actual, rec.cause)

    def snapshot(self) -> AuditSnapshot:
        """The counters and recent records now (:class:`AuditSnapshot`)."""
        with self._lock:
            return AuditSnapshot(dict(self._outcomes), dict(self._exact_outcomes),
                                 dict(self._causes), dict(self._unaudited),
                                 tuple(self._buckets), self._diff_sum, self._abs_sum,
                                 tuple(self._recent), dict(self._by_backend),
                                 dict(self._backend_abs))
