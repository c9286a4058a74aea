"""The HTTP layer (§10, §11): the Flask app around a :class:`kvsvc.service.Service`.

- :mod:`~kvsvc.http.app`: the app factory; :mod:`~kvsvc.http.extensions`: where it keeps the
  service objects.
- :mod:`~kvsvc.http.body`: body reading and shape checks (the one token-id rule).
- :mod:`~kvsvc.http.auth`: the internal token; :mod:`~kvsvc.http.errors`: the one error -> status
  table and the JSON error answers.
- :mod:`~kvsvc.http.internal`: ``/v1/internal/*`` (KV-cache query, heartbeat, route).
- :mod:`~kvsvc.http.openai`: the OpenAI-compatible endpoints.
- :mod:`~kvsvc.http.health`: ``/health`` and ``/ready``; :mod:`~kvsvc.http.metrics`: ``/metrics``.
"""
