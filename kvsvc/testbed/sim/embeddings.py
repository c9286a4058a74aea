"""The simulated engine's ``POST /v1/embeddings``: deterministic vectors in OpenAI's shape, so
the router's embeddings relay (``kvsvc up``, the README's example) has something to relay.

Pure functions, no sockets: :meth:`~kvsvc.testbed.sim.serving.Serving.handle` parses the body
and calls :func:`embeddings_answer`.

- ``input``: a string, a list of strings, a list of token ids, or a list of lists of token ids
  (OpenAI's four forms); empty strings and empty lists are refused, as the OpenAI API does.
- Each input's vector is a function of its tokens only (xxhash64 of the token ids with the
  component's index as seed, mapped to [-1, 1], then scaled to unit length): the same input
  gives the same vector on every engine and every run; different inputs give different ones.
- ``dimensions`` (optional, 1-4096) sets the length; default :data:`DEFAULT_DIMENSIONS`.
- ``encoding_format`` ``"float"`` (default) only; ``"base64"`` is refused with 400.
- ``usage``: ``prompt_tokens`` = ``total_tokens`` = the tokens of every input (the engine's
  tokenizer for text, as for completions).
"""

from __future__ import annotations

import base64
import math
import struct
from typing import Any, Callable, Sequence

import xxhash

from kvsvc.errors import SimBadRequest

EMBEDDINGS_PATH = "/v1/embeddings"
#: Vector length when the request names no ``dimensions``.
DEFAULT_DIMENSIONS = 16
MAX_DIMENSIONS = 4096
_MAX_TOKEN_ID = 2**31 - 1


def _is_token_list(value: Any) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value))


def input_tokens(value: Any, encode: Callable[[str], list[int]]) -> list[list[int]]:
    """The token ids of each input of an ``input`` field (see the module docstring).

    :param value: the request's ``input``.
    :param encode: text -> token ids (the engine's tokenizer).
    :raises SimBadRequest: a missing, empty or mistyped ``input``, or a token id out of range.
    """
    if isinstance(value, str):
        items: list[Any] = [value]
    elif _is_token_list(value):
        items = [value]
    elif isinstance(value, list) and value:
        items = value
    else:
        raise SimBadRequest("'input' must be a non-empty string, list of strings, list of "
                            "token ids or list of lists of token ids")
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str) and item:
            out.append(encode(item))
        elif _is_token_list(item):
            if not all(0 <= t <= _MAX_TOKEN_ID for t in item):
                raise SimBadRequest(f"'input[{i}]': token ids must be in 0-{_MAX_TOKEN_ID}")
            out.append(list(item))
        else:
            raise SimBadRequest(f"'input[{i}]' must be a non-empty string or list of token ids")
    return out


def embed(tokens: Sequence[int], dimensions: int) -> list[float]:
    """The unit-length vector of ``tokens`` (deterministic, see the module docstring)."""
    data = struct.pack(f"<{len(tokens)}I", *tokens)
    raw = [xxhash.xxh64_intdigest(data, seed=i) / 2**63 - 1.0 for i in range(dimensions)]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [round(x / norm, 6) for x in raw]


def embeddings_answer(doc: Any, model: str, encode: Callable[[str], list[int]]) -> dict:
    """The OpenAI embeddings answer of one request body.

    :param doc: the parsed JSON body.
    :param model: the engine's model (the caller answers 404 for another one).
    :param encode: text -> token ids.
    :returns: ``{"object": "list", "data": [{"object": "embedding", "index", "embedding"}],
        "model", "usage": {"prompt_tokens", "total_tokens"}}``.
    :raises SimBadRequest: a body that is not an object, a bad ``input``, ``dimensions`` or
        ``encoding_format``.
    """
    if not isinstance(doc, dict):
        raise SimBadRequest("body must be a JSON object")
    dims = doc.get("dimensions", DEFAULT_DIMENSIONS)
    if (not isinstance(dims, int) or isinstance(dims, bool)
            or not 1 <= dims <= MAX_DIMENSIONS):
        raise SimBadRequest(f"'dimensions' must be an integer in 1-{MAX_DIMENSIONS}")
    encoding = doc.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise SimBadRequest("'encoding_format' must be \"float\" or \"base64\"")
    inputs = input_tokens(doc.get("input"), encode)
    n = sum(len(t) for t in inputs)
    # base64: little-endian float32 bytes, what OpenAI's SDK asks for by default and decodes.
    form: Callable[[list[float]], Any] = (
        (lambda v: base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode("ascii"))
        if encoding == "base64" else (lambda v: v))
    return {"object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": form(embed(t, dims))}
                     for i, t in enumerate(inputs)],
            "model": model, "usage": {"prompt_tokens": n, "total_tokens": n}}
