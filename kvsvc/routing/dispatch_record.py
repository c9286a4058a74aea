"""What the router learns from its own dispatches (§14, §16): the request observer that records
each routed prompt's full blocks in the chosen (instance, DP rank)'s overlay.

:class:`DispatchRecorder` hears ``on_dispatch`` on the proxy's observer seam
(:mod:`kvsvc.routing.observer`) and hands the prompt's content keys (computed once by the query
and carried by the decision, :attr:`~kvsvc.routing.policy.Decision.prompt`) to the directory's
:meth:`~kvsvc.directory.Directory.record_dispatch`:

- an approximate index (§14) adds or renews every block as resident on Device;
- an exact stream's pending overlay (§16) adds the blocks after the reusable prefix the policy
  saw on that rank (those before it are exact already).

Which DP ranks: the rank the request is sent to when it carries one (``X-data-parallel-rank``,
§15: ``RequestInfo.dp_rank``); otherwise every rank of the instance, since the engine picks one
itself and routing counts the minimum over ranks (§11): a block counts there only once it is
recorded on every rank. The approximation is measured by the predicted-vs-actual audit
(:mod:`kvsvc.routing.cache_audit`), per backend.

An attempt that fails before its response head is not undone: its blocks expire with their
TTL (a retry is a new dispatch to another instance, recorded there). Each kvsvc replica (each
gunicorn worker, each service replica) learns only from its own routing: replicas do not share
what they recorded.

Thread-safe (the directory's overlays take their own locks); never raises (an observer must not
break a relay).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence

from kvsvc.index.overlay import PromptKeys
from kvsvc.routing.observer import RequestInfo


class DispatchSink(Protocol):
    """Where dispatches are recorded (:class:`kvsvc.directory.Directory`)."""

    def record_dispatch(self, instance_name: str, ranks: Sequence[tuple[int, int]],
                        prompt: PromptKeys, now: Optional[float] = None) -> int:
        """Record one dispatch's prompt on ``ranks`` ((dp_rank, reusable prefix tokens))."""
        ...


def dispatch_ranks(decision: Any, info: RequestInfo) -> list[tuple[int, int]]:
    """The (dp_rank, reusable prefix tokens the policy saw there) pairs one attempt is recorded
    on (module docstring): the rank it was sent to, else every rank the decision scored for its
    P, else ranks ``0 .. dp_size - 1`` of the P with no prefix (RR scores none).

    :param decision: the attempt's :class:`~kvsvc.routing.policy.Decision`.
    :param info: the attempt.
    """
    cand = decision.prefill_candidate(info.prefill)
    ranks = cand.ranks if cand is not None else ()
    chosen = info.dp_rank
    if chosen is not None:
        for r in ranks:
            if r.dp_rank == chosen:
                return [(chosen, r.device_hit_tokens + r.host_only_hit_tokens)]
        return [(chosen, 0)]
    if ranks:
        return [(r.dp_rank, r.device_hit_tokens + r.host_only_hit_tokens) for r in ranks]
    for inst in decision.prefill_ranking:
        if inst.name == info.prefill:
            return [(rank, 0) for rank in range(max(1, inst.dp_size))]
    return [(0, 0)]


class DispatchRecorder:
    """The request observer recording every dispatch in the overlays (module docstring).

    :param sink: the directory.
    """

    def __init__(self, sink: DispatchSink) -> None:
        self._sink = sink

    def on_dispatch(self, info: RequestInfo) -> None:
        """Record the attempt's prompt on its P's rank(s) (§14, §16)."""
        decision = info.decision
        prompt = getattr(decision, "prompt", None)
        if prompt is None:
            return
        self._sink.record_dispatch(info.prefill, dispatch_ranks(decision, info), prompt)

    def on_first_token(self, info: RequestInfo) -> None:
        """Ignored."""

    def on_token(self, info: RequestInfo) -> None:
        """Ignored."""

    def on_tokens(self, info: RequestInfo, n: int) -> None:
        """Ignored."""

    def on_end(self, info: RequestInfo, usage: Optional[dict]) -> None:
        """Ignored: blocks stay until their events, their TTL or the LRU bound."""

    def on_cancel(self, info: RequestInfo, reason: str) -> None:
        """Ignored (module docstring: not undone, the TTL ends it)."""
