"""Dispatch of OpenAI requests to xLLM engines natively, and their answers from ``Generations``
(§13 "Dispatch to an instance of backend xllm", "Answer assembly").

For a decision whose P has ``backend_type`` ``"xllm"`` (with ``--xllm_dispatch native``),
:meth:`XllmDispatcher.forward` sends the request to the engine with
``xllm.proto.XllmAPIService.ChatCompletions`` / ``.Completions`` instead of relaying HTTP:

- the message (:func:`chat_request`, :func:`completion_request`; field names of xLLM's
  ``chat.proto`` / ``completion.proto``) carries the OpenAI body's sampling fields, the
  prompt's ``token_ids`` (required: the engine takes them as given; a text prompt needs
  ``--tokenizer_path``, else the request gets 400, :data:`NEEDS_TOKENS`),
  ``service_request_id`` (a fresh id per attempt), ``routing`` ``{prefill_name, decode_name}``
  and ``source_xservice_addr`` (this replica's baidu_std ``ip:port``, where the engine sends
  its Generations). A field xLLM's message has no form for is never dropped silently:
  :func:`check_xllm_fields` answers 400 with ``param`` the field (e.g. ``seed``), before
  anything is sent;
- the request is registered in :class:`~kvsvc.routing.generations.PendingRequests` before the
  call, so an entry that arrives before the call returns is kept;
- the call is baidu_std (:class:`kvsvc.rpc.engines.BaiduStdCaller`, the service's) or brpc's
  HTTP+JSON form of the same method (:class:`HttpJsonCaller`); the engine answers at once with an empty
  response. A transport failure (refused, reset,
  timed out, an answer that is no success) fails that attempt before any byte reached the
  client: it is retried once on the next P of the ranking, as the HTTP relay does
  (:class:`~kvsvc.routing.proxy.Proxy`); a 4xx answer is the client's fault and answered as
  such (:class:`~kvsvc.errors.BadRequest`);
- the answer is written by :class:`GenerationsBody` from the request's entries: streamed, an
  SSE body relayed as the entries arrive; not streamed, the request thread waits for the last
  entry and answers one JSON object (an engine error status gets its HTTP status,
  :func:`~kvsvc.routing.answers.http_status_of_engine_error`);
- a request fails visibly when no entry arrives for ``read_timeout_s``
  (``--upstream_read_timeout_s``, §13's upstream timeout; :class:`~kvsvc.errors.UpstreamTimeout`),
  or when the instance that is generating it (P until the first token, then D in P/D) becomes
  SUSPECT, is removed, or is replaced by a new incarnation
  (:class:`~kvsvc.errors.UpstreamUnreachable`). Streamed, after the head, the HTTP layer turns
  either into the SSE error event and an aborted transfer (:mod:`kvsvc.http.openai`);
- the client going away (the WSGI server closes the body before the end) cancels the request:
  the engine's next entry is answered ``ok: false`` and the engine cancels it;
- every attempt is counted in flight and heard by the request observer (§12) like a relayed
  one: dispatch, the first entry with tokens (FINISH_PREFILL, heard for non-streamed requests
  too: the engine sends every token), one GENERATE per further token, then the end or a
  cancel.

Errors: :class:`~kvsvc.errors.BadRequest` (no token ids, or the engine refused the request),
:class:`~kvsvc.errors.UpstreamTimeout` / :class:`~kvsvc.errors.UpstreamUnreachable` (every
attempt failed before the client got a byte, or, non-streamed, the instance failed during the
request). Transport errors of the caller are translated where they happen
(:class:`HttpJsonCaller`).
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Protocol, Sequence, Union

import requests
import requests.adapters

from kvsvc.cluster.model import Instance, InstanceState, RegistrySnapshot
from kvsvc.errors import (
    BadRequest,
    ClientGone,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from kvsvc.routing.answers import (
    StreamAssembler,
    WholeAssembler,
    answer_spec,
    engine_param,
    error_body,
    http_status_of_engine_error,
)
from kvsvc.routing.engine_loss import LostEngines
from kvsvc.routing.generations import PendingRequest, PendingRequests
from kvsvc.routing.in_flight import Dispatch, InFlight
from kvsvc.routing.observer import (
    CANCEL_BROKEN,
    CANCEL_CLIENT_GONE,
    CANCEL_HTTP_ERROR,
    CANCEL_UPSTREAM_FAILED,
    RequestInfo,
    RequestObserver,
    notify,
    notify_heard,
)
from kvsvc.routing.policy import Decision
from kvsvc.routing.proxy import ClientWatch, RelayEnd, UpstreamBody, UpstreamReply

log = logging.getLogger(__name__)

#: xLLM's API service and its two methods (``xllm/proto/xllm_service.proto``).
API_SERVICE = "xllm.proto.XllmAPIService"
CHAT_METHOD = "ChatCompletions"
COMPLETIONS_METHOD = "Completions"
#: The 400 of a request whose prompt kvsvc cannot give as token ids.
NEEDS_TOKENS = ("prompt: xLLM engines take the prompt as token ids: send token ids, or start "
                "kvsvc with --tokenizer_path so that text and chat prompts are tokenized")
#: The 400 of a batch of prompts (a list of texts or of token-id lists): an xLLM request
#: carries one prompt.
ONE_PROMPT = ("prompt: xLLM engines take one prompt per request: send each prompt of the batch "
              "as its own request")
#: Longest wait between two checks of the generating instance's state, seconds.
CHECK_INTERVAL_S = 0.25
#: Bound of the engine's answer to the dispatch call (it answers at once), seconds.
DISPATCH_ANSWER_TIMEOUT_S = 10.0

#: Body fields sent to the engine as they are, under the same name, because xLLM's
#: ``ChatRequest`` / ``CompletionRequest`` has each (``chat.proto``, ``completion.proto``):
#: OpenAI's, then the vLLM-style extensions xLLM shares.
_SHARED_FIELDS = ("model", "temperature", "top_p", "n", "stream", "presence_penalty",
                  "frequency_penalty", "user", "best_of", "stop_token_ids",
                  "repetition_penalty", "top_k", "skip_special_tokens", "ignore_eos",
                  "request_id", "offline", "ttlt_slo_ms", "ttft_slo_ms", "tpot_slo_ms",
                  "priority", "beam_width", "num_return_sequences", "add_special_tokens",
                  "include_stop_str_in_output", "ttft_priority_weight",
                  "tpot_priority_weight", "ttlt_priority_weight", "priority_weight")
_CHAT_FIELDS = frozenset(_SHARED_FIELDS + ("logprobs", "top_logprobs", "response_format"))
_COMPLETION_FIELDS = frozenset(_SHARED_FIELDS + ("logprobs", "echo"))
#: Fields kvsvc maps itself (:func:`_common`, :func:`chat_request`,
#: :func:`completion_request`) or uses itself (the chat template's inputs: kvsvc renders and
#: tokenizes the prompt, the engine takes ``token_ids``).
_MAPPED_CHAT = frozenset({"messages", "stop", "stream_options", "max_tokens",
                          "max_completion_tokens", "add_generation_prompt",
                          "chat_template_kwargs", "tool_choice"})
_MAPPED_COMPLETION = frozenset({"prompt", "stop", "stream_options", "max_tokens",
                                "max_completion_tokens"})
#: OpenAI fields that change nothing the engine generates (OpenAI's own storage, billing and
#: caching hints): accepted and not sent.
_NO_EFFECT = frozenset({"metadata", "store", "service_tier", "prompt_cache_key",
                        "safety_identifier", "parallel_tool_calls"})
#: Fields of xLLM's messages that kvsvc fills itself: a client's value would be overwritten.
_RESERVED = frozenset({"service_request_id", "token_ids", "routing", "source_xservice_addr",
                       "x_request_id", "x_request_time"})
#: ``stream_options`` members xLLM's ``StreamOptions`` has.
_STREAM_OPTIONS = frozenset({"include_usage"})


def no_xllm_form(param: str, why: str = "") -> BadRequest:
    """The 400 of a request field native dispatch cannot hand to an xLLM engine: ``param``
    the field's path (OpenAI's ``param``), the message saying xLLM engines have no such
    option (or ``why``)."""
    return BadRequest(f"{param}: " + (why or "xLLM engines have no such option (native "
                      "dispatch sends only the fields of xLLM's ChatRequest / "
                      "CompletionRequest; send the request without it)"), param=param)


def check_xllm_fields(doc: Mapping[str, Any], chat: bool) -> None:
    """Refuse, before anything is sent, every body field native dispatch would otherwise drop
    (§13 "Dispatch": a field is mapped to its xLLM form or refused, never dropped): a field
    that is neither one of xLLM's (:data:`_CHAT_FIELDS` / :data:`_COMPLETION_FIELDS`), nor
    mapped or used by kvsvc, nor without effect on generation (:data:`_NO_EFFECT`). A null
    value, an empty list or an empty object counts as absent (the default). Also refused:
    ``tools`` (kvsvc writes the answer from the engine's text and has no tool-call parser:
    ``tool_calls`` would never come back), a content part that is not text (kvsvc tokenizes
    text only), a ``stream_options`` member other than ``include_usage``, and the fields kvsvc
    itself fills (``service_request_id``, ``token_ids``, ``routing``, ...).

    :raises BadRequest: ``param`` the field's path (e.g. ``seed``,
        ``messages[0].content[1].type``).
    """
    shared = _CHAT_FIELDS if chat else _COMPLETION_FIELDS
    mapped = _MAPPED_CHAT if chat else _MAPPED_COMPLETION
    for name, value in doc.items():
        if value is None or (isinstance(value, (list, dict)) and not value):
            continue
        if name in shared or name in mapped or name in _NO_EFFECT:
            continue
        if name in _RESERVED:
            raise no_xllm_form(name, "set by kvsvc for each dispatch, not by the client")
        if name == "tools":
            raise no_xllm_form(name, "kvsvc writes xLLM engines' answers from their text and "
                               "parses no tool calls (docs/xllm.md, out of scope)")
        raise no_xllm_form(name)
    options = doc.get("stream_options")
    if isinstance(options, Mapping):
        for key, value in options.items():
            if key not in _STREAM_OPTIONS and value is not None:
                raise no_xllm_form(f"stream_options.{key}")
    if chat:
        for i, m in enumerate(doc.get("messages") or ()):
            content = m.get("content") if isinstance(m, Mapping) else None
            if isinstance(content, list):
                for j, part in enumerate(content):
                    if isinstance(part, Mapping) and part.get("type") != "text":
                        raise no_xllm_form(f"messages[{i}].content[{j}].type",
                                           "kvsvc sends xLLM engines text prompts only "
                                           f"(a {str(part.get('type'))[:40]!r} part)")


class EngineCaller(Protocol):
    """Sends one call of xLLM's API service to an engine and waits for its (empty) answer.

    ``call(target, method, message)``: ``target`` the engine's ``host:port``, ``method``
    :data:`CHAT_METHOD` or :data:`COMPLETIONS_METHOD`, ``message`` the request in the JSON form
    of its protobuf message (field names of the ``.proto``). Raises
    :class:`~kvsvc.errors.UpstreamTimeout` / :class:`~kvsvc.errors.UpstreamUnreachable` when the
    call failed (nothing was accepted), :class:`~kvsvc.errors.BadRequest` when the engine
    refused the request as malformed. ``close()`` releases its connections.
    """

    def call(self, target: str, method: str, message: Mapping[str, Any]) -> None:
        """One call (see the class docstring)."""
        ...

    def close(self) -> None:
        """Release connections. Idempotent."""
        ...


class HttpJsonCaller:
    """:class:`EngineCaller` over brpc's HTTP+JSON form of a method (brpc serves it on the same
    port as baidu_std): ``POST http://<target>/xllm.proto.XllmAPIService/<method>`` with the
    message as JSON; any 2xx is success. Thread-safe (a pooled ``requests`` session).

    :param connect_timeout_s: TCP connect bound, seconds.
    :param answer_timeout_s: bound of the engine's answer, seconds.
    :param pool_maxsize: kept-alive connections per engine.
    """

    def __init__(self, connect_timeout_s: float = 2.0,
                 answer_timeout_s: float = DISPATCH_ANSWER_TIMEOUT_S,
                 pool_maxsize: int = 64) -> None:
        self._timeout = (connect_timeout_s, answer_timeout_s)
        self._session = requests.Session()
        self._session.trust_env = False
        adapter = requests.adapters.HTTPAdapter(pool_connections=16, pool_maxsize=pool_maxsize,
                                                max_retries=0)
        self._session.mount("http://", adapter)

    def call(self, target: str, method: str, message: Mapping[str, Any]) -> None:
        """See :class:`EngineCaller`."""
        url = f"http://{target}/{API_SERVICE}/{method}"
        try:
            resp = self._session.post(url, data=json.dumps(message), timeout=self._timeout,
                                      headers={"Content-Type": "application/json"})
        except requests.exceptions.Timeout as exc:
            raise UpstreamTimeout(f"upstream {target}: {method} not answered in time") from exc
        except requests.exceptions.RequestException as exc:
            raise UpstreamUnreachable(f"upstream {target}: {method} failed "
                                      f"({type(exc).__name__})") from exc
        with resp:
            if 200 <= resp.status_code < 300:
                return
            text = resp.text[:300].strip()
        if 400 <= resp.status_code < 500:
            raise BadRequest(f"the engine {target} refused the request ({resp.status_code}): "
                             f"{text}", param=engine_param(text, message))
        raise UpstreamUnreachable(f"upstream {target}: {method} answered {resp.status_code}: "
                                  f"{text}")

    def close(self) -> None:
        """See :class:`EngineCaller`."""
        self._session.close()


def _messages(messages: Sequence[Any]) -> list[dict]:
    out = []
    for m in messages:
        if not isinstance(m, Mapping):
            continue
        msg: dict[str, Any] = {}
        if isinstance(m.get("role"), str):
            msg["role"] = m["role"]
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: the text ones, in order
            content = "".join(p.get("text", "") for p in content
                              if isinstance(p, Mapping) and p.get("type") == "text")
        if isinstance(content, str):
            msg["content"] = content
        if isinstance(m.get("tool_call_id"), str):
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out


def _common(doc: Mapping[str, Any], fields: frozenset[str], token_ids: Sequence[int],
            service_request_id: str, prefill: str, decode: str, source_addr: str,
            x_request_id: str) -> dict[str, Any]:
    msg: dict[str, Any] = {name: value for name, value in doc.items()
                           if name in fields and value is not None}
    stop = doc.get("stop")
    if isinstance(stop, str):
        msg["stop"] = [stop]
    elif isinstance(stop, list) and stop:
        msg["stop"] = list(stop)
    # OpenAI's newer name wins over the deprecated max_tokens; xLLM has only max_tokens.
    max_tokens = doc.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = doc.get("max_tokens")
    if max_tokens is not None:
        msg["max_tokens"] = max_tokens
    options = doc.get("stream_options")
    if isinstance(options, Mapping) and isinstance(options.get("include_usage"), bool):
        msg["stream_options"] = {"include_usage": options["include_usage"]}
    msg["service_request_id"] = service_request_id
    msg["token_ids"] = list(token_ids)
    msg["routing"] = {"prefill_name": prefill, "decode_name": decode}
    if source_addr:
        msg["source_xservice_addr"] = source_addr
    if x_request_id:
        msg["x_request_id"] = x_request_id
    return msg


def chat_request(doc: Mapping[str, Any], token_ids: Sequence[int], service_request_id: str,
                 prefill: str, decode: str = "", source_addr: str = "",
                 x_request_id: str = "") -> dict[str, Any]:
    """The ``ChatRequest`` (JSON form) of a chat body validated by
    :func:`check_xllm_fields` (module docstring): every field xLLM has under its name,
    ``max_completion_tokens`` (else ``max_tokens``) as ``max_tokens``, messages with their
    role and text content (content parts joined), ``stop`` as a list."""
    msg = _common(doc, _CHAT_FIELDS, token_ids, service_request_id, prefill, decode,
                  source_addr, x_request_id)
    msg["messages"] = _messages(doc.get("messages") or [])
    return msg


def completion_request(doc: Mapping[str, Any], token_ids: Sequence[int],
                       service_request_id: str, prefill: str, decode: str = "",
                       source_addr: str = "", x_request_id: str = "") -> dict[str, Any]:
    """The ``CompletionRequest`` (JSON form) of a validated completions body: a text prompt
    is kept in ``prompt`` (the engine uses ``token_ids``), a token prompt leaves it empty."""
    msg = _common(doc, _COMPLETION_FIELDS, token_ids, service_request_id, prefill, decode,
                  source_addr, x_request_id)
    prompt = doc.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    msg["prompt"] = prompt if isinstance(prompt, str) else ""
    return msg


class BaiduStdHeartbeats:
    """How each instance's heartbeats reach this replica (baidu_std or HTTP), by name, with the
    incarnation they gave: under ``--xllm_dispatch auto`` an xLLM instance is dispatched
    natively unless its current incarnation's last heartbeat here came over HTTP. An xLLM
    engine registers in etcd only when started with ``--enable_service_routing``, and then
    heartbeats only over baidu_std and gives its tokens only by ``Generations``: native is
    right for every one this replica has not heard over HTTP (a replica that is not master
    hears no heartbeat at all). The simulated engine's HTTP mode (and ``vllm_sidecar``)
    heartbeats over HTTP: relayed. Thread-safe; one per service.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._heard: dict[str, tuple[str, bool]] = {}   # name -> (incarnation, baidu_std)

    def heard(self, name: str, incarnation_id: str, baidu_std: bool = True) -> None:
        """An accepted heartbeat of ``name`` (``incarnation_id`` ``""`` when it gave none)
        over baidu_std, or over HTTP (``baidu_std`` False); a change is logged once."""
        entry = (incarnation_id or "", baidu_std)
        if self._heard.get(name) == entry:
            return
        with self._lock:
            if self._heard.get(name) == entry:
                return
            self._heard[name] = entry
        log.info("xLLM instance %s heartbeats over %s: %s (--xllm_dispatch auto)", name,
                 "baidu_std" if baidu_std else "HTTP",
                 "dispatched natively" if baidu_std else "relayed over HTTP")

    def heard_http(self, name: str, incarnation_id: Optional[str]) -> None:
        """An accepted HTTP heartbeat of ``name``."""
        self.heard(name, incarnation_id or "", baidu_std=False)

    def native(self, inst: Instance) -> bool:
        """False only when ``inst``'s current incarnation's last heartbeat here came over HTTP
        (an incarnation missing on either side matches)."""
        entry = self._heard.get(inst.name)
        if entry is None:
            return True
        incarnation, baidu_std = entry
        if incarnation and inst.incarnation_id and incarnation != inst.incarnation_id:
            return True   # a new process, not heard yet
        return baidu_std


@dataclass(frozen=True, slots=True)
class Bound:
    """The instance a request waits on and the incarnation it was dispatched to.

    :ivar name: ``host:port``.
    :ivar incarnation_id: the registered incarnation at dispatch, ``None`` when unknown.
    """

    name: str
    incarnation_id: Optional[str]


def instance_problem(snapshot: RegistrySnapshot, bound: Bound,
                     lost: Optional[LostEngines] = None) -> Optional[str]:
    """Why ``bound`` can no longer answer (removed, SUSPECT, replaced by a new incarnation, or
    known dead from its closed baidu_std connection, :mod:`kvsvc.routing.engine_loss`),
    ``None`` while it can."""
    inst = snapshot.instances.get(bound.name)
    if inst is None:
        return f"instance {bound.name} was removed"
    if inst.state is InstanceState.SUSPECT:
        return f"instance {bound.name} is SUSPECT"
    if (bound.incarnation_id is not None and inst.incarnation_id is not None
            and inst.incarnation_id != bound.incarnation_id):
        return (f"instance {bound.name} was replaced (incarnation {bound.incarnation_id} -> "
                f"{inst.incarnation_id})")
    return lost.problem(bound.name, bound.incarnation_id) if lost is not None else None


class GenerationsBody(UpstreamBody):
    """The answer of one natively dispatched request, relayed the way an upstream HTTP body is
    (the HTTP layer treats both alike): iterating it yields the SSE events written from the
    request's entries (:class:`~kvsvc.routing.answers.StreamAssembler`) until the last one;
    :meth:`close` (the WSGI server's, at the end or when the client went away) cancels an
    unfinished request, releases its in-flight count, tells the observer how it ended and hands
    the :class:`~kvsvc.routing.proxy.RelayEnd` to the :meth:`when_closed` callback.

    It does not call :class:`UpstreamBody`'s constructor: it has no HTTP response; every
    public member is its own.

    :param pending: the request's registration.
    :param assembler: writes the answer: a :class:`~kvsvc.routing.answers.StreamAssembler`
        (iterating the body yields its events), or a
        :class:`~kvsvc.routing.answers.WholeAssembler` that the dispatcher feeds itself
        (:meth:`next_entries`, :meth:`heard`, :meth:`finished`); either one's ``usage`` and
        ``error`` decide what the observer hears at the end.
    :param snapshot: the registry's current snapshot (the instance checks).
    :param bounds: the instance generating until the first token, then the one after it (the
        same one without P/D).
    :param read_timeout_s: the longest wait for an entry, seconds.
    :param dispatch: the in-flight count, released by :meth:`close`.
    :param observer: hears the tokens and the end; ``None``: nobody.
    :param info: the attempt as the observer knows it.
    :param path: the request path (logs).
    :param client: the client's connection, peeked at between entries (a client gone while
        the engine is silent, e.g. in a long prefill, cancels at once); ``None``: not watched.
    :param lost: the engines known dead (:mod:`kvsvc.routing.engine_loss`), checked with the
        registry; ``None``: the registry only.
    """

    def __init__(self, pending: PendingRequest,
                 assembler: Union[StreamAssembler, WholeAssembler],
                 snapshot: Callable[[], RegistrySnapshot], bounds: tuple[Bound, Bound],
                 read_timeout_s: float, dispatch: Optional[Dispatch],
                 observer: Optional[RequestObserver], info: Optional[RequestInfo],
                 path: str = "", client: Optional[ClientWatch] = None,
                 lost: Optional[LostEngines] = None) -> None:
        self._client = client
        self._lost = lost
        self._next_check = 0.0
        self._pending = pending
        self._asm = assembler
        self._snapshot = snapshot
        self._bounds = bounds
        self._read_timeout_s = read_timeout_s
        self._dispatch = dispatch
        self._observer = observer
        self._info = info
        self.target = pending.prefill
        self.path = path
        self._lock = threading.Lock()
        self._closed = False
        self._complete = False
        self._on_close: Optional[Callable[[RelayEnd], None]] = None
        self._tokens = 0
        self.first_data_at: Optional[float] = None
        self.bytes_relayed = 0
        self.broken: Optional[str] = None

    def when_closed(self, callback: Callable[[RelayEnd], None]) -> None:
        """See :meth:`UpstreamBody.when_closed`."""
        self._on_close = callback

    def finished(self) -> None:
        """The request's last entry was read (the answer is complete)."""
        self._complete = True

    def heard(self, tokens: int) -> None:
        """Observer calls for ``tokens`` more output tokens (FINISH_PREFILL for the first,
        GENERATE for each further one, :func:`~kvsvc.routing.observer.notify_heard`)."""
        if self._info is not None:
            self._tokens = notify_heard(self._observer, self._info, self._tokens, tokens)

    def release_turn(self) -> None:
        """Pass the wake-up turn on (:meth:`PendingRequest.release_turn`)."""
        self._pending.release_turn()

    def next_entries(self) -> list[Any]:
        """Every entry of the request queued now, waiting (blocking) for the first, checking
        the generating instance between waits.

        :raises UpstreamTimeout: no entry for ``read_timeout_s``.
        :raises UpstreamUnreachable: the instance was removed, became SUSPECT or was replaced.
        :raises ClientGone: the client closed its connection (the request is cancelled: the
            engine's next entry gets ``ok: false``).
        """
        try:
            return self._next_entries()
        except UpstreamError as exc:
            if self.broken is None:   # failed from outside (its queue overflowed)
                self.broken = exc.message
            self._pending.release_turn()
            raise
        except BaseException:
            self._pending.release_turn()
            raise

    def _next_entries(self) -> list[Any]:
        while True:
            gens = self._pending.take(CHECK_INTERVAL_S)
            now = time.monotonic()
            if gens and now < self._next_check:
                return gens
            # Checked every CHECK_INTERVAL_S even while entries flow: a replaced or dead
            # instance may still have entries in flight.
            self._next_check = now + CHECK_INTERVAL_S
            bound = self._bounds[1 if self._tokens else 0]
            problem = instance_problem(self._snapshot(), bound, self._lost)
            if problem is not None:
                raise self._failed(UpstreamUnreachable(
                    f"upstream {bound.name}: {problem} while generating request "
                    f"{self._pending.service_req_id}"))
            # Before the entries: a non-streamed answer's entries may flow without a pause
            # for as long as the engine generates, and nobody reads them once the client left.
            if self._client is not None and self._client.client_gone():
                self._client.gone = True
                self._pending.cancel(CANCEL_CLIENT_GONE)
                raise ClientGone(f"client closed its connection while {self.target} generated "
                                 f"request {self._pending.service_req_id}")
            if gens:
                return gens
            silent = time.monotonic() - self._pending.last_entry_at
            if silent >= self._read_timeout_s:
                raise self._failed(UpstreamTimeout(
                    f"upstream {bound.name}: no Generations for request "
                    f"{self._pending.service_req_id} within {self._read_timeout_s:g} s"))

    def _failed(self, exc: UpstreamError) -> UpstreamError:
        self.broken = exc.message
        self._pending.fail(exc)
        log.warning("%s (after %d tokens, %d bytes relayed)", exc.message, self._tokens,
                    self.bytes_relayed)
        return exc

    def __iter__(self) -> Iterator[bytes]:
        """SSE events as the entries arrive, until the last one or :meth:`close`.

        :raises UpstreamTimeout: no entry within the read timeout.
        :raises UpstreamUnreachable: the instance failed (module docstring).
        """
        asm = self._asm
        assert isinstance(asm, StreamAssembler), "a non-streamed answer is not iterated"
        try:
            yield from self._events(asm)
        finally:
            self._pending.release_turn()

    def _events(self, asm: StreamAssembler) -> Iterator[bytes]:
        while not asm.done:
            with self._lock:
                if self._closed:
                    return
            try:
                gens = self.next_entries()
            except ClientGone:
                return  # nobody reads on: close() cancels the request
            # Every entry queued while the last write went out goes in one write (an engine
            # sends a step's tokens in a burst: one syscall and one chunk instead of several).
            parts = []
            tokens = 0
            for g in gens:
                tokens += g.tokens
                parts.append(asm.feed(g))
                if asm.done:
                    break
            self.heard(tokens)
            data = b"".join(parts)
            if data:
                if self.first_data_at is None:
                    self.first_data_at = time.monotonic()
                self.bytes_relayed += len(data)
                # The next ready reader runs while this one writes (generations.py).
                self._pending.release_turn()
                yield data
        self._complete = True

    def read_all(self) -> bytes:
        """The whole SSE body (for a client that did not ask for a stream but gets one);
        closed afterwards."""
        try:
            return b"".join(self)
        finally:
            self.close()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        with self._lock:
            return self._closed

    def close(self) -> None:
        """End the relay (module docstring). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        complete = self._complete
        if not complete:
            self._pending.cancel(CANCEL_CLIENT_GONE if self.broken is None else "failed")
        self._pending.close()
        if self._dispatch is not None:
            self._dispatch.release()
        if self._info is not None:
            if self.broken is not None:
                notify(self._observer, "on_cancel", self._info, f"{CANCEL_BROKEN}: "
                       f"{self.broken}")
            elif not complete:
                notify(self._observer, "on_cancel", self._info, CANCEL_CLIENT_GONE)
            elif self._asm.error is not None:
                notify(self._observer, "on_cancel", self._info,
                       f"{CANCEL_HTTP_ERROR}: engine status {self._asm.error.status_code}")
            else:
                usage = self._asm.usage.to_openai() if self._asm.usage is not None else None
                notify(self._observer, "on_end", self._info, usage)
        callback = self._on_close
        if callback is not None:
            end = RelayEnd(self.target, self.bytes_relayed, self.first_data_at,
                           time.monotonic(), complete, self.broken)
            try:
                callback(end)
            except Exception:  # noqa: BLE001 - the WSGI server's close must not fail
                log.exception("upstream %s: relay end callback failed", self.target)


class _WholeBody(UpstreamBody):
    """A non-streamed answer already assembled: its bytes, closed at once."""

    def __init__(self, target: str, data: bytes) -> None:
        self.target = target
        self.path = ""
        self._data = data
        self._closed = False
        self.bytes_relayed = len(data)
        self.first_data_at = None
        self.broken = None
        self._lock = threading.Lock()
        self._on_close: Optional[Callable[[RelayEnd], None]] = None

    def __iter__(self) -> Iterator[bytes]:
        yield self._data

    def read_all(self) -> bytes:
        """The answer's bytes."""
        self.close()
        return self._data

    def close(self) -> None:
        """Nothing to release (the request ended before the head). Idempotent."""
        self._closed = True


class XllmDispatcher:
    """Native dispatch to xLLM engines (module docstring). Thread-safe; one per service.

    :param caller: sends the API calls.
    :param pending: the Generations registry the baidu_std server delivers to.
    :param snapshot: the registry's current snapshot.
    :param in_flight: the ledger the router's policy reads.
    :param observer: the proxy's request observer (§12); ``None``: nobody.
    :param read_timeout_s: the longest wait for an entry, seconds (§13's upstream timeout).
    :param source_addr: this replica's baidu_std ``ip:port`` (``""`` while it has none).
    :param max_attempts: instances tried at most per request.
    :param lost: the engines known dead from their closed baidu_std connection
        (:mod:`kvsvc.routing.engine_loss`); ``None``: only the registry's states count.
    :param native_for: which xLLM instances are dispatched natively
        (:meth:`BaiduStdHeartbeats.native` under ``--xllm_dispatch auto``); ``None``: every
        one (``native``).
    """

    def __init__(self, caller: EngineCaller, pending: PendingRequests,
                 snapshot: Callable[[], RegistrySnapshot], in_flight: InFlight,
                 observer: Optional[RequestObserver], read_timeout_s: float,
                 source_addr: Callable[[], str], max_attempts: int = 2,
                 lost: Optional[LostEngines] = None,
                 native_for: Optional[Callable[[Instance], bool]] = None) -> None:
        self.caller = caller
        self.lost = lost
        self.native_for = native_for
        self.pending = pending
        self._snapshot = snapshot
        self.in_flight = in_flight
        self.observer = observer
        self.read_timeout_s = read_timeout_s
        self._source_addr = source_addr
        self.max_attempts = max_attempts
        self._attempt_ids = itertools.count(1 << 40)  # apart from the proxy's ids
        self._lock = threading.Lock()
        self._failures: dict[str, int] = {}

    def handles(self, inst: Instance) -> bool:
        """True when a request for ``inst`` goes natively: ``backend_type`` ``"xllm"`` and
        ``native_for`` says so (always without one)."""
        return inst.backend_type == "xllm" and (self.native_for is None
                                                or self.native_for(inst))

    def failures(self) -> dict[str, int]:
        """Engine ``host:port`` -> dispatch calls that failed."""
        with self._lock:
            return dict(self._failures)

    def forward(self, decision: Decision, path: str, doc: Mapping[str, Any],
                token_ids: Optional[Sequence[int]], x_request_id: str = "",
                client: Optional[ClientWatch] = None) -> UpstreamReply:
        """Dispatch one validated request as ``decision`` says and give its answer's head and
        body (module docstring).

        :param decision: the router's :class:`~kvsvc.routing.policy.Decision` (a P chosen).
        :param path: the OpenAI path (``/v1/chat/completions`` or ``/v1/completions``, a query
            string ignored).
        :param doc: the parsed body.
        :param token_ids: the prompt's tokens; ``None`` when they are unknown (400).
        :param x_request_id: the client's ``x-request-id``, passed on.
        :param client: the client's connection, watched between entries; ``None``: not.
        :raises ClientGone: not streamed, the client went away before the answer (cancelled).
        :raises BadRequest: a field with no xLLM form (:func:`check_xllm_fields`), no token
            ids, or the engine refused the request.
        :raises UpstreamTimeout: every attempt failed, the last by a timeout; or, not
            streamed, no entry came within the read timeout.
        :raises UpstreamUnreachable: every attempt failed; or, not streamed, the instance
            failed during the request.
        """
        chat = path.split("?", 1)[0].endswith("/chat/completions")
        check_xllm_fields(doc, chat)
        if token_ids is None:
            prompt = doc.get("prompt")
            if (not chat and isinstance(prompt, list) and prompt
                    and all(isinstance(p, (list, str)) for p in prompt)):
                raise BadRequest(ONE_PROMPT)
            raise BadRequest(NEEDS_TOKENS)
        streamed = doc.get("stream") is True
        decode_inst = decision.decode
        decode = decode_inst.name if decode_inst is not None else ""
        source = self._source_addr()
        tried: list[str] = []
        last: Optional[UpstreamError] = None
        ranking = [i for i in decision.prefill_ranking if self.handles(i)][:self.max_attempts]
        for inst in ranking:
            target = inst.name
            tried.append(target)
            sid = uuid.uuid4().hex
            build = chat_request if chat else completion_request
            message = build(doc, token_ids, sid, target, decode, source, x_request_id)
            pending = self.pending.open(sid, target, decode)
            dispatch = self.in_flight.begin((target, decode) if decode else (target,))
            info = RequestInfo(next(self._attempt_ids), target, decode, len(token_ids),
                               decision.prefill_estimates_ms.get(target, 0.0), decision.policy,
                               decision=decision, streamed=True)
            notify(self.observer, "on_dispatch", info)
            try:
                self.caller.call(target, CHAT_METHOD if chat else COMPLETIONS_METHOD, message)
            except UpstreamError as exc:
                last = exc
                pending.close()
                dispatch.release()
                notify(self.observer, "on_cancel", info,
                       f"{CANCEL_UPSTREAM_FAILED}: {exc.message}")
                with self._lock:
                    self._failures[target] = self._failures.get(target, 0) + 1
                retrying = len(tried) < len(ranking)
                log.warning("upstream %s: dispatch failed (%s)%s", target, exc.message,
                            "; retrying on the next candidate" if retrying else "")
                continue
            except BaseException:
                pending.close()
                dispatch.release()
                notify(self.observer, "on_cancel", info, CANCEL_UPSTREAM_FAILED)
                raise
            bounds = (Bound(target, inst.incarnation_id),
                      Bound(decode, decode_inst.incarnation_id) if decode_inst is not None
                      else Bound(target, inst.incarnation_id))
            spec = answer_spec(chat, doc, sid, int(time.time()))
            asm = (StreamAssembler(spec, bool(decode)) if streamed
                   else WholeAssembler(spec, bool(decode)))
            body = GenerationsBody(pending, asm, self._snapshot, bounds, self.read_timeout_s,
                                   dispatch, self.observer, info, path, client, self.lost)
            if streamed:
                return UpstreamReply(target, 200, [("Content-Type", "text/event-stream"),
                                                   ("Cache-Control", "no-cache")], body, tried)
            assert isinstance(asm, WholeAssembler)
            return self._whole(body, asm, target, tried)
        assert last is not None, "forward() needs a decision with a P"
        raise type(last)(f"{last.message} (tried {', '.join(tried)})") from last

    def _whole(self, body: GenerationsBody, asm: WholeAssembler, target: str,
               tried: list[str]) -> UpstreamReply:
        """Wait for the last entry of a non-streamed request and give its JSON answer."""
        try:
            while not asm.done:
                gens = body.next_entries()
                body.release_turn()
                tokens = 0
                for gen in gens:
                    tokens += gen.tokens
                    if asm.feed(gen):
                        break
                body.heard(tokens)  # once per batch, as the streamed relay does
            body.finished()
            if asm.error is not None:
                status = http_status_of_engine_error(asm.error.status_code)
                doc = error_body(status, asm.error.message,
                                 f"engine_{asm.error.status_code}",
                                 engine_param(asm.error.message, asm.spec.fields))
            else:
                status, doc = 200, asm.answer()
        finally:
            body.close()
        data = json.dumps(doc, ensure_ascii=False).encode()
        return UpstreamReply(target, status, [("Content-Type", "application/json")],
                             _WholeBody(target, data), tried)

    def close(self) -> None:
        """Release the caller's connections. Idempotent."""
        self.caller.close()
