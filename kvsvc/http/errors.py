"""The one place that turns kvsvc's errors into HTTP answers (§9-§11).

:data:`STATUS` maps every kind of :class:`~kvsvc.errors.RequestError` and
:class:`~kvsvc.errors.UpstreamError` to its status; :func:`status_of` looks an error up by its
class (the most specific entry wins). :func:`register` installs the app-wide handlers: every
error answer is JSON ``{"error": "..."}``, never HTML (werkzeug's own errors keep their status and
headers, e.g. ``Allow`` on 405; anything unexpected is logged and answers 500). The OpenAI
endpoints answer in OpenAI's shape instead (:mod:`kvsvc.http.openai`), with the same statuses.
"""

from __future__ import annotations

import json
import logging

import flask
from flask import request
from werkzeug.exceptions import HTTPException
from werkzeug.wrappers import Response as WerkzeugResponse

from kvsvc.errors import (
    BadRequest,
    HeartbeatRejected,
    InvalidHeartbeat,
    NoCandidate,
    NoRegistry,
    PayloadTooLarge,
    RequestError,
    StaleIncarnation,
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
    UnknownModel: 404,
    UnknownInstance: 409,
    StaleIncarnation: 409,
    PayloadTooLarge: 413,
    UpstreamUnreachable: 502,
    NoRegistry: 503,
    NoCandidate: 503,
    UpstreamTimeout: 504,
    # Bases, for a kind added without an entry of its own.
    HeartbeatRejected: 400,
    RequestError: 400,
    UpstreamError: 502,
}


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
    app.register_error_handler(HTTPException, _http_error)
    app.register_error_handler(Exception, _internal_error)


def _kvsvc_error(exc: RequestError | UpstreamError) -> tuple[flask.Response, int]:
    return flask.jsonify(error=exc.message), status_of(exc)


def _http_error(exc: HTTPException) -> WerkzeugResponse:
    # Keep werkzeug's response (status, and headers such as Allow on 405); replace the HTML.
    response = exc.get_response()
    response.set_data(json.dumps({"error": exc.description or exc.name}))
    response.content_type = "application/json"
    return response


def _internal_error(exc: Exception) -> tuple[flask.Response, int]:
    log.exception("unhandled error on %s %s", request.method, request.path)
    return flask.jsonify(error="internal server error"), 500
