"""The ``kvsvc`` command (also ``python -m kvsvc``).

Subcommands:

- ``serve``: validate the settings and the §8 file, export them as ``KVSVC_*`` variables and
  replace this process with gunicorn (``python -m gunicorn -c config/gunicorn.conf.py
  wsgi:app``) running in the foreground; Ctrl-C / SIGTERM stop it.
- ``check-config``: the same flags and ``KVSVC_*`` variables as ``serve``, and exactly its
  validation (:func:`validate_service`: settings, the §8 file, the token source, the etcd and
  discovery rules, the routing flags and tokenizer), then a summary; nothing is started. Meant
  as systemd's ``ExecStartPre=`` (``config/kvsvc.service``).
- ``up``, ``sim``, ``demo``, ``soak``, ``bench-routing``: the local cluster, the engine
  simulator, the demo, the chaos soak and the routing benchmark (``kvsvc.testbed``), imported
  only when used.

Flags: every flag of every subcommand is accepted in both spellings, ``--etcd_addr`` (xllm-service's)
and ``--etcd-addr`` (:func:`kvsvc.settings.add_flag`); the same thing has the same name in every
subcommand (``sim``/``demo`` take ``--etcd_addr`` too); log levels in any case; every ``--help``
shows the defaults; ``kvsvc --version`` prints the version.

Exit codes: 0 success, 2 invalid configuration or usage: every problem found is printed on
stderr, one line each, naming the field and the bad value (``kvsvc: invalid configuration:
streams[0].endpoint: ...``); for ``serve`` also a listen address that cannot be bound,
checked before gunicorn starts.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from kvsvc import __version__
from kvsvc.config import KvEventsConfig
from kvsvc.errors import ConfigError
from kvsvc.settings import (
    DefaultsHelpFormatter,
    HelpFormatter,
    SettingRow,
    ServiceSettings,
    add_arguments,
    describe_settings,
    export_environment,
    flag_values,
    load_service_settings,
    policy_summary,
    source_of,
)

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_CONFIG = 2

#: The source checkout holding ``wsgi.py`` and ``config/gunicorn.conf.py``.
PROJECT_ROOT = Path(__file__).resolve().parent.parent
GUNICORN_CONF = PROJECT_ROOT / "config" / "gunicorn.conf.py"

#: Subcommands implemented elsewhere, imported on use: name -> (module, help).
_LAZY_COMMANDS = {
    "up": ("kvsvc.testbed.up", "run a whole local cluster in the foreground (etcd, simulated "
                               "engines, the router) until Ctrl-C"),
    "sim": ("kvsvc.testbed.sim.cli", "run a simulated engine publishing KV events"),
    "demo": ("kvsvc.testbed.demo", "run the end-to-end demo"),
    "soak": ("kvsvc.testbed.soak", "run the chaos soak audited against ground truth"),
    "bench-routing": ("kvsvc.testbed.bench_routing", "replay traces through the router per policy"),
}


def _add_serve(sub: Any) -> None:
    p = sub.add_parser("serve", help="run the HTTP service under gunicorn (foreground)",
                       description="Run kvsvc under gunicorn. Flags override KVSVC_* env vars.",
                       formatter_class=HelpFormatter)
    add_arguments(p)  # one flag per row of the settings table
    p.set_defaults(func=cmd_serve)


def _add_check_config(sub: Any) -> None:
    p = sub.add_parser(
        "check-config", help="validate what `serve` would run with (same flags and env)",
        description="Validate exactly what `kvsvc serve` validates with the same flags and "
                    "KVSVC_* variables (settings, §8 file, token source, etcd/discovery "
                    "rules, routing); print a summary. Starts nothing. Exit 0 or 2.",
        formatter_class=HelpFormatter)
    add_arguments(p)  # the same flags as serve: it validates the same things
    p.set_defaults(func=cmd_check_config)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser (``sim``/``demo`` are listed; their own flags load on use)."""
    parser = argparse.ArgumentParser(
        prog="kvsvc", description="kvsvc: KV-cache-aware router and KV-event directory.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(sub)
    _add_check_config(sub)
    for name, (_, help_text) in _LAZY_COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def _config_error(exc: ConfigError) -> int:
    """Print every problem of ``exc``, one line each, on stderr; the configuration exit code."""
    for problem in exc.problems:
        print(f"kvsvc: invalid configuration: {problem.field or 'config'}: {problem.message}",
              file=sys.stderr)
    return EXIT_CONFIG


def resolve_serve_settings(args: argparse.Namespace) -> ServiceSettings:
    """Settings of ``serve`` from flags over ``KVSVC_*`` env, with the §8 file and the token
    checked too, so that a bad config fails here and not inside a gunicorn worker.

    :raises ConfigError: naming the field (``--port``, ``streams[0].endpoint``, ...).
    """
    given = flag_values(args)
    settings = load_service_settings(**given)
    try:
        validate_service(settings)
    except ConfigError as exc:
        # Checks after parsing (a tokenizer that does not load, ...) name the flag; name the
        # variable instead when that is where the value came from.
        name = exc.field.removeprefix("--")
        if exc.field.startswith("--") and name in given:
            field = source_of(name, given).field
            if field != exc.field:
                raise ConfigError(field, exc.message, more=exc.problems[1:]) from exc
        raise
    return settings


def validate_service(settings: ServiceSettings) -> Optional[KvEventsConfig]:
    """Everything the gunicorn worker's ``create_app`` checks, without starting anything: the
    §8 file (and the etcd requirement of discovery), the token source, the registry settings,
    the routing policy and the tokenizer. ``serve`` and ``check-config`` both call it, so a
    configuration ``check-config`` accepts is one the worker accepts.

    :returns: the validated §8 config (``None``: index disabled).
    :raises ConfigError: naming the field.
    """
    from kvsvc.http.app import create_app  # the app's own construction path: nothing starts there
    from kvsvc.http.extensions import ROUTING_EXTENSION

    kv_config = settings.kv_events_config()
    app = create_app(settings, kv_config)
    # The app is dropped; only the routing proxy's (still unused) session needs closing.
    app.extensions[ROUTING_EXTENSION].close()
    return kv_config


def serve_environment(settings: ServiceSettings, base: dict[str, str]) -> dict[str, str]:
    """The gunicorn process's environment: ``base`` without any ``KVSVC_*`` variable, plus the
    resolved settings as ``KVSVC_*`` (paths made absolute: gunicorn runs in the project root;
    :func:`kvsvc.settings.export_environment`). The token travels in the environment or as a
    file path, never in argv.

    :param settings: validated settings.
    :param base: the current environment.
    """
    return export_environment(settings, base)


def check_bind(host: str, port: int, field: str = "--port") -> None:
    """Refuse a listen address that cannot be bound now (taken, not local, privileged), the
    way gunicorn will bind it: the first address ``host`` resolves to, with ``SO_REUSEADDR``
    (gunicorn sets it, so a port whose old connections are in TIME_WAIT is accepted; one with
    a listener is not). Probing before gunicorn starts turns its five bind retries and exit 1
    after about 8 s (which systemd restarts) into an immediate configuration error. The
    socket is closed at once; another process may still take the port before gunicorn binds.

    :param field: the flag or variable named in the error.
    :raises ConfigError: naming ``field``, the address and the reason.
    """
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigError(field, f"cannot listen on {shown}: {exc}") from exc
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(addr)
        except OSError as exc:
            reason = ("already in use (another process listens there; `ss -ltnp "
                      f"'sport = :{port}'` names it)" if exc.errno == errno.EADDRINUSE
                      else exc.strerror or str(exc))
            raise ConfigError(field, f"cannot listen on {shown}: {reason}") from exc


def cmd_serve(args: argparse.Namespace) -> int:
    """``kvsvc serve``: validate, check that the listen addresses (HTTP, and baidu_std when
    served) can be bound (:func:`check_bind`), then exec gunicorn in the foreground (does not return on success).

    :returns: ``EXIT_CONFIG`` on invalid configuration, a listen address that cannot be bound
        or a missing gunicorn config.
    """
    try:
        settings = resolve_serve_settings(args)
        check_bind(settings.host, settings.port, source_of("port", flag_values(args)).field)
        if settings.rpc_address() is not None:
            # The baidu_std port (§13) is bound by the worker after the fork: refuse a taken
            # one here, before gunicorn starts, as the HTTP port.
            check_bind(settings.rpc_host, settings.rpc_port,
                       source_of("rpc_port", flag_values(args)).field)
    except ConfigError as exc:
        return _config_error(exc)
    if not GUNICORN_CONF.is_file() or not (PROJECT_ROOT / "wsgi.py").is_file():
        print(f"kvsvc: {GUNICORN_CONF} or wsgi.py not found: `kvsvc serve` runs from the "
              "source checkout (pip install -e .)", file=sys.stderr)
        return EXIT_CONFIG
    env = serve_environment(settings, dict(os.environ))
    argv = [sys.executable, "-m", "gunicorn", "-c", str(GUNICORN_CONF), "wsgi:app"]
    # Replace this process: gunicorn's arbiter then owns the terminal's signals directly
    # (SIGINT/SIGTERM stop it and its worker), and no parent is left to forward them.
    os.chdir(PROJECT_ROOT)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(argv[0], argv, env)
    return EXIT_OK  # not reached



def summarize_service(settings: ServiceSettings, config: Optional[KvEventsConfig],
                      source: Optional[Callable[[SettingRow], str]] = None) -> list[str]:
    """Human-readable lines describing validated service settings (never the token itself):
    a summary, the §8 config, then every setting of the table with where it came from.

    :param source: origin of a setting's value (``--port``, ``KVSVC_PORT``, ``default``);
        ``None`` leaves it out.
    """
    token = ("from KVSVC_INTERNAL_API_TOKEN" if settings.internal_api_token is not None else
             f"from file {settings.internal_api_token_file}" if settings.internal_api_token_file
             else "none (internal endpoints open)")
    lines = [f"listen: {settings.host}:{settings.port}; internal token: {token}; "
             f"/metrics token: {'required' if settings.metrics_require_token else 'not required'}",
             f"registry: {settings.etcd_addr or 'none'}"
             + (f" (namespace {settings.etcd_namespace!r})" if settings.etcd_addr else ""),
             f"routing: {settings.load_balance_policy} ({policy_summary(settings)}); "
             f"tokenizer: {settings.tokenizer_path or 'none'}",
             f"logs: {settings.log_format}, level {settings.log_level}, access log "
             f"{'on' if settings.access_log else 'off'}",
             f"worker: {settings.worker_threads} threads; snapshots at once: "
             f"{settings.max_concurrent_snapshots}"]
    if config is None:
        lines.append("kv_events_config_file: empty: KV index disabled")
    else:
        lines.extend(summarize(settings.kv_events_config_file, config))
    lines.extend(describe_settings(settings, source))
    return lines


def summarize(path: str, config: KvEventsConfig) -> list[str]:
    """Human-readable lines describing a validated §8 config: with discovery the backends it
    subscribes and each one's replay mode (§9), then every kept static stream with its own
    ``replay_mode`` (``snapshot`` §7 or ``history`` §7h)."""
    from kvsvc.cluster.discovery import describe_backends  # as validate_service: on use only

    kept = config.kept_streams()
    lines = [f"kv_events_config_file: {path}: valid"]
    if config.discovery is not None and config.discovery.enabled:
        d = config.discovery
        lines.append(f"discovery: enabled (block_size={d.block_size}, topic={d.topic!r}, "
                     f"event_port_offset={d.event_port_offset}, "
                     f"replay_port_offset={d.replay_port_offset}, "
                     f"refresh_interval_ms={d.refresh_interval_ms})")
        lines.append(f"discovery backends (replay mode): {describe_backends(d)}; instances of "
                     "other backends get no streams")
    instances = sorted({s.instance_name for s in kept})
    lines.append(f"streams: {len(config.streams)} configured, {len(kept)} kept "
                 f"(max_streams={config.max_streams}), {len(instances)} instances")
    for s in kept:
        lines.append(f"  {s.instance_name}/dp{s.dp_rank}: block_size={s.block_size} "
                     f"hash_seed={s.hash_seed} endpoint={s.endpoint} "
                     f"replay_endpoint={s.replay_endpoint} topic={s.topic!r} "
                     f"replay_mode={s.replay_mode.value}")
    lines.append(f"limits: max_blocks_per_stream={config.max_blocks_per_stream} "
                 f"max_message_bytes={config.max_message_bytes} "
                 f"max_buffered_bytes={config.max_buffered_bytes} "
                 f"replay_timeout_ms={config.replay_timeout_ms} "
                 f"resync_interval_ms={config.resync_interval_ms}")
    return lines


def cmd_check_config(args: argparse.Namespace) -> int:
    """``kvsvc check-config``: 0 and a summary on stdout, or 2 and every problem on stderr.
    Validates exactly what ``serve`` does (:func:`resolve_serve_settings`); only a valid
    configuration's warnings (:func:`kvsvc.service.startup_warnings`, what the worker logs at
    start) follow, on stderr, so that no warning comes before an error."""
    from kvsvc.service import startup_warnings  # as validate_service: the service on use only

    try:
        settings = resolve_serve_settings(args)
        config = settings.kv_events_config()
    except ConfigError as exc:
        return _config_error(exc)
    print("\n".join(summarize_service(settings, config, _source_of(args))))
    sys.stdout.flush()
    for line in startup_warnings(settings, config):
        print(f"kvsvc: warning: {line}", file=sys.stderr)
    return EXIT_OK


def _source_of(args: argparse.Namespace) -> Callable[[SettingRow], str]:
    """Where each setting of ``args`` came from (:func:`kvsvc.settings.source_of`): its flag,
    else its variable, else default."""
    given = flag_values(args)
    return lambda row: source_of(row.name, given).name


def lazy_parser(name: str) -> tuple[argparse.ArgumentParser, Any]:
    """The parser of a subcommand implemented elsewhere (``sim``, ``demo``, ...), with the
    module that implements it: its ``add_arguments`` flags (declared with
    :func:`kvsvc.settings.add_flag`: both spellings), help with every default.

    :raises ImportError: the module is not available in this build.
    """
    module_name, help_text = _LAZY_COMMANDS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"kvsvc {name}", description=help_text,
                                     formatter_class=DefaultsHelpFormatter)
    add_module_arguments: Callable[[argparse.ArgumentParser], None] = module.add_arguments
    add_module_arguments(parser)
    return parser, module


def _run_lazy(name: str, argv: Sequence[str]) -> int:
    try:
        parser, module = lazy_parser(name)
    except ImportError as exc:
        print(f"kvsvc {name}: not available in this build ({exc})", file=sys.stderr)
        return EXIT_CONFIG
    return int(module.run(parser.parse_args(list(argv))))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``kvsvc`` / ``python -m kvsvc``.

    :param argv: arguments without the program name (``sys.argv[1:]`` when ``None``).
    :returns: the process exit code.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _LAZY_COMMANDS:
        return _run_lazy(argv[0], argv[1:])
    logging.basicConfig(level=logging.WARNING, format="kvsvc: %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return int(args.func(args))
