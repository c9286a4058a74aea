"""The testbed's shared tokenizer (kvsvc.testbed.tokenizer): built in code, deterministic, any
text encodes (byte-level: decoding gives the text back), ChatML rendered by the router's own
template code."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from kvsvc.routing.prompt import PromptTokenizer
from kvsvc.testbed.tokenizer import SPECIAL_TOKENS, build_tokenizer, write_tokenizer

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
def test_any_text_encodes_and_decodes_back(text):
    ids = TOK.encode(text, add_special_tokens=False).ids
    assert TOK.decode(ids) == text
    assert TOK.token_to_id("[UNK]") is None
