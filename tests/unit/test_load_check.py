"""The one load check (§9, ``kvsvc.cluster.model.check_load``) and the §11 age rule
(``LoadMetrics.is_current``): usage above 1 is clamped and flagged, NaN/negative/infinite/wrong
types stay refused, for heartbeats and ``XLLM:LOADMETRICS`` values alike."""

from __future__ import annotations

import math

import pytest

from kvsvc.cluster.model import CheckedLoad, LoadMetrics, check_load, parse_load
from kvsvc.errors import MalformedRegistration

USAGE_ERROR = "gpu_cache_usage_perc: must be a finite number >= 0 (above 1 counts as 1)"


@pytest.mark.parametrize("usage, used", [(0, 0.0), (0.0, 0.0), (0.5, 0.5), (1, 1.0), (1.0, 1.0)])
def test_usage_in_range_is_kept(usage, used):
    checked = check_load(3, usage)
    assert checked == CheckedLoad(3, used, used) and not checked.clamped


@pytest.mark.parametrize("usage", [1.3, math.nextafter(1.0, 2.0), 2, 8.0, 1e300])
def test_finite_usage_above_one_is_clamped_and_flagged(usage):
    """vllm_sidecar sums the engines of a multi-engine vLLM: 1.3 means "full", not "broken"."""
    checked = check_load(0, usage)
    assert (checked.gpu_cache_usage_perc, checked.reported_usage, checked.clamped) == (
        1.0, float(usage), True)


@pytest.mark.parametrize("usage", [-0.1, -1, float("nan"), float("inf"), float("-inf"),
                                   10**400, True, False, None, "0.5", [0.5]])
def test_usage_refused(usage):
    with pytest.raises(MalformedRegistration) as err:
        check_load(0, usage, field_prefix="load_metrics.")
    assert str(err.value) == "load_metrics." + USAGE_ERROR


@pytest.mark.parametrize("waiting", [-1, 2**31, 1.5, True, None, "3"])
def test_waiting_refused(waiting):
    with pytest.raises(MalformedRegistration) as err:
        check_load(waiting, 0.5)
    assert str(err.value) == "waiting_requests_num: must be an integer in [0, 2147483647]"


def test_etcd_values_go_through_the_same_check():
    assert parse_load(b'{"waiting_requests_num": 2, "gpu_cache_usage_perc": 1.3}') == \
        CheckedLoad(2, 1.0, 1.3)
    with pytest.raises(MalformedRegistration) as err:
        parse_load(b'{"waiting_requests_num": 2, "gpu_cache_usage_perc": -0.5}')
    assert str(err.value) == USAGE_ERROR


def test_load_is_current_up_to_and_including_max_age():
    load = LoadMetrics(0, 0.0, received_at=50.0)
    assert load.is_current(60.0, 10.0) and load.age_s(60.0) == 10.0
    assert not load.is_current(math.nextafter(60.0, math.inf), 10.0)
    assert load.is_current(40.0, 10.0)  # received "after" now: age <= 0
