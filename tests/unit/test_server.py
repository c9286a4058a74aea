"""gunicorn settings of ``kvsvc serve`` (kvsvc.server): the worker's thread count is the
validated ``worker_threads`` service setting, read by config/gunicorn.conf.py."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

from kvsvc.errors import ConfigError
from kvsvc.server import gunicorn_settings

CONF = Path(__file__).resolve().parents[2] / "config" / "gunicorn.conf.py"




def test_default_worker_threads_sized_for_a_proxy():
    settings = gunicorn_settings()
    assert (settings["worker_class"], settings["workers"], settings["threads"]) == (
        "gthread", 1, 128)


def test_worker_threads_from_the_environment_reach_the_gunicorn_config(monkeypatch):
    monkeypatch.setenv("KVSVC_WORKER_THREADS", "48")
    assert gunicorn_settings()["threads"] == 48
    namespace = runpy.run_path(str(CONF))
    assert (namespace["threads"], namespace["worker_class"]) == (48, "gthread")


@pytest.mark.parametrize("value", ["0", "3", "4097", "many", "8.5"])
def test_invalid_worker_threads_refuse_start_up_naming_the_setting(monkeypatch, value):
    monkeypatch.setenv("KVSVC_WORKER_THREADS", value)
    with pytest.raises(ConfigError) as info:
        gunicorn_settings()
    assert info.value.field == "KVSVC_WORKER_THREADS"   # where the bad value came from


def test_proxy_pool_holds_one_connection_per_worker_thread(monkeypatch):
    from kvsvc.http.app import create_app
    from kvsvc.settings import load_service_settings
    from kvsvc.http.extensions import ROUTING_EXTENSION

    app = create_app(load_service_settings(worker_threads=32), None)
    router = app.extensions[ROUTING_EXTENSION]
    try:
        assert router.proxy.settings.pool_maxsize == 32
    finally:
        router.close()


def test_serve_flag_reaches_the_worker_environment_and_bad_values_refuse(monkeypatch):
    from kvsvc.cli import build_parser, resolve_serve_settings, serve_environment

    args = build_parser().parse_args(["serve", "--kv_events_config_file", "",
                                      "--worker_threads", "64"])
    env = serve_environment(resolve_serve_settings(args), {"KVSVC_WORKER_THREADS": "9"})
    assert env["KVSVC_WORKER_THREADS"] == "64"
    # What the gunicorn config then reads in the serve process:
    monkeypatch.setenv("KVSVC_WORKER_THREADS", env["KVSVC_WORKER_THREADS"])
    assert gunicorn_settings()["threads"] == 64

    bad = build_parser().parse_args(["serve", "--kv_events_config_file", "",
                                     "--worker_threads", "2"])
    with pytest.raises(ConfigError) as info:
        resolve_serve_settings(bad)
    assert "worker_threads" in str(info.value)


def test_max_concurrent_snapshots_reaches_the_directory_through_serve(monkeypatch, tmp_path):
    import json

    from kvsvc.http.app import create_app
    from kvsvc.http.extensions import EXTENSION
    from kvsvc.cli import build_parser, resolve_serve_settings, serve_environment
    from kvsvc.settings import load_service_settings
    from kvsvc.http.extensions import ROUTING_EXTENSION

    cfg = tmp_path / "kv.json"
    cfg.write_text(json.dumps({"streams": [{
        "instance_name": "a:1", "dp_rank": 0, "block_size": 16,
        "endpoint": "tcp://127.0.0.1:1", "replay_endpoint": "tcp://127.0.0.1:2"}]}))
    args = build_parser().parse_args(["serve", "--kv_events_config_file", str(cfg),
                                      "--max_concurrent_snapshots", "3"])
    env = serve_environment(resolve_serve_settings(args), {})
    assert env["KVSVC_MAX_CONCURRENT_SNAPSHOTS"] == "3"
    for key, value in env.items():
        if key.startswith("KVSVC_"):
            monkeypatch.setenv(key, value)
    settings = load_service_settings()  # what the gunicorn worker reads
    app = create_app(settings, settings.kv_events_config())
    try:
        directory = app.extensions[EXTENSION].directory
        assert directory.snapshot_gate().permits == 3  # nothing started: no stream thread
    finally:
        app.extensions[ROUTING_EXTENSION].close()


def test_a_tokenizer_that_does_not_load_is_named_as_it_was_given(monkeypatch, tmp_path):
    """Checks after parsing (the tokenizer loads in the app factory) name the flag or the
    variable, whichever gave the value."""
    from kvsvc.cli import build_parser, resolve_serve_settings

    missing = str(tmp_path / "nx")
    by_flag = build_parser().parse_args(["serve", "--kv_events_config_file", "",
                                         "--tokenizer_path", missing])
    with pytest.raises(ConfigError) as info:
        resolve_serve_settings(by_flag)
    assert (info.value.field, info.value.message) == ("--tokenizer_path", f"{missing} not found")
    monkeypatch.setenv("KVSVC_TOKENIZER_PATH", missing)
    by_env = build_parser().parse_args(["serve", "--kv_events_config_file", ""])
    with pytest.raises(ConfigError) as info:
        resolve_serve_settings(by_env)
    assert (info.value.field, info.value.message) == ("KVSVC_TOKENIZER_PATH", f"{missing} not found")


def test_post_worker_init_sets_the_switch_interval_then_starts(clean_env) -> None:
    """The worker's switch interval comes from ``--worker_switch_interval_ms``, set before the
    service starts (after the fork: the arbiter keeps Python's own)."""
    import sys
    from types import SimpleNamespace

    from kvsvc.http.extensions import EXTENSION
    from kvsvc.server import post_worker_init
    from kvsvc.settings import load_service_settings
    settings = load_service_settings(worker_switch_interval_ms=0.25, kv_events_config_file="")
    seen: list[float] = []
    service = SimpleNamespace(settings=settings,
                              start=lambda timeout_s: seen.append(sys.getswitchinterval()))
    worker = SimpleNamespace(pid=1, wsgi=SimpleNamespace(extensions={EXTENSION: service}))
    saved = sys.getswitchinterval()
    try:
        post_worker_init(worker)
        assert seen == [sys.getswitchinterval()]
        assert abs(seen[0] - 0.00025) < 1e-9
    finally:
        sys.setswitchinterval(saved)
    assert load_service_settings(kv_events_config_file="").worker_switch_interval_ms == 0.0


def test_switch_interval_unset_is_short_for_native_dispatch_only() -> None:
    """0 (the default) means 0.5 ms with native xLLM dispatch (baidu_std answers waiting behind
    a busy thread) and Python's 5 ms otherwise (forced switches cost HTTP requests' CPU); a
    value given is used as it is."""
    from types import SimpleNamespace

    from kvsvc.server import switch_interval_ms

    def of(ms: float, dispatch: str) -> float:
        return switch_interval_ms(SimpleNamespace(worker_switch_interval_ms=ms,  # type: ignore[arg-type]
                                                  xllm_dispatch=dispatch))

    assert of(0.0, "http") == 5.0
    assert of(0.0, "native") == 0.5
    assert of(2.5, "native") == 2.5
    assert of(0.25, "http") == 0.25
