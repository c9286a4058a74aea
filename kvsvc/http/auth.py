"""The internal API token (§10): every ``/v1/internal/*`` request, and ``/metrics`` when
``--metrics_require_token`` is set, carries ``X-Internal-Token`` equal to the configured token
(compared in constant time) or is refused with :class:`~kvsvc.errors.Unauthorized` (401). With
no token configured nothing is checked. The token is never logged.

A refused heartbeat is also reported to the service's
:class:`~kvsvc.cluster.rejections.HeartbeatRejections` (one WARNING per sender and reason, §10):
``missing_token`` or ``token_mismatch``, the sender being the ``name`` its body claims (the body
is not trusted, only read to say who it claims to be) or its remote address.

Installed app-wide by :func:`kvsvc.http.app.create_app` as a ``before_request`` hook, so an
unknown ``/v1/internal/...`` path is refused (401) before it is found missing (404).
"""

from __future__ import annotations

import hmac
from typing import Optional

import orjson
from flask import request

from kvsvc.cluster.rejections import RejectionReason, unidentified_sender
from kvsvc.errors import Unauthorized
from kvsvc.http.body import read_body
from kvsvc.http.extensions import service
from kvsvc.http.internal import HEARTBEAT_PATH, INTERNAL_PREFIX
from kvsvc.http.metrics import METRICS_PATH, HeartbeatOutcome, metrics

TOKEN_HEADER = "X-Internal-Token"
#: Longest claimed name shown in the log; a longer (or non-printable) one is not shown.
_MAX_CLAIMED_NAME = 255


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
            metrics().heartbeats.labels(HeartbeatOutcome.UNAUTHORIZED).inc()
            name = _claimed_name()
            service().heartbeat_rejections.rejected(
                name or unidentified_sender(request.remote_addr),
                RejectionReason.MISSING_TOKEN if given is None else RejectionReason.TOKEN_MISMATCH,
                claimed=name is not None)
        raise Unauthorized(f"missing or wrong {TOKEN_HEADER}")


def _claimed_name() -> Optional[str]:
    """The ``name`` of the refused heartbeat's body, for the log only: ``None`` when the body
    cannot be read or parsed, or the name is not a short printable string (it is not trusted,
    so it must not be able to forge log lines)."""
    try:
        doc = orjson.loads(read_body())
    except Exception:  # noqa: BLE001 - any unreadable body: the 401 stands, unnamed
        return None
    name = doc.get("name") if isinstance(doc, dict) else None
    if (not isinstance(name, str) or not name or len(name) > _MAX_CLAIMED_NAME
            or not name.isprintable()):
        return None
    return name
