"""The segment token cache (kvsvc.routing.token_cache): exact against tokenizing the whole text
(hypothesis, on the testbed's byte-level BPE, a Qwen2-style Split+ByteLevel BPE with NFC, a
word-level tokenizer with a BOS post-processor), reuse across a growing conversation, the
structure check, the verification that turns a wrong cut off, and the bound."""

from __future__ import annotations

import logging

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

from kvsvc.routing.token_cache import CHUNK_CHARS, SegmentTokenCache, cut_rules
from kvsvc.testbed.tokenizer import build_tokenizer, training_corpus
from tests.support.tokenizer import build_tokenizer as build_word_level

#: Qwen2's split regex (its tokenizer.json), before a ByteLevel without a regex of its own.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
               r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]


def qwen2_like() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    return tok


TOKENIZERS = {"testbed-bpe": build_tokenizer(), "qwen2-like": qwen2_like()}

#: Text made of what matters at cut points: ASCII letters and spaces (the plain-text cut),
#: added tokens (the other cut), and what could confuse either: punctuation, digits,
#: newlines, runs of spaces, apostrophes, non-ASCII letters and a combining accent.
PIECES = st.one_of(
    st.text(alphabet="abcdefghij ABC", min_size=1, max_size=40),
    st.sampled_from([" ", "  ", "\n", "\n\n", "'s", "'ll", ", ", ". ", "42", " 7", "é", "e\u0301",
                     "日本", "\t", "!?", "user\n", "assistant\n", *SPECIALS]),
)
TEXTS = st.lists(PIECES, max_size=60).map("".join)


def whole(tok: Tokenizer, text: str, special: bool) -> list[int]:
    return tok.encode(text, add_special_tokens=special).ids


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=TEXTS, special=st.booleans())
def test_segmented_encoding_is_the_whole_texts(name, text, special):
    tok = TOKENIZERS[name]
    cache = SegmentTokenCache(tok, 100_000, chunk_chars=8)  # many plain-text cuts
    assert cache.enabled
    assert "".join(cache.segments(text)) == text
    assert cache.encode(text, special) == whole(tok, text, special)
    # Again, now from cached segments, and with text appended (the next turn).
    assert cache.encode(text, special) == whole(tok, text, special)
    more = text + " and then some more words<|im_end|>\n"
    assert cache.encode(more, special) == whole(tok, more, special)
    assert cache.enabled  # no verification failed


@settings(max_examples=100, deadline=None)
@given(text=st.lists(st.sampled_from(["hello", "world", "how", "are", "you", "mars", " ",
                                      "  ", "<|user|>", "<|assistant|>"]), max_size=40).map("".join))
def test_word_level_with_a_bos_post_processor(text):
    tok = build_word_level()
    cache = SegmentTokenCache(tok, 10_000)
    for special in (True, False):
        assert cache.encode(text, special) == whole(tok, text, special)


def test_a_growing_conversation_reuses_its_earlier_turns():
    tok = TOKENIZERS["testbed-bpe"]
    cache = SegmentTokenCache(tok, 1_000_000)
    turns = ""
    for i in range(6):
        turns += (f"<|im_start|>user\nquestion {i}: " + "tell me about the cache " * 60
                  + "<|im_end|>\n<|im_start|>assistant\n" + "the answer is long " * 40
                  + "<|im_end|>\n")
        prompt = turns + "<|im_start|>assistant\n"
        assert cache.encode(prompt, False) == whole(tok, prompt, False)
    stats = cache.stats()
    assert stats.segment_hits > stats.segment_misses
    assert stats.tokens_reused > 0.6 * len(whole(tok, prompt, False)) * 5 / 6 * 0.5


def test_structure_check():
    assert cut_rules(TOKENIZERS["testbed-bpe"]) == (True, True, "")
    assert cut_rules(TOKENIZERS["qwen2-like"]) == (True, True, "")
    meta = Tokenizer(models.WordLevel({"[UNK]": 0, "▁a": 1}, unk_token="[UNK]"))
    meta.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    after, inside, why = cut_rules(meta)
    assert (after, inside) == (False, False) and "first" in why
    cache = SegmentTokenCache(meta, 1000)
    assert not cache.enabled and cache.encode("a a", False) == whole(meta, "a a", False)
    odd = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    odd.normalizer = normalizers.Replace(" ", "_")
    odd.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    assert cut_rules(odd)[:2] == (True, False)


def test_a_wrong_cut_is_caught_by_verification_and_turns_the_cache_off(caplog):
    """A tokenizer whose plain-text cuts are not compositional, the cut forced on: the first
    verified encoding differs, the whole text's ids are returned, the cache turns off."""
    tok = Tokenizer.from_str(TOKENIZERS["testbed-bpe"].to_str())
    tok.normalizer = normalizers.Strip()  # " word" of a segment loses its space
    assert cut_rules(tok)[:2] == (True, False)
    cache = SegmentTokenCache(tok, 1000)
    cache._inside_text = True  # what the structure check refused
    text = ("a " * CHUNK_CHARS) + "b"
    with caplog.at_level(logging.WARNING, logger="kvsvc.routing.token_cache"):
        assert cache.encode(text, False) == whole(tok, text, False)
    assert not cache.enabled
    assert [r.getMessage() for r in caplog.records] == [
        "tokenizer cache off: a segmented encoding differed from the whole text's; texts "
        "are tokenized whole"]
    assert cache.encode(text, False) == whole(tok, text, False)


def test_bounded_by_token_ids_least_recently_used_first():
    tok = TOKENIZERS["testbed-bpe"]
    cache = SegmentTokenCache(tok, 200)
    for i in range(50):
        cache.encode(f"<|im_start|>user\nmessage number {i} here<|im_end|>", False)
        assert cache.stats().cached_tokens <= 200
    assert cache.stats().cached_tokens > 100
    with pytest.raises(ValueError):
        SegmentTokenCache(tok, 0)
