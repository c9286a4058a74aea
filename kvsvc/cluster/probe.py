"""The registry's ``GET http://<name>/health`` probe of an instance whose key was deleted (§9).

The one place in :mod:`kvsvc.cluster` besides :mod:`kvsvc.cluster.etcd` that talks HTTP: every
``requests`` error is an answer here ("not healthy"), never an exception for the caller.

Threading: a :class:`HealthProbe` belongs to one thread (its ``requests.Session`` is not
shared); the registry's timer thread builds it in its setup and closes it in its teardown.
"""

from __future__ import annotations

import logging

import requests

log = logging.getLogger(__name__)


class HealthProbe:
    """Probes ``http://<name>/health``; healthy means a 200 answer within ``timeout_s``.

    :param timeout_s: connect and read timeout of one probe, seconds (the registry's
        ``health_probe_timeout_s``).
    """

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._session = requests.Session()

    def healthy(self, name: str) -> bool:
        """One probe of instance ``name`` (``host:port``).

        :returns: True on a 200 answer; False on any other status, a connection failure or a
            timeout (logged at debug level).
        """
        try:
            reply = self._session.get(f"http://{name}/health", timeout=self._timeout_s)
            return reply.status_code == 200
        except requests.RequestException as exc:
            log.debug("registry: probe of %s failed: %s", name, exc)
            return False

    def close(self) -> None:
        """Close the session's connections (idempotent)."""
        self._session.close()
