"""The simulated engine serves OpenAI requests: ``POST /v1/completions`` and
``POST /v1/chat/completions`` (streamed as SSE or not) and ``POST /v1/embeddings``
(deterministic vectors, :mod:`kvsvc.testbed.sim.embeddings`) on the instance's HTTP port, with a
latency model driven by its own prefix cache, so routing (§11) can be measured end to end.

Model, per DP rank (all durations are *simulated* time, divided by ``time_scale`` on the wall):

- A request joins the rank's FIFO **waiting queue** (the ``waiting_requests_num`` the engine
  heartbeats, §9). It leaves it when it is at the head, fewer than ``max_num_seqs`` requests
  run on the rank, and the rank's **prefill lane** is free: prefill is compute-bound, so one
  request prefills at a time per rank (a token-budgeted scheduler gives the same throughput).
- **Prefill** executes the prompt on the rank's block manager
  (:meth:`~kvsvc.testbed.sim.engine.SimEngine.execute`: hits counted, missing full blocks stored and
  published as KV events, §1/§2) and lasts :meth:`ServingConfig.prefill_us`:
  ``prefill_base_us + prefill_us_per_token * n + prefill_us_per_token_sq * n**2`` for the
  ``n`` prompt tokens found on neither tier (the square is attention: each new token attends to
  every earlier new one), plus ``host_load_us_per_token`` per Host-only hit token. A prompt
  wholly cached still costs the base (the engine runs its last token to sample the first
  output). The first token follows it: TTFT = time in the queue + prefill.
- **Decode**: each further output token is one decode step of the rank's batch, lasting
  :meth:`ServingConfig.tpot_us`: ``decode_us_per_token + decode_us_per_seq * B +
  decode_us_per_context_token * B * (L - 1)`` with ``B`` the requests decoding on the rank
  (this one included) and ``L`` their mean context length (prompt plus tokens generated), read
  when the step starts (§12's TPOT form, so a predictor fitted to the profiling data is exact).
  Decoding requests share the GPU (they only hold one of the ``max_num_seqs`` slots); prefill
  does not slow them (the sim keeps prefill and decode apart). ``max_tokens`` (chat:
  ``max_completion_tokens`` too) output tokens are produced, 16 by default; TPOT = decode time
  / (output tokens - 1).
- **Profiling data** (:func:`profiling_data`): ``ttft_profiling_data`` ``[[tokens, ms], ...]``
  (prefill of ``tokens`` uncached tokens) and ``tpot_profiling_data`` ``[[avg_len, batch, ms],
  ...]`` computed by the same two functions, which the registration publishes (§12), so the
  router's predictors are fitted from what the sim really does.
- **Metrics**: ``GET /metrics`` on the HTTP port (:meth:`Serving.metrics_text`, Prometheus text):
  ``kvsvc_sim_time_to_first_token_seconds`` and ``kvsvc_sim_time_per_output_token_seconds``
  histograms (simulated seconds, like vLLM's ``vllm:time_to_first_token_seconds`` /
  ``vllm:time_per_output_token_seconds``), request, prompt-token and cached-token counters and
  the waiting/running gauges; :meth:`Serving.stats` has the same sums in-process. The
  ``vllm`` and ``sglang`` flavors add their engine's own load gauges per DP rank
  (:func:`engine_load_gauges`: ``vllm:num_requests_waiting`` / ``vllm:kv_cache_usage_perc``
  labelled ``engine``, ``sglang:num_queue_reqs`` / ``sglang:token_usage`` labelled
  ``dp_rank``), which kvsvc scrapes as their load (§15).
- **DP rank**: a request with the header ``X-data-parallel-rank: r`` queues and runs on rank
  ``r`` (vLLM and SGLang honour the header the same way, §15; a value that is not a rank is
  answered 400); without it, on the least busy rank.
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
``x-sim-prefill-ms``, ``x-sim-ttft-ms``, ``x-sim-tpot-ms`` (simulated ms; TPOT 0 for one output
token), ``x-sim-rank``. Streamed answers send the head at once (like vLLM), then one chunk per
output token, the usage chunk when ``stream_options.include_usage`` is true (with the same
timing as a non-standard ``sim_timing`` object beside ``usage``: ``queue_ms``, ``prefill_ms``,
``ttft_ms``, ``tpot_ms``, ``rank``, ``instance``: the engine's name, so a client behind a
router sees which engine served it, and ``host_only_tokens``: the part of ``cached_tokens``
loaded from Host), and ``data: [DONE]``.

Like vLLM: a request for a model other than ``ServingConfig.model`` is answered 404
``model_not_found``; ``n`` choices (1-128, each the same text, one SSE chunk per choice and
token, ``usage.completion_tokens`` counting all of them); ``stop`` (a string or up to 4): the
text ends before the first stop string generated, ``finish_reason`` ``"stop"``
(:func:`generate`); a prompt plus ``max_tokens`` beyond ``max_model_len`` is answered 400 with
vLLM's message, and a request naming no ``max_tokens`` gets at most what the context leaves.

Errors (OpenAI's ``{"error": {...}}`` shape): 400 malformed body or context exceeded, 404
unknown path or model, 503 the engine is closing or the connection limit is reached. Inside the sim (never to the client):
:class:`~kvsvc.errors.SimBadRequest` for a malformed body (-> 400),
:class:`~kvsvc.errors.SimServingClosed` when :meth:`Serving.close` wakes waiting requests
(-> 503 or a cut stream), :class:`~kvsvc.errors.SimClientDisconnected` when the client went
away (counted ``cancelled``).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import json
import logging
import select
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Protocol, Sequence, TypeGuard

import prometheus_client
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvsvc.errors import SimBadRequest, SimClientDisconnected, SimServingClosed
from kvsvc.testbed.sim.embeddings import EMBEDDINGS_PATH, embeddings_answer
from kvsvc.testbed.sim.results import ExecResult

log = logging.getLogger(__name__)

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
MAX_TOKEN_ID = 2**31 - 1
#: Output tokens when the request names none (OpenAI's completions default).
DEFAULT_MAX_TOKENS = 16
#: Longest single wait between checks of the client socket and of close(), seconds.
_CHECK_S = 0.05
#: Shortest wall wait of a non-streamed decode: steps shorter than this (high time
#: compression) are waited in groups, the batch re-read per group.
_MIN_WAIT_S = 0.01
#: Histogram buckets, simulated seconds (vLLM's TTFT and TPOT buckets, trimmed).
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                  40.0, 80.0)
TPOT_BUCKETS_S = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                  0.3, 0.5, 1.0)


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

    def rank_device_usage(self, rank: int) -> float:
        """Device KV-cache usage of ``rank``, a fraction in [0, 1]."""
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


#: Prompt lengths (uncached tokens) of ``ttft_profiling_data`` (:func:`profiling_data`).
TTFT_PROFILE_TOKENS = (1, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
#: Mean context lengths of ``tpot_profiling_data``.
TPOT_PROFILE_LENGTHS = (128, 1024, 4096, 16384)


@dataclass(frozen=True, slots=True)
class ServingConfig:
    """Latency model and limits of a serving sim (see the module docstring).

    Defaults model one Qwen2.5-7B-class instance (28 layers, 4 KV heads of 128, bf16) on one
    H100: prefill about 20k tokens/s at short prompts (50 us/token) plus a 5 ms step and an
    attention term of 0.4 ns per token squared (about ``2 n^2 d_model layers`` FLOPs at a few
    hundred TFLOP/s: +2% at 2k tokens, +26% at 32k, +100% at 128k, where a prompt takes 13 s), Host->Device loads over PCIe at about 2 us/token; a decode step of 8 ms
    (reading 15 GB of weights at about 2 TB/s) plus 0.1 ms per sequence plus 0.02 us per
    context token of the batch (56 KiB of KV per token at about 3 TB/s): 8.1 ms alone, about
    25 ms for 64 sequences of 8k tokens.

    :param prefill_us_per_token: ``b``, simulated microseconds per prompt token not cached
        (> 0).
    :param host_load_us_per_token: simulated microseconds per Host-only hit token (>= 0).
    :param decode_us_per_token: ``d0``, the fixed part of one decode step, simulated
        microseconds (>= 0).
    :param max_num_seqs: running requests per DP rank (>= 1); the rest wait.
    :param time_scale: time compression factor (>= 1 compresses: every simulated duration is
        divided by it on the wall, every measured wall wait multiplied by it).
    :param max_connections: concurrent HTTP connections served (>= 1); more get 503.
    :param model: the model name reported in answers when the request names none.
    :param prefill_base_us: ``a``, the fixed part of a prefill, simulated microseconds (>= 0).
    :param prefill_us_per_token_sq: ``c``, simulated microseconds per squared uncached token
        (>= 0).
    :param decode_us_per_seq: ``d1``, simulated microseconds per decoding sequence per step
        (>= 0).
    :param decode_us_per_context_token: ``d2``, simulated microseconds per context token of
        each decoding sequence per step (>= 0).
    :param stream_coalesce_ms: streamed answers: decode steps are waited in groups of at
        least this much *wall* time and each group's SSE events written at once (several
        ``data:`` events in one write, each still one token), like an engine's output
        batching under load; 0: one write per token (>= 0). Keeps a compressed-time bench
        from spending its CPU on sub-millisecond writes; the modeled times are unchanged.
    :param max_model_len: the context, tokens (>= 2): a prompt plus its ``max_tokens`` beyond
        it is answered 400, as vLLM does (``--max-model-len``).
    :raises ValueError: a value out of range.
    """

    prefill_us_per_token: float = 50.0
    host_load_us_per_token: float = 2.0
    decode_us_per_token: float = 8_000.0
    max_num_seqs: int = 64
    time_scale: float = 1.0
    max_connections: int = 256
    model: str = "sim"
    prefill_base_us: float = 5_000.0
    prefill_us_per_token_sq: float = 0.0004
    decode_us_per_seq: float = 100.0
    decode_us_per_context_token: float = 0.02
    stream_coalesce_ms: float = 0.0
    max_model_len: int = 131_072

    def __post_init__(self) -> None:
        if not self.prefill_us_per_token > 0:
            raise ValueError("prefill_us_per_token must be > 0")
        if not self.max_model_len >= 2:
            raise ValueError("max_model_len must be >= 2")
        for name in ("host_load_us_per_token", "decode_us_per_token", "prefill_base_us",
                     "prefill_us_per_token_sq", "decode_us_per_seq",
                     "decode_us_per_context_token", "stream_coalesce_ms"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0")
        if self.max_num_seqs < 1 or self.max_connections < 1:
            raise ValueError("max_num_seqs and max_connections must be >= 1")
        if not self.time_scale > 0:
            raise ValueError("time_scale must be > 0")

    def prefill_us(self, uncached_tokens: int, host_only_tokens: int = 0) -> float:
        """Modeled prefill time, simulated microseconds: ``a + b n + c n^2`` for ``n =
        uncached_tokens`` (>= 0) plus ``host_load_us_per_token * host_only_tokens``."""
        n = max(0, uncached_tokens)
        return (self.prefill_base_us + self.prefill_us_per_token * n
                + self.prefill_us_per_token_sq * n * n
                + self.host_load_us_per_token * max(0, host_only_tokens))

    def tpot_us(self, batch: int, avg_len: float) -> float:
        """Modeled decode step, simulated microseconds, of a batch of ``batch`` (>= 1)
        sequences of mean context length ``avg_len`` tokens (>= 1): ``d0 + d1 B + d2 B (L -
        1)`` (§12's TPOT form)."""
        b = max(1, batch)
        return (self.decode_us_per_token + self.decode_us_per_seq * b
                + self.decode_us_per_context_token * b * max(0.0, avg_len - 1.0))


def profiling_data(config: ServingConfig) -> dict[str, list[list[float]]]:
    """The registration's profiling fields (§12), computed by ``config``'s own model, in
    *wall* ms: the model's simulated durations divided by ``time_scale``, which is what a
    router timing this engine on its own clock measures (a router's queue estimates run on
    that clock; a compressed simulation's clients convert back):

    - ``ttft_profiling_data``: ``[[tokens, ms], ...]``, the prefill of ``tokens`` uncached
      tokens (:data:`TTFT_PROFILE_TOKENS`), ms rounded to 1 us;
    - ``tpot_profiling_data``: ``[[avg_len, batch, ms], ...]``, one decode step of ``batch``
      sequences (1, 2, 4, ... up to ``max_num_seqs``, which is included) of mean context
      ``avg_len`` (:data:`TPOT_PROFILE_LENGTHS`).

    Token counts and batch sizes are ints, times floats (xllm-service reads doubles).
    """
    wall_us_per_ms = 1000.0 * config.time_scale
    batches = sorted({1 << i for i in range(config.max_num_seqs.bit_length())
                      if 1 << i <= config.max_num_seqs} | {config.max_num_seqs})
    return {
        "ttft_profiling_data": [[n, round(config.prefill_us(n) / wall_us_per_ms, 3)]
                                for n in TTFT_PROFILE_TOKENS],
        "tpot_profiling_data": [[length, b, round(config.tpot_us(b, length) / wall_us_per_ms,
                                                  3)]
                                for length in TPOT_PROFILE_LENGTHS for b in batches],
    }


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
    :param ttft_count: requests whose first token was produced.
    :param ttft_ms_sum: their TTFTs summed, simulated ms.
    :param tpot_count: requests decoded to their end with at least two output tokens.
    :param tpot_ms_sum: their TPOTs summed, simulated ms.
    :param decoding: requests decoding now (all ranks), the batches of the decode steps.
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
    ttft_count: int = 0
    ttft_ms_sum: float = 0.0
    tpot_count: int = 0
    tpot_ms_sum: float = 0.0
    decoding: int = 0


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
    :param n: choices to generate (each the same text: the sim's output is deterministic).
    :param stop: stop strings; the text ends before the first one generated.
    """

    chat: bool
    token_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    model: str
    decode_name: Optional[str]
    n: int = 1
    stop: tuple[str, ...] = ()

    def generation(self) -> "Generation":
        """What this request generates (:func:`generate`)."""
        return generate(self.max_tokens, self.stop)


#: Most choices per request (``n``) and stop strings (``stop``), as OpenAI allows.
MAX_CHOICES = 128
MAX_STOP_STRINGS = 4


@dataclass(frozen=True, slots=True)
class Generation:
    """The output of one choice: the text of each generated token (the last one cut before a
    stop string) and why it ended.

    :ivar texts: one text per generated token (``len(texts)`` tokens were generated).
    :ivar finish_reason: ``"stop"`` (a stop string was generated) or ``"length"``.
    """

    texts: tuple[str, ...]
    finish_reason: str

    @property
    def tokens(self) -> int:
        """Tokens generated (>= 1)."""
        return len(self.texts)

    @property
    def text(self) -> str:
        """The whole output text."""
        return "".join(self.texts)


def generate(max_tokens: int, stop: Sequence[str] = ()) -> Generation:
    """The sim's output: token ``i`` is :func:`_token_text` ``(i)``, up to ``max_tokens``
    tokens; with ``stop``, generation ends with the token that completes the first stop string
    found, and the text ends before that string (OpenAI's rule: the stop string is not
    returned), ``finish_reason`` ``"stop"``. The same arguments give the same (shared, frozen)
    value, computed once: a request of 100k tokens costs tens of ms to spell out, and every
    request of a benchmark asks for the same."""
    return _generate(max_tokens, tuple(stop))


@functools.lru_cache(maxsize=32)
def _generate(max_tokens: int, stop: tuple[str, ...]) -> Generation:
    texts = [_token_text(i) for i in range(max_tokens)]
    if not stop:
        return Generation(tuple(texts), "length")
    longest = max(len(x) for x in stop)
    tail = ""   # the last longest - 1 characters before the current token
    start = 0   # where the current token starts in the whole text
    for i, text in enumerate(texts):
        # Only a match ending in this token is new (an earlier one would have stopped).
        window = tail + text
        found = [at for at in (window.find(x) for x in stop) if at >= 0]
        if found:
            cut = start - len(tail) + min(found)
            out, at = [], 0
            for t in texts[:i + 1]:
                out.append(t if at + len(t) <= cut else t[:max(0, cut - at)])
                at += len(t)
            return Generation(tuple(out), "stop")
        start += len(text)
        tail = window[-(longest - 1):] if longest > 1 else ""
    return Generation(tuple(texts), "length")


@dataclass(frozen=True, slots=True)
class Prefilled:
    """What prefill did (times in simulated ms).

    :param rank: the DP rank.
    :param cached_tokens: Device + Host-only hit tokens.
    :param queue_ms: time spent waiting.
    :param prefill_ms: modeled prefill time.
    :param host_only_tokens: the part of ``cached_tokens`` that was on Host only.
    """

    rank: int
    cached_tokens: int
    queue_ms: float
    prefill_ms: float
    host_only_tokens: int = 0

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
                  default_model: str, max_model_len: Optional[int] = None) -> SimRequest:
    """Validate an OpenAI body and tokenize its prompt (see the module docstring).

    :param path: :data:`COMPLETIONS_PATH` or :data:`CHAT_PATH`.
    :param doc: the decoded JSON body.
    :param tokenizer: text tokenizer, ``None`` for the built-in byte scheme.
    :param max_model_len: the context; a request naming no ``max_tokens`` gets
        :data:`DEFAULT_MAX_TOKENS` or what is left of the context, the fewer (``None``: no
        context).
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
        max_tokens = doc.get("max_tokens")
    if max_tokens is None:  # absent or null: OpenAI's "the engine's default"
        max_tokens = DEFAULT_MAX_TOKENS
        if max_model_len is not None:
            max_tokens = max(1, min(max_tokens, max_model_len - len(token_ids)))
    if type(max_tokens) is not int or max_tokens < 1:
        raise SimBadRequest("max_tokens: must be an integer >= 1")
    n = doc.get("n", 1)
    if n is None:
        n = 1
    if type(n) is not int or not 1 <= n <= MAX_CHOICES:
        raise SimBadRequest(f"n: must be an integer in [1, {MAX_CHOICES}]")
    stop = doc.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif (isinstance(stop, list) and len(stop) <= MAX_STOP_STRINGS
          and all(isinstance(x, str) for x in stop)):
        stops = tuple(x for x in stop if x)
    else:
        raise SimBadRequest(f"stop: must be a string or a list of at most {MAX_STOP_STRINGS} "
                            "strings")
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
                      model, decode_name, n, stops)


def check_context(req: SimRequest, max_model_len: int) -> None:
    """A prompt plus its ``max_tokens`` must fit the context (vLLM's check and message).

    :raises SimBadRequest: they do not.
    """
    prompt = len(req.token_ids)
    if prompt + req.max_tokens > max_model_len:
        raise SimBadRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt + req.max_tokens} tokens ({prompt} in the messages, "
            f"{req.max_tokens} in the completion). Please reduce the length of the messages "
            "or completion.")


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
        # Decoding requests -> their context length (prompt + tokens generated), and the sum
        # of those lengths: the batch a decode step sees (ServingConfig.tpot_us).
        self.decoding: dict[_Ticket, int] = {}
        self.context_sum = 0

    def step_us(self, config: ServingConfig) -> float:
        """The decode step of the current batch, simulated us (call under ``cond``)."""
        batch = len(self.decoding)
        return config.tpot_us(batch, self.context_sum / batch if batch else 1.0)


class Serving:
    """The OpenAI front of one :class:`~kvsvc.testbed.sim.engine.SimEngine` (its HTTP handler calls
    :meth:`handle`). Thread-safe: every HTTP connection runs on its own thread.

    :param engine: the engine whose ranks execute the prompts (a :class:`RankExecutor`).
    :param config: latency model and limits.
    :param tokenizer: text tokenizer (see the module docstring), ``None`` for bytes.
    :param flavor: ``xllm``, ``vllm`` or ``sglang``: ``GET /metrics`` adds that engine's own
        load gauges, per DP rank (module docstring, §15).
    """

    def __init__(self, engine: RankExecutor, config: ServingConfig,
                 tokenizer: Optional[TextTokenizer] = None, flavor: str = "xllm") -> None:
        self.engine = engine
        self.config = config
        self.tokenizer = tokenizer
        self.flavor = flavor
        self._queues = [_RankQueue() for _ in range(engine.dp_size)]
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._ids = itertools.count(1)
        self._counts: collections.Counter[str] = collections.Counter()
        self._sums = {"ttft_ms": 0.0, "tpot_ms": 0.0}
        self._listeners: list[Callable[[], None]] = []
        # One registry per engine (no process-wide state): GET /metrics renders it.
        self._registry = prometheus_client.CollectorRegistry(auto_describe=True)
        self._ttft_hist = prometheus_client.Histogram(
            "kvsvc_sim_time_to_first_token_seconds",
            "Simulated time to first token (queue + prefill), seconds",
            buckets=TTFT_BUCKETS_S, registry=self._registry)
        self._tpot_hist = prometheus_client.Histogram(
            "kvsvc_sim_time_per_output_token_seconds",
            "Simulated time per output token after the first, seconds (one per request)",
            buckets=TPOT_BUCKETS_S, registry=self._registry)
        self._registry.register(_StatsCollector(self))

    def add_load_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` (on a request thread, no lock held; it must be quick) whenever
        the waiting queue changes, e.g. :meth:`~kvsvc.testbed.sim.registration.EtcdRegistration.load_changed`."""
        self._listeners.append(listener)

    def _load_changed(self) -> None:
        for listener in self._listeners:
            listener()

    # ---- state ---------------------------------------------------------------------------

    def rank_queues(self) -> list[tuple[int, int]]:
        """``(waiting, running)`` of every rank, in rank order."""
        out = []
        for q in self._queues:
            with q.cond:
                out.append((len(q.waiting), q.running))
        return out

    def waiting_requests(self) -> int:
        """Requests waiting (not yet prefilling) on every rank, ``waiting_requests_num``."""
        total = 0
        for q in self._queues:
            with q.cond:
                total += len(q.waiting)
        return total

    def stats(self) -> ServingStats:
        """Counters and the current queue (see :class:`ServingStats`)."""
        running = decoding = 0
        for q in self._queues:
            with q.cond:
                running += q.running
                decoding += len(q.decoding)
        with self._lock:
            c = dict(self._counts)
            sums = dict(self._sums)
        return ServingStats(c.get("requests", 0), c.get("completed", 0), c.get("cancelled", 0),
                            c.get("rejected", 0), c.get("pd_requests", 0),
                            self.waiting_requests(), running, c.get("prompt_tokens", 0),
                            c.get("cached_tokens", 0), c.get("ttft_count", 0),
                            sums["ttft_ms"], c.get("tpot_count", 0), sums["tpot_ms"], decoding)

    def metrics_text(self) -> bytes:
        """``GET /metrics``: the Prometheus text exposition of this engine (module docstring):
        TTFT and TPOT histograms in simulated seconds, the :class:`ServingStats` counters
        (``kvsvc_sim_<name>_total``) and the ``waiting``/``running`` gauges."""
        return prometheus_client.generate_latest(self._registry)

    def _count(self, **deltas: int) -> None:
        with self._lock:
            self._counts.update(deltas)

    def _observe(self, ttft_ms: Optional[float] = None, tpot_ms: Optional[float] = None) -> None:
        with self._lock:
            if ttft_ms is not None:
                self._counts["ttft_count"] += 1
                self._sums["ttft_ms"] += ttft_ms
            if tpot_ms is not None:
                self._counts["tpot_count"] += 1
                self._sums["tpot_ms"] += tpot_ms
        if ttft_ms is not None:
            self._ttft_hist.observe(ttft_ms / 1000.0)
        if tpot_ms is not None:
            self._tpot_hist.observe(tpot_ms / 1000.0)

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
               write: Callable[[bytes], None], dp_rank: Optional[str] = None) -> None:
        """Serve one request on an HTTP handler thread.

        :param path: request path without query.
        :param body: the request body.
        :param conn: the client socket (polled for a disconnect while waiting).
        :param start_response: sends status and headers (once).
        :param write: sends body bytes; raises ``OSError`` when the client is gone.
        :param dp_rank: the request's ``X-data-parallel-rank`` header (§15), ``None`` when
            absent: the request runs on that rank (as vLLM and SGLang do); a value that is
            not a rank of this engine is answered 400.
        """
        if path == EMBEDDINGS_PATH:
            self._serve_embeddings(body, start_response, write)
            return
        if path not in (COMPLETIONS_PATH, CHAT_PATH):
            _send_json(start_response, write, 404, _error(f"no route {path}", "not_found"))
            return
        rank: Optional[int] = None
        if dp_rank is not None:
            try:
                rank = int(dp_rank.strip())
            except ValueError:
                rank = -1
            if not 0 <= rank < len(self._queues):
                self._count(rejected=1)
                _send_json(start_response, write, 400, _error(
                    f"X-data-parallel-rank {dp_rank!r} is not a rank of this engine "
                    f"(0-{len(self._queues) - 1})"))
                return
        try:
            req = parse_request(path, json.loads(body), self.tokenizer, self.config.model,
                                self.config.max_model_len)
        except ValueError:
            self._count(rejected=1)
            _send_json(start_response, write, 400, _error("body is not valid JSON"))
            return
        except SimBadRequest as exc:
            self._count(rejected=1)
            _send_json(start_response, write, 400, _error(str(exc)))
            return
        if req.model != self.config.model:
            self._count(rejected=1)
            _send_json(start_response, write, 404, _error(
                f"The model `{req.model}` does not exist.", "NotFoundError",
                code="model_not_found", param="model"))
            return
        try:
            check_context(req, self.config.max_model_len)
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
                self._serve_stream(rid, req, conn, start_response, write, rank)
            else:
                self._serve_whole(rid, req, conn, start_response, write, rank)
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

    def _serve_embeddings(self, body: bytes, start_response: Callable,
                          write: Callable) -> None:
        """``POST /v1/embeddings`` (:mod:`kvsvc.testbed.sim.embeddings`): answered at once,
        no queue and no cache (an embedding request reuses no KV cache)."""
        tokenizer = self.tokenizer
        encode = tokenizer.encode_text if tokenizer is not None else byte_tokens
        try:
            doc = json.loads(body)
            model = doc.get("model") if isinstance(doc, dict) else None
            if isinstance(model, str) and model != self.config.model:
                self._count(rejected=1)
                _send_json(start_response, write, 404, _error(
                    f"The model `{model}` does not exist.", "NotFoundError",
                    code="model_not_found", param="model"))
                return
            answer = embeddings_answer(doc, self.config.model, encode)
        except ValueError:
            self._count(rejected=1)
            _send_json(start_response, write, 400, _error("body is not valid JSON"))
            return
        except SimBadRequest as exc:
            self._count(rejected=1)
            _send_json(start_response, write, 400, _error(str(exc)))
            return
        _send_json(start_response, write, 200, answer)

    def _pick_rank(self) -> int:
        # The least busy rank (waiting + running), the lowest on ties: deterministic.
        loads = []
        for q in self._queues:
            with q.cond:
                loads.append(len(q.waiting) + q.running)
        return loads.index(min(loads))

    def _wait(self, seconds: float, conn: "Peer") -> None:
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

    def _prefill(self, req: SimRequest, conn: "Peer",
                 rank: Optional[int] = None) -> tuple[Prefilled, int]:
        """Queue on ``rank`` (``None``: the least busy), then prefill (executing the prompt on
        the rank). Returns the prefill outcome and the rank whose slot the caller must release
        with :meth:`_release_slot`."""
        arrived = time.monotonic()
        rank = self._pick_rank() if rank is None else rank
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
            prefill_us = cfg.prefill_us(n - cached, res.host_only_hit_tokens)
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
        pre = Prefilled(rank, cached, queue_ms, prefill_us / 1000.0, res.host_only_hit_tokens)
        self._observe(ttft_ms=pre.ttft_ms)
        return pre, rank

    def _release_slot(self, rank: int, prefill_done: bool = True) -> None:
        q = self._queues[rank]
        with q.cond:
            q.running -= 1
            if not prefill_done:
                q.prefilling = False
            q.cond.notify_all()

    def _decode(self, rank: int, context: int, tokens: int, conn: "Peer",
                emit: Optional[Callable[[int, int], None]] = None) -> float:
        """Decode ``tokens`` further output tokens (after the first) on ``rank`` for a request
        of ``context`` tokens so far, one modeled step each (:meth:`ServingConfig.tpot_us` of
        the rank's batch at the step's start). With ``emit`` (a stream), ``emit(first, last)``
        is called after output tokens ``first..last`` (1-based after the first token), each
        step waited on its own unless ``stream_coalesce_ms`` groups them; without it steps are
        waited in groups of at least :data:`_MIN_WAIT_S` of wall time. The batch is re-read
        per group. Returns the decode time, simulated ms.

        :raises SimClientDisconnected: the client went away.
        :raises SimServingClosed: the engine is closing.
        """
        cfg = self.config
        q = self._queues[rank]
        ticket = _Ticket()
        with q.cond:
            q.decoding[ticket] = context
            q.context_sum += context
        total_us = 0.0
        done = 0
        try:
            while done < tokens:
                with q.cond:
                    step_us = q.step_us(cfg)
                    batch = len(q.decoding)
                min_wait_s = _MIN_WAIT_S if emit is None else cfg.stream_coalesce_ms / 1000.0
                group = 1
                if min_wait_s > 0:
                    wall_step = step_us / 1e6 / cfg.time_scale
                    group = min(tokens - done,
                                max(1, int(min_wait_s / wall_step) if wall_step > 0
                                    else tokens - done))
                # Every context of the batch grows by one per step, so the group's steps are
                # step_us, step_us + d2 B, ...: their exact sum for an unchanged batch.
                group_us = (group * step_us + cfg.decode_us_per_context_token * batch
                            * group * (group - 1) / 2)
                self._wait(group_us / 1e6 / cfg.time_scale, conn)
                total_us += group_us
                done += group
                with q.cond:
                    q.decoding[ticket] += group
                    q.context_sum += group
                if emit is not None:
                    emit(done - group + 1, done)
        finally:
            with q.cond:
                q.context_sum -= q.decoding.pop(ticket)
        return total_us / 1000.0

    # ---- native mode (xLLM's service routing, kvsvc.testbed.sim.native) ------------------

    def generate(self, req: SimRequest, cancel: "CancelFlag",
                 first: Callable[[Prefilled], None],
                 emit: Callable[[int, int], None], rank: Optional[int] = None,
                 decode: bool = True) -> tuple[Prefilled, float]:
        """Serve one request of the native mode: queue and prefill (the first output token is
        then produced: ``first(prefilled)``), then, with ``decode``, the further tokens
        (``emit(first, last)`` after output tokens ``first..last``, 1-based after the first),
        on the caller's thread. Counted like an HTTP request.

        :param cancel: set when the service answered an entry ``ok: false`` (the client went
            away): the request stops at its next step.
        :param decode: False: only the prefill and the first token (P/D: a D decodes the rest,
            :meth:`decode_only`).
        :returns: the prefill outcome and the TPOT (simulated ms, 0 without decode).
        :raises SimClientDisconnected: cancelled (counted ``cancelled``).
        :raises SimServingClosed: the engine is closing.
        """
        self._count(requests=1, pd_requests=1 if req.decode_name else 0)
        with self._native_outcome():
            pre, slot = self._prefill(req, cancel, rank)
            try:
                first(pre)
                decode_ms = (self._decode(slot, len(req.token_ids) + 1,
                                          req.generation().tokens - 1, cancel, emit=emit)
                             if decode else 0.0)
            finally:
                self._release_slot(slot)
        return pre, (self._finished(req.generation(), decode_ms) if decode else 0.0)

    @contextlib.contextmanager
    def _native_outcome(self) -> Iterator[None]:
        """Count how a native-mode request ended: cancelled (the client went away), rejected
        (the engine is closing) or completed; the two exceptions are re-raised."""
        try:
            yield
        except SimClientDisconnected:
            self._count(cancelled=1)
            raise
        except SimServingClosed:
            self._count(rejected=1)
            raise
        self._count(completed=1)

    def decode_only(self, req: SimRequest, cancel: "CancelFlag",
                    emit: Callable[[int, int], None]) -> float:
        """P/D's D side of the native mode: decode ``req.max_tokens - 1`` further tokens
        after the first (produced on P) on the least busy rank; see :meth:`generate`.
        Returns the TPOT, simulated ms."""
        self._count(requests=1, pd_requests=1)
        with self._native_outcome():
            decode_ms = self._decode(self._pick_rank(), len(req.token_ids) + 1,
                                     req.generation().tokens - 1, cancel, emit=emit)
        return self._finished(req.generation(), decode_ms)

    def _serve_whole(self, rid: str, req: SimRequest, conn: socket.socket,
                     start_response: Callable, write: Callable,
                     wanted_rank: Optional[int] = None) -> None:
        gen = req.generation()
        pre, rank = self._prefill(req, conn, wanted_rank)
        try:
            decode_ms = self._decode(rank, len(req.token_ids) + 1, gen.tokens - 1, conn)
        finally:
            self._release_slot(rank)
        tpot_ms = self._finished(gen, decode_ms)
        choices: list[dict[str, Any]] = []
        for index in range(req.n):
            choice: dict[str, Any] = {"index": index, "finish_reason": gen.finish_reason,
                                      "logprobs": None}
            if req.chat:
                choice["message"] = {"role": "assistant", "content": gen.text}
            else:
                choice["text"] = gen.text
            choices.append(choice)
        doc = {"id": rid, "object": "chat.completion" if req.chat else "text_completion",
               "created": int(time.time()), "model": req.model, "choices": choices,
               "usage": _usage(req, pre, gen)}
        _send_json(start_response, write, 200, doc, _timing_headers(pre, req, tpot_ms))

    def _serve_stream(self, rid: str, req: SimRequest, conn: socket.socket,
                      start_response: Callable, write: Callable,
                      wanted_rank: Optional[int] = None) -> None:
        headers = [("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache")]
        if req.decode_name is not None:
            headers.append(("x-sim-decode-name", req.decode_name))
        start_response(200, headers)
        created = int(time.time())
        obj = "chat.completion.chunk" if req.chat else "text_completion"

        def chunk(choices: list, usage: Optional[dict] = None,
                  timing: Optional[dict] = None) -> bytes:
            doc: dict[str, Any] = {"id": rid, "object": obj, "created": created,
                                   "model": req.model, "choices": choices}
            if usage is not None:
                doc["usage"] = usage
            if timing is not None:
                doc["sim_timing"] = timing  # non-standard; OpenAI clients ignore it
            return b"data: " + json.dumps(doc).encode() + b"\n\n"

        gen = req.generation()

        def token(i: int) -> bytes:
            # One chunk per choice (as vLLM streams n > 1), each naming its index.
            last = i == gen.tokens - 1
            text = gen.texts[i]
            finish = gen.finish_reason if last else None
            out = []
            for index in range(req.n):
                if req.chat:
                    delta = {"content": text} if i else {"role": "assistant", "content": text}
                    c = {"index": index, "delta": delta, "finish_reason": finish,
                         "logprobs": None}
                else:
                    c = {"index": index, "text": text, "finish_reason": finish,
                         "logprobs": None}
                out.append(chunk([c]))
            return b"".join(out)

        def tokens(first: int, last: int) -> None:
            write(b"".join(token(i) for i in range(first, last + 1)))

        pre, rank = self._prefill(req, conn, wanted_rank)
        try:
            write(token(0))
            decode_ms = self._decode(rank, len(req.token_ids) + 1, gen.tokens - 1, conn,
                                     emit=tokens)
        finally:
            self._release_slot(rank)
        tpot_ms = self._finished(gen, decode_ms)
        if req.include_usage:
            write(chunk([], _usage(req, pre, gen), {
                "queue_ms": round(pre.queue_ms, 3), "prefill_ms": round(pre.prefill_ms, 3),
                "ttft_ms": round(pre.ttft_ms, 3), "tpot_ms": round(tpot_ms, 3),
                "rank": pre.rank, "instance": self.engine.name,
                "host_only_tokens": pre.host_only_tokens}))
        write(b"data: [DONE]\n\n")

    def _finished(self, gen: Generation, decode_ms: float) -> float:
        """Count a request decoded to its end; returns its TPOT, simulated ms (0.0 with one
        output token)."""
        if gen.tokens < 2:
            return 0.0
        tpot_ms = decode_ms / (gen.tokens - 1)
        self._observe(tpot_ms=tpot_ms)
        return tpot_ms


class _StatsCollector:
    """Renders a :class:`Serving`'s counters and queue for its registry at scrape time."""

    _COUNTERS = ("requests", "completed", "cancelled", "rejected", "pd_requests",
                 "prompt_tokens", "cached_tokens")

    def __init__(self, serving: "Serving") -> None:
        self._serving = serving

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Any]:
        st = self._serving.stats()
        for name in self._COUNTERS:
            yield CounterMetricFamily(f"kvsvc_sim_{name}", f"ServingStats.{name} since start",
                                      value=getattr(st, name))
        yield GaugeMetricFamily("kvsvc_sim_waiting_requests", "Requests waiting now",
                                value=st.waiting)
        yield GaugeMetricFamily("kvsvc_sim_running_requests", "Requests holding a slot now",
                                value=st.running)
        yield from engine_load_gauges(self._serving)


def engine_load_gauges(serving: "Serving") -> Iterator[Any]:
    """The load gauges a real engine of the sim's flavor exposes, one label set per DP rank,
    under that engine's own names and labels (§15), so a router scrapes the sim as it would
    scrape the engine: vLLM ``vllm:num_requests_waiting``, ``vllm:num_requests_running`` and
    ``vllm:kv_cache_usage_perc`` labelled ``model_name`` and ``engine`` (the DP rank, as
    vLLM's per-engine labels); SGLang ``sglang:num_queue_reqs``, ``sglang:num_running_reqs``
    and ``sglang:token_usage`` labelled ``model_name``, ``engine_type``, ``tp_rank``,
    ``pp_rank`` and ``dp_rank``. Nothing for xLLM (it reports load by heartbeat)."""
    flavor = serving.flavor
    if flavor not in ("vllm", "sglang"):
        return
    queues = serving.rank_queues()
    usage = [serving.engine.rank_device_usage(r) for r in range(len(queues))]
    model = serving.config.model
    if flavor == "vllm":
        labels = ["model_name", "engine"]
        names = ("vllm:num_requests_waiting", "vllm:num_requests_running",
                 "vllm:kv_cache_usage_perc")

        def values(rank: int) -> list[str]:
            return [model, str(rank)]
    else:
        labels = ["model_name", "engine_type", "tp_rank", "pp_rank", "dp_rank"]
        names = ("sglang:num_queue_reqs", "sglang:num_running_reqs", "sglang:token_usage")

        def values(rank: int) -> list[str]:
            return [model, "unified", "0", "0", str(rank)]
    helps = ("Requests waiting to be scheduled", "Requests running",
             "KV-cache usage, 1 means 100 percent")
    for i, (name, doc) in enumerate(zip(names, helps)):
        family = GaugeMetricFamily(name, doc, labels=labels)
        for rank, (waiting, running) in enumerate(queues):
            family.add_metric(values(rank), (waiting, running, usage[rank])[i])
        yield family


def _token_text(i: int) -> str:
    return f" t{i}"


def _usage(req: SimRequest, pre: Prefilled, gen: Generation) -> dict:
    n = len(req.token_ids)
    completion = req.n * gen.tokens
    return {"prompt_tokens": n, "completion_tokens": completion,
            "total_tokens": n + completion,
            "prompt_tokens_details": {"cached_tokens": pre.cached_tokens}}


def _timing_headers(pre: Prefilled, req: SimRequest,
                    tpot_ms: float) -> list[tuple[str, str]]:
    out = [("x-sim-queue-ms", f"{pre.queue_ms:.3f}"), ("x-sim-prefill-ms", f"{pre.prefill_ms:.3f}"),
           ("x-sim-ttft-ms", f"{pre.ttft_ms:.3f}"), ("x-sim-tpot-ms", f"{tpot_ms:.3f}"),
           ("x-sim-rank", str(pre.rank))]
    if req.decode_name is not None:
        out.append(("x-sim-decode-name", req.decode_name))
    return out


def _error(message: str, kind: str = "invalid_request_error", code: Optional[str] = None,
           param: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _send_json(start_response: Callable, write: Callable, status: int, doc: dict,
               extra: Sequence[tuple[str, str]] = ()) -> None:
    body = json.dumps(doc).encode()
    start_response(status, [("Content-Type", "application/json"),
                            ("Content-Length", str(len(body))), *extra])
    write(body)


class CancelFlag:
    """The "client" of a native-mode request (:meth:`Serving.generate`): set when the service
    answered one of its entries ``ok: false``; waited on where an HTTP request polls its
    socket."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        """Cancel the request."""
        self._event.set()

    def is_set(self) -> bool:
        """True once cancelled."""
        return self._event.is_set()

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds; True when cancelled."""
        return self._event.wait(max(0.0, timeout_s))


#: What a request waits on: its HTTP client's socket, or a native request's cancel flag.
Peer = Any


def _peer_closed(conn: Peer, timeout_s: float) -> bool:
    """True when the client has closed (readable with EOF or reset) within ``timeout_s``.
    The request body was read whole, so the client sends nothing more: readability means
    the connection ended. A :class:`CancelFlag`: True when it is set within ``timeout_s``."""
    if isinstance(conn, CancelFlag):
        return conn.wait(timeout_s)
    try:
        readable, _, _ = select.select([conn], [], [], max(0.0, timeout_s))
        if not readable:
            return False
        return conn.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True
