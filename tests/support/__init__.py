"""Helpers shared by the test modules (no tests here): engines built from PROTOCOL.md
(``publisher``), bounded waits and free loopback ports (``util``), a real etcd (``etcd_server``),
``kvsvc serve`` under gunicorn (``gunicorn``, ``http_service``), the systemd unit (``systemd``),
loopback upstreams (``upstreams``), the in-process apps (``app``, ``routes``), registry and
policy inputs (``discovery``, ``registry``, ``policy``), the simulated engine (``sim``), the
subscriber harness (``subscriber``), hypothesis strategies (``strategies``), Prometheus text
(``metrics``) and a small tokenizer (``tokenizer``). Test modules import from here, never from
each other."""
