"""The simulated engine's latency model and the profiling data it registers (§12,
kvsvc.testbed.sim.serving): exact numbers of ``a + b n + c n^2`` prefill and ``d0 + d1 B + d2 B
(L - 1)`` decode steps, and profiling points that a least-squares fit of §12's forms recovers
exactly. No sockets."""

from __future__ import annotations

import pytest

from kvsvc.testbed.sim.serving import (
    TPOT_PROFILE_LENGTHS,
    TTFT_PROFILE_TOKENS,
    ServingConfig,
    profiling_data,
)


def _solve(a: list[list[float]], y: list[float]) -> list[float]:
    """Least squares by the normal equations and Gauss-Jordan (3 unknowns; no numpy)."""
    n = len(a[0])
    m = [[sum(r[i] * r[j] for r in a) for j in range(n)]
         + [sum(r[i] * v for r, v in zip(a, y))] for i in range(n)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * p for x, p in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] for i in range(n)]


def test_prefill_grows_faster_than_linearly_with_exact_terms():
    cfg = ServingConfig(prefill_base_us=1000.0, prefill_us_per_token=100.0,
                        prefill_us_per_token_sq=0.5, host_load_us_per_token=2.0)
    assert cfg.prefill_us(0) == 1000.0                       # fully cached: the base step
    assert cfg.prefill_us(200) == 1000.0 + 20_000.0 + 20_000.0
    assert cfg.prefill_us(200, host_only_tokens=100) == 41_000.0 + 200.0
    # Doubling the uncached prompt more than doubles its cost above the base.
    assert cfg.prefill_us(400) - 1000.0 > 2 * (cfg.prefill_us(200) - 1000.0)


def test_default_model_resembles_a_7b_model_on_one_h100():
    cfg = ServingConfig()
    assert cfg.prefill_us(2048) / 1000 == pytest.approx(109.078, abs=1e-3)   # ~19k tok/s
    assert cfg.prefill_us(32768) / 1000 == pytest.approx(2072.897, abs=1e-3)  # attention +26%
    assert cfg.tpot_us(1, 1) / 1000 == pytest.approx(8.1)
    assert cfg.tpot_us(64, 8000) / 1000 == pytest.approx(24.63872)


def test_decode_step_is_the_tpot_form_of_section_12():
    cfg = ServingConfig(decode_us_per_token=1000.0, decode_us_per_seq=500.0,
                        decode_us_per_context_token=10.0)
    assert cfg.tpot_us(1, 11) == 1000.0 + 500.0 + 100.0
    assert cfg.tpot_us(4, 101) == 1000.0 + 2000.0 + 4 * 100 * 10.0
    assert cfg.tpot_us(0, 1) == cfg.tpot_us(1, 1)  # a step always has its own sequence


def test_profiling_data_is_computed_by_the_model_and_fits_exactly():
    cfg = ServingConfig(max_num_seqs=48)
    data = profiling_data(cfg)
    ttft = data["ttft_profiling_data"]
    assert [p[0] for p in ttft] == list(TTFT_PROFILE_TOKENS)
    assert all(type(n) is int and ms == round(cfg.prefill_us(n) / 1000, 3) for n, ms in ttft)
    tpot = data["tpot_profiling_data"]
    batches = [1, 2, 4, 8, 16, 32, 48]
    assert [(p[0], p[1]) for p in tpot] == [(length, b) for length in TPOT_PROFILE_LENGTHS
                                            for b in batches]
    assert all(ms == round(cfg.tpot_us(b, length) / 1000, 3) for length, b, ms in tpot)
    # §12's fits recover the model's own coefficients (ms), so predictions match the sim.
    c0, c1, c2 = _solve([[1.0, n, n * n] for n, _ in ttft], [ms for _, ms in ttft])
    assert (c0, c1, c2) == pytest.approx((5.0, 0.05, 4e-7), rel=1e-3, abs=2e-3)
    d0, d1, d2 = _solve([[1.0, b, b * (length - 1)] for length, b, _ in tpot],
                        [ms for _, _, ms in tpot])
    assert (d0, d1, d2) == pytest.approx((8.0, 0.1, 2e-5), rel=1e-3, abs=1e-3)


@pytest.mark.parametrize("field", ["prefill_base_us", "prefill_us_per_token_sq",
                                   "decode_us_per_seq", "decode_us_per_context_token"])
def test_negative_terms_are_refused(field):
    with pytest.raises(ValueError, match=field):
        ServingConfig(**{field: -1.0})
