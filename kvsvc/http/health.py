"""Liveness and readiness (§10).

- ``GET /health``: liveness, always 200 ``{"status": "ok"}``; touches nothing (no etcd, no
  upstream, no stream lock).
- ``GET /ready``: 200 once the service runs, the registry (when configured) is fresh or static
  streams are configured, and every stream has been synchronized at least once; else 503. The
  body shows every stream's state, error, sequence, resident block counts, completed recoveries
  and periodic-resync differences (§6); with a registry also ``registry`` (``fresh``,
  ``is_master``, ``generation``, ``instances``), with discovery also ``discovery.excluded``
  (instance -> reason) and each stream's ``identity`` (the incarnation it was added for). etcd
  unreachable keeps the last registry snapshot (streams go on) and only degrades readiness.
"""

from __future__ import annotations

from typing import Any

import flask

from kvsvc.http.extensions import service


def blueprint() -> flask.Blueprint:
    """``/health`` and ``/ready``."""
    bp = flask.Blueprint("kvsvc_health", __name__)
    bp.add_url_rule("/health", "health", _health, methods=["GET"])
    bp.add_url_rule("/ready", "ready", _ready, methods=["GET"])
    return bp


def _health() -> flask.Response:
    return flask.jsonify(status="ok")


def _ready() -> tuple[flask.Response, int]:
    svc = service()
    directory = svc.directory
    statuses = directory.statuses() if directory is not None else []
    registry: dict[str, Any] = {}
    registry_ok = True
    if svc.registry is not None:
        snap = svc.registry.snapshot()
        registry.update(fresh=snap.fresh, is_master=snap.is_master, generation=snap.generation,
                        instances=len(snap.instances))
        registry_ok = snap.fresh or svc.static_streams
    ready = svc.running and registry_ok and all(st.synchronized_once for st in statuses)
    streams = [{
            "instance_name": st.stream.instance_name,
            "dp_rank": st.stream.dp_rank,
            "state": st.state.value,
            "synchronized_once": st.synchronized_once,
            "sequence": st.sequence,
            "error": st.error,
            "device_blocks": st.device_blocks,
            "host_blocks": st.host_blocks,
            "recoveries": st.recoveries,
            "resync_differences": st.resync_differences,
        } for st in statuses]
    body: dict[str, Any] = {
        "ready": ready,
        "running": svc.running,
        "index_enabled": directory is not None,
    }
    # The registry and discovery parts appear only when configured (the body of a static
    # service is unchanged).
    if svc.registry is not None:
        body["registry"] = registry
        # ``not_candidates``: registered instances the router does not route to now, with
        # why (instance -> reason; the router's own rule, §11).
        body["not_candidates"] = svc.router.not_candidates()
    if svc.discovery is not None and directory is not None:
        body["discovery"] = {"excluded": dict(svc.discovery.excluded())}
        for entry, st in zip(streams, statuses):
            entry["identity"] = directory.identity(st.stream)
    body["streams"] = streams
    return flask.jsonify(body), 200 if ready else 503
