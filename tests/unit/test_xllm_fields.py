"""The OpenAI fields native dispatch hands to xLLM engines (§13 "Dispatch", issue 19 items 3
and 4): every field xLLM's ``ChatRequest`` / ``CompletionRequest`` has is sent under its xLLM
form (and survives the protobuf message kvsvc sends), a field without one is a 400 whose
``param`` names it before anything is sent, and an engine's refusal carries the engine's
``param`` or the field it names. No sockets."""

from __future__ import annotations

import json

import pytest
from google.protobuf import json_format

from kvsvc.errors import BadRequest
from kvsvc.routing.answers import (
    StreamAssembler,
    WholeAssembler,
    answer_spec,
    engine_param,
)
from kvsvc.routing.answers import Generation
from kvsvc.routing.xllm_dispatch import check_xllm_fields, chat_request, completion_request
from kvsvc.rpc import messages
from tests.unit.test_xllm_dispatch import P1, TOKENS, Engine, Registry, decision, dispatcher, inst

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def proto_dict(msg: dict, chat: bool) -> dict:
    """The message as the engine gets it: through xLLM's protobuf message (unknown fields
    would be dropped here), back to JSON."""
    pb = json_format.ParseDict(msg, messages.ChatRequest() if chat
                               else messages.CompletionRequest(), ignore_unknown_fields=True)
    return json_format.MessageToDict(pb, preserving_proto_field_name=True)


def test_every_openai_field_xllm_has_reaches_the_engine() -> None:
    doc = {**CHAT, "n": 3, "stop": "END", "logprobs": True, "top_logprobs": 2,
           "presence_penalty": 0.5, "frequency_penalty": -0.25, "max_completion_tokens": 7,
           "max_tokens": 99, "stream": True, "stream_options": {"include_usage": True},
           "user": "u-1", "temperature": 0.0, "top_p": 0.9, "top_k": 4,
           "repetition_penalty": 1.1, "ignore_eos": True, "stop_token_ids": [7],
           "response_format": {"type": "text"}, "seed": None, "metadata": {"a": "b"}}
    check_xllm_fields(doc, chat=True)
    got = proto_dict(chat_request(doc, [1, 2], "sid", P1), chat=True)
    assert got["n"] == 3 and got["stop"] == ["END"] and got["logprobs"] is True
    assert got["top_logprobs"] == 2 and got["presence_penalty"] == 0.5
    assert got["frequency_penalty"] == -0.25 and got["max_tokens"] == 7
    assert got["stream_options"] == {"include_usage": True} and got["user"] == "u-1"
    assert got["top_k"] == "4" and got["ignore_eos"] is True and got["stop_token_ids"] == [7]
    assert got["response_format"] == {"type": "text"} and got["temperature"] == 0.0
    assert "metadata" not in got and "seed" not in got
    comp = {"model": "m", "prompt": [5, 6], "n": 2, "stop": ["a", "b"], "logprobs": 3,
            "echo": True, "best_of": 2, "max_tokens": 4, "user": "u"}
    check_xllm_fields(comp, chat=False)
    got = proto_dict(completion_request(comp, [5, 6], "sid", P1), chat=False)
    assert (got["n"], got["stop"], got["logprobs"], got["echo"], got["best_of"],
            got["max_tokens"], got["user"]) == (2, ["a", "b"], 3, True, 2, 4, "u")


@pytest.mark.parametrize("chat, extra, param", [
    (True, {"seed": 42}, "seed"),
    (False, {"seed": 0}, "seed"),
    (True, {"logit_bias": {"5": 1.0}}, "logit_bias"),
    (False, {"suffix": "x"}, "suffix"),
    (True, {"echo": True}, "echo"),                      # completions-only in xLLM
    (False, {"top_logprobs": 2}, "top_logprobs"),        # chat-only in xLLM
    (False, {"response_format": {"type": "json_object"}}, "response_format"),
    (True, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    (True, {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    (True, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "u"}}]}]},
     "messages[0].content[1].type"),
    (True, {"service_request_id": "mine"}, "service_request_id"),
    (True, {"guided_json": {"type": "object"}}, "guided_json"),
])
def test_a_field_without_an_xllm_form_is_a_400_naming_it(chat, extra, param) -> None:
    doc = {**(CHAT if chat else {"model": "m", "prompt": [1]}), **extra}
    with pytest.raises(BadRequest) as err:
        check_xllm_fields(doc, chat)
    assert err.value.param == param
    assert err.value.message.startswith(f"{param}: ")
    if param in ("seed", "logit_bias", "suffix", "guided_json"):
        assert "xLLM engines have no such option" in err.value.message


def test_the_dispatcher_refuses_before_sending_anything() -> None:
    reg = Registry(inst(P1))
    disp, engine, rec, in_flight = dispatcher(lambda p: Engine(p), reg)
    with pytest.raises(BadRequest) as err:
        disp.forward(decision(inst(P1)), "/v1/chat/completions", {**CHAT, "seed": 1}, TOKENS)
    assert err.value.param == "seed"
    assert engine.calls == [] and rec.calls == [] and in_flight.snapshot().total(P1) == 0


def test_engine_param_is_the_engines_own_or_the_field_it_names() -> None:
    fields = ("model", "max_tokens", "max_completion_tokens", "n")
    assert engine_param('{"error": {"message": "bad", "param": "top_k"}}', fields) == "top_k"
    assert engine_param('{"param": "n", "message": "x"}', fields) == "n"
    assert engine_param("max_completion_tokens exceeds the context", fields) == \
        "max_completion_tokens"
    assert engine_param("invalid max_tokens: 0", fields) == "max_tokens"
    assert engine_param("no KV blocks left", fields) is None
    assert engine_param("{not json", fields) is None
    assert engine_param("maximum n_tokens", ("n",)) is None   # a word, not a substring


def test_an_engine_error_status_carries_the_field_it_names() -> None:
    """gen_status INVALID_ARGUMENT (3): the answer's ``param`` is the request's field that the
    engine's message names, streamed and not."""
    doc = {"model": "m", "prompt": [1], "max_tokens": 5, "stream": True}
    gen = Generation("sid", status_code=3, status_msg="max_tokens is larger than the model's "
                                                      "context")
    stream = StreamAssembler(answer_spec(False, doc, "sid", 1))
    event = json.loads(stream.feed(gen)[len(b"data: "):])
    assert event["error"]["param"] == "max_tokens"
    assert event["error"]["type"] == "invalid_request_error"
    reg = Registry(inst(P1))
    disp, _, _, _ = dispatcher(lambda q: Engine(q, script=lambda sid: [
        Generation(sid, status_code=3, status_msg="n must be 1 for beam search")]), reg)
    reply = disp.forward(decision(inst(P1)), "/v1/completions",
                         {"model": "m", "prompt": TOKENS, "n": 2}, TOKENS)
    assert reply.status == 400
    assert json.loads(reply.body.read_all())["error"]["param"] == "n"
    whole = WholeAssembler(answer_spec(True, CHAT, "sid", 1))
    assert whole.feed(Generation("sid", status_code=3, status_msg="oops")) is True


def test_a_protobuf_parse_failure_names_the_field() -> None:
    from kvsvc.rpc.engines import BaiduStdCaller

    caller = BaiduStdCaller()
    try:
        with pytest.raises(BadRequest) as err:   # refused before any connection is made
            caller.call("127.0.0.1:1", "Completions", {"model": "m", "max_tokens": -1})
    finally:
        caller.close()
    assert err.value.param == "max_tokens"
    assert "a field has no xLLM form" not in err.value.message
