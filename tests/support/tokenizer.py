"""A small real ``tokenizers`` tokenizer (word-level, a fixed vocabulary and chat markers) built in
memory, for the tokenization tests; no download."""

from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers, processors

VOCAB = {"[UNK]": 0, "<s>": 1, "</s>": 2, "<|user|>": 3, "<|assistant|>": 4, "<|system|>": 5,
         "hello": 6, "world": 7, "how": 8, "are": 9, "you": 10, '{"a":': 11, '"<b>"}': 12}


def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok
