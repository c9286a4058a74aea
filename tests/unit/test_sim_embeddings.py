"""The simulated engine's embeddings (kvsvc.testbed.sim.embeddings): OpenAI's four input
forms, deterministic unit vectors, usage, and 400s naming the field."""

from __future__ import annotations

import math

import pytest

from kvsvc.errors import SimBadRequest
from kvsvc.testbed.sim.embeddings import DEFAULT_DIMENSIONS, embed, embeddings_answer
from kvsvc.testbed.sim.serving import byte_tokens


def test_every_input_form_gets_a_unit_vector_in_openais_shape():
    for value, n_inputs, tokens in (("hi", 1, 2), (["hi", "there"], 2, 7), ([1, 2, 3], 1, 3),
                                    ([[1, 2], [3]], 2, 3)):
        doc = embeddings_answer({"model": "sim", "input": value}, "sim", byte_tokens)
        assert doc["object"] == "list" and doc["model"] == "sim"
        assert [d["index"] for d in doc["data"]] == list(range(n_inputs))
        assert all(d["object"] == "embedding" for d in doc["data"])
        for d in doc["data"]:
            assert len(d["embedding"]) == DEFAULT_DIMENSIONS
            assert math.isclose(math.sqrt(sum(x * x for x in d["embedding"])), 1.0,
                                abs_tol=1e-5)
        assert doc["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_vectors_depend_on_the_tokens_only():
    a = embeddings_answer({"input": "hello"}, "sim", byte_tokens)["data"][0]["embedding"]
    assert a == embed(byte_tokens("hello"), DEFAULT_DIMENSIONS)
    assert a == embeddings_answer({"input": byte_tokens("hello")}, "sim",
                                  byte_tokens)["data"][0]["embedding"]
    assert a != embeddings_answer({"input": "hellp"}, "sim", byte_tokens)["data"][0]["embedding"]
    assert len(embeddings_answer({"input": "x", "dimensions": 3}, "sim",
                                 byte_tokens)["data"][0]["embedding"]) == 3


def test_base64_is_the_float_vector_as_little_endian_float32():
    """The openai SDK asks for ``encoding_format`` ``base64`` by default and decodes it so."""
    import base64
    import struct
    plain = embeddings_answer({"input": "hello", "dimensions": 8}, "sim",
                              byte_tokens)["data"][0]["embedding"]
    packed = embeddings_answer({"input": "hello", "dimensions": 8, "encoding_format": "base64"},
                               "sim", byte_tokens)["data"][0]["embedding"]
    got = struct.unpack("<8f", base64.b64decode(packed))
    assert got == pytest.approx(plain, rel=1e-6)


@pytest.mark.parametrize("doc, words", [
    ([], "JSON object"), ({}, "'input'"), ({"input": ""}, "'input[0]'"), ({"input": []}, "'input'"),
    ({"input": ["a", ""]}, "'input[1]'"), ({"input": [[1], [-1]]}, "'input[1]'"),
    ({"input": [True]}, "'input[0]'"), ({"input": "a", "dimensions": 0}, "'dimensions'"),
    ({"input": "a", "dimensions": True}, "'dimensions'"),
    ({"input": "a", "encoding_format": "int8"}, "'encoding_format'")])
def test_bad_bodies_are_refused_naming_the_field(doc, words):
    with pytest.raises(SimBadRequest) as info:
        embeddings_answer(doc, "sim", byte_tokens)
    assert words in str(info.value)
