"""Where the entries of ``Generations`` calls go (§13): a registry of per-request sinks keyed
by ``service_req_id``, filled by the dispatch side and read by the RPC server.

An xLLM engine pushes every output token of a request dispatched to it (``ChatCompletions`` /
``Completions`` carrying ``service_request_id``) back with ``Generations``; the server answers
each entry with one ``Status`` and the engine cancels the request on ``ok: false``. The rules:

- a request's sink is registered **before** its dispatch call is sent (an engine may push its
  first token before the dispatch answer arrives) and unregistered when the request ends;
- :meth:`GenerationSinks.deliver` hands one entry to its sink and returns the entry's ``ok``:
  ``False`` for an unknown ``service_req_id`` (never dispatched here, or already ended), an
  entry xllm-service would reject (empty ``service_req_id``), a sink that answers ``False``
  (its client went away, the request was cancelled) or a sink that raises (logged);
- a sink is called on the server's connection thread, entry after entry, and must not block:
  it queues the entry for the request's own thread and returns (the engine sends all its
  tokens from one thread and waits for each answer, so a slow sink slows every request of
  that engine).

Values: :class:`Generation` (one entry, ``xllm.proto.DisaggStreamGeneration``),
:class:`SequenceOutput`, :class:`OutputUsage`, :class:`TokenLogProb`. Thread-safe; no I/O.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Optional, Protocol

from kvsvc.rpc import messages

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TokenLogProb:
    """One ``LogProbData``: ``token`` text, ``token_id``, natural-log ``logprob``,
    ``finished_token``."""

    token: str
    token_id: int
    logprob: float
    finished_token: bool = False


@dataclass(frozen=True, slots=True)
class LogProb:
    """One ``LogProb`` of a sequence output: the chosen token and the top alternatives."""

    chosen: TokenLogProb
    top: tuple[TokenLogProb, ...] = ()


@dataclass(frozen=True, slots=True)
class SequenceOutput:
    """One ``SequenceOutput`` of an entry.

    :param index: the sequence's index in the request (OpenAI's choice ``index``).
    :param text: the delta text since the previous entry.
    :param token_ids: the delta's token ids.
    :param finish_reason: ``""`` until the sequence ends (``"stop"``, ``"length"``...).
    :param logprobs: one per delta token when the request asked for them.
    """

    index: int = 0
    text: str = ""
    token_ids: tuple[int, ...] = ()
    finish_reason: str = ""
    logprobs: tuple[LogProb, ...] = ()


@dataclass(frozen=True, slots=True)
class OutputUsage:
    """``OutputUsage``: token counts of the whole request so far (the final entry's are the
    request's usage; ``num_cached_tokens`` are prompt tokens served from the prefix cache)."""

    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_total_tokens: int = 0
    num_cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Generation:
    """One entry of a ``Generations`` call (``DisaggStreamGeneration``).

    :param service_req_id: the id kvsvc gave the request at dispatch (the sink's key).
    :param req_id: the engine's own id of the request.
    :param status_code: ``gen_status.status_code``; 0 is success, anything else an error the
        answer must report (§13).
    :param status_msg: ``gen_status.status_msg``.
    :param has_status: the entry carried a ``gen_status`` (final entries do).
    :param outputs: the sequences' deltas.
    :param usage: ``None`` when the entry carried none.
    :param finished: the request is complete (last entry).
    :param finished_on_prefill_instance: sent by the P instance of a PD pair (the first token).
    """

    service_req_id: str
    req_id: str = ""
    status_code: int = 0
    status_msg: str = ""
    has_status: bool = False
    outputs: tuple[SequenceOutput, ...] = ()
    usage: Optional[OutputUsage] = None
    finished: bool = False
    finished_on_prefill_instance: bool = False

    @classmethod
    def from_proto(cls, msg: Any) -> "Generation":
        """The entry of a parsed ``xllm.proto.DisaggStreamGeneration``."""
        def lp(d: Any) -> TokenLogProb:
            return TokenLogProb(d.token, d.token_id, d.logprob, d.finished_token)

        outputs = tuple(
            SequenceOutput(o.index, o.text, tuple(o.token_ids), o.finish_reason,
                           tuple(LogProb(lp(p.log_prob_data), tuple(lp(t) for t in p.top_logprobs))
                                 for p in o.logprobs))
            for o in msg.outputs)
        usage = None
        if msg.HasField("usage"):
            u = msg.usage
            usage = OutputUsage(u.num_prompt_tokens, u.num_generated_tokens,
                                u.num_total_tokens, u.num_cached_tokens)
        has_status = msg.HasField("gen_status")
        return cls(msg.service_req_id, msg.req_id, msg.gen_status.status_code,
                   msg.gen_status.status_msg, has_status, outputs, usage, msg.finished,
                   msg.finished_on_prefill_instance)

    def to_proto(self) -> Any:
        """This entry as an ``xllm.proto.DisaggStreamGeneration`` (for engines and tests)."""
        msg = messages.DisaggStreamGeneration(
            req_id=self.req_id, service_req_id=self.service_req_id, finished=self.finished,
            finished_on_prefill_instance=self.finished_on_prefill_instance)
        if self.has_status or self.status_code or self.status_msg:
            msg.gen_status.status_code = self.status_code
            msg.gen_status.status_msg = self.status_msg
        for o in self.outputs:
            out = msg.outputs.add(index=o.index, text=o.text, token_ids=o.token_ids,
                                  finish_reason=o.finish_reason)
            for p in o.logprobs:
                item = out.logprobs.add()
                c = p.chosen
                item.log_prob_data.token, item.log_prob_data.token_id = c.token, c.token_id
                item.log_prob_data.logprob = c.logprob
                item.log_prob_data.finished_token = c.finished_token
                for t in p.top:
                    item.top_logprobs.add(token=t.token, token_id=t.token_id,
                                          logprob=t.logprob, finished_token=t.finished_token)
        if self.usage is not None:
            u = self.usage
            msg.usage.num_prompt_tokens = u.num_prompt_tokens
            msg.usage.num_generated_tokens = u.num_generated_tokens
            msg.usage.num_total_tokens = u.num_total_tokens
            msg.usage.num_cached_tokens = u.num_cached_tokens
        return msg


class GenerationSink(Protocol):
    """Where one request's entries go (implemented by the dispatch side)."""

    def on_generation(self, generation: Generation) -> bool:
        """Take one entry of this request, in the order the engine sent them; must not block
        (queue it for the request's thread).

        :returns: the entry's ``ok``: ``False`` when the request is no longer wanted (client
            gone, cancelled): the engine then cancels it.
        """
        ...


class GenerationSinks:
    """The registry ``service_req_id`` -> :class:`GenerationSink` (module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sinks: dict[str, GenerationSink] = {}

    def register(self, service_req_id: str, sink: GenerationSink) -> None:
        """Route the entries of ``service_req_id`` to ``sink`` from now on.

        :raises ValueError: ``service_req_id`` is empty or already registered (ids are unique
            per request).
        """
        if not service_req_id:
            raise ValueError("service_req_id must not be empty")
        with self._lock:
            if service_req_id in self._sinks:
                raise ValueError(f"service_req_id {service_req_id!r} is already registered")
            self._sinks[service_req_id] = sink

    def unregister(self, service_req_id: str) -> None:
        """Forget ``service_req_id`` (its later entries answer ``ok: false``); idempotent."""
        with self._lock:
            self._sinks.pop(service_req_id, None)

    def __len__(self) -> int:
        """Requests currently registered."""
        with self._lock:
            return len(self._sinks)

    def __contains__(self, service_req_id: object) -> bool:
        with self._lock:
            return service_req_id in self._sinks

    def deliver(self, generation: Generation) -> bool:
        """Hand one entry to its request's sink (module docstring).

        :returns: the ``ok`` of the entry's ``Status``.
        """
        if not generation.service_req_id:
            return False
        with self._lock:
            sink = self._sinks.get(generation.service_req_id)
        if sink is None:
            return False
        try:
            return bool(sink.on_generation(generation))
        except Exception:  # noqa: BLE001 - one request's bug must not fail the whole call
            log.exception("generation sink of %s raised; answering ok: false",
                          generation.service_req_id)
            return False
