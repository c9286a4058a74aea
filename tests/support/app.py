"""The Flask app of one static stream, in process: :func:`running_app` (a started and closed app),
:func:`one_stream_config` (one stream at given ports) and :func:`post` (a §10 query through a test
client with the internal token)."""

from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Iterator, Optional

import flask

from kvsvc.config import KvEventsConfig, parse_kv_events_config
from kvsvc.http.app import create_app
from kvsvc.http.extensions import EXTENSION
from kvsvc.http.internal import QUERY_PATH
from kvsvc.settings import load_service_settings

TOKEN = "s3cret-token"
HEADERS = {"X-Internal-Token": TOKEN}
INSTANCE = "127.0.0.1:9000"


def one_stream_config(event_port: int, replay_port: int, block_size: int = 4) -> KvEventsConfig:
    return parse_kv_events_config({
        "streams": [{"instance_name": INSTANCE, "block_size": block_size,
                     "endpoint": f"tcp://127.0.0.1:{event_port}",
                     "replay_endpoint": f"tcp://127.0.0.1:{replay_port}"}],
        "replay_timeout_ms": 300,
    })


@contextmanager
def running_app(kv_config: Optional[KvEventsConfig], token: Optional[str] = TOKEN,
                max_query_tokens: int = 64, start: bool = True) -> Iterator[flask.Flask]:
    """A fresh app per test; its service is started (unless ``start`` is False) and closed."""
    settings = load_service_settings(internal_api_token=token, max_query_tokens=max_query_tokens)
    app = create_app(settings, kv_config)
    service = app.extensions[EXTENSION]
    if start:
        service.start(timeout_s=5.0)
    try:
        yield app
    finally:
        service.close(timeout_s=5.0)


def post(client, body, headers=HEADERS, **kwargs):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return client.post(QUERY_PATH, data=data, headers=headers, content_type="application/json",
                       **kwargs)
