"""``Generations`` entries between their protobuf form (``xllm.proto.DisaggStreamGeneration``,
§13) and kvsvc's values (:class:`kvsvc.routing.answers.Generation`), and the interface the
baidu_std server hands them to.

:class:`GenerationSink` is what the dispatch side implements
(:class:`kvsvc.routing.generations.PendingRequests`): one call per ``Generations`` call, the
entries in order, one ``ok`` per entry back, at once (never after client I/O: the engine sends
all its tokens from one thread and waits for each answer). The server makes the answer's
``StatusSet`` exactly as long as the call's entries whatever the sink returns (an engine
aborts on any other count).
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

from kvsvc.routing.answers import Generation, GenOutput, GenUsage, LogProbEntry
from kvsvc.rpc import messages


class GenerationSink(Protocol):
    """Takes the entries of one ``Generations`` call (module docstring). A sink may also have
    ``deliver_deferred(entries, convert)`` (:meth:`kvsvc.routing.generations.PendingRequests.
    deliver_deferred`): the parsed protobuf entries, converted by :func:`generation_from_proto`
    only where a request takes them, and the readers woken by the function it returns, which
    the server calls once the ``StatusSet`` was sent."""

    def deliver(self, gens: Sequence[Generation]) -> list[bool]:
        """One ``ok`` per entry, in order: ``False`` for an unknown ``service_req_id``, a
        request whose client went away or that was cancelled."""
        ...


def generation_from_proto(msg: Any) -> Generation:
    """The value of one parsed ``xllm.proto.DisaggStreamGeneration`` (absent fields are
    their defaults; ``usage`` is ``None`` when the entry carries none)."""
    # On the Generations path (every token of every request): one attribute read per field,
    # no generator where the repeated field is empty (logprobs mostly are).
    outputs = []
    for o in msg.outputs:
        lps = o.logprobs
        outputs.append(GenOutput(
            o.index, o.text, tuple(o.token_ids), o.finish_reason,
            tuple(_logprob(p) for p in lps) if lps else ()))
    usage = None
    if msg.HasField("usage"):
        u = msg.usage
        usage = GenUsage(u.num_prompt_tokens, u.num_generated_tokens, u.num_total_tokens,
                         u.num_cached_tokens)
    code, text = 0, ""
    if msg.HasField("gen_status"):
        status = msg.gen_status
        code, text = status.status_code, status.status_msg
    return Generation(msg.service_req_id, msg.req_id, code, text, tuple(outputs), usage,
                      msg.finished, msg.finished_on_prefill_instance)


def _logprob(p: Any) -> LogProbEntry:
    d = p.log_prob_data
    return LogProbEntry(d.token, d.token_id, d.logprob,
                        tuple((t.token, t.token_id, t.logprob) for t in p.top_logprobs))


def generation_to_proto(gen: Generation, with_status: bool = False) -> Any:
    """``gen`` as an ``xllm.proto.DisaggStreamGeneration`` (what an engine sends).

    :param with_status: write ``gen_status`` even when it is 0 / empty (an engine's final
        entry carries it).
    """
    msg = messages.DisaggStreamGeneration(
        req_id=gen.req_id, service_req_id=gen.service_req_id, finished=gen.finished,
        finished_on_prefill_instance=gen.finished_on_prefill_instance)
    if with_status or gen.status_code or gen.status_msg:
        msg.gen_status.status_code = gen.status_code
        msg.gen_status.status_msg = gen.status_msg
    for o in gen.outputs:
        out = msg.outputs.add(index=o.index, text=o.text, token_ids=o.token_ids,
                              finish_reason=o.finish_reason)
        for lp in o.logprobs:
            item = out.logprobs.add()
            item.log_prob_data.token = lp.token
            item.log_prob_data.token_id = lp.token_id
            item.log_prob_data.logprob = lp.logprob
            for token, token_id, logprob in lp.top:
                item.top_logprobs.add(token=token, token_id=token_id, logprob=logprob)
    if gen.usage is not None:
        u = gen.usage
        msg.usage.num_prompt_tokens = u.prompt_tokens
        msg.usage.num_generated_tokens = u.generated_tokens
        msg.usage.num_total_tokens = u.total_tokens
        msg.usage.num_cached_tokens = u.cached_tokens
    return msg
