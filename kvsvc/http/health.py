"""Liveness and readiness (§10).

- ``GET /health``: liveness, always 200 ``{"status": "ok"}``; touches nothing (no etcd, no
  upstream, no stream lock).
- ``GET /ready``: "this replica should receive traffic" (§15, a probe's rule). 200 once the
  router can route: (a) the service runs, (b) the registry, when configured, has been listed
  successfully once (before that there is nothing to route on: etcd down at boot means 503
  until the first list), and (c) with a registry, at least one instance is a routing
  candidate now (:meth:`~kvsvc.routing.router.Router.prefill_candidates`: schedulable, with a
  current load report). Streams never gate it: a stream that has not synchronized (an engine
  started without KV events, a stream in recovery) is reported in ``streams`` and
  ``unsynchronized_streams``, and only lowers its instance's hits (§11). Through an etcd
  outage it stays 200 while candidates remain (routing on the last registry snapshot,
  ``registry.routing_on_last_snapshot``, ``stale_for_s``). 503 otherwise, with
  ``waiting_for`` naming what is missing (``"service start"``, ``"registry first list"``,
  ``"a routing candidate"``). What to alert on instead: docs/real-clusters.md.
- ``GET /ready?streams=synchronized``: the stricter warm-up gate for tooling that must wait
  for the index (the demo, benchmarks, tests): also 503 until every configured stream
  synchronized once (the static streams of the §8 config, or, with discovery, the streams of
  its first plan made from a listed registry; a stream removed meanwhile is no longer waited
  for; ``"discovery first plan"``, ``"stream <instance>/dp<rank> first synchronization"``),
  kept once reached (:class:`Readiness`), and without the candidate condition.

  The body: ``ready``, ``running``, ``index_enabled``, ``warmed_up`` (every configured stream
  synchronized once), ``waiting_for``, ``unsynchronized_streams`` (``instance/dp<rank>`` of
  every stream not synchronized now), with a registry ``candidates`` (the routing
  candidates now),
  ``heartbeat_rejections`` (sender -> reason, since_s, count; see
  :class:`~kvsvc.cluster.rejections.HeartbeatRejections`), with a registry also ``registry``
  (``fresh``, ``is_master``, ``generation``, ``instances``, ``listed_once``,
  ``routing_on_last_snapshot``, ``stale_for_s``: seconds since the last successful list while
  not fresh, else null) and ``not_candidates`` (registered instance -> why it is not a
  routing candidate now, the router's rule, §11), with discovery also ``discovery.excluded``
  (instance -> reason) and ``discovery.other_backends`` (instance -> its ``backend_type``, for
  the instances without streams because their backend is not in ``discovery.backends``, §9),
  and ``streams``: every stream's state, error, sequence, resident block counts, completed
  recoveries and periodic-resync differences (§6), ``completeness`` (``"exact"``,
  ``"subset"`` §7h, ``null`` while not synchronized: what its hits are worth, §10) and
  ``replay_mode`` (``"snapshot"`` §7 or ``"history"`` §7h), with discovery each stream's
  ``identity`` (the incarnation it was added for).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Optional

import flask
from flask import current_app

from kvsvc.http.extensions import service
from kvsvc.service import Service
from kvsvc.config import ReplayMode
from kvsvc.streams.state import StreamId, StreamState, StreamStatus

log = logging.getLogger(__name__)

#: ``app.extensions`` key of the app's :class:`Readiness`.
READINESS_EXTENSION = "kvsvc.readiness"


def blueprint() -> flask.Blueprint:
    """``/health`` and ``/ready``; registering it gives the app its :class:`Readiness`."""
    bp = flask.Blueprint("kvsvc_health", __name__)
    bp.record_once(lambda state: state.app.extensions.setdefault(READINESS_EXTENSION,
                                                                 Readiness()))
    bp.add_url_rule("/health", "health", _health, methods=["GET"])
    bp.add_url_rule("/ready", "ready", _ready, methods=["GET"])
    return bp


#: ``waiting_for`` entry of a registry without a routing candidate.
WAITING_CANDIDATE = "a routing candidate"


class Readiness:
    """The readiness rule and the warm-up latch of one app (see the module docstring): once
    every configured stream was synchronized and the registry listed, it stays warm.
    Thread-safe (request threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._warmed_up = False

    def evaluate(self, svc: Service, statuses: list[StreamStatus],
                 streams_required: bool = False) -> list[str]:
        """What ``svc`` still needs before it should receive traffic, ``[]`` when ready.
        Reaching warm-up is logged once (INFO).

        :param svc: the app's service.
        :param statuses: the directory's stream statuses (as shown in the body).
        :param streams_required: the warm-up gate (``?streams=synchronized``): every
            configured stream synchronized once, instead of a routing candidate.
        """
        waiting: list[str] = []
        if not svc.running:
            waiting.append("service start")
        if svc.registry is not None and svc.registry.last_listed_at() is None:
            waiting.append("registry first list")
        missing = self._warm_up(svc, statuses, not waiting)
        if streams_required:
            waiting.extend(missing)
        elif svc.registry is not None and not waiting and not svc.router.prefill_candidates():
            waiting.append(WAITING_CANDIDATE)
        return waiting

    def _warm_up(self, svc: Service, statuses: list[StreamStatus], base_ok: bool) -> list[str]:
        """The warm-up set's streams still missing their first synchronization (``[]`` once
        warm); latches (and logs) warm-up when nothing is missing and ``base_ok``."""
        with self._lock:
            if self._warmed_up:
                return []
        missing = _warm_up_missing(svc, statuses)
        if missing or not base_ok:
            return missing
        with self._lock:
            first = not self._warmed_up
            self._warmed_up = True
        if first:
            log.info("warmed up: %s, %d streams synchronized once", "registry listed"
                     if svc.registry is not None else "no registry", len(statuses))
        return []

    @property
    def warmed_up(self) -> bool:
        """True once warm-up was reached."""
        with self._lock:
            return self._warmed_up


def _warm_up_missing(svc: Service, statuses: list[StreamStatus]) -> list[str]:
    """The warm-up set's streams not synchronized once yet (and discovery's missing plan)."""
    wanted: Optional[frozenset[StreamId]]
    if svc.discovery is not None:
        wanted = svc.discovery.first_plan()
        if wanted is None:
            return ["discovery first plan"]
    else:
        wanted = frozenset(st.stream for st in statuses)
    # A warm-up stream no longer in the directory (instance gone) is not waited for.
    return [f"stream {st.stream} first synchronization" for st in statuses
            if st.stream in wanted and not st.synchronized_once]


def stream_json(status: StreamStatus, replay_mode: Optional[ReplayMode]) -> dict[str, Any]:
    """One ``/ready`` ``streams`` entry (see the module docstring).

    :param status: the stream's status.
    :param replay_mode: its configured replay mode (``None``: unknown, shown as null).
    """
    return {
        "instance_name": status.stream.instance_name,
        "dp_rank": status.stream.dp_rank,
        "state": status.state.value,
        "synchronized_once": status.synchronized_once,
        "sequence": status.sequence,
        "error": status.error,
        "device_blocks": status.device_blocks,
        "host_blocks": status.host_blocks,
        "recoveries": status.recoveries,
        "resync_differences": status.resync_differences,
        # §10: null unless synchronized, whatever the stream last held.
        "completeness": (status.completeness.value if status.completeness is not None
                         and status.state is StreamState.SYNCHRONIZED else None),
        "replay_mode": replay_mode.value if replay_mode is not None else None,
    }


def _health() -> flask.Response:
    return flask.jsonify(status="ok")


def _ready() -> tuple[flask.Response, int]:
    svc = service()
    readiness: Readiness = current_app.extensions[READINESS_EXTENSION]
    directory = svc.directory
    statuses = directory.statuses() if directory is not None else []
    strict = flask.request.args.get("streams") == "synchronized"
    waiting = readiness.evaluate(svc, statuses, streams_required=strict)
    ready = not waiting
    modes = directory.replay_modes() if directory is not None else {}
    streams = [stream_json(st, modes.get(st.stream)) for st in statuses]
    body: dict[str, Any] = {
        "ready": ready,
        "running": svc.running,
        "index_enabled": directory is not None,
        "warmed_up": readiness.warmed_up,
        "waiting_for": waiting,
        "unsynchronized_streams": [str(st.stream) for st in statuses
                                   if st.state is not StreamState.SYNCHRONIZED],
        "heartbeat_rejections": svc.heartbeat_rejections.to_json(),
    }
    # The registry and discovery parts appear only when configured.
    if svc.registry is not None:
        snap = svc.registry.snapshot()
        listed_at = svc.registry.last_listed_at()
        stale_for: Optional[float] = None
        if not snap.fresh and listed_at is not None:
            stale_for = round(max(0.0, svc.registry.clock.now() - listed_at), 3)
        body["registry"] = {
            "fresh": snap.fresh, "is_master": snap.is_master, "generation": snap.generation,
            "instances": len(snap.instances), "listed_once": listed_at is not None,
            "routing_on_last_snapshot": not snap.fresh and listed_at is not None,
            "stale_for_s": stale_for}
        # ``not_candidates``: registered instances the router does not route to now, with
        # why (instance -> reason; the router's own rule, §11).
        body["not_candidates"] = svc.router.not_candidates()
        body["candidates"] = list(svc.router.prefill_candidates())
    if svc.discovery is not None and directory is not None:
        body["discovery"] = {"excluded": dict(svc.discovery.excluded()),
                             "other_backends": dict(svc.discovery.other_backends())}
        for entry, st in zip(streams, statuses):
            entry["identity"] = directory.identity(st.stream)
    body["streams"] = streams
    return flask.jsonify(body), 200 if ready else 503
