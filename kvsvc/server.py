"""gunicorn integration: settings derived from ``KVSVC_*`` env and the worker hooks.

``config/gunicorn.conf.py`` imports this module and exposes :func:`gunicorn_settings` as module
names plus the hooks. One ``gthread`` worker (the ``sync`` worker kills requests running past
``timeout``) with ``--worker_threads`` threads (``KVSVC_WORKER_THREADS``; default and range in
:mod:`kvsvc.settings`: a proxied request holds a thread until its answer is relayed, so this
caps the requests in flight), ``preload_app`` off, so the app (``wsgi:app``) and its
:class:`~kvsvc.service.Service` are built inside the worker process and the service's ZMQ context
and threads are only created after the fork: :func:`post_worker_init` starts the service,
:func:`worker_exit` closes it (§6: stream threads are owned and joined).

The arbiter's systemd READY=1 only means "socket bound"; readiness of the index is ``/ready``.
(gunicorn 27 ``Arbiter.start``: ``systemd.sd_notify("READY=1...")`` right after the listeners are
created, sent only when ``NOTIFY_SOCKET`` is set; ``kvsvc serve`` execs gunicorn, so the
arbiter is the unit's main process, as ``Type=notify`` with the default ``NotifyAccess=main``
needs.)

Logging is configured once, by gunicorn, from :func:`log_config` (``logconfig_dict``): the
arbiter, the worker and kvsvc's own loggers share it. ``--log_format json`` (default) writes one
JSON object per line (python-json-logger: ``timestamp``, ``level``, ``logger``, ``process``,
``message``, ``exc_info`` when there is one); ``text`` one plain line. gunicorn enables its
access logger whenever ``logconfig_dict`` is set, so with ``--access_log`` off the
``gunicorn.access`` logger is set to WARNING (it only logs at INFO) and writes nothing.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from gunicorn.glogging import Logger as GunicornGlogging

from kvsvc.address import format_host_port
from kvsvc.http.extensions import EXTENSION
from kvsvc.service import Service
from kvsvc.settings import LOG_LEVELS, ServiceSettings, load_service_settings

log = logging.getLogger(__name__)

#: Seconds a worker gets to finish requests and close its streams on SIGTERM.
GRACEFUL_TIMEOUT_S = 10
#: Seconds each stream thread gets to start (post_worker_init) and to stop (worker_exit).
STREAM_TIMEOUT_S = 5.0

#: Fields of a JSON log line besides ``timestamp`` (renamed: levelname -> level, name -> logger).
JSON_FIELDS = "%(levelname)s %(name)s %(process)d %(message)s"
TEXT_FORMAT = "%(asctime)s [%(process)d] [%(levelname)s] %(name)s: %(message)s"
#: gunicorn access line: client, request line, status, bytes, seconds, the answer's x-request-id.
#: No request header is logged
#: (the internal token travels in one).
ACCESS_LOG_FORMAT = '%(h)s "%(r)s" %(s)s %(b)s %(L)s %({x-request-id}o)s'


def bind_address(host: str, port: int) -> str:
    """gunicorn ``bind`` string; IPv6 literals get brackets.

    :param host: address to listen on, e.g. ``0.0.0.0``, ``127.0.0.1`` or ``::``.
    :param port: TCP port.
    """
    return format_host_port(host, port)


def log_config(level: str, log_format: str = "json", access_log: bool = False) -> dict[str, Any]:
    """``logging.config.dictConfig`` document: kvsvc and gunicorn errors to stderr at ``level``,
    access lines to stdout when ``access_log`` (else the access logger writes nothing), no
    duplicates.

    :param level: ``debug`` .. ``critical``.
    :param log_format: ``json`` (python-json-logger, one object per line) or ``text``.
    :param access_log: write gunicorn's per-request access lines.
    """
    level = level.upper()
    if log_format == "json":
        formatter: dict[str, Any] = {
            "()": "pythonjsonlogger.json.JsonFormatter", "fmt": JSON_FIELDS, "timestamp": True,
            "rename_fields": {"levelname": "level", "name": "logger"}}
    else:
        formatter = {"format": TEXT_FORMAT, "class": "logging.Formatter"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"generic": formatter},
        # Records logged while an OpenAI request runs carry its request id (JSON field).
        "filters": {"request_id": {"()": "kvsvc.http.admission.RequestIdFilter"}},
        "handlers": {
            "stderr": {"class": "logging.StreamHandler", "formatter": "generic",
                       "stream": "ext://sys.stderr", "filters": ["request_id"]},
            "stdout": {"class": "logging.StreamHandler", "formatter": "generic",
                       "stream": "ext://sys.stdout", "filters": ["request_id"]},
        },
        "root": {"level": level, "handlers": ["stderr"]},
        "loggers": {
            "gunicorn.error": {"level": level, "handlers": ["stderr"], "propagate": False},
            "gunicorn.access": {"level": "INFO" if access_log else "WARNING",
                                "handlers": ["stdout"], "propagate": False},
        },
    }


class GunicornLogger(GunicornGlogging):
    """gunicorn's logger, building a request's access line only when the access logger would
    write it (``--access_log``). With a ``logconfig_dict`` gunicorn takes access logging as on
    and builds every request's log atoms (its environ, both header sets, a ``strftime``) for a
    logger that drops them at INFO (:func:`log_config` sets it to WARNING)."""

    def setup(self, cfg: Any) -> None:
        """gunicorn's setup, then whether access lines are built, judged by the access logger
        as configured (gunicorn judges it before applying the configuration)."""
        super().setup(cfg)
        self._access_log_enabled = (self._compute_access_log_enabled()
                                    and self.access_log.isEnabledFor(logging.INFO))


def gunicorn_settings() -> dict[str, Any]:
    """gunicorn settings from the ``KVSVC_*`` environment (what ``kvsvc serve`` exports).

    :returns: setting name -> value, for the gunicorn config module's namespace.
    :raises ConfigError: an invalid ``KVSVC_*`` value, naming the field.
    """
    settings = load_service_settings()
    level = settings.log_level.lower() if settings.log_level.lower() in LOG_LEVELS else "info"
    return {
        "bind": [bind_address(settings.host, settings.port)],
        "workers": 1,
        "worker_class": "gthread",
        # Each proxied request holds a thread until its answer is relayed (ServiceSettings).
        "threads": settings.worker_threads,
        "preload_app": False,
        "graceful_timeout": GRACEFUL_TIMEOUT_S,
        "timeout": 30,
        "loglevel": level,
        "logconfig_dict": log_config(level, settings.log_format, settings.access_log),
        "access_log_format": ACCESS_LOG_FORMAT,
        "logger_class": "kvsvc.server.GunicornLogger",
        "proc_name": "kvsvc",
        # gunicorn >= 25.1 opens a control socket at one fixed per-user path by default; two
        # services on a host would fight over it, and kvsvc needs no runtime control surface.
        "control_socket_disable": True,
    }


#: The worker's switch interval (ms) when ``--worker_switch_interval_ms`` is 0: with native
#: xLLM dispatch, and otherwise (Python's own).
NATIVE_SWITCH_INTERVAL_MS = 0.5
DEFAULT_SWITCH_INTERVAL_MS = 5.0


def switch_interval_ms(settings: ServiceSettings) -> float:
    """The worker's interpreter switch interval, ms: ``--worker_switch_interval_ms`` when set,
    else :data:`NATIVE_SWITCH_INTERVAL_MS` with ``--xllm_dispatch native`` and
    :data:`DEFAULT_SWITCH_INTERVAL_MS` without."""
    if settings.worker_switch_interval_ms > 0:
        return settings.worker_switch_interval_ms
    return (NATIVE_SWITCH_INTERVAL_MS if settings.xllm_dispatch == "native"
            else DEFAULT_SWITCH_INTERVAL_MS)


def _service(worker: Any) -> Service:
    return worker.wsgi.extensions[EXTENSION]


def post_worker_init(worker: Any) -> None:
    """gunicorn hook, in the worker after the app is loaded: set the worker's switch interval
    (``--worker_switch_interval_ms``), then start the service's streams.

    :raises LifecycleError: a stream did not start; gunicorn then reports the worker failed to
        boot and the arbiter stops.
    """
    service = _service(worker)
    interval_ms = switch_interval_ms(service.settings)
    # Per process, and the arbiter's own value must not change: set in the worker only.
    sys.setswitchinterval(interval_ms / 1000.0)
    log.info("worker %s: starting service (switch interval %g ms)", worker.pid, interval_ms)
    service.start(timeout_s=STREAM_TIMEOUT_S)


def worker_exit(server: Any, worker: Any) -> None:
    """gunicorn hook, in the worker as it exits: close the service (joins stream threads)."""
    wsgi = getattr(worker, "wsgi", None)
    if wsgi is None or EXTENSION not in getattr(wsgi, "extensions", {}):
        return  # the app never loaded; nothing was started
    log.info("worker %s: closing service", worker.pid)
    _service(worker).close(timeout_s=STREAM_TIMEOUT_S)
