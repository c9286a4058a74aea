"""The testbed's shared tokenizer (kvsvc.testbed.tokenizer): built in code, deterministic, any
text encodes (byte-level: decoding gives the text back), ChatML rendered by the router's own
template code."""

from __future__ import annotations

from hypothesis import example, given, settings, strategies as st

from kvsvc.routing.prompt import PromptTokenizer
from kvsvc.testbed.tokenizer import (
    SPECIAL_TOKENS,
    build_tokenizer,
    single_token_words,
    text_of_tokens,
    write_tokenizer,
)

TOK = build_tokenizer()


def test_written_once_the_same_and_loaded_by_the_router(tmp_path):
    a = write_tokenizer(tmp_path / "a")
    b = write_tokenizer(tmp_path / "b")
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    tok = PromptTokenizer.load(str(a))
    assert tok.has_chat_template
    text = tok.render_chat([{"role": "user", "content": "hello"}])
    assert text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode_chat([{"role": "user", "content": "hello"}])
    start, end = (TOK.token_to_id(t) for t in SPECIAL_TOKENS[1:])
    assert ids[0] == start and ids.count(end) == 1
    assert len(tok.encode_text(" the model and the cache")) == 5  # trained words: one each


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
@example("<|endoftext|>")
@example("a<|im_start|>b")
def test_any_text_encodes_and_decodes_back(text):
    # Text may hold the template's added tokens (hypothesis found "<|endoftext|>"): they
    # encode to their own id and decode back only when special tokens are kept.
    ids = TOK.encode(text, add_special_tokens=False).ids
    assert TOK.decode(ids, skip_special_tokens=False) == text
    assert TOK.token_to_id("[UNK]") is None


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**31 - 1), max_size=300))
def test_token_ids_as_text_keep_one_token_per_id(ids):
    """bench-routing --prompts text: a trace's ids as words, one token each, so the text
    prompt has the token-id prompt's length and prefix structure."""
    words = single_token_words(TOK)
    assert len(words) > 500 and len(set(words)) == len(words)
    encoded = TOK.encode(text_of_tokens(ids, words), add_special_tokens=False).ids
    assert [TOK.id_to_token(i) for i in encoded] == [
        "Ġ" + words[t % len(words)][1:] for t in ids]
