"""The policy ``--load_balance_policy`` names (§11, §12), built once per service.

``RR`` and ``CAR`` (:mod:`kvsvc.routing.policy`), ``SLO_AWARE`` (:mod:`kvsvc.routing.slo`) and
``TTFT`` (:mod:`kvsvc.routing.ttft`); the last two read the service's request-metrics ledger
(:mod:`kvsvc.routing.request_metrics`). One INFO line names the policy and its parameters.

The name and the parameters arrive valid: the settings table (:mod:`kvsvc.settings`) checks
them once; an unknown name here is a bug (``ValueError``).
"""

from __future__ import annotations

import logging
from typing import Optional

from kvsvc.routing.policy import CacheAware, Policy, RoundRobin
from kvsvc.routing.request_metrics import RequestMetricsLedger
from kvsvc.routing.slo import SloAware
from kvsvc.routing.ttft import TtftPolicy
from kvsvc.settings import (
    DEFAULT_MAX_LOAD_AGE_S,
    DEFAULT_PREFILL_TOKENS_PER_S,
    DEFAULT_TARGET_TPOT_MS,
    DEFAULT_TARGET_TTFT_MS,
    DEFAULT_TTFT_HOST_HIT_WEIGHT,
    DEFAULT_TTFT_WORK_WEIGHT,
    PolicyName,
)

log = logging.getLogger(__name__)


def make_policy(name: str, prefill_lambda: float = 0.5, host_hit_weight: float = 0.5,
                max_load_age_s: float = DEFAULT_MAX_LOAD_AGE_S, *,
                ledger: Optional[RequestMetricsLedger] = None,
                target_ttft_ms: int = DEFAULT_TARGET_TTFT_MS,
                target_tpot_ms: int = DEFAULT_TARGET_TPOT_MS,
                default_prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S,
                dp_rank_routing: bool = True,
                ttft_work_weight: float = DEFAULT_TTFT_WORK_WEIGHT,
                ttft_host_hit_weight: float = DEFAULT_TTFT_HOST_HIT_WEIGHT) -> Policy:
    """The policy selected by ``--load_balance_policy`` (xllm-service's names, plus TTFT).

    :param name: ``RR``, ``CAR``, ``SLO_AWARE`` or ``TTFT``.
    :param prefill_lambda: ``--car_prefill_lambda``, CAR only.
    :param host_hit_weight: ``--car_host_hit_weight``, CAR.
    :param max_load_age_s: ``--max_load_age_s``, every policy.
    :param ledger: the request-metrics ledger the proxy feeds, SLO_AWARE and TTFT (without
        one they see no traffic of their own).
    :param target_ttft_ms: ``--target_ttft``, SLO_AWARE.
    :param target_tpot_ms: ``--target_tpot``, SLO_AWARE.
    :param default_prefill_tokens_per_s: ``--default_prefill_tokens_per_s``, TTFT.
    :param dp_rank_routing: ``--dp_rank_routing`` (§15), CAR and TTFT.
    :param ttft_work_weight: ``--ttft_work_weight``, TTFT.
    :param ttft_host_hit_weight: ``--ttft_host_hit_weight``, TTFT (D30).
    :raises ValueError: ``name`` is none of :class:`~kvsvc.settings.PolicyName` (a bug: the
        setting's validator admits only those).
    """
    if name == PolicyName.RR:
        rr = RoundRobin(max_load_age_s)
        log.info("routing policy RR (max load age %g s)", rr.max_load_age_s)
        return rr
    if name == PolicyName.CAR:
        policy = CacheAware(prefill_lambda, host_hit_weight, max_load_age_s, dp_rank_routing)
        log.info("routing policy CAR (lambda %.3f, host hit weight %.3f, max load age %g s, "
                 "DP-rank routing %s)", policy.prefill_lambda, policy.host_hit_weight,
                 policy.max_load_age_s, "on" if policy.dp_rank_routing else "off")
        # CAR without a KV index is warned about by the service once, at start (it is built
        # twice under `serve`: to validate, then in the worker).
        return policy
    if name == PolicyName.SLO_AWARE:
        slo = SloAware(ledger, target_ttft_ms, target_tpot_ms, max_load_age_s)
        log.info("routing policy SLO_AWARE (target TTFT %d ms, target TPOT %d ms, max load "
                 "age %g s)", slo.target_ttft_ms, slo.target_tpot_ms, slo.max_load_age_s)
        return slo
    if name == PolicyName.TTFT:
        ttft = TtftPolicy(ledger, ttft_host_hit_weight, default_prefill_tokens_per_s,
                          max_load_age_s, dp_rank_routing, ttft_work_weight)
        log.info("routing policy TTFT (host hit weight %.3f, default prefill %g tokens/s, "
                 "max load age %g s, DP-rank routing %s, work weight %g)",
                 ttft.host_hit_weight, ttft.default_prefill_tokens_per_s, ttft.max_load_age_s,
                 "on" if ttft.dp_rank_routing else "off", ttft.work_weight)
        return ttft
    raise ValueError(f"no routing policy {name!r}")
