"""The one place that turns kvsvc's errors into HTTP answers (§9-§11).

:data:`STATUS` maps every kind of :class:`~kvsvc.errors.RequestError` and
:class:`~kvsvc.errors.UpstreamError` to its status; :func:`status_of` looks an error up by its
class (the most specific entry wins). :func:`register` installs the app-wide handlers: every
error answer is JSON, never HTML (werkzeug's own errors keep their status and headers, e.g.
``Allow`` on 405; anything unexpected is logged and answers 500), in one of two shapes chosen by
the path (:func:`is_openai_path`):

- under ``/v1/`` except ``/v1/internal/*`` (the OpenAI-compatible API, §11): OpenAI's
  ``{"error": {"message", "type", "param", "code"}}`` (:func:`openai_error`), for every status
  (400, 401 API key, 404 unknown model or URL, 405, 413 naming the limit and
  ``--max_request_bytes``, 429 in-flight limit, 500, 502, 503, 504), so an OpenAI client
  library can read every refusal;
- every 429 and 503 answer carries ``Retry-After`` (:data:`RETRY_AFTER_S` seconds);
- everywhere else (``/v1/internal/*``, ``/health``, ``/ready``, ``/metrics``): kvsvc's own
  ``{"error": "..."}``.
"""

from __future__ import annotations

import json
import logging

import flask
from typing import Optional, Union

from flask import request
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge
from werkzeug.wrappers import Response as WerkzeugResponse

from kvsvc.errors import (
    BadRequest,
    ClientGone,
    HeartbeatRejected,
    InvalidApiKey,
    InvalidHeartbeat,
    NoCandidate,
    NoRegistry,
    PayloadTooLarge,
    RequestError,
    RpcTimeout,
    RpcUnreachable,
    StaleIncarnation,
    TooManyRequests,
    Unauthorized,
    UnknownInstance,
    UnknownModel,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnreachable,
)

log = logging.getLogger(__name__)

#: Error kind -> HTTP status.
STATUS: dict[type[Exception], int] = {
    BadRequest: 400,
    InvalidHeartbeat: 400,
    Unauthorized: 401,
    InvalidApiKey: 401,
    UnknownModel: 404,
    TooManyRequests: 429,
    UnknownInstance: 409,
    StaleIncarnation: 409,
    PayloadTooLarge: 413,
    UpstreamUnreachable: 502,
    NoRegistry: 503,
    NoCandidate: 503,
    UpstreamTimeout: 504,
    # A real xLLM engine's baidu_std channel (§13): the same answers as HTTP upstreams.
    RpcUnreachable: 502,
    RpcTimeout: 504,
    # nginx's "client closed request": written to nobody, counted as ``client_closed``.
    ClientGone: 499,
    # Bases, for a kind added without an entry of its own.
    HeartbeatRejected: 400,
    RequestError: 400,
    UpstreamError: 502,
}


#: HTTP status -> OpenAI's error ``type`` and ``code`` (:func:`openai_error`'s defaults; a
#: status without an entry is ``invalid_request_error`` below 500, ``server_error`` from 500).
OPENAI_ERRORS: dict[int, tuple[str, Optional[str]]] = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", "model_not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    500: ("server_error", None),
    502: ("upstream_error", None),
    503: ("service_unavailable", None),
    504: ("upstream_timeout", None),
}
#: ``Retry-After`` of every 429 and 503 answer, seconds (a routing decision or a freed slot is
#: that close; a client that backs off longer loses nothing).
RETRY_AFTER_S = 1
#: Statuses whose answers carry ``Retry-After``.
RETRY_STATUSES = frozenset({429, 503})
#: werkzeug's 404 for a path no route serves: OpenAI's ``code`` for it.
UNKNOWN_URL_CODE = "unknown_url"
#: The prefix of kvsvc's internal API, answered in kvsvc's own error shape.
_INTERNAL = "/v1/internal"
_DEFAULT = object()


def is_openai_path(path: str) -> bool:
    """True for a path answered in OpenAI's error shape: under ``/v1/`` and not under
    ``/v1/internal``."""
    return path.startswith("/v1/") and not (path == _INTERNAL
                                            or path.startswith(_INTERNAL + "/"))


def openai_error(status: int, message: str, param: Optional[str] = None,
                 code: Union[Optional[str], object] = _DEFAULT) -> flask.Response:
    """OpenAI's error body ``{"error": {"message", "type", "param", "code"}}`` with ``status``.

    :param status: the HTTP status; it picks ``type`` (and ``code`` unless given) from
        :data:`OPENAI_ERRORS`.
    :param message: the human-readable reason.
    :param param: the request field at fault, ``None`` when none.
    :param code: OpenAI's ``code`` string (``None`` for null); default the status's.
    """
    kind, default_code = OPENAI_ERRORS.get(status, ("invalid_request_error" if status < 500
                                                    else "server_error", None))
    response = flask.jsonify(error={"message": message, "type": kind, "param": param,
                                    "code": default_code if code is _DEFAULT else code})
    response.status_code = status
    return response


def too_large_message() -> str:
    """The 413 message of the OpenAI endpoints: the limit in bytes and the flag that sets it
    (the request's ``max_content_length``, which those endpoints set from it)."""
    limit = request.max_content_length
    size = f"{limit} bytes" if limit is not None else "the configured size"
    return f"Request body too large: the limit is {size} (--max_request_bytes)."


def status_of(exc: Exception) -> int:
    """The HTTP status answering ``exc``: the :data:`STATUS` entry of its most specific class,
    500 for an error that has none."""
    for cls in type(exc).__mro__:
        status = STATUS.get(cls)
        if status is not None:
            return status
    return 500


def register(app: flask.Flask) -> None:
    """Install the app-wide JSON error handlers on ``app``."""
    app.register_error_handler(RequestError, _kvsvc_error)
    app.register_error_handler(UpstreamError, _kvsvc_error)
    app.register_error_handler(ClientGone, _kvsvc_error)
    app.register_error_handler(HTTPException, _http_error)
    app.register_error_handler(Exception, _internal_error)


def _kvsvc_error(exc: RequestError | UpstreamError | ClientGone) -> flask.Response:
    response = _kvsvc_answer(exc)
    if response.status_code in RETRY_STATUSES:
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
    return response


def _kvsvc_answer(exc: RequestError | UpstreamError | ClientGone) -> flask.Response:
    status = status_of(exc)
    if not is_openai_path(request.path):
        response = flask.jsonify(error=exc.message)
        response.status_code = status
        return response
    param: Optional[str] = None
    if isinstance(exc, PayloadTooLarge):
        return openai_error(status, too_large_message())
    if isinstance(exc, BadRequest):
        param = exc.param
    elif isinstance(exc, UnknownModel):
        param = "model"
    return openai_error(status, exc.message, param)


def _http_error(exc: HTTPException) -> WerkzeugResponse:
    # Keep werkzeug's response (status, and headers such as Allow on 405); replace the HTML.
    response = exc.get_response()
    status = exc.code or 500
    message = exc.description or exc.name
    if is_openai_path(request.path):
        if isinstance(exc, RequestEntityTooLarge):
            message = too_large_message()
        code: Optional[str] = (UNKNOWN_URL_CODE if status == 404
                               else OPENAI_ERRORS.get(status, ("", None))[1])
        body = openai_error(status, message, code=code).get_data()
    else:
        body = json.dumps({"error": message}).encode()
    response.set_data(body)
    response.content_type = "application/json"
    return response


def _internal_error(exc: Exception) -> flask.Response:
    log.exception("unhandled error on %s %s", request.method, request.path)
    if is_openai_path(request.path):
        return openai_error(500, "internal server error")
    response = flask.jsonify(error="internal server error")
    response.status_code = 500
    return response
