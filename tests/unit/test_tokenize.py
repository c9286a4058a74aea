"""Prompt tokenization for CAR: a small word-level tokenizer built here, HF-style chat
templates rendered with jinja2, and the exact token ids both give."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from kvsvc.errors import ConfigError
from kvsvc.routing.prompt import ChatPrompt, CompletionPrompt, PromptTokenizer, TokenSource
from tests.support.tokenizer import build_tokenizer

TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
            "{% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
            "<|{{ m['role'] }}|> {{ m['content'] }}\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
CHAT = [{"role": "system", "content": "hello"}, {"role": "user", "content": "how are you"}]


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    build_tokenizer().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": TEMPLATE, "bos_token": {"content": "<s>", "lstrip": False},
        "eos_token": "</s>"}))
    return tmp_path


def test_completion_text_gets_special_tokens(model_dir):
    tok = PromptTokenizer.load(str(model_dir))
    assert tok.has_chat_template
    assert tok.encode_text("hello world") == [1, 6, 7]
    assert tok.encode_text("hello mars") == [1, 6, 0]


def test_chat_rendered_like_hf_and_encoded_without_added_specials(model_dir):
    tok = PromptTokenizer.load(str(model_dir))
    text = tok.render_chat(CHAT)
    assert text == "<s><|system|> hello\n<|user|> how are you\n<|assistant|>"
    assert tok.encode_chat(CHAT) == [1, 5, 6, 3, 8, 9, 10, 4]
    assert tok.encode_chat(CHAT, add_generation_prompt=False) == [1, 5, 6, 3, 8, 9, 10]


def test_template_list_default_jinja_file_precedence_and_hf_helpers(tmp_path):
    build_tokenizer().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "nope"},
        {"name": "default", "template": "{{ messages[0]['content'] | tojson }}"}]}))
    tok = PromptTokenizer.load(str(tmp_path))
    # HF's tojson does not HTML-escape (jinja's own would give \\u003c).
    assert tok.render_chat([{"role": "user", "content": {"a": "<b>"}}]) == '{"a": "<b>"}'
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}"
        "{% if loop.index == 1 %}{% break %}{% endif %}{% endfor %}{{ greeting }}")
    tok = PromptTokenizer.load(str(tmp_path))
    assert tok.render_chat(CHAT, extra={"greeting": " world"}) == "hello world"
    assert tok.encode_chat(CHAT, extra={"greeting": " world"}) == [6, 7]


def test_tokenizer_file_alone_has_no_chat_template(model_dir):
    tok = PromptTokenizer.load(str(model_dir / "tokenizer.json"))
    assert not tok.has_chat_template
    assert tok.encode_text("how are you") == [1, 8, 9, 10]


@pytest.mark.parametrize("setup, message", [
    (lambda d: None, "not found"),
    (lambda d: (d / "tokenizer.json").write_text("{}"), "cannot load tokenizer"),
    (lambda d: (build_tokenizer().save(str(d / "tokenizer.json")),
                (d / "tokenizer_config.json").write_text("{nope")), "cannot read JSON"),
    (lambda d: (build_tokenizer().save(str(d / "tokenizer.json")),
                (d / "tokenizer_config.json").write_text(
                    json.dumps({"chat_template": "{% for %}"}))), "does not compile"),
    (lambda d: (build_tokenizer().save(str(d / "tokenizer.json")),
                (d / "tokenizer_config.json").write_text(
                    json.dumps({"chat_template": [{"name": "x", "template": "y"}]}))),
     "no 'default' template"),
])
def test_bad_tokenizer_path_is_a_config_error(tmp_path, setup, message):
    setup(tmp_path)
    with pytest.raises(ConfigError) as err:
        PromptTokenizer.load(str(tmp_path))
    assert err.value.field == "--tokenizer_path"
    assert message in err.value.message


def test_token_source_uses_ids_as_is_and_tokenizes_text(model_dir):
    source = TokenSource(PromptTokenizer.load(str(model_dir)))
    assert source.completion_tokens(CompletionPrompt(token_ids=[9, 8, 7])) == [9, 8, 7]
    assert source.completion_tokens(CompletionPrompt(text="hello")) == [1, 6]
    assert source.completion_tokens(CompletionPrompt()) is None  # a batch: no single prompt
    assert source.chat_tokens(ChatPrompt(CHAT)) == [1, 5, 6, 3, 8, 9, 10, 4]


def test_without_tokenizer_text_routes_blind_with_one_warning(caplog):
    source = TokenSource(None)
    with caplog.at_level(logging.WARNING, logger="kvsvc.routing.prompt"):
        assert source.completion_tokens(CompletionPrompt(text="hello")) is None
        assert source.chat_tokens(ChatPrompt(CHAT)) is None
        assert source.completion_tokens(CompletionPrompt(text="hello")) is None
        assert source.completion_tokens(CompletionPrompt(token_ids=[1, 2])) == [1, 2]
    assert [r.getMessage() for r in caplog.records] == [
        "no --tokenizer_path: text prompts route with hit ratio 0 (warned once)"]


def test_template_failure_and_missing_template_give_none_warned_once(model_dir, caplog):
    source = TokenSource(PromptTokenizer.load(str(model_dir)))
    bad = ChatPrompt([{"role": "tool", "content": "x"}])
    no_template = TokenSource(PromptTokenizer.load(str(model_dir / "tokenizer.json")))
    with caplog.at_level(logging.WARNING, logger="kvsvc.routing.prompt"):
        assert source.chat_tokens(bad) is None
        assert source.chat_tokens(bad) is None
        assert no_template.chat_tokens(ChatPrompt(CHAT)) is None
        assert no_template.chat_tokens(ChatPrompt(CHAT)) is None
    assert [r.getMessage() for r in caplog.records] == [
        "chat template failed (no tools here): such requests route with hit ratio 0 "
        "(warned once)",
        "the tokenizer has no chat template: chat requests route with hit ratio 0 (warned once)"]
