"""The testbed's own tokenizer (issue 20 item 5): one ``tokenizer.json`` (and a
``tokenizer_config.json`` with a ChatML chat template) that ``kvsvc up`` writes once and hands
to its simulated engines (``kvsvc sim --tokenizer-path``) and to the router
(``--tokenizer_path``), so text from the OpenAI SDK, aiperf or guidellm tokenizes to the same
ids on both sides and is routed on its cache hits.

It is built in code with the ``tokenizers`` library, nothing downloaded: a byte-level BPE (the
GPT-2 / Qwen2 family's structure: the GPT-2 split regex, bytes mapped to printable characters,
so any UTF-8 text encodes with no unknown token) trained on a fixed word list generated here
(:func:`training_corpus`), plus ChatML's special tokens ``<|im_start|>``, ``<|im_end|>`` and
``<|endoftext|>``. Training is deterministic: the same code writes the same file.

:func:`build_tokenizer` returns the ``tokenizers.Tokenizer``; :func:`write_tokenizer` writes the
directory ``--tokenizer_path`` takes (a :class:`~kvsvc.routing.prompt.PromptTokenizer` loads
it).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any, Iterator

#: Vocabulary size of the BPE (the 256 byte symbols included).
VOCAB_SIZE = 4096
#: The special tokens, in id order after the trained vocabulary's start.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
#: ChatML, as Qwen2's template renders it (no default system prompt).
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                 "{{ message['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "an", "el", "is", "or", "un",
              "be", "da", "fe", "go", "hi", "ja", "pu", "th", "er", "in", "on", "at", "es",
              "re", "st", "ng", "ch")
_WORDS = ("the", "of", "and", "to", "in", "is", "you", "that", "it", "he", "was", "for", "on",
          "are", "as", "with", "his", "they", "at", "be", "this", "have", "from", "or", "one",
          "had", "by", "word", "but", "not", "what", "all", "were", "we", "when", "your", "can",
          "said", "there", "use", "an", "each", "which", "she", "do", "how", "their", "if",
          "will", "up", "other", "about", "out", "many", "then", "them", "these", "so", "some",
          "her", "would", "make", "like", "him", "into", "time", "has", "look", "two", "more",
          "write", "go", "see", "number", "no", "way", "could", "people", "my", "than",
          "first", "water", "been", "call", "who", "oil", "its", "now", "find", "long", "down",
          "day", "did", "get", "come", "made", "may", "part", "user", "assistant", "system",
          "cache", "token", "model", "prompt", "request", "answer", "question", "hello")


def training_corpus() -> Iterator[str]:
    """The fixed training text: common English words and two-syllable made-up words, each in a
    few sentence shapes (capitalized, after a space, with punctuation and digits)."""
    made_up = ["".join(p) for p in itertools.product(_SYLLABLES, repeat=2)]
    for i, word in enumerate(itertools.chain(_WORDS * 4, made_up)):
        yield f"{word.capitalize()} {word}, the {word}. {word}: {i % 100} {word}!\n"


def build_tokenizer() -> Any:
    """The testbed's tokenizer (a ``tokenizers.Tokenizer``), trained here (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    return tok


def write_tokenizer(directory: Path) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (ChatML template, ``eos_token``
    ``<|im_end|>``) into ``directory`` (created); returns it, the ``--tokenizer_path`` value.

    :raises OSError: the directory cannot be written.
    """
    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        # tokenizer_class: what transformers' AutoTokenizer (aiperf, guidellm) needs to load
        # a local directory without a model config.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "model_max_length": 131072}, indent=2),
        encoding="utf-8")
    return directory


def write_tokenizer_dir(directory: Path) -> Path:
    """:func:`write_tokenizer` under the name ``kvsvc up --xllm native`` first used (that
    router tokenizes text for engines that take token ids only, §13)."""
    return write_tokenizer(directory)


def single_token_words(tokenizer: Any) -> list[str]:
    """Words that the byte-level BPE encodes as one token each, whatever precedes them: every
    vocabulary entry ``Ġ<ASCII letters>`` (a space then letters: one pre-token), as text
    (`` word``), sorted. Text made of them tokenizes to exactly one id per word."""
    words = [tok[1:] for tok in tokenizer.get_vocab()
             if tok.startswith("Ġ") and len(tok) > 1 and tok[1:].isascii() and tok[1:].isalpha()]
    return sorted(" " + w for w in words)


def text_of_tokens(token_ids: Any, words: list[str]) -> str:
    """A text whose shared-tokenizer encoding has one token per id of ``token_ids`` and the
    same prefix structure (id ``t`` becomes ``words[t % len(words)]``): a trace's token ids
    as a text prompt (``kvsvc bench-routing --prompts text``)."""
    n = len(words)
    return "".join(words[t % n] for t in token_ids)
