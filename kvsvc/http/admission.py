"""Who may use the OpenAI API and how many at once (issue 20 item 7), plus the request id.

- **API key** (``--api_key``, vLLM's ``--api-key`` rule): every request under ``/v1/`` except
  ``/v1/internal/*`` needs ``Authorization: Bearer <key>`` (compared in constant time) or is
  refused with :class:`~kvsvc.errors.InvalidApiKey` (401, OpenAI's error shape). The internal
  API keeps its own ``X-Internal-Token`` (§10, :mod:`kvsvc.http.auth`). The key is never logged;
  the ``Authorization`` header is forwarded to the engine (which may check the same key).
- **In-flight limit** (``--max_in_flight_requests``, 0: none): the proxied OpenAI requests
  being served, counted from the request's start until its answer is built (the upstream's
  whole body read) or, for a stream, until its relay closes (:func:`hand_over_slot`); one more
  is refused with :class:`~kvsvc.errors.TooManyRequests` (429)
  before its body is read. Every 429 and 503 answer carries ``Retry-After``
  (:data:`kvsvc.http.errors.RETRY_AFTER_S`).
- **Request id**: ``X-Request-Id`` from the client when it is printable ASCII of at most
  :data:`MAX_REQUEST_ID_CHARS` characters, else a new one (32 hex digits); it is sent to the
  engine, returned in the answer's ``x-request-id``, and set for the request's log records
  (:class:`RequestIdFilter` adds ``request_id``; gunicorn's access line shows it too).

Installed by :func:`kvsvc.http.app.create_app` (:func:`install`): the app-wide ``before_request``
hooks run in the order key, request id, limit, so a refused key holds no slot.
"""

from __future__ import annotations

import contextvars
import hmac
import logging
import random
import threading
from typing import Callable, Optional

import flask
from flask import request

from kvsvc.errors import InvalidApiKey, TooManyRequests
from kvsvc.http.errors import is_openai_path

#: Header of the request id (sent upstream and returned).
REQUEST_ID_HEADER = "X-Request-Id"
#: Longest client-chosen request id kept (characters); a longer one is replaced.
MAX_REQUEST_ID_CHARS = 128
#: Paths counted by the in-flight limit (the proxied OpenAI endpoints).
LIMITED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/embeddings"})

#: The request id of the request running on this thread ("" outside one).
_REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("kvsvc_request_id",
                                                                  default="")
_G_REQUEST_ID = "kvsvc_request_id"
_G_SLOT = "kvsvc_in_flight_slot"

log = logging.getLogger(__name__)


class RequestIdFilter(logging.Filter):
    """Adds ``request_id`` (the current request's id) to every record logged while an OpenAI
    request runs on the thread; the JSON log format shows such extra fields
    (:func:`kvsvc.server.log_config`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Always keeps the record."""
        rid = _REQUEST_ID.get()
        if rid:
            record.request_id = rid
        return True


def current_request_id() -> str:
    """The id of the request running on this thread, ``""`` outside one."""
    return _REQUEST_ID.get()


class InFlightLimit:
    """Counts the OpenAI requests being served against a limit. Thread-safe.

    :param limit: most requests at once; 0 means no limit (still counted).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._count = 0
        self.refused = 0

    def acquire(self) -> bool:
        """Take a slot; False (counted in :attr:`refused`) when the limit is reached."""
        with self._lock:
            if self.limit and self._count >= self.limit:
                self.refused += 1
                return False
            self._count += 1
            return True

    def release(self) -> None:
        """Give a slot back (once per successful :meth:`acquire`)."""
        with self._lock:
            self._count -= 1

    @property
    def count(self) -> int:
        """Requests holding a slot now."""
        with self._lock:
            return self._count


class _Slot:
    """One request's slot, released once (by the request's teardown, or by the relay of the
    stream it was handed to)."""

    def __init__(self, limit: InFlightLimit) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._held = True

    def release(self) -> None:
        with self._lock:
            if not self._held:
                return
            self._held = False
        self._limit.release()


def _check_api_key(key: Optional[str]) -> None:
    if key is None or not is_openai_path(request.path):
        return
    given = request.headers.get("Authorization", "")
    scheme, _, value = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
            value.strip().encode("utf-8", "surrogateescape"), key.encode("utf-8")):
        raise InvalidApiKey("Invalid or missing API key (Authorization: Bearer <key>).")


def _valid_request_id(value: Optional[str]) -> bool:
    return (value is not None and 0 < len(value) <= MAX_REQUEST_ID_CHARS
            and all(" " < c <= "~" for c in value))


def new_request_id() -> str:
    """A new request id: 32 lowercase hex digits (128 random bits, the length of a UUID's
    hex form). From the interpreter's PRNG, which ``random`` reseeds in every forked child:
    an id names a request, it guards nothing, so it needs no system entropy per request."""
    return f"{random.getrandbits(128):032x}"


def install(app: flask.Flask, api_key: Optional[str], limit: InFlightLimit) -> None:
    """Install the key check, the request id and the in-flight limit on ``app`` (see the
    module docstring).

    :param app: the Flask app.
    :param api_key: ``--api_key``, ``None`` when none is required.
    :param limit: the app's in-flight limit.
    """

    @app.before_request
    def _admit() -> None:
        _check_api_key(api_key)
        if not is_openai_path(request.path):
            return
        given = request.headers.get(REQUEST_ID_HEADER)
        rid = given if given is not None and _valid_request_id(given) else new_request_id()
        flask.g.setdefault(_G_REQUEST_ID, rid)
        _REQUEST_ID.set(rid)
        if request.path in LIMITED_PATHS:
            if not limit.acquire():
                log.warning("in-flight limit %d reached: %s refused with 429", limit.limit,
                            request.path)
                raise TooManyRequests(f"Too many requests in flight (limit {limit.limit}, "
                                      "--max_in_flight_requests); retry later.")
            flask.g.setdefault(_G_SLOT, _Slot(limit))

    @app.after_request
    def _tag(response: flask.Response) -> flask.Response:
        rid = flask.g.get(_G_REQUEST_ID)
        if rid:
            response.headers["x-request-id"] = rid
        return response

    @app.teardown_request
    def _teardown(exc: Optional[BaseException]) -> None:
        slot = flask.g.pop(_G_SLOT, None)
        if slot is not None:  # not handed to a stream's relay: the answer is built
            slot.release()
        _REQUEST_ID.set("")


def hand_over_slot() -> Optional[Callable[[], None]]:
    """Take the current request's in-flight slot out of the request's hands: the caller
    releases it (a streamed answer when its relay closes: werkzeug hands a direct-passthrough
    iterable to the WSGI server as it is, so the response's own close callbacks never run).
    ``None`` when the request holds none."""
    slot = flask.g.pop(_G_SLOT, None)
    return slot.release if slot is not None else None


def request_id() -> Optional[str]:
    """The current request's id (``None`` outside an OpenAI request)."""
    rid: Optional[str] = flask.g.get(_G_REQUEST_ID)
    return rid
