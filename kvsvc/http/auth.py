"""The internal API token (§10): every ``/v1/internal/*`` request, and ``/metrics`` when
``--metrics_require_token`` is set, carries ``X-Internal-Token`` equal to the configured token
(compared in constant time) or is refused with :class:`~kvsvc.errors.Unauthorized` (401). With
no token configured nothing is checked. The token is never logged.

Installed app-wide by :func:`kvsvc.http.app.create_app` as a ``before_request`` hook, so an
unknown ``/v1/internal/...`` path is refused (401) before it is found missing (404).
"""

from __future__ import annotations

import hmac

from flask import request

from kvsvc.errors import Unauthorized
from kvsvc.http.extensions import service
from kvsvc.http.internal import HEARTBEAT_PATH, INTERNAL_PREFIX
from kvsvc.http.metrics import METRICS_PATH, metrics

TOKEN_HEADER = "X-Internal-Token"


def check_internal_token() -> None:
    """``before_request`` hook: refuse the request unless it carries the token (see the module
    docstring). A refused heartbeat counts as ``unauthorized`` in ``kvsvc_heartbeats_total``.

    :raises Unauthorized: header missing or different from the token.
    """
    path = request.path
    if not path.startswith(INTERNAL_PREFIX):
        if path != METRICS_PATH:
            return
        if not service().settings.metrics_require_token:
            return
    expected = service().token
    if expected is None:
        return
    given = request.headers.get(TOKEN_HEADER)
    if given is None or not hmac.compare_digest(given.encode("utf-8", "surrogateescape"),
                                                expected.encode("utf-8")):
        if path == HEARTBEAT_PATH:
            metrics().heartbeats.labels("unauthorized").inc()
        raise Unauthorized(f"missing or wrong {TOKEN_HEADER}")
