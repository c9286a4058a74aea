"""The ``kvsvc`` command (also ``python -m kvsvc``).

Subcommands:

- ``serve``: validate the settings and the §8 file, export them as ``KVSVC_*`` variables and
  replace this process with gunicorn (``python -m gunicorn -c config/gunicorn.conf.py
  wsgi:app``) running in the foreground; Ctrl-C / SIGTERM stop it.
- ``check-config``: the same flags and ``KVSVC_*`` variables as ``serve``, and exactly its
  validation (:func:`validate_service`: settings, the §8 file, the token source, the etcd and
  discovery rules, the routing flags and tokenizer), then a summary; nothing is started. Meant
  as systemd's ``ExecStartPre=`` (``config/kvsvc.service``).
- ``sim``, ``demo``, ``soak``: the engine simulator, the demo and the chaos soak, imported
  only when used.

Exit codes: 0 success, 2 invalid configuration or usage (the offending field named on stderr).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from kvsvc.config import LOG_FORMATS, LOG_LEVELS, KvEventsConfig, ServiceSettings, load_service_settings
from kvsvc.errors import ConfigError

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_CONFIG = 2

#: The source checkout holding ``wsgi.py`` and ``config/gunicorn.conf.py``.
PROJECT_ROOT = Path(__file__).resolve().parent.parent
GUNICORN_CONF = PROJECT_ROOT / "config" / "gunicorn.conf.py"

_LOG_LEVELS = LOG_LEVELS

#: Subcommands implemented elsewhere, imported on use: name -> (module, help).
_LAZY_COMMANDS = {
    "sim": ("kvsvc.testbed.sim.cli", "run a simulated engine publishing KV events"),
    "demo": ("kvsvc.testbed.demo", "run the end-to-end demo"),
    "soak": ("kvsvc.testbed.soak", "run the chaos soak audited against ground truth"),
    "bench-routing": ("kvsvc.testbed.bench_routing", "replay traces through the router per policy"),
}


#: ``serve`` flags of the routing settings (§11), passed through as ``KVSVC_*``.
_ROUTING_FLAGS = ("load_balance_policy", "car_prefill_lambda", "car_host_hit_weight",
                  "tokenizer_path", "model", "upstream_connect_timeout_s",
                  "upstream_read_timeout_s", "max_request_bytes")


#: ``serve`` flags of logging and metrics, passed through as ``KVSVC_*``.
_OPS_FLAGS = ("log_format", "access_log", "metrics_require_token")

#: ``serve`` flags of the worker's sizing, passed through as ``KVSVC_*`` (repr of the value).
_SERVER_FLAGS = ("worker_threads", "max_concurrent_snapshots")


def _add_serve(sub: Any) -> None:
    p = sub.add_parser("serve", help="run the HTTP service under gunicorn (foreground)",
                       description="Run kvsvc under gunicorn. Flags override KVSVC_* env vars.")
    _add_service_flags(p)
    p.set_defaults(func=cmd_serve)


def _bool_flag(value: str) -> bool:
    """``true``/``false`` (also 1/0, yes/no, on/off) for the boolean flags."""
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def _add_service_flags(p: argparse.ArgumentParser) -> None:
    """The flags of ``serve`` (and of ``check-config``, which validates the same things)."""
    p.add_argument("--host", help="HTTP bind address (KVSVC_HOST, default 0.0.0.0)")
    p.add_argument("--port", type=int, help="HTTP port (KVSVC_PORT, default 8888)")
    p.add_argument("--kv_events_config_file",
                   help="§8 JSON file; empty disables the index (KVSVC_KV_EVENTS_CONFIG_FILE)")
    p.add_argument("--internal_api_token_file",
                   help="file holding the X-Internal-Token value (KVSVC_INTERNAL_API_TOKEN_FILE)")
    p.add_argument("--internal_api_token",
                   help="token value; visible in `ps` to every local user: prefer "
                        "KVSVC_INTERNAL_API_TOKEN or --internal_api_token_file")
    p.add_argument("--max_query_tokens", type=int,
                   help="largest token_ids list of a query (KVSVC_MAX_QUERY_TOKENS)")
    p.add_argument("--log_level", choices=_LOG_LEVELS, help="log level (KVSVC_LOG_LEVEL)")
    p.add_argument("--log_format", choices=LOG_FORMATS,
                   help="json: one JSON object per line (default, for journald/log shippers); "
                        "text: plain lines for a terminal (KVSVC_LOG_FORMAT)")
    p.add_argument("--access_log", type=_bool_flag, nargs="?", const=True,
                   help="gunicorn per-request access lines on stdout (KVSVC_ACCESS_LOG, "
                        "default false)")
    p.add_argument("--metrics_require_token", type=_bool_flag, nargs="?", const=True,
                   help="require X-Internal-Token on GET /metrics too "
                        "(KVSVC_METRICS_REQUIRE_TOKEN, default false)")
    p.add_argument("--etcd_addr",
                   help="etcd host:port of the instance registry (§9); required when the "
                        "config file enables discovery (KVSVC_ETCD_ADDR, default: no registry)")
    p.add_argument("--etcd_namespace",
                   help="registry key namespace, keys under /<ns>/ (KVSVC_ETCD_NAMESPACE)")
    p.add_argument("--detect_disconnected_instance_interval", type=float,
                   help="seconds a SUSPECT instance is kept before removal "
                        "(KVSVC_DETECT_DISCONNECTED_INSTANCE_INTERVAL, default 15)")
    p.add_argument("--self_address",
                   help="host:port engines reach this service at, published as master "
                        "(KVSVC_SELF_ADDRESS, default host:port)")
    # Routing (§11), xllm-service's flag names; see kvsvc.http.routes.
    p.add_argument("--load_balance_policy", help="RR or CAR (KVSVC_LOAD_BALANCE_POLICY, "
                   "default CAR); SLO_AWARE is not supported")
    p.add_argument("--car_prefill_lambda", type=float,
                   help="CAR cache-miss weight in [0, 1] (KVSVC_CAR_PREFILL_LAMBDA, default 0.5)")
    p.add_argument("--car_host_hit_weight", type=float,
                   help="CAR Host-hit weight in [0, 1] (KVSVC_CAR_HOST_HIT_WEIGHT, default 0.5)")
    p.add_argument("--tokenizer_path", help="tokenizer.json or a directory with it and "
                   "tokenizer_config.json (KVSVC_TOKENIZER_PATH; empty: text hits are 0)")
    p.add_argument("--model", help="comma-separated served model names (KVSVC_MODEL; empty: "
                   "any name accepted)")
    p.add_argument("--upstream_connect_timeout_s", type=float,
                   help="upstream connect timeout, s (KVSVC_UPSTREAM_CONNECT_TIMEOUT_S, 2)")
    p.add_argument("--upstream_read_timeout_s", type=float,
                   help="upstream read timeout, s (KVSVC_UPSTREAM_READ_TIMEOUT_S, 600)")
    p.add_argument("--max_request_bytes", type=int,
                   help="largest OpenAI request body, bytes (KVSVC_MAX_REQUEST_BYTES, 16 MiB)")
    p.add_argument("--max_concurrent_snapshots", type=int,
                   help="snapshot recoveries running at once across all streams, 1-128; the "
                        "others queue (KVSVC_MAX_CONCURRENT_SNAPSHOTS, default 1)")
    p.add_argument("--worker_threads", type=int,
                   help="threads of the gunicorn worker, 4-4096: requests served at once, "
                        "proxied ones included (KVSVC_WORKER_THREADS, default 128)")


def _add_check_config(sub: Any) -> None:
    p = sub.add_parser(
        "check-config", help="validate what `serve` would run with (same flags and env)",
        description="Validate exactly what `kvsvc serve` validates with the same flags and "
                    "KVSVC_* variables (settings, §8 file, token source, etcd/discovery "
                    "rules, routing); print a summary. Starts nothing. Exit 0 or 2.")
    _add_service_flags(p)
    p.set_defaults(func=cmd_check_config)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser (``sim``/``demo`` are listed; their own flags load on use)."""
    parser = argparse.ArgumentParser(
        prog="kvsvc", description="kvsvc: KV-cache-aware router and KV-event directory.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(sub)
    _add_check_config(sub)
    for name, (_, help_text) in _LAZY_COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def _config_error(exc: ConfigError) -> int:
    print(f"kvsvc: invalid configuration: {exc.field or 'config'}: {exc.message}",
          file=sys.stderr)
    return EXIT_CONFIG


def resolve_serve_settings(args: argparse.Namespace) -> ServiceSettings:
    """Settings of ``serve`` from flags over ``KVSVC_*`` env, with the §8 file and the token
    checked too, so that a bad config fails here and not inside a gunicorn worker.

    :raises ConfigError: naming the field (``--port``, ``streams[0].endpoint``, ...).
    """
    settings = load_service_settings(
        host=args.host, port=args.port, kv_events_config_file=args.kv_events_config_file,
        internal_api_token=args.internal_api_token,
        internal_api_token_file=args.internal_api_token_file,
        max_query_tokens=args.max_query_tokens, log_level=args.log_level,
        etcd_addr=args.etcd_addr, etcd_namespace=args.etcd_namespace,
        detect_disconnected_instance_interval=args.detect_disconnected_instance_interval,
        self_address=args.self_address,
        **{name: getattr(args, name, None)
           for name in _ROUTING_FLAGS + _OPS_FLAGS + _SERVER_FLAGS})
    try:
        validate_service(settings)
    except ConfigError as exc:
        # Checks after parsing (a tokenizer that does not load, ...) name the flag; name the
        # variable instead when that is where the value came from.
        name = exc.field.removeprefix("--")
        if (exc.field.startswith("--") and getattr(args, name, None) is None
                and os.environ.get(f"KVSVC_{name.upper()}")):
            raise ConfigError(f"KVSVC_{name.upper()}", exc.message) from exc
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
    resolved settings as ``KVSVC_*`` (paths made absolute: gunicorn runs in the project root).
    The token travels in the environment or as a file path, never in argv.

    :param settings: validated settings.
    :param base: the current environment.
    """
    env = {k: v for k, v in base.items() if not k.startswith("KVSVC_")}
    cfg = settings.kv_events_config_file
    env.update({
        "KVSVC_HOST": settings.host,
        "KVSVC_PORT": str(settings.port),
        "KVSVC_KV_EVENTS_CONFIG_FILE": os.path.abspath(cfg) if cfg else "",
        "KVSVC_MAX_QUERY_TOKENS": str(settings.max_query_tokens),
        "KVSVC_LOG_LEVEL": settings.log_level.lower(),
        "KVSVC_LOG_FORMAT": settings.log_format,
        "KVSVC_ACCESS_LOG": "true" if settings.access_log else "false",
        "KVSVC_METRICS_REQUIRE_TOKEN": "true" if settings.metrics_require_token else "false",
        "KVSVC_ETCD_ADDR": settings.etcd_addr,
        "KVSVC_ETCD_NAMESPACE": settings.etcd_namespace,
        "KVSVC_DETECT_DISCONNECTED_INSTANCE_INTERVAL":
            repr(settings.detect_disconnected_instance_interval),
        "KVSVC_SELF_ADDRESS": settings.self_address,
    })
    for name in _ROUTING_FLAGS + _SERVER_FLAGS:
        value = getattr(settings, name)
        if name == "tokenizer_path" and value:
            value = os.path.abspath(value)
        env["KVSVC_" + name.upper()] = value if isinstance(value, str) else repr(value)
    if settings.internal_api_token is not None:
        env["KVSVC_INTERNAL_API_TOKEN"] = settings.internal_api_token.get_secret_value()
    elif settings.internal_api_token_file:
        env["KVSVC_INTERNAL_API_TOKEN_FILE"] = os.path.abspath(settings.internal_api_token_file)
    return env


def cmd_serve(args: argparse.Namespace) -> int:
    """``kvsvc serve``: validate, then exec gunicorn in the foreground (does not return on
    success).

    :returns: ``EXIT_CONFIG`` on invalid configuration or a missing gunicorn config.
    """
    try:
        settings = resolve_serve_settings(args)
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


def summarize_service(settings: ServiceSettings, config: Optional[KvEventsConfig]) -> list[str]:
    """Human-readable lines describing validated service settings (never the token itself)."""
    token = ("from KVSVC_INTERNAL_API_TOKEN" if settings.internal_api_token is not None else
             f"from file {settings.internal_api_token_file}" if settings.internal_api_token_file
             else "none (internal endpoints open)")
    lines = [f"listen: {settings.host}:{settings.port}; internal token: {token}; "
             f"/metrics token: {'required' if settings.metrics_require_token else 'not required'}",
             f"registry: {settings.etcd_addr or 'none'}"
             + (f" (namespace {settings.etcd_namespace!r})" if settings.etcd_addr else ""),
             f"routing: {settings.load_balance_policy} (lambda {settings.car_prefill_lambda}, "
             f"host hit weight {settings.car_host_hit_weight}); tokenizer: "
             f"{settings.tokenizer_path or 'none'}",
             f"logs: {settings.log_format}, level {settings.log_level}, access log "
             f"{'on' if settings.access_log else 'off'}",
             f"worker: {settings.worker_threads} threads; snapshots at once: "
             f"{settings.max_concurrent_snapshots}"]
    if config is None:
        lines.append("kv_events_config_file: empty: KV index disabled")
    else:
        lines.extend(summarize(settings.kv_events_config_file, config))
    return lines


def summarize(path: str, config: KvEventsConfig) -> list[str]:
    """Human-readable lines describing a validated §8 config."""
    kept = config.kept_streams()
    lines = [f"kv_events_config_file: {path}: valid"]
    if config.discovery is not None and config.discovery.enabled:
        d = config.discovery
        lines.append(f"discovery: enabled (block_size={d.block_size}, topic={d.topic!r}, "
                     f"event_port_offset={d.event_port_offset}, "
                     f"replay_port_offset={d.replay_port_offset}, "
                     f"refresh_interval_ms={d.refresh_interval_ms})")
    instances = sorted({s.instance_name for s in kept})
    lines.append(f"streams: {len(config.streams)} configured, {len(kept)} kept "
                 f"(max_streams={config.max_streams}), {len(instances)} instances")
    for s in kept:
        lines.append(f"  {s.instance_name}/dp{s.dp_rank}: block_size={s.block_size} "
                     f"hash_seed={s.hash_seed} endpoint={s.endpoint} "
                     f"replay_endpoint={s.replay_endpoint} topic={s.topic!r}")
    lines.append(f"limits: max_blocks_per_stream={config.max_blocks_per_stream} "
                 f"max_message_bytes={config.max_message_bytes} "
                 f"max_buffered_bytes={config.max_buffered_bytes} "
                 f"replay_timeout_ms={config.replay_timeout_ms} "
                 f"resync_interval_ms={config.resync_interval_ms}")
    return lines


def cmd_check_config(args: argparse.Namespace) -> int:
    """``kvsvc check-config``: 0 and a summary on stdout, or 2 and the field on stderr.
    Validates exactly what ``serve`` does (:func:`resolve_serve_settings`)."""
    try:
        settings = resolve_serve_settings(args)
        config = settings.kv_events_config()
    except ConfigError as exc:
        return _config_error(exc)
    print("\n".join(summarize_service(settings, config)))
    return EXIT_OK


def _run_lazy(name: str, argv: Sequence[str]) -> int:
    module_name, help_text = _LAZY_COMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        print(f"kvsvc {name}: not available in this build ({exc})", file=sys.stderr)
        return EXIT_CONFIG
    parser = argparse.ArgumentParser(prog=f"kvsvc {name}", description=help_text)
    add_arguments: Callable[[argparse.ArgumentParser], None] = module.add_arguments
    add_arguments(parser)
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
