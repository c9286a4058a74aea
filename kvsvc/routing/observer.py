"""The request lifecycle seam (§12): who hears what happens to each proxied request.

The proxy sees every attempt it sends and every chunk it relays; policies that keep their own
per-instance request metrics (SLO_AWARE, TTFT: :mod:`kvsvc.routing.request_metrics`) and any
accounting of answers (e.g. predicted vs actual cached tokens) hang on one seam, a
:class:`RequestObserver`, instead of on the proxy's internals. The events are xllm-service's
request actions (``RequestAction`` of ``common/types.h``):

========================  =====================================================  =============
call                      when                                                   source action
========================  =====================================================  =============
``on_dispatch(info)``     the proxy sends one attempt upstream                    SCHEDULE
``on_first_token(info)``  the first SSE event with a choice was relayed           FINISH_PREFILL
``on_token(info)``        each later SSE event with a choice was relayed          GENERATE
``on_end(info, usage)``   the answer was relayed to its end with a status < 400   FINISH_DECODE
``on_cancel(info, why)``  the attempt failed before its head, its body broke,     CANCEL
                          the client went away, or the upstream answered >= 400
========================  =====================================================  =============

An observer may also have ``on_tokens(info, n)``: ``n`` further tokens relayed together (one
write), the same as ``n`` ``on_token`` calls; :func:`notify_tokens` calls it where it exists
and ``on_token`` ``n`` times elsewhere.

Every dispatched attempt gets exactly one of ``on_end`` / ``on_cancel``; a retry on the next
candidate is a new attempt (a new :class:`RequestInfo`). A non-streamed answer has no token
events: ``on_end`` comes alone (with the body's ``usage``), and an observer treats a request
that ends while still in prefill as having passed its first token at the end.

``usage`` is the OpenAI ``usage`` object the upstream sent (the last SSE event carrying one, or
the JSON body's), e.g. ``{"prompt_tokens": 40, "completion_tokens": 8, "total_tokens": 48,
"prompt_tokens_details": {"cached_tokens": 32}}``, or ``None`` when the answer carried none.

Threads: calls for one attempt come in order but possibly from different threads (the request
thread dispatches, the WSGI server's thread closes the body); calls for different attempts run
concurrently. An observer must be thread-safe, must not block, and must not raise: an exception
is logged by the caller (:func:`notify`) and never reaches the relay.
"""

from __future__ import annotations

import orjson
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

log = logging.getLogger(__name__)

#: ``on_cancel`` reasons.
CANCEL_UPSTREAM_FAILED = "upstream failed before the response head"
CANCEL_BROKEN = "upstream body broke"
CANCEL_CLIENT_GONE = "client went away"
CANCEL_HTTP_ERROR = "upstream answered an error status"


@dataclass(frozen=True)
class RequestInfo:
    """One attempt of one proxied request, as the observers see it.

    :ivar attempt_id: unique per attempt in this process (> 0).
    :ivar prefill: the P instance the attempt was sent to, ``host:port``.
    :ivar decode: the D named in the body, ``host:port``; ``""`` without a D.
    :ivar prompt_tokens: the prompt's token ids counted by the router (0 when unknown).
    :ivar estimated_prefill_ms: the policy's predicted prefill time of this request on
        ``prefill``, milliseconds (SLO_AWARE's ``estimated_ttft``, TTFT's ``ttft_P(uncached)``);
        0 when the policy predicts none (RR, CAR).
    :ivar policy: the deciding policy's name (``RR``, ``CAR``, ``SLO_AWARE``, ``TTFT``).
    :ivar dispatched_at: ``time.monotonic()`` seconds when the attempt was sent.
    :ivar decision: the policy's :class:`~kvsvc.routing.policy.Decision` (typed loosely so this
        module imports nothing of the policies), ``None`` when unknown.
    :ivar streamed: the client asked for a stream (``"stream": true``): its first token is
        heard when it is relayed; otherwise only the end is heard.
    :ivar dp_rank: the DP rank the attempt was sent to (``X-data-parallel-rank``, §15),
        ``None`` when it carried none.
    :ivar model: the request's ``model`` (``""`` when unknown).
    """

    attempt_id: int
    prefill: str
    decode: str
    prompt_tokens: int
    estimated_prefill_ms: float = 0.0
    policy: str = ""
    dispatched_at: float = field(default_factory=time.monotonic)
    decision: Any = None
    streamed: bool = True
    dp_rank: Optional[int] = None
    model: str = ""


class RequestObserver(Protocol):
    """Hears the lifecycle of every proxied attempt (module docstring). Thread-safe, never
    blocks, never raises."""

    def on_dispatch(self, info: RequestInfo) -> None:
        """The attempt was sent upstream (SCHEDULE)."""
        ...

    def on_first_token(self, info: RequestInfo) -> None:
        """The first generated token was relayed (FINISH_PREFILL)."""
        ...

    def on_token(self, info: RequestInfo) -> None:
        """One further generated token was relayed (GENERATE)."""
        ...

    def on_end(self, info: RequestInfo, usage: Optional[dict]) -> None:
        """The answer was relayed to its end (FINISH_DECODE); ``usage`` the upstream's OpenAI
        ``usage`` object or ``None``."""
        ...

    def on_cancel(self, info: RequestInfo, reason: str) -> None:
        """The attempt ended without a complete answer (CANCEL); ``reason`` one of the
        ``CANCEL_*`` strings, possibly with detail after ``": "``."""
        ...


def notify(observer: Optional[RequestObserver], method: str, *args: Any) -> None:
    """Call ``observer.<method>(*args)``; an exception is logged (with its traceback), never
    raised: an observer must not break a relay."""
    if observer is None:
        return
    try:
        getattr(observer, method)(*args)
    except Exception:  # noqa: BLE001 - the relay must go on
        log.exception("request observer %s.%s failed", type(observer).__name__, method)


def notify_tokens(observer: Optional[RequestObserver], info: RequestInfo, n: int) -> None:
    """``n`` further tokens (GENERATE ``n`` times) relayed together: ``observer.on_tokens(info,
    n)`` where it has one, else ``on_token(info)`` ``n`` times; logged, never raised, as
    :func:`notify`."""
    if observer is None or n <= 0:
        return
    batch = getattr(observer, "on_tokens", None)
    if batch is not None:
        notify(observer, "on_tokens", info, n)
        return
    for _ in range(n):
        notify(observer, "on_token", info)


def notify_heard(observer: Optional[RequestObserver], info: RequestInfo, seen: int,
                 tokens: int) -> int:
    """``tokens`` more output tokens of an answer that had ``seen`` so far: the answer's first
    is FINISH_PREFILL (``on_first_token``), the others GENERATE (:func:`notify_tokens`).

    :returns: the tokens seen now (``seen + tokens``; ``seen`` when ``tokens`` <= 0).
    """
    if tokens <= 0:
        return seen
    if seen == 0:
        notify(observer, "on_first_token", info)
        notify_tokens(observer, info, tokens - 1)
    else:
        notify_tokens(observer, info, tokens)
    return seen + tokens


class ObserverChain:
    """Several observers heard in order (e.g. the request-metrics ledger, then an accounting
    of cached tokens); one failing does not stop the others.

    :param observers: the observers, called in this order.
    """

    def __init__(self, observers: Sequence[RequestObserver]) -> None:
        self.observers = tuple(observers)

    def on_dispatch(self, info: RequestInfo) -> None:
        """See :meth:`RequestObserver.on_dispatch`."""
        for o in self.observers:
            notify(o, "on_dispatch", info)

    def on_first_token(self, info: RequestInfo) -> None:
        """See :meth:`RequestObserver.on_first_token`."""
        for o in self.observers:
            notify(o, "on_first_token", info)

    def on_token(self, info: RequestInfo) -> None:
        """See :meth:`RequestObserver.on_token`."""
        for o in self.observers:
            notify(o, "on_token", info)

    def on_tokens(self, info: RequestInfo, n: int) -> None:
        """``n`` further tokens at once (:func:`notify_tokens` on each observer)."""
        for o in self.observers:
            notify_tokens(o, info, n)

    def on_end(self, info: RequestInfo, usage: Optional[dict]) -> None:
        """See :meth:`RequestObserver.on_end`."""
        for o in self.observers:
            notify(o, "on_end", info, usage)

    def on_cancel(self, info: RequestInfo, reason: str) -> None:
        """See :meth:`RequestObserver.on_cancel`."""
        for o in self.observers:
            notify(o, "on_cancel", info, reason)


#: Largest non-event-stream body kept to read its ``usage`` at the end (bytes); a larger
#: answer ends with ``usage`` None (an OpenAI completion body is far smaller).
MAX_USAGE_BODY_BYTES = 8 * 1024 * 1024
#: Longest SSE line kept across chunks (bytes); a longer one is skipped, not counted.
MAX_SSE_LINE_BYTES = 1024 * 1024


class RelayTracker:
    """Turns one relayed upstream body into observer calls (module docstring): fed every
    chunk as it is handed on (:meth:`chunk`), then how the relay ended (:meth:`finish`).

    SSE: each ``data:`` line is one event; ``[DONE]`` and events without a non-empty
    ``choices`` list (the usage-only last chunk, error events) are not tokens; the first token
    event calls ``on_first_token``, each later one ``on_token``; the last ``usage`` object seen
    is handed to ``on_end``. Other bodies are kept (up to :data:`MAX_USAGE_BODY_BYTES`) and their
    JSON's ``usage`` read at the end.

    :param observer: who hears it.
    :param info: the attempt.
    :param status: the upstream's HTTP status (>= 400 ends in ``on_cancel``).
    :param event_stream: the body is ``text/event-stream``.
    """

    def __init__(self, observer: RequestObserver, info: RequestInfo, status: int,
                 event_stream: bool) -> None:
        self.observer = observer
        self.info = info
        self.status = status
        self.event_stream = event_stream
        self.tokens = 0
        self.usage: Optional[dict] = None
        self._partial = b""
        self._body: list[bytes] = []
        self._body_bytes = 0
        self._lock = threading.Lock()
        self._finished = False

    def chunk(self, data: bytes) -> None:
        """One relayed chunk, undecoded."""
        if not self.event_stream:
            if self._body_bytes + len(data) <= MAX_USAGE_BODY_BYTES:
                self._body.append(data)
            self._body_bytes += len(data)
            return
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > MAX_SSE_LINE_BYTES:
            self._partial = b""
        tokens = 0
        for line in lines:
            tokens += self._line(line.rstrip(b"\r"))
        self._heard(tokens)

    def _heard(self, tokens: int) -> None:
        """Observer calls for ``tokens`` token events of one chunk (the first of the answer
        is FINISH_PREFILL, the others GENERATE at once)."""
        self.tokens = notify_heard(self.observer, self.info, self.tokens, tokens)

    def _line(self, line: bytes) -> int:
        """1 when ``line`` is a token event, else 0; keeps the last ``usage`` seen."""
        if not line.startswith(b"data:"):
            return 0
        payload = line[5:].strip()
        if not payload or payload == b"[DONE]":
            return 0
        try:
            doc = orjson.loads(payload)  # every relayed event: the Rust parser
        except (ValueError, RecursionError):
            return 0
        if not isinstance(doc, dict):
            return 0
        usage = doc.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        choices = doc.get("choices")
        return 1 if isinstance(choices, list) and choices else 0

    def finish(self, complete: bool, broken: Optional[str]) -> None:
        """The relay ended: ``complete`` (read to its end) or not; ``broken`` the error that
        broke it, ``None`` when none (an incomplete, unbroken relay: the client went away).
        Only the first call counts."""
        with self._lock:
            if self._finished:
                return
            self._finished = True
        if broken is not None:
            notify(self.observer, "on_cancel", self.info, f"{CANCEL_BROKEN}: {broken}")
        elif not complete:
            notify(self.observer, "on_cancel", self.info, CANCEL_CLIENT_GONE)
        elif self.status >= 400:
            notify(self.observer, "on_cancel", self.info,
                   f"{CANCEL_HTTP_ERROR}: {self.status}")
        else:
            if self.event_stream and self._partial:
                self._heard(self._line(self._partial.rstrip(b"\r")))
                self._partial = b""
            if not self.event_stream:
                self.usage = _body_usage(self._body, self._body_bytes)
            notify(self.observer, "on_end", self.info, self.usage)


def _body_usage(parts: list[bytes], size: int) -> Optional[dict]:
    """The ``usage`` object of a JSON body, ``None`` when absent, not JSON or too large."""
    if size > MAX_USAGE_BODY_BYTES:
        return None
    try:
        doc = orjson.loads(b"".join(parts))
    except (ValueError, RecursionError, UnicodeDecodeError):
        return None
    usage = doc.get("usage") if isinstance(doc, dict) else None
    return usage if isinstance(usage, dict) else None


#: Builds the :class:`RequestInfo` of one attempt sent to a target (``host:port``).
InfoFor = Callable[[str], RequestInfo]
