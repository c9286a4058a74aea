"""A tokenizer directory for local clusters whose router must tokenize text (``kvsvc up
--xllm native``: an xLLM engine takes token ids only, §13): one token per UTF-8 byte (a
byte-level BPE of 256 symbols, no merges, built with ``tokenizers``, no download) and a ChatML
chat template, written as ``tokenizer.json`` and ``tokenizer_config.json`` for
``--tokenizer_path``."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

#: ChatML, the simulated engine's own chat rendering (:func:`kvsvc.testbed.sim.serving.chatml`).
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_tokenizer() -> Tokenizer:
    """One token per UTF-8 byte (ids 0-255 in the byte-level alphabet's order)."""
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def write_tokenizer_dir(directory: Path) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (ChatML) into ``directory``
    (created); returns it.

    :raises OSError: the directory cannot be written.
    """
    directory.mkdir(parents=True, exist_ok=True)
    byte_tokenizer().save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHATML}, indent=2), encoding="utf-8")
    return directory
