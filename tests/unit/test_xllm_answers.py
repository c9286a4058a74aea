"""The OpenAI answers assembled from Generations entries (§13 "Answer assembly"), without
sockets: streamed and not, chat and completions, usage with cached tokens, errors, [DONE], P/D."""

from __future__ import annotations

import json

import pytest

from kvsvc.routing.answers import (
    DONE,
    AnswerSpec,
    GenOutput,
    GenUsage,
    Generation,
    LogProbEntry,
    StreamAssembler,
    WholeAssembler,
    answer_spec,
    ends_request,
    generation_from_dict,
    http_status_of_engine_error,
)

SID = "req-1"


def _gens(texts: list[str], finish: str = "length", usage: GenUsage | None = None,
          index: int = 0) -> list[Generation]:
    out = []
    for i, t in enumerate(texts):
        last = i == len(texts) - 1
        out.append(Generation(SID, "e-1", outputs=(GenOutput(index, t, (100 + i,),
                                                             finish if last else ""),),
                              usage=usage if last else None, finished=last))
    return out


def _events(data: bytes) -> list:
    """The SSE events of ``data``: JSON objects, or the string ``"[DONE]"``."""
    events = []
    for block in data.decode().split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def _spec(chat: bool, include_usage: bool = False, logprobs: bool = False) -> AnswerSpec:
    return AnswerSpec(chat, ("chatcmpl-" if chat else "cmpl-") + SID, "m", 1700000000,
                      include_usage, logprobs)


def test_stream_chat_one_chunk_per_entry_role_first_finish_last_then_usage_and_done() -> None:
    usage = GenUsage(40, 3, 43, 32)
    asm = StreamAssembler(_spec(chat=True, include_usage=True))
    data = b"".join(asm.feed(g) for g in _gens([" a", " b", " c"], usage=usage))
    events = _events(data)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert [c["object"] for c in chunks] == ["chat.completion.chunk"] * 4
    assert {c["id"] for c in chunks} == {"chatcmpl-req-1"}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": " a"}
    assert chunks[1]["choices"][0]["delta"] == {"content": " b"}
    assert [c["choices"][0]["finish_reason"] for c in chunks[:3]] == [None, None, "length"]
    # include_usage: every chunk before the last carries "usage": null, the last is usage only.
    assert all(c["usage"] is None for c in chunks[:3])
    assert chunks[3]["choices"] == []
    assert chunks[3]["usage"] == {"prompt_tokens": 40, "completion_tokens": 3,
                                  "total_tokens": 43,
                                  "prompt_tokens_details": {"cached_tokens": 32}}
    assert asm.done and asm.feed(_gens(["late"])[0]) == b""


def test_stream_completion_chunks_without_usage_unless_asked() -> None:
    asm = StreamAssembler(_spec(chat=False))
    events = _events(b"".join(asm.feed(g) for g in _gens(["x", "y"], finish="stop")))
    assert events[-1] == "[DONE]"
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["x", "y"]
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert all("usage" not in e for e in events[:-1])
    assert {e["object"] for e in events[:-1]} == {"text_completion"}


def test_stream_several_output_indexes_in_one_chunk() -> None:
    asm = StreamAssembler(_spec(chat=True))
    gen = Generation(SID, outputs=(GenOutput(0, "a"), GenOutput(1, "b")))
    (chunk,) = _events(asm.feed(gen))
    assert [(c["index"], c["delta"]["content"]) for c in chunk["choices"]] == [(0, "a"),
                                                                               (1, "b")]
    assert all(c["delta"]["role"] == "assistant" for c in chunk["choices"])
    end = Generation(SID, outputs=(GenOutput(0, "", (), "stop"), GenOutput(1, "c", (), "stop")),
                     finished=True)
    events = _events(asm.feed(end))
    assert events[-1] == "[DONE]"
    assert "role" not in events[0]["choices"][1]["delta"]


def test_stream_error_status_gives_an_error_event_then_the_end_without_done() -> None:
    asm = StreamAssembler(_spec(chat=True))
    first = asm.feed(_gens(["a", "b"])[0])
    assert _events(first)[0]["choices"][0]["delta"]["content"] == "a"
    err = asm.feed(Generation(SID, status_code=5, status_msg="out of KV blocks"))
    (event,) = _events(err)
    assert event["error"]["message"] == "out of KV blocks"
    assert event["error"]["code"] == "engine_5"
    assert asm.done and asm.error is not None
    assert DONE not in err


def test_stream_entry_without_output_gives_nothing_until_the_end() -> None:
    asm = StreamAssembler(_spec(chat=False, include_usage=True))
    assert asm.feed(Generation(SID, usage=GenUsage(5, 0, 5, 0))) == b""
    events = _events(asm.feed(Generation(SID, usage=GenUsage(5, 1, 6, 0), finished=True)))
    assert events[0]["usage"]["completion_tokens"] == 1 and events[1] == "[DONE]"


def test_whole_chat_answer_concatenates_and_reports_usage_with_cached_tokens() -> None:
    asm = WholeAssembler(_spec(chat=True))
    gens = _gens([" a", " b", " c"], finish="stop", usage=GenUsage(40, 3, 43, 32))
    assert [asm.feed(g) for g in gens] == [False, False, True]
    doc = asm.answer()
    assert doc["object"] == "chat.completion"
    assert doc["choices"] == [{"index": 0, "message": {"role": "assistant", "content": " a b c"},
                               "logprobs": None, "finish_reason": "stop"}]
    assert doc["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    assert doc["usage"]["total_tokens"] == 43


def test_whole_completion_answer_and_total_filled_when_engine_sends_zero() -> None:
    asm = WholeAssembler(_spec(chat=False))
    for g in _gens(["x", "y"], usage=GenUsage(7, 2, 0, 0)):
        asm.feed(g)
    doc = asm.answer()
    assert doc["object"] == "text_completion"
    assert doc["choices"][0]["text"] == "xy" and doc["choices"][0]["finish_reason"] == "length"
    assert doc["usage"]["total_tokens"] == 9


def test_whole_error_status_sets_the_error() -> None:
    asm = WholeAssembler(_spec(chat=False))
    assert asm.feed(Generation(SID, status_code=3, status_msg="bad prompt"))
    assert asm.error is not None and asm.error.message == "bad prompt"
    assert http_status_of_engine_error(3) == 400
    assert http_status_of_engine_error(250) == 500


def test_logprobs_only_when_asked() -> None:
    lp = (LogProbEntry(" a", 7, -0.5, ((" a", 7, -0.5), (" b", 8, -1.5))),)
    gen = Generation(SID, outputs=(GenOutput(0, " a", (7,), "stop", lp),), finished=True)
    asked = _events(StreamAssembler(_spec(chat=True, logprobs=True)).feed(gen))[0]
    content = asked["choices"][0]["logprobs"]["content"]
    assert content[0]["token"] == " a" and content[0]["logprob"] == -0.5
    assert [t["token"] for t in content[0]["top_logprobs"]] == [" a", " b"]
    plain = _events(StreamAssembler(_spec(chat=True)).feed(gen))[0]
    assert plain["choices"][0]["logprobs"] is None
    whole = WholeAssembler(_spec(chat=False, logprobs=True))
    whole.feed(gen)
    lps = whole.answer()["choices"][0]["logprobs"]
    assert lps["tokens"] == [" a"] and lps["top_logprobs"] == [{" a": -0.5, " b": -1.5}]


def test_pd_handover_entry_does_not_end_the_request() -> None:
    first = Generation(SID, outputs=(GenOutput(0, " a", (1,)),), finished=True,
                       finished_on_prefill_instance=True)
    assert not ends_request(first, has_decode=True)
    assert ends_request(first, has_decode=False)
    done_on_p = Generation(SID, outputs=(GenOutput(0, " a", (1,), "length"),), finished=True,
                           finished_on_prefill_instance=True)
    assert ends_request(done_on_p, has_decode=True)
    asm = StreamAssembler(_spec(chat=True), has_decode=True)
    assert DONE not in asm.feed(first)
    rest = Generation(SID, outputs=(GenOutput(0, " b", (2,), "length"),), finished=True)
    out = asm.feed(rest)
    assert out.endswith(DONE)
    assert "role" not in _events(out)[0]["choices"][0]["delta"]


def test_answer_spec_reads_the_client_body() -> None:
    spec = answer_spec(True, {"model": "qwen", "stream": True,
                              "stream_options": {"include_usage": True}, "logprobs": True},
                       "abc", 5)
    assert (spec.answer_id, spec.model, spec.include_usage, spec.logprobs) == (
        "chatcmpl-abc", "qwen", True, True)
    spec = answer_spec(False, {"model": "qwen", "logprobs": 2}, "abc", 5)
    assert spec.answer_id == "cmpl-abc" and spec.logprobs and not spec.include_usage


@pytest.mark.parametrize("camel", [True, False])
def test_generation_from_the_protobuf_json_form(camel: bool) -> None:
    def k(snake: str) -> str:
        if not camel:
            return snake
        head, *rest = snake.split("_")
        return head + "".join(w.title() for w in rest)

    doc = {k("req_id"): "e-9", k("service_req_id"): SID,
           k("gen_status"): {k("status_code"): 0, k("status_msg"): ""},
           "outputs": [{"index": 1, "text": " hi", k("token_ids"): [5, 6],
                        k("finish_reason"): "stop",
                        "logprobs": [{k("log_prob_data"): {"token": " hi", k("token_id"): 5,
                                                            "logprob": -0.1}}]}],
           "usage": {k("num_prompt_tokens"): 4, k("num_generated_tokens"): 2,
                     k("num_total_tokens"): "6", k("num_cached_tokens"): 0},
           "finished": True, k("finished_on_prefill_instance"): False}
    gen = generation_from_dict(doc)
    assert gen.service_req_id == SID and gen.req_id == "e-9" and gen.finished
    assert gen.outputs[0] == GenOutput(1, " hi", (5, 6), "stop",
                                       (LogProbEntry(" hi", 5, -0.1, ()),))
    assert gen.usage == GenUsage(4, 2, 6, 0)
    assert gen.tokens == 2
    assert generation_from_dict({}) == Generation("")


def test_token_chunks_are_the_whole_objects_bytes():
    """A token chunk's fixed part is encoded once per answer; the bytes stay those of the
    whole chunk object through orjson (every spec shape, odd model names)."""
    import orjson

    from kvsvc.routing.answers import StreamAssembler, answer_spec
    for chat in (True, False):
        for include_usage in (True, False):
            for model in ("sim", 'q"u\\ote\u2028ü', ""):
                spec = answer_spec(chat, {"model": model, "stream_options": {
                    "include_usage": include_usage}}, "sid-1", 1700000000)
                asm = StreamAssembler(spec)
                choices = [{"index": 0, "text": "t\n\"é", "logprobs": None,
                            "finish_reason": None}]
                doc = {"id": spec.answer_id, "object": spec.chunk_object,
                       "created": spec.created, "model": spec.model, "choices": choices}
                if include_usage:
                    doc["usage"] = None
                assert asm._chunk(choices) == b"data: " + orjson.dumps(doc) + b"\n\n"
