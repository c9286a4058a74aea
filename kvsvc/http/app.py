"""The Flask app factory (§10, §11): ``create_app(settings)`` builds the app around a
:class:`~kvsvc.service.Service`; nothing starts there. Whoever serves the app starts the service
after any fork (gunicorn: ``post_worker_init``, see :mod:`kvsvc.server`) and closes it at exit.

What the app holds (:mod:`kvsvc.http.extensions`): ``app.extensions["kvsvc"]`` the service,
``["kvsvc.routing"]`` its router, ``["kvsvc.metrics"]`` the app's own Prometheus registry and
instruments (:class:`~kvsvc.http.metrics.Metrics`; never prometheus_client's global registry, so
a process can hold many apps).

What it serves, one module per concern:

- :mod:`kvsvc.http.internal`: ``/v1/internal/kv-cache/query``, ``/v1/internal/heartbeat``,
  ``/v1/internal/route``, behind the internal token (:mod:`kvsvc.http.auth`);
- :mod:`kvsvc.http.openai`: ``/v1/completions``, ``/v1/chat/completions``,
  ``/v1/embeddings``, ``/v1/models``, behind ``--api_key`` and the in-flight limit, each
  answer tagged with its request id (:mod:`kvsvc.http.admission`);
- :mod:`kvsvc.http.health`: ``/health``, ``/ready``;
- :mod:`kvsvc.http.metrics`: ``/metrics``.

Request bodies are read and checked by :mod:`kvsvc.http.body`; every error answer is JSON, its
status taken from the one table in :mod:`kvsvc.http.errors` (OpenAI's error shape for everything
under ``/v1/`` but ``/v1/internal/*``). The app-wide body limit is sized for the longest token-id query
(:func:`~kvsvc.http.body.max_content_length`); the OpenAI endpoints and ``/v1/internal/route``
use ``--max_request_bytes``.
"""

from __future__ import annotations

from typing import Optional

import flask

from kvsvc.clock import MONOTONIC, Clock
from kvsvc.config import KvEventsConfig
from kvsvc.settings import ServiceSettings
from kvsvc.http import admission, errors, health, internal, metrics, openai
from kvsvc.http.auth import check_internal_token
from kvsvc.http.body import max_content_length
from kvsvc.http.extensions import (
    ADMISSION_EXTENSION,
    EXTENSION,
    METRICS_EXTENSION,
    ROUTING_EXTENSION,
)
from kvsvc.service import Service


def create_app(settings: ServiceSettings, kv_config: Optional[KvEventsConfig] = None,
               clock: Clock = MONOTONIC) -> flask.Flask:
    """Build the Flask app and its (not started) :class:`~kvsvc.service.Service`.

    :param settings: service settings.
    :param kv_config: the §8 config; ``None`` loads ``settings.kv_events_config_file`` when set,
        and an empty path disables the index.
    :param clock: the service's clock (:class:`~kvsvc.service.Service`); real by default.
    :raises ConfigError: the §8 file, the token file, the routing settings or the tokenizer is
        invalid or unreadable.
    """
    if kv_config is None:
        kv_config = settings.kv_events_config()
    app = flask.Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = max_content_length(settings.max_query_tokens)
    app.json.sort_keys = False  # type: ignore[attr-defined]  # flask's DefaultJSONProvider
    svc = Service(settings, kv_config, clock)
    app.extensions[EXTENSION] = svc
    app.extensions[ROUTING_EXTENSION] = svc.router
    app.extensions[METRICS_EXTENSION] = metrics.Metrics(svc)
    app.before_request(check_internal_token)
    limit = admission.InFlightLimit(settings.max_in_flight_requests)
    app.extensions[ADMISSION_EXTENSION] = limit
    admission.install(app, settings.api_key.get_secret_value()
                      if settings.api_key is not None else None, limit)
    errors.register(app)
    app.register_blueprint(internal.blueprint())
    app.register_blueprint(health.blueprint())
    app.register_blueprint(metrics.blueprint())
    app.register_blueprint(openai.blueprint())
    return app
