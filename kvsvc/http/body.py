"""Request bodies: reading them, and checking their shape before anything else sees them
(§9, §10, §11). Every refusal is a :class:`~kvsvc.errors.BadRequest` whose message names the
field (or :class:`~kvsvc.errors.PayloadTooLarge`, :class:`~kvsvc.errors.UnknownModel`).

- Reading: :func:`read_body` (any endpoint; chunked bodies bounded here) and
  :func:`read_query_body` (the query endpoint's one ``wsgi.input.read``).
- Token ids (§4, §10): :func:`token_ids_problem` is the one rule (every element an ``int``, never
  a ``bool``, in ``[0, MAX_TOKEN_ID]``) and its error texts; :func:`parse_token_ids` /
  :func:`parse_query_tokens` read ``{"token_ids": [...]}`` bodies through a packing fast path
  that falls back to the rule for the message; :func:`is_token_list` is the rule for a prompt.
- Heartbeats (§9): :func:`parse_heartbeat` checks the body's shape only (JSON types); the load
  ranges are the registry's (:meth:`kvsvc.cluster.registry.Registry.heartbeat` raises
  :class:`~kvsvc.errors.InvalidHeartbeat`).
- OpenAI bodies (§11): :func:`json_object`, :func:`parse_completion_prompt`,
  :func:`parse_chat_prompt` (messages, :func:`_check_message`),
  :func:`check_generation_fields` (sampling fields' types and ranges),
  :func:`check_model_and_stream`.
"""

from __future__ import annotations

import json
import math
from array import array
from dataclasses import dataclass
from typing import Any, Optional, Sequence, TypeGuard, Union

import orjson
from flask import request
from gunicorn.http.errors import ParseException as GunicornParseError
from werkzeug.exceptions import RequestEntityTooLarge
from werkzeug.wsgi import get_content_length

from kvsvc.cluster.model import MAX_WAITING_REQUESTS
from kvsvc.errors import BadRequest, PayloadTooLarge, UnknownModel
from kvsvc.index.keys import ARRAY_IS_WIRE_FORM, MAX_TOKEN_ID, pack_tokens
from kvsvc.routing.prompt import ChatPrompt, CompletionPrompt

#: Error texts of the token-id rule (:func:`token_ids_problem`).
NOT_INTEGERS = "token_ids: every element must be an integer"
OUT_OF_RANGE = f"token_ids: every element must be in [0, {MAX_TOKEN_ID}]"

#: Bytes of JSON one token id can take in a body: ``2147483647`` plus ``", "``.
_BYTES_PER_TOKEN = 12
#: Room for the object around the list and for pretty-printing whitespace.
_BODY_SLACK_BYTES = 64 * 1024
#: Bytes per read of a chunked body.
_CHUNKED_READ_BYTES = 64 * 1024


def max_content_length(max_query_tokens: int) -> int:
    """Largest query body accepted, bytes: a body with ``max_query_tokens`` of the longest ids,
    comma-space separated, fits with room to spare; anything larger gets 413 before it is read.

    :param max_query_tokens: the ``max_query_tokens`` setting (§10).
    """
    return max_query_tokens * _BYTES_PER_TOKEN + _BODY_SLACK_BYTES


# -- reading ---------------------------------------------------------------------------------------

def read_body() -> bytes:
    """The current request's raw body.

    A chunked body (no ``Content-Length``) is read here up to the size limit plus one byte:
    werkzeug's own limit on such a body stops reading at the limit and returns what it has,
    which could turn an oversized body into a shorter, different, valid one.

    :raises BadRequest: the server cannot read it (gunicorn's ``InvalidChunkSize`` and other
        ``ParseException`` errors for bad chunked framing, ``NoMoreData`` when the client stops
        sending): bad input, not a server fault.
    :raises PayloadTooLarge: a chunked body over the limit.
    :raises RequestEntityTooLarge: werkzeug's, a ``Content-Length`` over the limit.
    """
    environ = request.environ
    limit = request.max_content_length
    try:
        if (limit is not None and get_content_length(environ) is None
                and environ.get("wsgi.input_terminated")):
            stream = environ["wsgi.input"]
            chunks: list[bytes] = []
            total = 0
            while True:
                chunk = stream.read(min(_CHUNKED_READ_BYTES, limit + 1 - total))
                if not chunk:
                    return b"".join(chunks)
                total += len(chunk)
                if total > limit:
                    raise PayloadTooLarge(RequestEntityTooLarge.description)
                chunks.append(chunk)
        return request.get_data(cache=False)
    except (OSError, GunicornParseError) as exc:
        raise BadRequest(f"request body could not be read: {type(exc).__name__}") from exc


def read_query_body() -> bytes:
    """The current request's raw body (the query endpoint's and the proxied OpenAI
    endpoints'), read straight from ``wsgi.input``.

    A body of known ``Content-Length`` within ``MAX_CONTENT_LENGTH`` is read with one
    ``read(length)`` call (what WSGI promises to support), skipping werkzeug's limited-stream
    wrapper (64 KiB ``bytearray`` per read, three copies of the body). A chunked body or one
    over the limit takes :func:`read_body`, whose checks answer 413.

    :raises BadRequest: the server cannot read the body (see :func:`read_body`).
    :raises RequestEntityTooLarge: ``Content-Length`` over the limit (413).
    """
    environ = request.environ
    length = get_content_length(environ)
    limit = request.max_content_length
    if length is None or (limit is not None and length > limit):
        return read_body()
    if length == 0:
        return b""
    try:
        data: bytes = environ["wsgi.input"].read(length)
        return data
    except (OSError, GunicornParseError) as exc:
        raise BadRequest(f"request body could not be read: {type(exc).__name__}") from exc


def json_object(body: bytes) -> dict[str, Any]:
    """``body`` parsed as a JSON object: ``orjson`` (Rust-backed), and the stdlib parser for
    what orjson refuses but the stdlib accepts (integers beyond 64 bits, ``NaN``, UTF-16), so
    the accepted language is the stdlib's.

    :raises BadRequest: not JSON (nesting too deep included), not an object, or a string
        holding a lone UTF-16 surrogate (``"\\ud800"``: the stdlib parses it, but it is no
        text a tokenizer can read or an upstream body can carry), naming where it is.
    """
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        try:
            doc = json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise BadRequest("body is not valid JSON") from exc
        # orjson refuses lone surrogates, so only a stdlib-parsed body can hold one.
        where = _lone_surrogate(doc, "")
        if where is not None:
            raise BadRequest(f"{where or 'body'}: a string holds a lone UTF-16 surrogate")
    if not isinstance(doc, dict):
        raise BadRequest("body must be a JSON object")
    return doc


def _lone_surrogate(value: Any, path: str) -> Optional[str]:
    """The path (``messages[0].content``) of the first string in ``value``, keys included,
    that is no valid Unicode text (a lone surrogate), or None."""
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return where
        elif isinstance(item, dict):
            for key, sub in reversed(list(item.items())):
                name = f"{where}.{key}" if where else str(key)
                stack.append((sub, name))
                stack.append((key, name))
        elif isinstance(item, list):
            stack.extend((sub, f"{where}[{i}]") for i, sub in reversed(list(enumerate(item))))
    return None


# -- token ids -------------------------------------------------------------------------------------

def token_ids_problem(token_ids: list[Any]) -> Optional[str]:
    """The token-id rule (§4, §10): every element an ``int`` (a ``bool`` is none, though Python
    makes it an int subclass) in ``[0, MAX_TOKEN_ID]``.

    :param token_ids: parsed JSON values; an empty list passes.
    :returns: ``None`` when every element passes, else :data:`NOT_INTEGERS` or
        :data:`OUT_OF_RANGE`.
    """
    if not token_ids:
        return None
    # type() is not isinstance(): bool is an int subclass but never a token id.
    if set(map(type, token_ids)) != {int}:
        return NOT_INTEGERS
    if min(token_ids) < 0 or max(token_ids) > MAX_TOKEN_ID:
        return OUT_OF_RANGE
    return None


def is_token_list(value: Any) -> bool:
    """True for a non-empty list that passes :func:`token_ids_problem` (a prompt of ids)."""
    return isinstance(value, list) and bool(value) and token_ids_problem(value) is None


def _token_list(body: bytes, max_tokens: int) -> list[Any]:
    """The ``token_ids`` list of a query body (§10), its elements not checked yet.

    ``orjson`` parses (Rust-backed; bodies it refuses but the stdlib accepts, such as integers
    beyond 64 bits or UTF-16, go to ``json.loads``, so the accepted language is unchanged).

    :raises BadRequest: not JSON, not an object, no ``token_ids`` list, too long.
    """
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        try:
            doc = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
            raise BadRequest("body is not valid JSON") from exc
        except RecursionError as exc:  # nesting deeper than the stdlib parser's stack
            raise BadRequest("body is nested too deeply") from exc
    if not isinstance(doc, dict):
        raise BadRequest("body must be a JSON object")
    if "token_ids" not in doc:
        raise BadRequest("token_ids: missing")
    token_ids = doc["token_ids"]
    if not isinstance(token_ids, list):
        raise BadRequest("token_ids: must be a list of integers")
    if len(token_ids) > max_tokens:
        raise BadRequest(f"token_ids: {len(token_ids)} tokens, more than "
                         f"max_query_tokens={max_tokens}")
    return token_ids


def _check_elements(body: bytes, token_ids: list[Any]) -> None:
    """:func:`token_ids_problem` of a body's list, raising (slow path: bad bodies and bodies that
    may hold a boolean).

    Where ``orjson`` produced a float, the stdlib's parse of ``body`` decides: orjson turns
    integers beyond 64 bits into floats, which would change the message. A body the stdlib
    parser cannot take (nested deeper than its stack) keeps orjson's list.

    :raises BadRequest: the rule's message.
    """
    if float in set(map(type, token_ids)):
        try:
            token_ids = json.loads(body)["token_ids"]
        except (ValueError, UnicodeDecodeError, RecursionError):
            pass
    problem = token_ids_problem(token_ids)
    if problem is not None:
        raise BadRequest(problem)


def _packed_token_ids(body: bytes, token_ids: list[Any]) -> bytes:
    """``token_ids`` (non-empty, from :func:`_token_list` of ``body``) packed as §4's 32-bit
    little-endian integers; packing checks type and range in C.

    Only a boolean packs although it is no token id (as 0/1), so a body containing ``true``
    or ``false`` somewhere gets the element checks. The words are searched for only when their
    rarest letters are there: a ``u`` / ``l`` byte is one ``memchr``, a word search is a
    substring scan, and a body of only numbers has neither letter.

    :raises BadRequest: an element that is not an int or not in ``[0, MAX_TOKEN_ID]``.
    """
    if (b"u" in body and b"true" in body) or (b"l" in body and b"false" in body):
        _check_elements(body, token_ids)  # a boolean may hide among them
    try:
        return pack_tokens(token_ids)
    except ValueError:
        _check_elements(body, token_ids)  # raises, naming the problem
        raise BadRequest(f"token_ids: every element must be an integer in [0, {MAX_TOKEN_ID}]"
                         ) from None


def parse_token_ids(body: bytes, max_tokens: int) -> list[int]:
    """Validate a ``{"token_ids": [int, ...]}`` body (§10) and return its token ids.

    ``orjson`` then one ``struct`` pack check type and range; the element rule
    (:func:`token_ids_problem`) runs only for bodies that fail or may hold a boolean.

    :param body: raw request body.
    :param max_tokens: most token ids accepted.
    :raises BadRequest: naming what is wrong.
    """
    token_ids = _token_list(body, max_tokens)
    if token_ids:
        _packed_token_ids(body, token_ids)
    return token_ids


def parse_query_tokens(body: bytes, max_tokens: int) -> Sequence[int]:
    """:func:`parse_token_ids` for the query endpoint: the same checks and errors, but the
    ids come back as an ``array("I")`` over the packed bytes, which
    :func:`~kvsvc.index.keys.pack_tokens` (inside ``Directory.query``) takes as is instead of
    packing them a second time.

    :returns: the token ids, an ``array("I")`` (a ``list`` on a big-endian host or where a C
        ``unsigned int`` is not 4 bytes: the array's buffer must be the §4 byte form).
    :raises BadRequest: naming what is wrong.
    """
    token_ids = _token_list(body, max_tokens)
    if not token_ids:
        return token_ids
    packed = _packed_token_ids(body, token_ids)
    if not ARRAY_IS_WIRE_FORM:
        return token_ids
    out = array("I")
    out.frombytes(packed)
    return out


# -- heartbeats ------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Heartbeat:
    """A heartbeat body of the right shape (§9); its load is not range-checked yet.

    :ivar name: instance ``host:port`` (non-empty).
    :ivar incarnation_id: the sender's incarnation, ``None`` when absent or empty.
    :ivar waiting_requests_num: queued requests as sent, a JSON number (the registry accepts
        only an int in ``[0, 2**31 - 1]``).
    :ivar gpu_cache_usage_perc: Device usage as sent, a JSON number (the registry accepts
        only [0, 1]).
    """

    name: str
    incarnation_id: Optional[str]
    waiting_requests_num: Union[int, float]
    gpu_cache_usage_perc: Union[int, float]


def _is_number(value: object) -> TypeGuard[Union[int, float]]:
    # A JSON number: int or float, never a bool (the stdlib parser also gives NaN/Infinity
    # floats, which the registry's range check refuses).
    return type(value) in (int, float)


def parse_heartbeat(body: bytes) -> Heartbeat:
    """Check a heartbeat body's shape (xllm-service's JSON, §9): a JSON object, ``name`` a
    non-empty string, ``incarnation_id`` a string or absent/null, ``load_metrics`` an object
    whose ``waiting_requests_num`` and ``gpu_cache_usage_perc`` are numbers, ``latency_metrics``
    an object or absent (accepted, not used yet). Unknown keys are ignored. Value ranges are
    the registry's to judge.

    :param body: raw request body.
    :raises BadRequest: naming the field of the wrong JSON type.
    """
    doc = json_object(body)
    name = doc.get("name")
    if not isinstance(name, str) or not name:
        raise BadRequest("name: must be a non-empty string")
    incarnation = doc.get("incarnation_id")
    if incarnation is not None and not isinstance(incarnation, str):
        raise BadRequest("incarnation_id: must be a string")
    load = doc.get("load_metrics")
    if not isinstance(load, dict):
        raise BadRequest("load_metrics: must be an object")
    waiting = load.get("waiting_requests_num")
    if not _is_number(waiting):
        raise BadRequest("load_metrics.waiting_requests_num: must be an integer in "
                         f"[0, {MAX_WAITING_REQUESTS}]")
    usage = load.get("gpu_cache_usage_perc")
    if not _is_number(usage):
        raise BadRequest("load_metrics.gpu_cache_usage_perc: must be a number in [0, 1]")
    latency = doc.get("latency_metrics")
    if latency is not None and not isinstance(latency, dict):
        raise BadRequest("latency_metrics: must be an object")
    return Heartbeat(name, incarnation or None, waiting, usage)


# -- OpenAI bodies ---------------------------------------------------------------------------------

def parse_completion_prompt(doc: dict[str, Any]) -> CompletionPrompt:
    """``prompt`` of a completion body: a string, a list of strings, a token-id list or a list
    of token-id lists (:func:`is_token_list`). A one-element batch is unwrapped; a larger batch
    routes with hit 0.

    :raises BadRequest: naming ``prompt``.
    """
    if "prompt" not in doc:
        raise BadRequest("prompt: missing")
    prompt = doc["prompt"]
    if isinstance(prompt, str):
        return CompletionPrompt(text=prompt)
    if isinstance(prompt, list) and prompt:
        if is_token_list(prompt):
            return CompletionPrompt(token_ids=prompt)
        if all(isinstance(p, str) for p in prompt):
            return CompletionPrompt(text=prompt[0]) if len(prompt) == 1 else CompletionPrompt()
        if all(is_token_list(p) for p in prompt):
            return (CompletionPrompt(token_ids=prompt[0]) if len(prompt) == 1
                    else CompletionPrompt())
    raise BadRequest("prompt: must be a string, a non-empty list of strings, a list of "
                     f"token ids in [0, {MAX_TOKEN_ID}] or a list of such lists")


#: Chat message roles of OpenAI's API (``developer`` is its newer ``system``; ``function``
#: its deprecated ``tool``).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def _check_message(i: int, message: Any) -> None:
    """One chat message: an object, ``role`` one of :data:`CHAT_ROLES`, ``content`` a string,
    a non-empty list of content parts (objects with a string ``type``; a ``text`` part with a
    string ``text``) or, for an assistant message (which may carry only ``tool_calls``), null
    or absent; ``name`` a string when present.

    :raises BadRequest: naming ``messages[i]``, ``messages[i].role``, ``messages[i].content``
        or ``messages[i].content[j].type`` / ``.text``.
    """
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise BadRequest(f"{where}: must be an object")
    role = message.get("role")
    if not isinstance(role, str):
        raise BadRequest(f"{where}.role: must be a string")
    if role not in CHAT_ROLES:
        raise BadRequest(f"{where}.role: must be one of {', '.join(CHAT_ROLES)}, got "
                         f"{role!r}"[:200])
    content = message.get("content")
    if isinstance(content, str):
        pass
    elif content is None:
        if role != "assistant":
            raise BadRequest(f"{where}.content: must be a string or a list of content parts "
                             f"(only an assistant message may have none)")
    elif isinstance(content, list) and content:
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise BadRequest(f"{where}.content[{j}].type: every content part must be an "
                                 "object with a string type")
            if part["type"] == "text" and not isinstance(part.get("text"), str):
                raise BadRequest(f"{where}.content[{j}].text: must be a string")
    else:
        raise BadRequest(f"{where}.content: must be a string or a non-empty list of content "
                         f"parts, got {type(content).__name__}")
    if "name" in message and not isinstance(message["name"], str):
        raise BadRequest(f"{where}.name: must be a string")


def parse_chat_prompt(doc: dict[str, Any]) -> ChatPrompt:
    """Template inputs of a chat body; every message checked (:func:`_check_message`).

    :raises BadRequest: naming the field (``messages``, ``messages[i].role``,
        ``messages[i].content[j].type``, ...).
    """
    messages = doc.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: must be a non-empty list of objects")
    for i, message in enumerate(messages):
        _check_message(i, message)
    add_gen = doc.get("add_generation_prompt", True)
    if not isinstance(add_gen, bool):
        raise BadRequest("add_generation_prompt: must be a boolean")
    tools = doc.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadRequest("tools: must be a list")
    kwargs = doc.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise BadRequest("chat_template_kwargs: must be an object")
    return ChatPrompt(messages, add_gen, tools, kwargs or {})


def _finite(value: Any) -> bool:
    # A JSON number that is finite (the stdlib parser also gives NaN and Infinity).
    return _is_number(value) and math.isfinite(value)


def _check_number(doc: dict[str, Any], name: str, low: float, high: float,
                  low_open: bool = False) -> None:
    value = doc.get(name)
    if value is None:
        return
    if not _is_number(value):
        raise BadRequest(f"{name}: must be a number, got {value!r}"[:200])
    if not math.isfinite(value):
        raise BadRequest(f"{name}: not a finite number, got {value!r}")
    if value < low or (low_open and value == low) or value > high:
        bounds = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise BadRequest(f"{name}: must be in {bounds}, got {value!r}")


def _check_int(doc: dict[str, Any], name: str, low: int, high: Optional[int] = None) -> None:
    value = doc.get(name)
    if value is None:
        return
    if type(value) is not int or value < low or (high is not None and value > high):
        bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise BadRequest(f"{name}: must be an integer {bounds} or null, got {value!r}"[:200])


def _check_bool(doc: dict[str, Any], name: str) -> None:
    value = doc.get(name)
    if value is not None and not isinstance(value, bool):
        raise BadRequest(f"{name}: must be a boolean, got {value!r}"[:200])


#: Largest ``top_logprobs`` (chat) / ``logprobs`` (completions) OpenAI accepts.
MAX_TOP_LOGPROBS = 20


def check_generation_fields(doc: dict[str, Any], chat: bool) -> None:
    """The standard OpenAI sampling and output fields of a completion (``chat`` False) or
    chat body, once, for every backend (§11): each absent or null, else

    - ``temperature`` a finite number in [0, 2], ``top_p`` in [0, 1], ``presence_penalty``
      and ``frequency_penalty`` in [-2, 2] (NaN and infinities: "not a finite number");
    - ``n`` an integer >= 1; completions' ``best_of`` an integer >= 1; ``seed`` an integer;
    - ``stop`` a string or a list of strings; ``user`` a string;
    - chat's ``logprobs`` a boolean and ``top_logprobs`` an integer in [0, 20]; completions'
      ``logprobs`` an integer in [0, 20] and ``echo`` a boolean;
    - ``stream_options`` an object whose ``include_usage`` is a boolean when present;
      ``logit_bias`` an object of finite numbers.

    Fields it does not know pass (engines have extensions: vLLM's ``top_k``, ...); the
    output limits and ``stream`` are :func:`check_model_and_stream`'s.

    :raises BadRequest: naming the field (``param`` of the OpenAI error).
    """
    _check_number(doc, "temperature", 0.0, 2.0)
    _check_number(doc, "top_p", 0.0, 1.0)
    _check_number(doc, "presence_penalty", -2.0, 2.0)
    _check_number(doc, "frequency_penalty", -2.0, 2.0)
    _check_int(doc, "n", 1)
    _check_int(doc, "seed", -(1 << 63), (1 << 64) - 1)
    stop = doc.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise BadRequest(f"stop: must be a string or a list of strings, got {stop!r}"[:200])
    user = doc.get("user")
    if user is not None and not isinstance(user, str):
        raise BadRequest(f"user: must be a string, got {user!r}"[:200])
    if chat:
        _check_bool(doc, "logprobs")
        _check_int(doc, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    else:
        _check_int(doc, "logprobs", 0, MAX_TOP_LOGPROBS)
        _check_int(doc, "best_of", 1)
        _check_bool(doc, "echo")
    options = doc.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise BadRequest("stream_options: must be an object")
        include = options.get("include_usage")
        if include is not None and not isinstance(include, bool):
            raise BadRequest("stream_options.include_usage: must be a boolean, got "
                             f"{include!r}"[:200])
    bias = doc.get("logit_bias")
    if bias is not None and not (isinstance(bias, dict)
                                 and all(_finite(v) for v in bias.values())):
        raise BadRequest("logit_bias: must be an object of token ids to finite numbers")


#: Output-length fields of OpenAI bodies: an integer >= 1, or null / absent.
OUTPUT_LIMIT_FIELDS = ("max_tokens", "max_completion_tokens")


def check_model_and_stream(doc: dict[str, Any], models: tuple[str, ...]) -> None:
    """``stream`` (a boolean when present), the output limits (:data:`OUTPUT_LIMIT_FIELDS`:
    an integer >= 1 when present and not null; an engine refuses anything else, and the router
    would have routed and counted it first) and ``model`` (a non-empty string, one of
    ``models`` unless that is empty).

    :raises BadRequest: naming the field: ``stream`` not a boolean, an output limit not an
        integer >= 1, ``model`` missing or not a string.
    :raises UnknownModel: ``model`` not served.
    """
    if "stream" in doc and not isinstance(doc["stream"], bool):
        raise BadRequest("stream: must be a boolean")
    for name in OUTPUT_LIMIT_FIELDS:
        _check_int(doc, name, 1)
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("model: must be a non-empty string")
    if models and model not in models:
        raise UnknownModel(f"The model `{model}` does not exist.")
