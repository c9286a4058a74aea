"""OpenAI answers written from an xLLM engine's ``Generations`` entries (§13 "Answer
assembly"): pure objects, no sockets, no threads.

An xLLM engine with ``--enable_service_routing`` sends every output token of a request to the
service in ``Generations`` (``DisaggStreamGeneration`` entries); its HTTP caller gets none. The
values here are kvsvc's own, independent of the protobuf classes (:func:`generation_from_dict`
reads the protobuf's JSON form, field names as in xLLM's ``disagg_pd.proto``):

- :class:`Generation`: one entry, ``req_id``, ``service_req_id``, ``gen_status``
  (``status_code`` 0 is success), ``outputs`` (one :class:`GenOutput` per sequence ``index``,
  ``text`` the delta since the previous entry), ``usage``, ``finished`` and
  ``finished_on_prefill_instance`` (P/D: P's entry carrying the first token).
- :class:`StreamAssembler`: one SSE ``data:`` event per entry that carries output, in the
  endpoint's chunk shape (``chat.completion.chunk``, ``text_completion``): one choice per output
  ``index`` with the delta text (chat: ``delta.content``, the first delta of an index also
  ``role: "assistant"``), ``logprobs`` when asked for and sent, and ``finish_reason`` where the
  entry sets one; after the request's last entry the usage chunk (``choices: []``) when the
  client asked for it (``stream_options.include_usage``; every earlier chunk then carries
  ``"usage": null``, as OpenAI does) and ``data: [DONE]``.
- :class:`WholeAssembler`: the non-streamed answer: per index the concatenated text, the last
  ``finish_reason`` and the logprobs; ``usage``.
- ``usage`` (:meth:`GenUsage.to_openai`): ``prompt_tokens`` = ``num_prompt_tokens``,
  ``completion_tokens`` = ``num_generated_tokens``, ``total_tokens`` = ``num_total_tokens``
  (their sum when the engine sent 0), ``prompt_tokens_details.cached_tokens`` =
  ``num_cached_tokens``; the last entry carrying usage wins.
- An entry whose ``gen_status.status_code`` is not 0 ends the request with an OpenAI error
  (:class:`EngineError`; the HTTP layer answers it with :func:`http_status_of_engine_error`).
  Streamed: one ``data: {"error": {...}}`` event and then the end of the stream, without
  ``[DONE]`` (a client reading to ``[DONE]`` must not take a failed answer as complete, the
  same rule as a broken relay, :mod:`kvsvc.http.openai`).

The end of a request (:func:`ends_request`): an entry with ``finished`` true, unless it is P's
hand-over in P/D (``finished_on_prefill_instance`` true with a D named and an output without a
``finish_reason``: D sends the rest under the same ``service_req_id``).

Tool-call and reasoning parsing (xllm-service runs its chat templates' parsers on the text) is
out of scope: text is relayed as generated (docs/xllm.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence

import orjson

#: xLLM ``llm::StatusCode`` values (CANCELLED 1, UNKNOWN 2, INVALID_ARGUMENT 3,
#: DEADLINE_EXCEEDED 4, RESOURCE_EXHAUSTED 5, UNAUTHENTICATED 6, UNAVAILABLE 7,
#: UNIMPLEMENTED 8) -> HTTP statuses of the non-streamed error answer; anything else is 500.
_ENGINE_HTTP = {1: 499, 2: 500, 3: 400, 4: 504, 5: 429, 6: 401, 7: 503, 8: 501}
#: OpenAI error ``type`` per HTTP status.
_ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 429:
               "rate_limit_exceeded", 499: "cancelled", 501: "not_implemented",
               503: "service_unavailable", 504: "upstream_timeout"}


@dataclass(frozen=True, slots=True)
class LogProbEntry:
    """One output token's log probability (xLLM ``LogProb``).

    :ivar token: the token's text.
    :ivar token_id: its id.
    :ivar logprob: its log probability (natural log, <= 0).
    :ivar top: the most likely alternatives, ``(token, token_id, logprob)`` each.
    """

    token: str
    token_id: int
    logprob: float
    top: tuple[tuple[str, int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class GenOutput:
    """One sequence's part of one entry (xLLM ``SequenceOutput``).

    :ivar index: the sequence's index in the request (OpenAI ``choices[].index``), >= 0.
    :ivar text: the text generated since the previous entry (the delta).
    :ivar token_ids: the ids of that text's tokens.
    :ivar finish_reason: ``"stop"``, ``"length"``, ...; ``""`` while the sequence runs.
    :ivar logprobs: per token, when the request asked for them.
    """

    index: int = 0
    text: str = ""
    token_ids: tuple[int, ...] = ()
    finish_reason: str = ""
    logprobs: tuple[LogProbEntry, ...] = ()


@dataclass(frozen=True, slots=True)
class GenUsage:
    """Token counts of a request (xLLM ``OutputUsage``); every count >= 0.

    :ivar prompt_tokens: ``num_prompt_tokens``.
    :ivar generated_tokens: ``num_generated_tokens``.
    :ivar total_tokens: ``num_total_tokens`` (0: not sent).
    :ivar cached_tokens: ``num_cached_tokens``, prompt tokens served from the prefix cache.
    """

    prompt_tokens: int = 0
    generated_tokens: int = 0
    total_tokens: int = 0
    cached_tokens: int = 0

    def to_openai(self) -> dict:
        """The OpenAI ``usage`` object (module docstring)."""
        total = self.total_tokens or self.prompt_tokens + self.generated_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.generated_tokens,
                "total_tokens": total,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass(frozen=True, slots=True)
class Generation:
    """One ``Generations`` entry (xLLM ``DisaggStreamGeneration``, §13).

    :ivar service_req_id: the id kvsvc gave the request at dispatch (``service_request_id``).
    :ivar req_id: the engine's own request id.
    :ivar status_code: ``gen_status.status_code``; 0 is success.
    :ivar status_msg: ``gen_status.status_msg``.
    :ivar outputs: the sequences' deltas.
    :ivar usage: the counts so far, ``None`` when the entry carries none.
    :ivar finished: the engine finished the request (see :func:`ends_request`).
    :ivar finished_on_prefill_instance: P/D: P's entry with the first token.
    """

    service_req_id: str
    req_id: str = ""
    status_code: int = 0
    status_msg: str = ""
    outputs: tuple[GenOutput, ...] = ()
    usage: Optional[GenUsage] = None
    finished: bool = False
    finished_on_prefill_instance: bool = False

    @property
    def tokens(self) -> int:
        """Output tokens this entry carries (token ids over all outputs; an output with text
        but no ids counts as one)."""
        outputs = self.outputs
        if len(outputs) == 1:   # the usual entry: one sequence
            o = outputs[0]
            return len(o.token_ids) or (1 if o.text else 0)
        return sum(len(o.token_ids) or (1 if o.text else 0) for o in outputs)


def _int(value: Any) -> int:
    # protobuf's JSON form writes 64-bit integers as strings.
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def _logprob(doc: Mapping[str, Any]) -> LogProbEntry:
    data = doc.get("logProbData") or doc.get("log_prob_data") or {}
    tops = doc.get("topLogprobs") or doc.get("top_logprobs") or []
    return LogProbEntry(str(data.get("token", "")), _int(data.get("tokenId", data.get(
        "token_id", 0))), float(data.get("logprob", 0.0)),
        tuple((str(t.get("token", "")), _int(t.get("tokenId", t.get("token_id", 0))),
               float(t.get("logprob", 0.0))) for t in tops if isinstance(t, Mapping)))


def generation_from_dict(doc: Mapping[str, Any]) -> Generation:
    """A :class:`Generation` from the JSON form of a ``DisaggStreamGeneration`` (protobuf's
    ``MessageToDict``: camelCase names, or the proto's own names; absent fields are their
    defaults). Never raises on missing fields; a field of the wrong type gives its default."""
    def get(name: str, camel: str, default: Any = None) -> Any:
        return doc.get(camel, doc.get(name, default))

    status = get("gen_status", "genStatus") or {}
    usage_doc = get("usage", "usage")
    usage = None
    if isinstance(usage_doc, Mapping):
        usage = GenUsage(_int(usage_doc.get("numPromptTokens", usage_doc.get(
            "num_prompt_tokens"))), _int(usage_doc.get("numGeneratedTokens", usage_doc.get(
                "num_generated_tokens"))), _int(usage_doc.get("numTotalTokens", usage_doc.get(
                    "num_total_tokens"))), _int(usage_doc.get("numCachedTokens", usage_doc.get(
                        "num_cached_tokens"))))
    outputs = []
    for o in get("outputs", "outputs") or []:
        if not isinstance(o, Mapping):
            continue
        outputs.append(GenOutput(
            _int(o.get("index", 0)), str(o.get("text", "")),
            tuple(_int(t) for t in o.get("tokenIds", o.get("token_ids", [])) or []),
            str(o.get("finishReason", o.get("finish_reason", "")) or ""),
            tuple(_logprob(lp) for lp in o.get("logprobs", []) or []
                  if isinstance(lp, Mapping))))
    return Generation(
        str(get("service_req_id", "serviceReqId", "")), str(get("req_id", "reqId", "")),
        _int(status.get("statusCode", status.get("status_code", 0)))
        if isinstance(status, Mapping) else 0,
        str(status.get("statusMsg", status.get("status_msg", "")))
        if isinstance(status, Mapping) else "",
        tuple(outputs), usage, bool(get("finished", "finished", False)),
        bool(get("finished_on_prefill_instance", "finishedOnPrefillInstance", False)))


def ends_request(gen: Generation, has_decode: bool) -> bool:
    """True when ``gen`` is the request's last entry: ``finished``, or an error status; in
    P/D (``has_decode``) P's hand-over entry (``finished_on_prefill_instance``) ends it only
    when every output it carries has a ``finish_reason`` (the request finished on P)."""
    if gen.status_code != 0:
        return True
    if not gen.finished:
        return False
    if has_decode and gen.finished_on_prefill_instance:
        return bool(gen.outputs) and all(o.finish_reason for o in gen.outputs)
    return True


@dataclass(frozen=True, slots=True)
class AnswerSpec:
    """What the answer must look like (from the client's request).

    :ivar chat: ``/v1/chat/completions`` (else ``/v1/completions``).
    :ivar answer_id: the answer's ``id`` (``chatcmpl-...`` / ``cmpl-...``).
    :ivar model: the ``model`` echoed in every chunk.
    :ivar created: unix seconds, the ``created`` of every chunk.
    :ivar include_usage: streamed: end with the usage chunk
        (``stream_options.include_usage``).
    :ivar logprobs: the client asked for log probabilities.
    :ivar fields: the request body's field names (the ``param`` of an engine's refusal,
        :func:`engine_param`).
    """

    chat: bool
    answer_id: str
    model: str
    created: int
    include_usage: bool = False
    logprobs: bool = False
    fields: tuple[str, ...] = ()

    @property
    def chunk_object(self) -> str:
        """``object`` of a streamed chunk."""
        return "chat.completion.chunk" if self.chat else "text_completion"


def answer_spec(chat: bool, doc: Mapping[str, Any], service_req_id: str,
                created: int) -> AnswerSpec:
    """The :class:`AnswerSpec` of a validated OpenAI body ``doc``."""
    options = doc.get("stream_options")
    include_usage = isinstance(options, Mapping) and options.get("include_usage") is True
    asked = doc.get("logprobs")
    logprobs = asked is True if chat else (type(asked) is int and asked > 0)
    model = doc.get("model")
    return AnswerSpec(chat, f"{'chatcmpl' if chat else 'cmpl'}-{service_req_id}",
                      model if isinstance(model, str) else "", created, include_usage,
                      logprobs, tuple(doc))


class EngineError(Exception):
    """The engine ended the request with ``gen_status.status_code`` != 0.

    :ivar status_code: the engine's code.
    :ivar message: its ``status_msg`` (or a generic text).
    """

    def __init__(self, status_code: int, message: str) -> None:
        self.status_code = status_code
        self.message = message or f"the engine failed the request (status {status_code})"
        super().__init__(self.message)


def http_status_of_engine_error(status_code: int) -> int:
    """The HTTP status a non-streamed answer gets for the engine's ``status_code``."""
    return _ENGINE_HTTP.get(status_code, 500)


def error_body(status: int, message: str, code: Optional[str] = None,
               param: Optional[str] = None) -> dict:
    """OpenAI's error object ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": _ERROR_TYPE.get(status, "upstream_error"),
                      "param": param, "code": code}}


def engine_param(text: str, fields: Iterable[str]) -> Optional[str]:
    """OpenAI's ``param`` for an engine's refusal: the engine's own when its answer is an
    OpenAI-style JSON error carrying one (``{"error": {"param": ...}}`` or
    ``{"param": ...}``), else the longest of the request's ``fields`` the text names as a
    word (``"max_tokens must be ..."`` -> ``max_tokens``), else ``None``."""
    stripped = text.strip()
    if stripped.startswith("{"):
        try:
            doc = orjson.loads(stripped)
        except orjson.JSONDecodeError:
            doc = None
        if isinstance(doc, Mapping):
            inner = doc.get("error")
            param = (inner.get("param") if isinstance(inner, Mapping) else None) or \
                doc.get("param")
            if isinstance(param, str) and param:
                return param
    best: Optional[str] = None
    for name in fields:
        if (best is None or len(name) > len(best)) and name and re.search(
                rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", text):
            best = name
    return best


def _chat_logprobs(entries: Sequence[LogProbEntry]) -> dict:
    return {"content": [{"token": e.token, "logprob": e.logprob,
                         "bytes": list(e.token.encode("utf-8")),
                         "top_logprobs": [{"token": t, "logprob": lp,
                                           "bytes": list(t.encode("utf-8"))}
                                          for t, _, lp in e.top]} for e in entries]}


def _completion_logprobs(entries: Sequence[LogProbEntry], offset: int) -> dict:
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {"tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t: lp for t, _, lp in e.top} for e in entries],
            "text_offset": offsets}


def _sse(doc: Mapping[str, Any]) -> bytes:
    # orjson: compact UTF-8 JSON, several times faster than json.dumps (a chunk per token).
    return b"data: " + orjson.dumps(doc) + b"\n\n"


DONE = b"data: [DONE]\n\n"


class StreamAssembler:
    """The SSE answer of one streamed request, fed its entries in order (module docstring).
    One per request; not thread-safe (the request's HTTP thread alone feeds it).

    :param spec: the answer's shape.
    :param has_decode: P/D (a D was named): P's hand-over entry does not end the request.
    """

    def __init__(self, spec: AnswerSpec, has_decode: bool = False) -> None:
        self.spec = spec
        self.has_decode = has_decode
        self.usage: Optional[GenUsage] = None
        self.done = False
        self.error: Optional[EngineError] = None
        self._roled: set[int] = set()
        self._offsets: dict[int, int] = {}
        # A token chunk is these bytes around its choices: the same bytes as the whole
        # object through orjson (keys in this order), without encoding the fixed part per
        # token.
        head = orjson.dumps({"id": spec.answer_id, "object": spec.chunk_object,
                             "created": spec.created, "model": spec.model})
        self._head = b"data: " + head[:-1] + b',"choices":'
        self._tail = b',"usage":null}\n\n' if spec.include_usage else b"}\n\n"

    def _chunk(self, choices: list, usage: Any = ...) -> bytes:
        if usage is ...:
            return self._head + orjson.dumps(choices) + self._tail
        doc: dict[str, Any] = {"id": self.spec.answer_id, "object": self.spec.chunk_object,
                               "created": self.spec.created, "model": self.spec.model,
                               "choices": choices, "usage": usage}
        return _sse(doc)

    def _choice(self, out: GenOutput) -> dict:
        choice: dict[str, Any] = {"index": out.index}
        if self.spec.chat:
            delta: dict[str, Any] = {}
            if out.index not in self._roled:
                self._roled.add(out.index)
                delta["role"] = "assistant"
            delta["content"] = out.text
            choice["delta"] = delta
            logprobs = _chat_logprobs(out.logprobs) if out.logprobs else None
        else:
            choice["text"] = out.text
            offset = self._offsets.get(out.index, 0)
            logprobs = _completion_logprobs(out.logprobs, offset) if out.logprobs else None
            self._offsets[out.index] = offset + len(out.text)
        choice["logprobs"] = logprobs if self.spec.logprobs else None
        choice["finish_reason"] = out.finish_reason or None
        return choice

    def feed(self, gen: Generation) -> bytes:
        """The SSE bytes of one entry (possibly ``b""``: an entry without output that does not
        end the request); after the last entry also the usage chunk and ``[DONE]`` (or, for
        an error status, the error event and nothing after). :attr:`done` is then True and
        further entries give ``b""``."""
        if self.done:
            return b""
        if gen.status_code != 0:
            self.done = True
            self.error = EngineError(gen.status_code, gen.status_msg)
            status = http_status_of_engine_error(gen.status_code)
            return _sse(error_body(status, self.error.message, f"engine_{gen.status_code}",
                                   engine_param(self.error.message, self.spec.fields)))
        if gen.usage is not None:
            self.usage = gen.usage
        out = b""
        if gen.outputs:
            out = self._chunk([self._choice(o) for o in gen.outputs])
        if ends_request(gen, self.has_decode):
            self.done = True
            if self.spec.include_usage:
                usage = (self.usage or GenUsage()).to_openai()
                out += self._chunk([], usage)
            out += DONE
        return out

    def error_event(self, message: str, code: str, status: int = 502) -> bytes:
        """An error event for a request that ends without its last entry (the instance died,
        went silent, or was replaced); marks the answer done."""
        self.done = True
        return _sse(error_body(status, message, code))


@dataclass
class _Sequence:
    text: list[str] = field(default_factory=list)
    finish_reason: str = ""
    logprobs: list[LogProbEntry] = field(default_factory=list)


class WholeAssembler:
    """The non-streamed answer of one request, fed its entries in order (module docstring).
    Not thread-safe.

    :param spec: the answer's shape (``include_usage`` is ignored: usage is always there).
    :param has_decode: P/D (a D was named).
    """

    def __init__(self, spec: AnswerSpec, has_decode: bool = False) -> None:
        self.spec = spec
        self.has_decode = has_decode
        self.usage: Optional[GenUsage] = None
        self.done = False
        self.error: Optional[EngineError] = None
        self._seqs: dict[int, _Sequence] = {}

    def feed(self, gen: Generation) -> bool:
        """Add one entry; True once the request ended (its last entry, or an error status,
        then :attr:`error` is set)."""
        if self.done:
            return True
        if gen.status_code != 0:
            self.error = EngineError(gen.status_code, gen.status_msg)
            self.done = True
            return True
        if gen.usage is not None:
            self.usage = gen.usage
        for o in gen.outputs:
            seq = self._seqs.setdefault(o.index, _Sequence())
            seq.text.append(o.text)
            seq.logprobs.extend(o.logprobs)
            if o.finish_reason:
                seq.finish_reason = o.finish_reason
        self.done = ends_request(gen, self.has_decode)
        return self.done

    def answer(self) -> dict:
        """The OpenAI answer object (``chat.completion`` / ``text_completion``)."""
        choices = []
        for index in sorted(self._seqs) or [0]:
            seq = self._seqs.get(index, _Sequence())
            text = "".join(seq.text)
            choice: dict[str, Any] = {"index": index}
            if self.spec.chat:
                choice["message"] = {"role": "assistant", "content": text}
                logprobs = _chat_logprobs(seq.logprobs) if seq.logprobs else None
            else:
                choice["text"] = text
                logprobs = _completion_logprobs(seq.logprobs, 0) if seq.logprobs else None
            choice["logprobs"] = logprobs if self.spec.logprobs else None
            choice["finish_reason"] = seq.finish_reason or None
            choices.append(choice)
        return {"id": self.spec.answer_id,
                "object": "chat.completion" if self.spec.chat else "text_completion",
                "created": self.spec.created, "model": self.spec.model, "choices": choices,
                "usage": (self.usage or GenUsage()).to_openai()}
