"""Per-instance request metrics kept from the router's own traffic (§12): xllm-service's
``RequestMetrics`` (``common/types.h``) and ``InstanceMgr::update_request_metrics``, fed by
the proxy's request observer seam (:mod:`kvsvc.routing.observer`).

Per instance (``host:port``), :class:`InstanceRequestMetrics`:

- ``prefill_request_num`` / ``prefill_token_num``: requests (and their prompt tokens) sent to
  it as P that have not relayed their first token;
- ``estimated_prefill_ms``: the sum of those requests' predicted prefill times (the
  deciding policy's ``estimated_ttft``, :attr:`~kvsvc.routing.observer.RequestInfo.
  estimated_prefill_ms`);
- ``decode_request_num`` / ``decode_token_num``: requests sent with it as D that have not
  ended, and their tokens (the prompt from dispatch, plus one per relayed token).

The updates, per action of the source:

==============  ===============================================  ===========================
action          P (``prefill``)                                  D (``decode``)
==============  ===============================================  ===========================
SCHEDULE        requests +1, tokens + prompt, time + estimate     requests +1, tokens + prompt
FINISH_PREFILL  requests -1, tokens - prompt, time - estimate     tokens +1
GENERATE        -                                                 tokens +1
FINISH_DECODE   (FINISH_PREFILL first if still in prefill)        requests -1, tokens - added
CANCEL          undone if still in prefill                        requests -1, tokens - added
==============  ===============================================  ===========================

Two deliberate differences from the source (docs/routing.md): (1) every end subtracts
exactly what this request added (the source subtracts ``prompt + generated``, the same total
when nothing is lost), and a CANCEL after the first token does not undo the prefill part a
second time (the source's CANCEL subtracts the P's request, tokens and time again after
FINISH_PREFILL already did: each client that goes away mid-decode would drive that P's
``estimated_prefill_time`` below zero for good, and SLO_AWARE would then send it everything);
(2) a request without a D still counts on its P (the source's lookup of the empty decode name
fails and it counts nothing, while its selection still added the time: that P's estimate only
grows). Metrics are not reset when an instance is replaced: requests in flight to the old
process still end and subtract what they added, so the counts return to 0.

When a request's end (FINISH_DECODE or CANCEL) leaves its D with no decode request, the
ledger calls its idle listeners with the D's name (outside its lock): the source calls
``flip_decode_to_prefill`` there (SLO_AWARE's :meth:`~kvsvc.routing.slo.SloAware.on_decode_idle`).

Threads: the proxy's threads call the observer methods concurrently, policies read
:meth:`RequestMetricsLedger.snapshot`; one lock, held only to update or copy, except by
GENERATE, which only the request's own relay thread writes (it is counted on the request and
summed into its D's tokens by the snapshot). Nothing raises.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping, Optional

from kvsvc.routing.observer import RequestInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class InstanceRequestMetrics:
    """One instance's request metrics (module docstring); all counts >= 0 while the
    observer's calls are consistent.

    :ivar prefill_request_num: requests in prefill on it (as P).
    :ivar prefill_token_num: their prompt tokens.
    :ivar estimated_prefill_ms: the sum of their predicted prefill times, milliseconds.
    :ivar decode_request_num: requests not ended with it as D.
    :ivar decode_token_num: their tokens: prompts plus relayed tokens.
    """

    prefill_request_num: int = 0
    prefill_token_num: int = 0
    estimated_prefill_ms: float = 0.0
    decode_request_num: int = 0
    decode_token_num: int = 0

    def to_json(self) -> dict:
        """JSON object of these metrics."""
        return {"prefill_request_num": self.prefill_request_num,
                "prefill_token_num": self.prefill_token_num,
                "estimated_prefill_ms": self.estimated_prefill_ms,
                "decode_request_num": self.decode_request_num,
                "decode_token_num": self.decode_token_num}


#: An instance nothing was sent to.
NO_REQUESTS = InstanceRequestMetrics()


@dataclass(frozen=True, slots=True)
class PendingPrefill:
    """One request still in prefill on its P.

    :ivar dispatched_at: ``time.monotonic()`` seconds it was sent.
    :ivar estimated_prefill_ms: its predicted prefill time, milliseconds.
    :ivar streamed: its first token will be heard (a non-streamed request stays pending until
        its end, through its decode).
    :ivar dp_rank: the DP rank it was sent to (§15), ``None`` when sent without one.
    """

    dispatched_at: float
    estimated_prefill_ms: float
    streamed: bool = True
    dp_rank: Optional[int] = None


@dataclass(frozen=True, slots=True)
class PrefillEnd:
    """One streamed request that recently left its P's prefill queue.

    :ivar dispatched_at: ``time.monotonic()`` seconds it was sent.
    :ivar ended_at: ``time.monotonic()`` seconds its first token was relayed, or it was
        cancelled before one.
    :ivar estimated_prefill_ms: its predicted prefill time, milliseconds.
    :ivar first_token: it ended by its first token (the P's prefill lane was then free), not
        by a cancel.
    :ivar dp_rank: the DP rank it was sent to (§15), ``None`` when sent without one.
    """

    dispatched_at: float
    ended_at: float
    estimated_prefill_ms: float
    first_token: bool
    dp_rank: Optional[int] = None


#: Streamed prefill ends kept per instance (:attr:`RequestMetricsSnapshot.recent`): enough to
#: cover several heartbeats of a busy P, bounded so the ledger's memory is.
RECENT_PREFILL_ENDS = 256


@dataclass(frozen=True)
class RequestMetricsSnapshot:
    """The ledger at one moment.

    :ivar metrics: instance ``host:port`` -> its metrics (absent: :data:`NO_REQUESTS`).
    :ivar pending: instance ``host:port`` -> its requests still in prefill, oldest first.
    :ivar recent: instance ``host:port`` -> its last :data:`RECENT_PREFILL_ENDS` streamed
        prefill ends, oldest first (``ended_at`` non-decreasing: stamped under the lock).
    """

    metrics: Mapping[str, InstanceRequestMetrics] = field(
        default_factory=lambda: MappingProxyType({}))
    pending: Mapping[str, tuple[PendingPrefill, ...]] = field(
        default_factory=lambda: MappingProxyType({}))
    recent: Mapping[str, tuple[PrefillEnd, ...]] = field(
        default_factory=lambda: MappingProxyType({}))

    def of(self, name: str) -> InstanceRequestMetrics:
        """``name``'s metrics (:data:`NO_REQUESTS` when nothing was sent to it)."""
        return self.metrics.get(name, NO_REQUESTS)

    def pending_of(self, name: str) -> tuple[PendingPrefill, ...]:
        """``name``'s requests still in prefill, oldest first."""
        return self.pending.get(name, ())

    def recent_of(self, name: str) -> tuple[PrefillEnd, ...]:
        """``name``'s recent streamed prefill ends, oldest first."""
        return self.recent.get(name, ())


#: A ledger with nothing in it (policies called without one).
EMPTY_REQUEST_METRICS = RequestMetricsSnapshot()


class _Counts:
    """Mutable counts of one instance (under the ledger's lock)."""

    __slots__ = ("p_req", "p_tok", "p_ms", "d_req", "d_tok")

    def __init__(self) -> None:
        self.p_req = self.p_tok = self.d_req = self.d_tok = 0
        self.p_ms = 0.0

    def freeze(self, generated: int = 0) -> InstanceRequestMetrics:
        return InstanceRequestMetrics(self.p_req, self.p_tok, self.p_ms, self.d_req,
                                      self.d_tok + generated)


class _Open:
    """One request the ledger counts (under the ledger's lock)."""

    __slots__ = ("info", "in_prefill", "decode_added", "generated", "pending")

    def __init__(self, info: RequestInfo) -> None:
        self.info = info
        self.in_prefill = True
        # Built once: every routing decision's snapshot lists it while in prefill.
        self.pending = PendingPrefill(info.dispatched_at, info.estimated_prefill_ms,
                                      info.streamed, info.dp_rank)
        self.decode_added = 0
        # GENERATE tokens, written only by the request's relay thread and without the lock
        # (one call per relayed SSE event: under the lock, 128 relay threads queued on it);
        # folded into the D's decode tokens when a snapshot is taken.
        self.generated = 0


class RequestMetricsLedger:
    """The per-instance request metrics of this worker (module docstring); a
    :class:`~kvsvc.routing.observer.RequestObserver`. One per service, built by
    :func:`kvsvc.service.build_router`, heard by the proxy, read by SLO_AWARE and TTFT.

    :param clock: ``time.monotonic``-like seconds, the time of each :class:`PrefillEnd`.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._counts: dict[str, _Counts] = {}
        self._open: dict[int, _Open] = {}
        self._recent: dict[str, collections.deque[PrefillEnd]] = {}
        self._idle_listeners: list[Callable[[str], None]] = []

    def add_idle_listener(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(decode_name)`` whenever a request's end leaves that D with no
        decode request (outside the lock; exceptions are logged)."""
        with self._lock:
            self._idle_listeners.append(listener)

    def _c(self, name: str) -> _Counts:
        c = self._counts.get(name)
        if c is None:
            c = self._counts[name] = _Counts()
        return c

    def on_dispatch(self, info: RequestInfo) -> None:
        """SCHEDULE: count the request on its P (request, prompt tokens, estimate) and D."""
        with self._lock:
            if info.attempt_id in self._open:
                return
            rec = self._open[info.attempt_id] = _Open(info)
            p = self._c(info.prefill)
            p.p_req += 1
            p.p_tok += info.prompt_tokens
            p.p_ms += info.estimated_prefill_ms
            if info.decode:
                d = self._c(info.decode)
                d.d_req += 1
                d.d_tok += info.prompt_tokens
                rec.decode_added = info.prompt_tokens

    def _finish_prefill(self, rec: _Open, first_token: bool = False) -> None:
        rec.in_prefill = False
        info = rec.info
        if info.streamed:
            # A non-streamed end comes after the decode: its prefill end time is unknown.
            ends = self._recent.get(info.prefill)
            if ends is None:
                ends = self._recent[info.prefill] = collections.deque(maxlen=RECENT_PREFILL_ENDS)
            ends.append(PrefillEnd(info.dispatched_at, self._clock(),
                                   info.estimated_prefill_ms, first_token, info.dp_rank))
        p = self._c(info.prefill)
        p.p_req -= 1
        p.p_tok -= info.prompt_tokens
        p.p_ms -= info.estimated_prefill_ms
        if p.p_req == 0:
            p.p_ms = 0.0   # no float residue once nothing is in prefill

    def on_first_token(self, info: RequestInfo) -> None:
        """FINISH_PREFILL: the request leaves its P's prefill counts; one token on its D."""
        with self._lock:
            rec = self._open.get(info.attempt_id)
            if rec is None or not rec.in_prefill:
                return
            self._finish_prefill(rec, first_token=True)
            self._token(rec)

    def _token(self, rec: _Open) -> None:
        if rec.info.decode:
            self._c(rec.info.decode).d_tok += 1
            rec.decode_added += 1

    def on_token(self, info: RequestInfo) -> None:
        """GENERATE: one more token on the request's D (lock-free: only the request's own
        relay thread calls this for it)."""
        rec = self._open.get(info.attempt_id)
        if rec is not None and rec.info.decode:
            rec.generated += 1

    def on_tokens(self, info: RequestInfo, n: int) -> None:
        """GENERATE ``n`` times (lock-free, as :meth:`on_token`)."""
        rec = self._open.get(info.attempt_id)
        if rec is not None and rec.info.decode:
            rec.generated += n

    def on_end(self, info: RequestInfo, usage: Optional[dict]) -> None:
        """FINISH_DECODE (after FINISH_PREFILL when the answer was not streamed)."""
        self._close(info)

    def on_cancel(self, info: RequestInfo, reason: str) -> None:
        """CANCEL: undo what the request still counts."""
        self._close(info)

    def _close(self, info: RequestInfo) -> None:
        idle: Optional[str] = None
        with self._lock:
            rec = self._open.pop(info.attempt_id, None)
            if rec is None:
                return
            if rec.in_prefill:
                self._finish_prefill(rec)
            if info.decode:
                d = self._c(info.decode)
                d.d_req -= 1
                d.d_tok -= rec.decode_added
                if d.d_req == 0:
                    idle = info.decode
            listeners = list(self._idle_listeners) if idle else []
        for listener in listeners:
            try:
                listener(info.decode)
            except Exception:  # noqa: BLE001 - a listener must not break the relay
                log.exception("request metrics: idle listener failed for %s", info.decode)

    def snapshot(self) -> RequestMetricsSnapshot:
        """Every instance's metrics and pending prefills (copied under the lock)."""
        with self._lock:
            generated: dict[str, int] = {}
            pending: dict[str, list[PendingPrefill]] = {}
            for rec in self._open.values():
                if rec.generated:
                    generated[rec.info.decode] = generated.get(rec.info.decode, 0) + rec.generated
                if rec.in_prefill:
                    pending.setdefault(rec.info.prefill, []).append(rec.pending)
            recent = {n: tuple(v) for n, v in self._recent.items() if v}
            metrics = {n: c.freeze(generated.get(n, 0)) for n, c in self._counts.items()}
        return RequestMetricsSnapshot(
            MappingProxyType(metrics),
            MappingProxyType({n: tuple(sorted(v, key=lambda p: p.dispatched_at))
                              for n, v in pending.items()}),
            MappingProxyType(recent))
