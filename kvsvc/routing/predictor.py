"""Per-instance time predictors fitted from registered profiling data (§12; xllm-service's
``common/time_predictor.cpp``).

- TTFT: ``ttft(n) = c0 + c1 n + c2 n^2`` milliseconds for a prefill of ``n`` tokens, fitted
  by least squares to ``ttft_profiling_data`` ``[[tokens, ms], ...]``.
- TPOT: ``tpot = d0 + d1 batch + d2 x`` milliseconds, fitted by least squares to
  ``tpot_profiling_data`` ``[[avg_len, batch, ms], ...]`` with ``x = batch (avg_len - 1)``;
  predicted, as the source does, with ``x`` = the decode tokens the instance would hold
  (:meth:`TimePredictor.predict_tpot`).

No data: the prediction is 0 (the source's zero coefficients). kvsvc also falls back to "no
data" where the source would fit something it cannot determine: fewer points than
coefficients (3), or points that do not determine them (e.g. every TTFT point at the same token
count); the source's ``colPivHouseholderQr`` then returns one of infinitely many solutions.
Dropped points and fallbacks are named in :attr:`TimePredictor.problems`, which
:class:`PredictorCache` logs once per instance incarnation as one WARNING.

The fit: each column is scaled to a largest magnitude of 1 (token counts reach 1e5, their
squares 1e10), then solved by Householder QR in float64; a column whose remaining norm is
below :data:`RANK_TOLERANCE` of its scale makes the system rank deficient (fallback). Pure
functions and values, no I/O; nothing raises.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from kvsvc.cluster.model import Instance, ProfilingData, instance_identity

log = logging.getLogger(__name__)

#: Coefficients of each fit (the source's ``kDegree + 1``).
COEFFICIENTS = 3
#: Relative size below which a column counts as dependent on the others (rank deficient).
RANK_TOLERANCE = 1e-9

TTFT_FIELD = "ttft_profiling_data"
TPOT_FIELD = "tpot_profiling_data"


def least_squares(rows: Sequence[Sequence[float]], target: Sequence[float]
                  ) -> Optional[tuple[float, ...]]:
    """The ``x`` minimising ``|A x - b|`` for ``A`` = ``rows`` (m x k, m >= k) and ``b`` =
    ``target``, by Householder QR on column-scaled ``A``; ``None`` when ``m < k`` or ``A`` is
    rank deficient (a column within :data:`RANK_TOLERANCE` of the span of the others).

    :param rows: ``m`` rows of ``k`` finite floats.
    :param target: ``m`` finite floats.
    """
    m = len(rows)
    k = len(rows[0]) if rows else 0
    if k == 0 or m < k:
        return None
    scales = [max(abs(r[j]) for r in rows) or 1.0 for j in range(k)]
    a = [[r[j] / scales[j] for j in range(k)] for r in rows]
    b = [float(t) for t in target]
    for j in range(k):
        norm = math.sqrt(sum(a[i][j] ** 2 for i in range(j, m)))
        if norm <= RANK_TOLERANCE * math.sqrt(m):
            return None
        alpha = -norm if a[j][j] >= 0 else norm
        v = [0.0] * m
        v[j] = a[j][j] - alpha
        for i in range(j + 1, m):
            v[i] = a[i][j]
        vnorm2 = sum(x * x for x in v[j:])
        if vnorm2 == 0.0:
            continue
        for col in range(j, k):
            dot = sum(v[i] * a[i][col] for i in range(j, m))
            f = 2.0 * dot / vnorm2
            for i in range(j, m):
                a[i][col] -= f * v[i]
        dot = sum(v[i] * b[i] for i in range(j, m))
        f = 2.0 * dot / vnorm2
        for i in range(j, m):
            b[i] -= f * v[i]
    x = [0.0] * k
    for j in reversed(range(k)):
        s = b[j] - sum(a[j][c] * x[c] for c in range(j + 1, k))
        x[j] = s / a[j][j]
    return tuple(x[j] / scales[j] for j in range(k))


@dataclass(frozen=True, slots=True)
class TimePredictor:
    """One instance's TTFT and TPOT predictors (module docstring).

    :ivar ttft_coefficients: ``(c0, c1, c2)``, or ``None`` without a usable fit.
    :ivar tpot_coefficients: ``(d0, d1, d2)``, or ``None`` without a usable fit.
    :ivar problems: one line per field with a problem, each starting with the field's name.
    """

    ttft_coefficients: Optional[tuple[float, float, float]]
    tpot_coefficients: Optional[tuple[float, float, float]]
    problems: tuple[str, ...] = ()

    @property
    def has_ttft(self) -> bool:
        """A TTFT fit exists (else :meth:`predict_ttft` answers 0)."""
        return self.ttft_coefficients is not None

    @property
    def has_tpot(self) -> bool:
        """A TPOT fit exists (else :meth:`predict_tpot` answers 0)."""
        return self.tpot_coefficients is not None

    def predict_ttft(self, tokens: float) -> float:
        """``c0 + c1 n + c2 n^2`` milliseconds for a prefill of ``tokens`` (``n``); 0.0
        without a fit. May be negative where the fit is (the source does not clamp)."""
        c = self.ttft_coefficients
        if c is None:
            return 0.0
        return c[0] + c[1] * tokens + c[2] * tokens * tokens

    def predict_tpot(self, total_tokens: float, batch: float) -> float:
        """``d0 + d1 batch + d2 total_tokens`` milliseconds per output token with ``batch``
        requests holding ``total_tokens`` tokens (the source's ``predict_tpot(total_length,
        batch_size)``); 0.0 without a fit."""
        d = self.tpot_coefficients
        if d is None:
            return 0.0
        return d[0] + d[1] * batch + d[2] * total_tokens

    def to_json(self) -> dict:
        """JSON object: both coefficient triples (``null`` without a fit) and the problems."""
        return {"ttft_coefficients": list(self.ttft_coefficients)
                if self.ttft_coefficients else None,
                "tpot_coefficients": list(self.tpot_coefficients)
                if self.tpot_coefficients else None,
                "problems": list(self.problems)}


def _as3(x: Optional[tuple[float, ...]]) -> Optional[tuple[float, float, float]]:
    if x is None or not all(math.isfinite(v) for v in x):
        return None
    return (x[0], x[1], x[2])


def fit(profiling: ProfilingData) -> TimePredictor:
    """Fit both predictors of one instance from its registered points (module docstring).

    Each field without a usable fit gets a problem line: absent (``none registered``; none
    when the parser dropped every point, its own line says so), fewer than 3 valid points,
    or points that do not determine the 3 coefficients; lines from the parser (dropped
    points) come first.
    """
    problems = list(profiling.problems)

    def solve(field: str, count: int, rows: list[tuple[float, float, float]],
              values: list[float], form: str) -> Optional[tuple[float, float, float]]:
        if not count:
            # Registered but every point dropped: the parser's line already says so.
            if not any(p.startswith(field + ":") for p in profiling.problems):
                problems.append(f"{field}: none registered")
            return None
        if count < COEFFICIENTS:
            problems.append(f"{field}: {count} valid points, the fit needs {COEFFICIENTS}")
            return None
        x = _as3(least_squares(rows, values))
        if x is None:
            problems.append(f"{field}: the points do not determine {form}")
        return x

    ttft = solve(TTFT_FIELD, len(profiling.ttft),
                 [(1.0, float(n), float(n) * n) for n, _ in profiling.ttft],
                 [ms for _, ms in profiling.ttft],
                 f"c0 + c1 n + c2 n^2 (fewer than {COEFFICIENTS} distinct token counts, or "
                 "values too large to solve for)")
    tpot = solve(TPOT_FIELD, len(profiling.tpot),
                 [(1.0, float(b), float(b) * (length - 1)) for length, b, _ in profiling.tpot],
                 [ms for _, _, ms in profiling.tpot], "d0 + d1 batch + d2 batch (avg_len - 1)")
    return TimePredictor(ttft, tpot, tuple(problems))


#: :func:`growing_ttft` checks a fit over 1 .. this many tokens (beyond any served context).
GROWTH_CHECK_TOKENS = 1 << 20


def growing_ttft(predictor: TimePredictor) -> TimePredictor:
    """``predictor`` without its TTFT fit when that fit is not a prefill time that grows with
    the prompt over 1 .. :data:`GROWTH_CHECK_TOKENS` tokens: positive at n = 1 and a
    non-negative slope ``c1 + 2 c2 n`` at both ends (the slope is linear in n, so that holds
    in between). The TTFT policy (§12) compares predicted times across instances: a fit that
    falls towards 0 (a least-squares quadratic extrapolates far past its points) would win
    every decision whatever the instance's queue. Adds a problem line naming
    :data:`TTFT_FIELD` and the coefficients; other fits are returned unchanged."""
    c = predictor.ttft_coefficients
    if c is None:
        return predictor
    c0, c1, c2 = c
    if c0 + c1 + c2 > 0 and c1 + 2 * c2 >= 0 and c1 + 2 * c2 * GROWTH_CHECK_TOKENS >= 0:
        return predictor
    problem = (f"{TTFT_FIELD}: the fit {c0:.6g} + {c1:.6g} n + {c2:.6g} n^2 ms does not grow "
               f"with the prompt over 1..{GROWTH_CHECK_TOKENS} tokens")
    return TimePredictor(None, predictor.tpot_coefficients, (*predictor.problems, problem))


class PredictorCache:
    """Each instance incarnation's :class:`TimePredictor`, fitted once, on first use (the
    source fits at registration). Thread-safe; the request path only fits a new incarnation's
    few points (microseconds).

    The first fit of an incarnation with problems logs one WARNING naming the instance and
    every field with a problem and the fallback, e.g. ``instance 10.0.0.1:9000: profiling
    data unusable (tpot_profiling_data: 2 valid points, the fit needs 3); SLO_AWARE predicts
    0 ms there``.

    :param policy: the policy name, for the WARNING.
    :param fallback: what the policy does without a fit, for the WARNING.
    :param fields: the profiling fields the policy uses: only their problems are warned about
        (TTFT uses no TPOT prediction).
    :param check: applied to each new fit before it is kept (e.g. :func:`growing_ttft`);
        ``None``: the fit as it is (SLO_AWARE, as the source).
    """

    def __init__(self, policy: str, fallback: str,
                 fields: tuple[str, ...] = (TTFT_FIELD, TPOT_FIELD),
                 check: Optional[Callable[[TimePredictor], TimePredictor]] = None) -> None:
        self.policy = policy
        self.fallback = fallback
        self.fields = fields
        self.check = check
        self._lock = threading.Lock()
        self._fits: dict[str, tuple[str, ProfilingData, TimePredictor]] = {}

    def get(self, inst: Instance) -> TimePredictor:
        """``inst``'s predictor (fitted now when its incarnation or profiling data is new)."""
        identity = instance_identity(inst)
        with self._lock:
            known = self._fits.get(inst.name)
        if known is not None and known[0] == identity and known[1] is inst.profiling:
            return known[2]
        predictor = fit(inst.profiling)
        if self.check is not None:
            predictor = self.check(predictor)
        with self._lock:
            again = self._fits.get(inst.name)
            warn = again is None or again[0] != identity or again[1] != inst.profiling
            self._fits[inst.name] = (identity, inst.profiling, predictor)
        problems = [p for p in predictor.problems if p.split(":", 1)[0] in self.fields]
        if warn and problems:
            log.warning("instance %s: profiling data unusable (%s); %s %s", inst.name,
                        "; ".join(problems), self.policy, self.fallback)
        return predictor

    def forget_except(self, names: set[str]) -> None:
        """Drop the fits of instances not in ``names`` (gone from the registry)."""
        with self._lock:
            for name in [n for n in self._fits if n not in names]:
                del self._fits[name]
