"""The §12 time predictors (kvsvc.routing.predictor) and the profiling data they are fitted from
(kvsvc.cluster.model.parse_profiling): exact coefficients from exact data, the least-squares
solution of inconsistent data checked against the normal equations solved in exact rational
arithmetic, xllm-service's ``predict_tpot(total_length, batch)`` shape, and every bad input
(missing, short, rank-deficient, strings, negative times, NaN, wrong shapes) falling back to
"no data" with one WARNING per instance incarnation naming the instance and the field."""

from __future__ import annotations

import dataclasses
import json
import logging
from fractions import Fraction

import pytest

from kvsvc.cluster.model import (
    InstanceType,
    NO_PROFILING,
    ProfilingData,
    parse_profiling,
    parse_registration,
)
from kvsvc.routing.predictor import PredictorCache, fit, least_squares
from tests.support.policy import inst


def exact_normal_solution(rows, target):
    """Solve ``A^T A x = A^T b`` in rationals (Gauss-Jordan): the least-squares oracle."""
    a = [[Fraction(v) for v in r] for r in rows]
    b = [Fraction(v) for v in target]
    k = len(a[0])
    m = [[sum(a[i][p] * a[i][q] for i in range(len(a))) for q in range(k)]
         + [sum(a[i][p] * b[i] for i in range(len(a)))] for p in range(k)]
    for c in range(k):
        piv = next(r for r in range(c, k) if m[r][c] != 0)
        m[c], m[piv] = m[piv], m[c]
        for r in range(k):
            if r != c and m[r][c] != 0:
                f = m[r][c] / m[c][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c])]
    return [float(m[i][k] / m[i][i]) for i in range(k)]


def test_exact_quadratic_is_recovered():
    pts = tuple((n, 5.0 + 0.1 * n + 1e-5 * n * n) for n in (0, 512, 2048, 8192, 32768))
    p = fit(ProfilingData(ttft=pts))
    c0, c1, c2 = p.ttft_coefficients
    assert c0 == pytest.approx(5.0, abs=1e-6)
    assert c1 == pytest.approx(0.1, rel=1e-9)
    assert c2 == pytest.approx(1e-5, rel=1e-9)
    assert p.predict_ttft(1000) == pytest.approx(5.0 + 100.0 + 10.0, rel=1e-12)


def test_inconsistent_points_give_the_least_squares_solution():
    pts = ((100, 30.0), (400, 61.0), (1600, 290.0), (3200, 930.0), (6400, 3400.0))
    p = fit(ProfilingData(ttft=pts))
    expected = exact_normal_solution([(1, n, n * n) for n, _ in pts], [ms for _, ms in pts])
    assert p.ttft_coefficients == pytest.approx(expected, rel=1e-8)


def test_tpot_fit_and_the_sources_prediction_shape():
    # tpot = 2 + 0.5 batch + 0.01 batch (avg_len - 1), fitted from [avg_len, batch, ms].
    pts = tuple((length, b, 2.0 + 0.5 * b + 0.01 * b * (length - 1))
                for length, b in ((100, 1), (500, 4), (1000, 8), (2000, 16), (300, 32)))
    p = fit(ProfilingData(tpot=pts))
    assert p.tpot_coefficients == pytest.approx((2.0, 0.5, 0.01), rel=1e-9)
    # predict_tpot(total_length, batch) = d0 + d1 batch + d2 total_length (the source's).
    assert p.predict_tpot(1200, 3) == pytest.approx(2.0 + 1.5 + 12.0, rel=1e-12)


def test_no_data_predicts_zero_and_names_both_fields():
    p = fit(NO_PROFILING)
    assert (p.has_ttft, p.has_tpot) == (False, False)
    assert (p.predict_ttft(5000), p.predict_tpot(5000, 4)) == (0.0, 0.0)
    assert p.problems == ("ttft_profiling_data: none registered",
                          "tpot_profiling_data: none registered")


def test_every_point_dropped_is_said_once_not_as_none_registered():
    dropped = "ttft_profiling_data: 2 of 2 points dropped (item 0: not [tokens, ms] numbers)"
    p = fit(ProfilingData(problems=(dropped,)))
    assert p.problems == (dropped, "tpot_profiling_data: none registered")


def test_too_few_or_undetermined_points_fall_back():
    two = fit(ProfilingData(ttft=((100, 10.0), (200, 20.0)),
                            tpot=((10, 1, 5.0), (10, 2, 6.0))))
    assert (two.ttft_coefficients, two.tpot_coefficients) == (None, None)
    assert two.problems == ("ttft_profiling_data: 2 valid points, the fit needs 3",
                            "tpot_profiling_data: 2 valid points, the fit needs 3")
    same = fit(ProfilingData(ttft=((100, 10.0), (100, 11.0), (100, 12.0), (100, 13.0))))
    assert same.ttft_coefficients is None and same.predict_ttft(100) == 0.0
    assert same.problems[0].startswith("ttft_profiling_data: the points do not determine")
    # batch (avg_len - 1) proportional to batch: d1 and d2 cannot be told apart.
    flat = fit(ProfilingData(tpot=((11, 1, 1.0), (11, 2, 2.0), (11, 3, 3.0))))
    assert flat.tpot_coefficients is None
    assert least_squares([(1.0, 2.0)], [1.0]) is None  # fewer rows than unknowns


@pytest.mark.parametrize("raw, kept, problem", [
    ([[10, 1.0], [20, 2.0], [30, 3.0]], ((10, 1.0), (20, 2.0), (30, 3.0)), None),
    ([[10, "1.0"], [20, 2.0]], ((20, 2.0),), "1 of 2 points dropped (item 0"),
    ([[10, -1.0], [20, 2.0], [30]], ((20, 2.0),), "2 of 3 points dropped (item 0"),
    ([[10.5, 1.0], [True, 2.0], [-3, 1.0]], (), "3 of 3 points dropped (item 0"),
    ([[10, float("nan")], [10, float("inf")]], (), "2 of 2 points dropped"),
    ("1,2", (), "not a list of [tokens, ms] (str)"),
    (None, (), None),
])
def test_parse_profiling_keeps_valid_points_and_names_the_rest(raw, kept, problem):
    data = parse_profiling({"ttft_profiling_data": raw})
    assert data.ttft == kept
    if problem is None:
        assert data.problems == ()
    else:
        (line,) = data.problems
        assert line.startswith("ttft_profiling_data: ") and problem in line


def test_registration_carries_profiling_and_bad_data_never_refuses_it():
    value = json.dumps({"name": "h:1", "type": 0, "incarnation_id": "i",
                        "ttft_profiling_data": [[100, 12.5], [200, 20.0], [400, 41.0]],
                        "tpot_profiling_data": [[100, 1, 5.0], ["x", 2, 6.0]]}).encode()
    reg = parse_registration(InstanceType.DEFAULT, "h:1", value)
    assert reg.profiling.ttft == ((100, 12.5), (200, 20.0), (400, 41.0))
    assert reg.profiling.tpot == ((100, 1, 5.0),)
    assert reg.profiling.problems[0].startswith("tpot_profiling_data: 1 of 2 points dropped")
    # NaN (which Python's json reads) and a non-list are problems, not refusals.
    nan = b'{"type": 0, "ttft_profiling_data": [[1, NaN]], "tpot_profiling_data": {}}'
    reg = parse_registration(InstanceType.DEFAULT, "h:1", nan)
    assert reg.profiling.ttft == () and len(reg.profiling.problems) == 2


def test_cache_warns_once_per_incarnation_naming_instance_and_fields(caplog):
    cache = PredictorCache("SLO_AWARE", "predicts 0 ms there (§12)")
    bad = dataclasses.replace(inst("10.0.0.1:9000"), profiling=ProfilingData(
        ttft=((100, 10.0), (200, 20.0)), problems=("ttft_profiling_data: 1 of 3 points "
                                                   "dropped (item 2: ...)",)))
    with caplog.at_level(logging.WARNING, logger="kvsvc.routing.predictor"):
        for _ in range(3):
            assert cache.get(bad).predict_ttft(100) == 0.0
        assert [r.getMessage() for r in caplog.records] == [
            "instance 10.0.0.1:9000: profiling data unusable (ttft_profiling_data: 1 of 3 "
            "points dropped (item 2: ...); ttft_profiling_data: 2 valid points, the fit needs "
            "3; tpot_profiling_data: none registered); SLO_AWARE predicts 0 ms there (§12)"]
        caplog.clear()
        cache.get(dataclasses.replace(bad, incarnation_id="new"))  # a new process: again
        assert len(caplog.records) == 1
        caplog.clear()
        good = dataclasses.replace(bad, profiling=ProfilingData(
            ttft=((0, 1.0), (1, 2.0), (2, 5.0)), tpot=((1, 1, 1.0), (2, 2, 3.0), (4, 1, 4.0))))
        assert cache.get(good).predict_ttft(3) == pytest.approx(10.0)
        assert caplog.records == []
