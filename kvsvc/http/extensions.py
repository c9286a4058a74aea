"""Where :func:`kvsvc.http.app.create_app` keeps the service objects in ``app.extensions``, and the
accessors views reach them through (inside a request or app context, via ``current_app``; the
metrics' accessor is :func:`kvsvc.http.metrics.metrics`).

Keys (unchanged, other code reads them): ``"kvsvc"`` the :class:`~kvsvc.service.Service`,
``"kvsvc.routing"`` its :class:`~kvsvc.routing.router.Router`, ``"kvsvc.metrics"`` the app's
:class:`~kvsvc.http.metrics.Metrics`.
"""

from __future__ import annotations

from flask import current_app

from kvsvc.routing.router import Router
from kvsvc.service import Service

#: ``app.extensions`` key of the :class:`~kvsvc.service.Service`.
EXTENSION = "kvsvc"
#: ``app.extensions`` key of the service's :class:`~kvsvc.routing.router.Router`.
ROUTING_EXTENSION = "kvsvc.routing"
#: ``app.extensions`` key of the app's :class:`~kvsvc.http.metrics.Metrics`.
METRICS_EXTENSION = "kvsvc.metrics"
#: ``app.extensions`` key of the app's :class:`~kvsvc.http.admission.InFlightLimit`.
ADMISSION_EXTENSION = "kvsvc.admission"


def service() -> Service:
    """The :class:`~kvsvc.service.Service` of the current app."""
    svc: Service = current_app.extensions[EXTENSION]
    return svc


def router() -> Router:
    """The :class:`~kvsvc.routing.router.Router` of the current app."""
    routing: Router = current_app.extensions[ROUTING_EXTENSION]
    return routing
