"""The simulated engine serves OpenAI requests: ``POST /v1/completions`` and
``POST /v1/chat/completions`` (streamed as SSE or not) on the instance's HTTP port, with a
latency model driven by its own prefix cache, so routing (§11) can be measured end to end.

Model, per DP rank (all durations are *simulated* time, divided by ``time_scale`` on the wall):

- A request joins the rank's FIFO **waiting queue** (the ``waiting_requests_num`` the engine
  heartbeats, §9). It leaves it when it is at the head, fewer than ``max_num_seqs`` requests
  run on the rank, and the rank's **prefill lane** is free: prefill is compute-bound, so one
  request prefills at a time per rank (a token-budgeted scheduler gives the same throughput).
- **Prefill** executes the prompt on the rank's block manager
  (:meth:`~kvsvc.testbed.sim.engine.SimEngine.execute`: hits counted, missing full blocks stored and
  published as KV events, §1/§2) and lasts ``prefill_us_per_token`` per prompt token found on
  neither tier plus ``host_load_us_per_token`` per Host-only hit token. The first token follows
  it: TTFT = time in the queue + prefill.
- **Decode** lasts ``decode_us_per_token`` per output token; decoding requests share the GPU
  (they only hold one of the ``max_num_seqs`` slots). ``max_tokens`` (chat:
  ``max_completion_tokens`` too) output tokens are produced, 16 by default.
- ``usage`` reports ``prompt_tokens``, ``completion_tokens``, ``total_tokens`` and
  ``prompt_tokens_details.cached_tokens`` = Device hits + Host-only hits (full blocks only).
- A client that goes away (socket closed, seen while queued, prefilling or decoding) cancels the
  request: it leaves the queue or frees its slot at once and is counted ``cancelled``.

Prompts: a completion's ``prompt`` may be token ids (``[int, ...]``, each in
``[0, 2**31 - 1]``, used as is), a string, or a one-element list of either. Text is tokenized
with ``tokenizer`` when given (a :class:`~kvsvc.routing.prompt.PromptTokenizer`, the same
``tokenizer.json`` and chat template as the service's ``--tokenizer_path``, so both see the
same ids); without one, by the built-in byte scheme :func:`byte_tokens`: every UTF-8 byte is
one token id (0..255), and a chat renders as ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per
message plus ``<|im_start|>assistant\\n`` (ChatML), then bytes. The service without a
tokenizer routes text with hit ratio 0 (never a guessed hit), so the built-in scheme only
decides the sim's own cache.

P/D: a body carrying ``"routing": {"prefill_name", "decode_name"}`` (xLLM's field, §11) is
served whole by this instance acting as P (the sim has no KV transfer); the request is counted
in ``pd_requests`` and the decode name is echoed in ``x-sim-decode-name``.

Non-streamed answers carry the simulated timing in headers: ``x-sim-queue-ms``,
``x-sim-prefill-ms``, ``x-sim-ttft-ms`` (simulated ms), ``x-sim-rank``. Streamed answers send
the head at once (like vLLM), then one chunk per output token, the usage chunk when
``stream_options.include_usage`` is true, and ``data: [DONE]``.

Errors (OpenAI's ``{"error": {...}}`` shape): 400 malformed body, 404 unknown path, 503 the
engine is closing or the connection limit is reached. Inside the sim (never to the client):
:class:`~kvsvc.errors.SimBadRequest` for a malformed body (-> 400),
:class:`~kvsvc.errors.SimServingClosed` when :meth:`Serving.close` wakes waiting requests
(-> 503 or a cut stream), :class:`~kvsvc.errors.SimClientDisconnected` when the client went
away (counted ``cancelled``).
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import select
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence, TypeGuard

from kvsvc.errors import SimBadRequest, SimClientDisconnected, SimServingClosed
from kvsvc.testbed.sim.results import ExecResult

log = logging.getLogger(__name__)

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
MAX_TOKEN_ID = 2**31 - 1
#: Output tokens when the request names none (OpenAI's completions default).
DEFAULT_MAX_TOKENS = 16
#: Longest single wait between checks of the client socket and of close(), seconds.
_CHECK_S = 0.05


class RankExecutor(Protocol):
    """What :class:`Serving` needs of its engine
    (:class:`~kvsvc.testbed.sim.engine.SimEngine` provides it).

    ``name`` is the instance name (logs), ``dp_size`` the number of DP ranks; ``execute``
    runs one prompt on ``rank`` (``0 <= rank < dp_size``) and publishes its KV events (§1, §2).
    """

    @property
    def name(self) -> str:
        """The instance name."""
        ...

    @property
    def dp_size(self) -> int:
        """DP ranks (>= 1)."""
        ...

    def execute(self, token_ids: Sequence[int], rank: Optional[int] = None) -> ExecResult:
        """Run ``token_ids`` on ``rank`` (``None``: any) and publish its events.

        :raises LifecycleError: the rank is not running.
        """
        ...


class TextTokenizer(Protocol):
    """A text tokenizer for prompts (:class:`~kvsvc.routing.prompt.PromptTokenizer` is one).

    ``encode_text`` tokenizes a completion prompt; ``encode_chat`` renders OpenAI chat messages
    with the model's chat template and tokenizes them (only when ``has_chat_template``).
    """

    @property
    def has_chat_template(self) -> bool:
        """True when :meth:`encode_chat` can render messages."""
        ...

    def encode_text(self, text: str) -> list[int]:
        """Token ids of a completion prompt."""
        ...

    def encode_chat(self, messages: Sequence[Any], *,
                    add_generation_prompt: bool = True) -> list[int]:
        """Token ids of rendered chat messages; any exception is a template failure."""
        ...


@dataclass(frozen=True, slots=True)
class ServingConfig:
    """Latency model and limits of a serving sim (see the module docstring).

    Defaults model one Qwen2.5-7B-class instance on one H100: prefill about 20k tokens/s
    (50 us/token), Host->Device loads over PCIe at about 2 us/token, 20 ms per output token.

    :param prefill_us_per_token: simulated microseconds per prompt token not cached (> 0).
    :param host_load_us_per_token: simulated microseconds per Host-only hit token (>= 0).
    :param decode_us_per_token: simulated microseconds per output token (>= 0).
    :param max_num_seqs: running requests per DP rank (>= 1); the rest wait.
    :param time_scale: time compression factor (>= 1 compresses: every simulated duration is
        divided by it on the wall, every measured wall wait multiplied by it).
    :param max_connections: concurrent HTTP connections served (>= 1); more get 503.
    :param model: the model name reported in answers when the request names none.
    :raises ValueError: a value out of range.
    """

    prefill_us_per_token: float = 50.0
    host_load_us_per_token: float = 2.0
    decode_us_per_token: float = 20_000.0
    max_num_seqs: int = 64
    time_scale: float = 1.0
    max_connections: int = 256
    model: str = "sim"

    def __post_init__(self) -> None:
        if not self.prefill_us_per_token > 0:
            raise ValueError("prefill_us_per_token must be > 0")
        if self.host_load_us_per_token < 0 or self.decode_us_per_token < 0:
            raise ValueError("host_load_us_per_token and decode_us_per_token must be >= 0")
        if self.max_num_seqs < 1 or self.max_connections < 1:
            raise ValueError("max_num_seqs and max_connections must be >= 1")
        if not self.time_scale > 0:
            raise ValueError("time_scale must be > 0")


@dataclass(frozen=True, slots=True)
class ServingStats:
    """Counters of a serving sim since start, plus the queue right now.

    :param requests: requests accepted (valid bodies).
    :param completed: requests answered to the end.
    :param cancelled: requests whose client went away before the end.
    :param rejected: requests answered 4xx/5xx by the sim (bad body, closing, over limit).
    :param pd_requests: requests carrying a P/D ``routing`` field.
    :param waiting: requests waiting now (all ranks), ``waiting_requests_num``.
    :param running: requests holding a slot now (all ranks).
    :param prompt_tokens: prompt tokens of prefilled requests.
    :param cached_tokens: their cached (Device + Host-only hit) tokens.
    """

    requests: int
    completed: int
    cancelled: int
    rejected: int
    pd_requests: int
    waiting: int
    running: int
    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class SimRequest:
    """A validated request.

    :param chat: chat completion (else text completion).
    :param token_ids: the prompt's token ids.
    :param max_tokens: output tokens to produce (>= 1).
    :param stream: answer as SSE.
    :param include_usage: streamed answers end with a usage chunk.
    :param model: model name echoed back.
    :param decode_name: P/D decode instance named by ``routing``, ``None`` without P/D.
    """

    chat: bool
    token_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    model: str
    decode_name: Optional[str]


@dataclass(frozen=True, slots=True)
class Prefilled:
    """What prefill did (times in simulated ms).

    :param rank: the DP rank.
    :param cached_tokens: Device + Host-only hit tokens.
    :param queue_ms: time spent waiting.
    :param prefill_ms: modeled prefill time.
    """

    rank: int
    cached_tokens: int
    queue_ms: float
    prefill_ms: float

    @property
    def ttft_ms(self) -> float:
        """Time to first token, simulated ms: queue + prefill."""
        return self.queue_ms + self.prefill_ms


# ---- text tokenization -----------------------------------------------------------------------

def byte_tokens(text: str) -> list[int]:
    """The built-in scheme: one token id per UTF-8 byte of ``text`` (ids 0..255)."""
    return list(text.encode("utf-8"))


def chatml(messages: Sequence[dict]) -> str:
    """The built-in chat rendering: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per
    message, then ``<|im_start|>assistant\\n``. Non-string content is JSON-encoded."""
    parts = []
    for m in messages:
        content = m.get("content", "")
        if not isinstance(content, str):
            content = json.dumps(content, sort_keys=True, ensure_ascii=False)
        parts.append(f"<|im_start|>{m['role']}\n{content}<|im_end|>\n")
    return "".join(parts) + "<|im_start|>assistant\n"


def _is_token_list(value: Any) -> TypeGuard[list[int]]:
    return (isinstance(value, list) and bool(value)
            and all(type(v) is int and 0 <= v <= MAX_TOKEN_ID for v in value))


def parse_request(path: str, doc: Any, tokenizer: Optional[TextTokenizer],
                  default_model: str) -> SimRequest:
    """Validate an OpenAI body and tokenize its prompt (see the module docstring).

    :param path: :data:`COMPLETIONS_PATH` or :data:`CHAT_PATH`.
    :param doc: the decoded JSON body.
    :param tokenizer: text tokenizer, ``None`` for the built-in byte scheme.
    :raises SimBadRequest: naming the offending field.
    """
    if not isinstance(doc, dict):
        raise SimBadRequest("body must be a JSON object")
    chat = path == CHAT_PATH
    if chat:
        messages = doc.get("messages")
        if (not isinstance(messages, list) or not messages
                or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                           for m in messages)):
            raise SimBadRequest("messages: must be a non-empty list of objects with a role")
        if tokenizer is not None and tokenizer.has_chat_template:
            try:
                token_ids = tokenizer.encode_chat(messages, add_generation_prompt=True)
            except Exception as exc:  # template errors of arbitrary user templates
                raise SimBadRequest(f"messages: chat template failed: {exc}") from exc
        else:
            text = chatml(messages)
            token_ids = tokenizer.encode_text(text) if tokenizer is not None else byte_tokens(text)
    else:
        prompt = doc.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if _is_token_list(prompt):
            token_ids = list(prompt)
        elif isinstance(prompt, str) and prompt:
            token_ids = tokenizer.encode_text(prompt) if tokenizer is not None else byte_tokens(prompt)
        else:
            raise SimBadRequest(f"prompt: must be a non-empty string or a list of token ids in "
                             f"[0, {MAX_TOKEN_ID}] (one prompt per request)")
    if not token_ids:
        raise SimBadRequest("prompt: tokenizes to no tokens")
    max_tokens = doc.get("max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = doc.get("max_tokens", DEFAULT_MAX_TOKENS)
    if type(max_tokens) is not int or max_tokens < 1:
        raise SimBadRequest("max_tokens: must be an integer >= 1")
    stream = doc.get("stream", False)
    if not isinstance(stream, bool):
        raise SimBadRequest("stream: must be a boolean")
    options = doc.get("stream_options") or {}
    if not isinstance(options, dict):
        raise SimBadRequest("stream_options: must be an object")
    model = doc.get("model", default_model)
    if not isinstance(model, str):
        raise SimBadRequest("model: must be a string")
    routing = doc.get("routing")
    decode_name = None
    if routing is not None:
        if not isinstance(routing, dict) or not isinstance(routing.get("decode_name", ""), str):
            raise SimBadRequest("routing: must be an object with prefill_name/decode_name strings")
        decode_name = routing.get("decode_name", "")
    return SimRequest(chat, token_ids, max_tokens, stream, options.get("include_usage") is True,
                      model, decode_name)


# ---- the scheduler -------------------------------------------------------------------------

class _Ticket:
    __slots__ = ("cancelled",)

    def __init__(self) -> None:
        self.cancelled = False


class _RankQueue:
    """Waiting queue, running slots and the prefill lane of one rank; guarded by ``cond``."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.waiting: collections.deque[_Ticket] = collections.deque()
        self.running = 0
        self.prefilling = False


class Serving:
    """The OpenAI front of one :class:`~kvsvc.testbed.sim.engine.SimEngine` (its HTTP handler calls
    :meth:`handle`). Thread-safe: every HTTP connection runs on its own thread.

    :param engine: the engine whose ranks execute the prompts (a :class:`RankExecutor`).
    :param config: latency model and limits.
    :param tokenizer: text tokenizer (see the module docstring), ``None`` for bytes.
    """

    def __init__(self, engine: RankExecutor, config: ServingConfig,
                 tokenizer: Optional[TextTokenizer] = None) -> None:
        self.engine = engine
        self.config = config
        self.tokenizer = tokenizer
        self._queues = [_RankQueue() for _ in range(engine.dp_size)]
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._ids = itertools.count(1)
        self._counts: collections.Counter[str] = collections.Counter()
        self._listeners: list[Callable[[], None]] = []

    def add_load_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` (on a request thread, no lock held; it must be quick) whenever
        the waiting queue changes, e.g. :meth:`~kvsvc.testbed.sim.registration.EtcdRegistration.load_changed`."""
        self._listeners.append(listener)

    def _load_changed(self) -> None:
        for listener in self._listeners:
            listener()

    # ---- state ---------------------------------------------------------------------------

    def waiting_requests(self) -> int:
        """Requests waiting (not yet prefilling) on every rank, ``waiting_requests_num``."""
        total = 0
        for q in self._queues:
            with q.cond:
                total += len(q.waiting)
        return total

    def stats(self) -> ServingStats:
        """Counters and the current queue (see :class:`ServingStats`)."""
        running = 0
        for q in self._queues:
            with q.cond:
                running += q.running
        with self._lock:
            c = dict(self._counts)
        return ServingStats(c.get("requests", 0), c.get("completed", 0), c.get("cancelled", 0),
                            c.get("rejected", 0), c.get("pd_requests", 0),
                            self.waiting_requests(), running, c.get("prompt_tokens", 0),
                            c.get("cached_tokens", 0))

    def _count(self, **deltas: int) -> None:
        with self._lock:
            self._counts.update(deltas)

    def open(self) -> None:
        """Accept requests (again, after :meth:`close`)."""
        self._closing.clear()

    def close(self) -> None:
        """Stop accepting; queued and running requests end within ``_CHECK_S`` (503 or a cut
        stream). The HTTP server joins their threads."""
        self._closing.set()
        for q in self._queues:
            with q.cond:
                q.cond.notify_all()

    # ---- the request path ----------------------------------------------------------------

    def handle(self, path: str, body: bytes, conn: socket.socket,
               start_response: Callable[[int, list[tuple[str, str]]], None],
               write: Callable[[bytes], None]) -> None:
        """Serve one request on an HTTP handler thread.

        :param path: request path without query.
        :param body: the request body.
        :param conn: the client socket (polled for a disconnect while waiting).
        :param start_response: sends status and headers (once).
        :param write: sends body bytes; raises ``OSError`` when the client is gone.
        """
        if path not in (COMPLETIONS_PATH, CHAT_PATH):
            _send_json(start_response, write, 404, _error(f"no route {path}", "not_found"))
            return
        try:
            req = parse_request(path, json.loads(body), self.tokenizer, self.config.model)
        except ValueError:
            self._count(rejected=1)
            _send_json(start_response, write, 400, _error("body is not valid JSON"))
            return
        except SimBadRequest as exc:
            self._count(rejected=1)
            _send_json(start_response, write, 400, _error(str(exc)))
            return
        if self._closing.is_set():
            self._count(rejected=1)
            _send_json(start_response, write, 503, _error("engine is shutting down",
                                                          "service_unavailable"))
            return
        rid = f"{'chatcmpl' if req.chat else 'cmpl'}-sim-{next(self._ids)}"
        self._count(requests=1, pd_requests=1 if req.decode_name is not None else 0)
        if req.decode_name is not None:
            log.debug("sim %s: %s is P/D, decode on %s (served here as P)", self.engine.name,
                      rid, req.decode_name)
        try:
            if req.stream:
                self._serve_stream(rid, req, conn, start_response, write)
            else:
                self._serve_whole(rid, req, conn, start_response, write)
        except (SimClientDisconnected, OSError):
            self._count(cancelled=1)
            log.info("sim %s: %s cancelled (client went away)", self.engine.name, rid)
        except SimServingClosed:
            self._count(rejected=1)
            if not req.stream:
                _send_json(start_response, write, 503, _error("engine is shutting down",
                                                              "service_unavailable"))
        else:
            self._count(completed=1)

    def _pick_rank(self) -> int:
        # The least busy rank (waiting + running), the lowest on ties: deterministic.
        loads = []
        for q in self._queues:
            with q.cond:
                loads.append(len(q.waiting) + q.running)
        return loads.index(min(loads))

    def _wait(self, seconds: float, conn: socket.socket) -> None:
        """Sleep ``seconds`` of wall time unless the client goes away or close() is called.

        :raises SimClientDisconnected: the client closed its connection.
        :raises SimServingClosed: the engine is closing.
        """
        deadline = time.monotonic() + seconds
        while True:
            if self._closing.is_set():
                raise SimServingClosed("closing")
            left = deadline - time.monotonic()
            if left <= 0:
                return
            step = min(left, _CHECK_S)
            started = time.monotonic()
            if _peer_closed(conn, step):
                raise SimClientDisconnected("client closed")
            if time.monotonic() - started < step / 2:
                # Readable but not closed: the client sent more bytes (never read); wait on
                # close() instead so that this does not spin.
                self._closing.wait(step)

    def _prefill(self, req: SimRequest, conn: socket.socket) -> tuple[Prefilled, int]:
        """Queue, then prefill (executing the prompt on the rank). Returns the prefill outcome
        and the rank whose slot the caller must release with :meth:`_release_slot`."""
        arrived = time.monotonic()
        rank = self._pick_rank()
        q = self._queues[rank]
        ticket = _Ticket()
        cfg = self.config
        with q.cond:
            q.waiting.append(ticket)
        self._load_changed()
        try:
            while True:
                with q.cond:
                    if self._closing.is_set():
                        raise SimServingClosed("closing")
                    if (q.waiting[0] is ticket and q.running < cfg.max_num_seqs
                            and not q.prefilling):
                        q.waiting.popleft()
                        q.running += 1
                        q.prefilling = True
                        break
                    q.cond.wait(_CHECK_S)
                if _peer_closed(conn, 0.0):
                    raise SimClientDisconnected("client closed while queued")
        except BaseException:
            with q.cond:
                if ticket in q.waiting:
                    q.waiting.remove(ticket)
                q.cond.notify_all()
            self._load_changed()
            raise
        self._load_changed()
        try:
            admitted = time.monotonic()
            queue_ms = (admitted - arrived) * 1000.0 * cfg.time_scale
            res = self.engine.execute(req.token_ids, rank)
            cached = res.device_hit_tokens + res.host_only_hit_tokens
            n = len(req.token_ids)
            prefill_us = ((n - cached) * cfg.prefill_us_per_token
                          + res.host_only_hit_tokens * cfg.host_load_us_per_token)
            self._count(prompt_tokens=n, cached_tokens=cached)
            # The simulator's own CPU time (hashing, publishing) counts as part of the modeled
            # prefill, so a busy machine does not inflate every compressed duration.
            self._wait(prefill_us / 1e6 / cfg.time_scale - (time.monotonic() - admitted), conn)
        except BaseException:
            self._release_slot(rank, prefill_done=False)
            raise
        with q.cond:
            q.prefilling = False
            q.cond.notify_all()
        return Prefilled(rank, cached, queue_ms, prefill_us / 1000.0), rank

    def _release_slot(self, rank: int, prefill_done: bool = True) -> None:
        q = self._queues[rank]
        with q.cond:
            q.running -= 1
            if not prefill_done:
                q.prefilling = False
            q.cond.notify_all()

    def _decode_s(self, tokens: int) -> float:
        return tokens * self.config.decode_us_per_token / 1e6 / self.config.time_scale

    def _serve_whole(self, rid: str, req: SimRequest, conn: socket.socket,
                     start_response: Callable, write: Callable) -> None:
        pre, rank = self._prefill(req, conn)
        try:
            self._wait(self._decode_s(req.max_tokens), conn)
        finally:
            self._release_slot(rank)
        text = "".join(_token_text(i) for i in range(req.max_tokens))
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
        if req.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        doc = {"id": rid, "object": "chat.completion" if req.chat else "text_completion",
               "created": int(time.time()), "model": req.model, "choices": [choice],
               "usage": _usage(req, pre)}
        _send_json(start_response, write, 200, doc, _timing_headers(pre, req))

    def _serve_stream(self, rid: str, req: SimRequest, conn: socket.socket,
                      start_response: Callable, write: Callable) -> None:
        headers = [("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache")]
        if req.decode_name is not None:
            headers.append(("x-sim-decode-name", req.decode_name))
        start_response(200, headers)
        created = int(time.time())
        obj = "chat.completion.chunk" if req.chat else "text_completion"

        def chunk(choices: list, usage: Optional[dict] = None) -> bytes:
            doc: dict[str, Any] = {"id": rid, "object": obj, "created": created,
                                   "model": req.model, "choices": choices}
            if usage is not None:
                doc["usage"] = usage
            return b"data: " + json.dumps(doc).encode() + b"\n\n"

        pre, rank = self._prefill(req, conn)
        try:
            per_token = self._decode_s(1)
            for i in range(req.max_tokens):
                if i:
                    self._wait(per_token, conn)
                last = i == req.max_tokens - 1
                text = _token_text(i)
                if req.chat:
                    delta = {"content": text} if i else {"role": "assistant", "content": text}
                    c = {"index": 0, "delta": delta, "finish_reason": "length" if last else None,
                         "logprobs": None}
                else:
                    c = {"index": 0, "text": text, "finish_reason": "length" if last else None,
                         "logprobs": None}
                write(chunk([c]))
        finally:
            self._release_slot(rank)
        if req.include_usage:
            write(chunk([], _usage(req, pre)))
        write(b"data: [DONE]\n\n")


def _token_text(i: int) -> str:
    return f" t{i}"


def _usage(req: SimRequest, pre: Prefilled) -> dict:
    n = len(req.token_ids)
    return {"prompt_tokens": n, "completion_tokens": req.max_tokens,
            "total_tokens": n + req.max_tokens,
            "prompt_tokens_details": {"cached_tokens": pre.cached_tokens}}


def _timing_headers(pre: Prefilled, req: SimRequest) -> list[tuple[str, str]]:
    out = [("x-sim-queue-ms", f"{pre.queue_ms:.3f}"), ("x-sim-prefill-ms", f"{pre.prefill_ms:.3f}"),
           ("x-sim-ttft-ms", f"{pre.ttft_ms:.3f}"), ("x-sim-rank", str(pre.rank))]
    if req.decode_name is not None:
        out.append(("x-sim-decode-name", req.decode_name))
    return out


def _error(message: str, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def _send_json(start_response: Callable, write: Callable, status: int, doc: dict,
               extra: Sequence[tuple[str, str]] = ()) -> None:
    body = json.dumps(doc).encode()
    start_response(status, [("Content-Type", "application/json"),
                            ("Content-Length", str(len(body))), *extra])
    write(body)


def _peer_closed(conn: socket.socket, timeout_s: float) -> bool:
    """True when the client has closed (readable with EOF or reset) within ``timeout_s``.
    The request body was read whole, so the client sends nothing more: readability means
    the connection ended."""
    try:
        readable, _, _ = select.select([conn], [], [], max(0.0, timeout_s))
        if not readable:
            return False
        return conn.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True
