"""The settings table (kvsvc.settings): one declaration per setting, from which the flags, the
``KVSVC_*`` variables, their export to the gunicorn worker, ``check-config`` and the README
table are produced; and the settings' sources and validation (flags over env over defaults,
errors naming ``--flag`` or ``KVSVC_VAR``)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from kvsvc import settings as settings_module
from kvsvc.cli import build_parser, main, resolve_serve_settings, serve_environment
from kvsvc.errors import ConfigError
from kvsvc.routing import policies as policy
from kvsvc.settings import (
    CAR_WEIGHT_RANGE,
    POLICY_NAMES,
    README_BEGIN,
    README_END,
    SECTIONS,
    SETTINGS,
    UNSUPPORTED_POLICIES,
    ServiceSettings,
    export_environment,
    flag_values,
    load_service_settings,
    markdown_table,
    replace_readme_table,
)

README = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
REGENERATE = "python -m kvsvc.settings --update-readme docs/configuration.md"


# -- the table ------------------------------------------------------------------------------------

def test_readme_settings_table_is_the_generated_one():
    text = README.read_text(encoding="utf-8")
    assert README_BEGIN in text and README_END in text, (
        f"docs/configuration.md lost its settings-table markers; put them back and run `{REGENERATE}`")
    current = text[text.index(README_BEGIN) + len(README_BEGIN):text.index(README_END)]
    assert current.strip("\n") == markdown_table().strip("\n"), (
        f"docs/configuration.md's settings table differs from kvsvc/settings.py: run `{REGENERATE}`")


def test_every_setting_has_flag_env_help_and_section():
    assert [row.name for row in SETTINGS] == list(ServiceSettings.model_fields)
    for row in SETTINGS:
        assert row.flag == f"--{row.name}"
        assert row.env == f"KVSVC_{row.name.upper()}"
        assert row.meta.help.strip(), row.name
        assert row.meta.section in SECTIONS, row.name
    assert len({row.env for row in SETTINGS}) == len(SETTINGS)


def test_markdown_lists_every_setting_once_and_the_readme_can_be_regenerated(tmp_path, capsys):
    table = markdown_table()
    for row in SETTINGS:
        assert table.count(f"`{row.env}`") == 1, row.name
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{README_BEGIN}\nstale\n{README_END}\nrest\n", encoding="utf-8")
    assert settings_module.main(["--update-readme", str(readme)]) == 0
    assert readme.read_text(encoding="utf-8") == (
        f"intro\n{README_BEGIN}\n{table}{README_END}\nrest\n")
    assert replace_readme_table(readme.read_text(encoding="utf-8")) == readme.read_text(
        encoding="utf-8")
    assert settings_module.main(["--markdown"]) == 0
    assert capsys.readouterr().out == table
    with pytest.raises(ValueError):
        replace_readme_table("no markers")


def _actions(command: str) -> dict[str, argparse.Action]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a for a in sub.choices[command]._actions if a.option_strings}


@pytest.mark.parametrize("command", ["serve", "check-config"])
def test_flags_come_from_the_table(command):
    actions = _actions(command)
    assert set(actions) - {"help"} == {row.name for row in SETTINGS}
    for row in SETTINGS:
        action = actions[row.name]
        # xllm-service's spelling first, the dashed one generated beside it.
        dashed = row.flag.replace("_", "-")
        assert action.option_strings == ([row.flag, dashed] if dashed != row.flag
                                         else [row.flag])
        # Not given is None, so the KVSVC_* variable or the table's default applies.
        assert action.default is None
        assert row.env in action.help and f"default {row.default_text()}" in action.help


def test_no_flag_no_env_gives_the_table_defaults(clean_env):
    clean_env.delenv("KVSVC_RPC_PORT")   # set by the conftest for every other test
    settings = resolve_serve_settings(build_parser().parse_args(["serve"]))
    for row in SETTINGS:
        assert getattr(settings, row.name) == row.default, row.name


def test_range_and_unit_shown_in_help():
    actions = _actions("serve")
    assert "1-65535" in actions["port"].help
    assert "default 600 s" in actions["upstream_read_timeout_s"].help
    assert "> 0, ≤ 3600" in actions["detect_disconnected_instance_interval"].help
    assert actions["log_format"].choices == ("json", "text")
    assert actions["load_balance_policy"].choices is None  # SLO_AWARE gets its own message
    assert "RR, CAR" in actions["load_balance_policy"].help


# -- export to the gunicorn worker ----------------------------------------------------------------

def _non_default_values(tmp_path: Path) -> dict[str, Any]:
    """One valid value, not the default, per setting (the token comes in a second round)."""
    values = {
        "host": "127.0.0.1", "port": 9001, "kv_events_config_file": str(tmp_path / "kv.json"),
        "internal_api_token_file": str(tmp_path / "token"), "max_query_tokens": 500,
        "log_level": "debug", "log_format": "text", "access_log": True,
        "metrics_require_token": True, "etcd_addr": "127.0.0.1:2379", "etcd_namespace": "ns",
        "detect_disconnected_instance_interval": 2.5, "self_address": "10.0.0.1:8888",
        "max_concurrent_snapshots": 3, "load_balance_policy": "RR", "car_prefill_lambda": 0.25,
        "car_host_hit_weight": 1.0, "max_load_age_s": 30.0,
        "target_ttft": 800, "target_tpot": 40, "default_prefill_tokens_per_s": 5000.0,
        "tokenizer_path": str(tmp_path / "tok"), "model": "m1,m2",
        "upstream_connect_timeout_s": 0.5, "upstream_read_timeout_s": 30.0,
        "max_request_bytes": 4096, "worker_threads": 16, "worker_switch_interval_ms": 2.5,
        "dp_rank_routing": False,
        "load_scrape_backends": "vllm", "load_scrape_interval_ms": 250,
        "api_key": "client-key-1", "max_in_flight_requests": 12,
        "tokenizer_cache_tokens": 4096,
        "xllm_dispatch": "native", "pending_ttl_ms": 0, "pending_blocks": 100, "ttft_work_weight": 1.0,
        "ttft_host_hit_weight": 0.5,
        "rpc_port": 9889, "rpc_host": "127.0.0.1", "rpc_advertise_host": "10.0.0.1",
    }
    names = {row.name for row in SETTINGS}
    assert set(values) | {"internal_api_token"} == names, "give every new setting a value here"
    for name, value in values.items():
        assert value != ServiceSettings.model_fields[name].default, name
    return values


def _clear(monkeypatch) -> None:
    for key in [k for k in os.environ if k.startswith("KVSVC_")]:
        monkeypatch.delenv(key)


def _reload_from(env: dict[str, str], monkeypatch) -> ServiceSettings:
    """What the gunicorn worker reads from the environment ``kvsvc serve`` exports; the
    environment is cleared again afterwards."""
    _clear(monkeypatch)
    for key, value in env.items():
        if key.startswith("KVSVC_"):
            monkeypatch.setenv(key, value)
    try:
        return load_service_settings()
    finally:
        _clear(monkeypatch)


def test_env_export_round_trips_every_setting(clean_env, tmp_path):
    values = _non_default_values(tmp_path)
    original = load_service_settings(**values)
    env = export_environment(original, {"PATH": "/bin", "KVSVC_STALE": "x"})
    assert env["PATH"] == "/bin" and "KVSVC_STALE" not in env
    assert _reload_from(env, clean_env) == original
    # The token travels as its own variable instead of the file.
    del values["internal_api_token_file"]
    with_token = load_service_settings(internal_api_token="s3cret", **values)
    env = export_environment(with_token, {})
    assert env["KVSVC_INTERNAL_API_TOKEN"] == "s3cret" and "KVSVC_INTERNAL_API_TOKEN_FILE" not in env
    assert _reload_from(env, clean_env) == with_token
    # Defaults round-trip too; an unset token is not exported at all.
    defaults = load_service_settings()
    env = export_environment(defaults, {})
    assert "KVSVC_INTERNAL_API_TOKEN" not in env and "KVSVC_INTERNAL_API_TOKEN_FILE" not in env
    assert _reload_from(env, clean_env) == defaults


def test_export_makes_paths_absolute_and_matches_serve(clean_env, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(["serve", "--kv_events_config_file", "",
                                      "--tokenizer_path", "tok", "--internal_api_token_file",
                                      "token", "--detect_disconnected_instance_interval", "7"])
    settings = load_service_settings(tokenizer_path="tok", internal_api_token_file="token",
                                     detect_disconnected_instance_interval=7)
    env = serve_environment(settings, {})
    assert env == export_environment(settings, {})
    assert env["KVSVC_TOKENIZER_PATH"] == str(tmp_path / "tok")
    assert env["KVSVC_INTERNAL_API_TOKEN_FILE"] == str(tmp_path / "token")
    assert env["KVSVC_KV_EVENTS_CONFIG_FILE"] == ""
    assert env["KVSVC_DETECT_DISCONNECTED_INSTANCE_INTERVAL"] == "7.0"
    assert env["KVSVC_ACCESS_LOG"] == "false"
    assert args.tokenizer_path == "tok"


# -- check-config ---------------------------------------------------------------------------------

def test_check_config_lists_every_setting_with_its_source(clean_env, capsys):
    clean_env.setenv("KVSVC_PORT", "9001")
    clean_env.setenv("KVSVC_INTERNAL_API_TOKEN", "s3cret-token")
    assert main(["check-config", "--kv_events_config_file", "", "--worker_threads", "32"]) == 0
    out = capsys.readouterr().out
    for row in SETTINGS:
        assert f"    {row.name} = " in out, row.name
    assert "    port = 9001  (KVSVC_PORT)" in out
    assert "    worker_threads = 32  (--worker_threads)" in out
    assert "    host = 0.0.0.0  (default)" in out
    assert "    internal_api_token = set (hidden)  (KVSVC_INTERNAL_API_TOKEN)" in out
    assert "s3cret-token" not in out


# -- policy names and routing ranges, checked once --------------------------------------------------

def test_policy_names_and_ranges_are_checked_by_the_table_only():
    """Every name the table admits builds its policy; the table refuses the rest, and the
    policies, which receive only valid values, no longer check them again."""
    for name in POLICY_NAMES:
        assert load_service_settings(load_balance_policy=name).load_balance_policy == name
        assert policy.make_policy(name).name == name
    for name, message in UNSUPPORTED_POLICIES.items():
        with pytest.raises(ConfigError) as by_settings:
            load_service_settings(load_balance_policy=name)
        assert by_settings.value.message == message
    with pytest.raises(ConfigError) as err:
        load_service_settings(load_balance_policy="LEAST_LOAD")
    assert (err.value.field, err.value.message) == (
        "--load_balance_policy", "must be RR or CAR or SLO_AWARE or TTFT, got 'LEAST_LOAD'")
    with pytest.raises(ValueError):
        policy.make_policy("LEAST_LOAD")  # a bug, not a configuration: the table admits none
    low, high = CAR_WEIGHT_RANGE
    for field, kwarg in (("car_prefill_lambda", "prefill_lambda"),
                         ("car_host_hit_weight", "host_hit_weight")):
        for ok in (low, high):
            assert getattr(load_service_settings(**{field: ok}), field) == ok
            assert getattr(policy.make_policy("CAR", **{kwarg: ok}), kwarg) == ok
        for bad in (low - 0.01, high + 0.01, float("nan")):
            with pytest.raises(ConfigError) as err:
                load_service_settings(**{field: bad})
            assert err.value.field == f"--{field}"
    for field, bad in (("target_ttft", -1), ("target_tpot", 600_001), ("target_tpot", 1.5),
                       ("default_prefill_tokens_per_s", 0),
                       ("default_prefill_tokens_per_s", float("inf")),
                       ("default_prefill_tokens_per_s", 1e10),
                       ("max_load_age_s", 0), ("max_load_age_s", 3600.5),
                       ("max_load_age_s", float("nan"))):
        with pytest.raises(ConfigError) as err:
            load_service_settings(**{field: bad})
        assert err.value.field == f"--{field}", (field, bad)


def test_no_consumer_checks_a_settings_range_again():
    """The ranges are declared once, in the table: no service module outside kvsvc.settings
    reads the range constants or raises a ConfigError about a setting with a range (the §8
    file's own model, the command line's bind probe and the testbed's own flags aside)."""
    root = Path(settings_module.__file__).resolve().parent
    ranged = [row for row in SETTINGS if row.range_text()]
    ranges = [name for name in dir(settings_module) if name.endswith(("_RANGE", "_RANGE_S",
                                                                      "_RANGE_MS"))]
    assert ranges
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel in ("settings.py", "config.py", "cli.py") or rel.startswith("testbed/"):
            continue
        text = path.read_text(encoding="utf-8")
        for name in ranges:
            assert name not in text, f"{path.relative_to(root)} re-checks {name}"
        for row in ranged:
            for field in (row.name, row.flag):
                assert f'ConfigError("{field}"' not in text, (
                    f"{path.relative_to(root)} checks {field} again")


@pytest.mark.parametrize("row", [r for r in SETTINGS if r.meta.choices], ids=lambda r: r.name)
def test_values_outside_the_choices_are_refused_naming_the_setting(clean_env, row):
    for choice in row.meta.choices:
        assert getattr(load_service_settings(**{row.name: choice}), row.name) == choice
    with pytest.raises(ConfigError) as info:
        load_service_settings(**{row.name: "bogus"})
    assert info.value.field == row.flag
    clean_env.setenv(row.env, "bogus")
    with pytest.raises(ConfigError) as info:
        load_service_settings()
    assert info.value.field == row.env


# -- sources and validation (flags over env over defaults) ----------------------------------------

def test_settings_defaults(clean_env):
    s = load_service_settings()
    assert (s.host, s.port, s.kv_events_config_file, s.max_query_tokens, s.log_level) == (
        "0.0.0.0", 8888, "", 1 << 20, "info")
    assert s.token() is None
    assert s.kv_events_config() is None


def test_settings_from_env_and_flags_override_env(clean_env):
    clean_env.setenv("KVSVC_PORT", "9001")
    clean_env.setenv("KVSVC_HOST", "127.0.0.1")
    clean_env.setenv("KVSVC_MAX_QUERY_TOKENS", "500")
    s = load_service_settings()
    assert (s.host, s.port, s.max_query_tokens) == ("127.0.0.1", 9001, 500)
    s = load_service_settings(port=9002, host=None, max_query_tokens=None)
    assert (s.host, s.port, s.max_query_tokens) == ("127.0.0.1", 9002, 500)


@pytest.mark.parametrize("kwargs, field", [
    ({"port": 0}, "--port"), ({"port": 65536}, "--port"),
    ({"max_query_tokens": 0}, "--max_query_tokens"),
])
def test_settings_ranges_named(clean_env, kwargs, field):
    with pytest.raises(ConfigError) as info:
        load_service_settings(**kwargs)
    assert info.value.field == field


def test_load_scrape_backends_take_the_backend_names_only(clean_env):
    """A misspelt backend would scrape nothing; it is refused naming the flag and the name,
    as ``discovery.backends`` refuses it (§8)."""
    with pytest.raises(ConfigError) as info:
        load_service_settings(load_scrape_backends="vllm,foo")
    assert info.value.field == "--load_scrape_backends" and "'foo'" in str(info.value)
    assert load_service_settings(load_scrape_backends=" vllm, sglang ,").load_scrape_backends
    assert load_service_settings(load_scrape_backends="").load_scrape_backends == ""


def test_settings_bad_env_value_named(clean_env):
    """An error names the variable the value came from; a flag that overrides it, the flag."""
    clean_env.setenv("KVSVC_PORT", "http")
    with pytest.raises(ConfigError) as info:
        load_service_settings()
    assert (info.value.field, info.value.message) == (
        "KVSVC_PORT", "Input should be a valid integer, unable to parse string as an integer, "
                      "got 'http'")
    clean_env.setenv("KVSVC_PORT", "9000")
    clean_env.setenv("KVSVC_CAR_PREFILL_LAMBDA", "2")
    with pytest.raises(ConfigError) as info:
        load_service_settings(port=0)
    assert info.value.field == "--port"
    with pytest.raises(ConfigError) as info:
        load_service_settings(port=9001)
    assert (info.value.field, info.value.message) == (
        "KVSVC_CAR_PREFILL_LAMBDA", "Input should be less than or equal to 1, got '2'")


def test_every_settings_error_is_reported_at_once_with_its_source_and_value(clean_env):
    """Three bad values, two flags and a variable: one ConfigError lists all three, each under
    the name it was given by and with the value, in declaration order."""
    clean_env.setenv("KVSVC_CAR_HOST_HIT_WEIGHT", "1.5")
    with pytest.raises(ConfigError) as info:
        load_service_settings(port=0, worker_threads=2)
    assert [(p.field, p.message) for p in info.value.problems] == [
        ("--port", "Input should be greater than or equal to 1, got 0"),
        ("KVSVC_CAR_HOST_HIT_WEIGHT", "Input should be less than or equal to 1, got '1.5'"),
        ("--worker_threads", "Input should be greater than or equal to 4, got 2"),
    ]
    assert (info.value.field, info.value.message) == (
        "--port", "Input should be greater than or equal to 1, got 0")


def test_every_serve_flag_is_accepted_in_both_spellings_with_the_same_result():
    """xllm-service's --etcd_addr and the dashed --etcd-addr, for every setting of the table:
    the same parsed value, hence the same settings."""
    samples = {bool: "false", int: "7", float: "0.5", str: "x", SecretStr: "tok"}
    for row in SETTINGS:
        value = row.meta.choices[0] if row.meta.choices else samples[row.kind]
        dashed = row.flag.replace("_", "-")
        parsed = [flag_values(build_parser().parse_args([command, flag, value]))
                  for command in ("serve", "check-config") for flag in (row.flag, dashed)]
        assert parsed[0][row.name] is not None, row.name
        assert all(p == parsed[0] for p in parsed), row.name


def test_log_level_in_any_case(clean_env):
    args = build_parser().parse_args(["serve", "--log-level", "WARNING"])
    assert resolve_serve_settings(args).log_level == "warning"
    clean_env.setenv("KVSVC_LOG_LEVEL", "Debug")
    assert resolve_serve_settings(build_parser().parse_args(["serve"])).log_level == "debug"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--log_level", "LOUD"])


def test_token_from_env_and_from_file(clean_env, tmp_path):
    clean_env.setenv("KVSVC_INTERNAL_API_TOKEN", "s3cret")
    assert load_service_settings().token() == "s3cret"
    clean_env.delenv("KVSVC_INTERNAL_API_TOKEN")
    path = tmp_path / "token"
    path.write_text("from-file\n", encoding="utf-8")
    assert load_service_settings(internal_api_token_file=str(path)).token() == "from-file"


def test_token_and_token_file_are_exclusive(clean_env, tmp_path):
    path = tmp_path / "token"
    path.write_text("x", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_service_settings(internal_api_token="a", internal_api_token_file=str(path))
    assert info.value.field == "--internal_api_token_file"


def test_token_file_missing_or_empty(clean_env, tmp_path):
    with pytest.raises(ConfigError) as info:
        load_service_settings(internal_api_token_file=str(tmp_path / "nope")).token()
    assert info.value.field == "internal_api_token_file"
    empty = tmp_path / "empty"
    empty.write_text("  \n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_service_settings(internal_api_token_file=str(empty)).token()
    assert (info.value.field, info.value.message) == ("internal_api_token_file", "file is empty")


def test_token_file_first_line_is_the_token(clean_env, tmp_path):
    path = tmp_path / "token"
    path.write_text("s3cret\nsecond line ignored\n", encoding="utf-8")
    assert load_service_settings(internal_api_token_file=str(path)).token() == "s3cret"


@pytest.mark.parametrize("token, problem", [
    (" abc", "starts or ends with whitespace"), ("abc ", "starts or ends with whitespace"),
    ("\tabc", "starts or ends with whitespace"), ("abc\n", "starts or ends with whitespace"),
    ("a\x01b", "holds a character outside printable ASCII"),
    ("a\u00e9b", "holds a character outside printable ASCII"),
])
def test_a_token_no_header_can_carry_is_refused(clean_env, tmp_path, token, problem):
    """HTTP strips a header value's surrounding whitespace and gunicorn refuses control
    characters, so such a token locks every client out; the message never shows the token."""
    clean_env.setenv("KVSVC_INTERNAL_API_TOKEN", token)
    with pytest.raises(ConfigError) as info:
        load_service_settings()
    assert (info.value.field, info.value.message) == (
        "KVSVC_INTERNAL_API_TOKEN", f"{problem}, which no X-Internal-Token header can carry")
    clean_env.delenv("KVSVC_INTERNAL_API_TOKEN")
    if token.strip() != token:
        return  # a token file's line is stripped: that token is fine there
    path = tmp_path / "token"
    path.write_text(token + "\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_service_settings(internal_api_token_file=str(path)).token()
    assert (info.value.field, info.value.message) == (
        "internal_api_token_file",
        f"the token {problem}, which no X-Internal-Token header can carry")


def test_empty_token_from_env_is_refused(clean_env):
    clean_env.setenv("KVSVC_INTERNAL_API_TOKEN", "")
    with pytest.raises(ConfigError) as info:
        load_service_settings()
    assert info.value.field == "KVSVC_INTERNAL_API_TOKEN"


@pytest.mark.parametrize("host, ok", [
    ("0.0.0.0", True), ("::", True), ("127.0.0.1", True), ("svc-1.example", True),
    ("*", False), ("", False), ("a b", False),
])
def test_bind_host_validated(clean_env, host, ok):
    if ok:
        assert load_service_settings(host=host).host == host
        return
    with pytest.raises(ConfigError) as info:
        load_service_settings(host=host)
    assert info.value.field == "--host"


def test_kv_events_config_loaded_through_settings(clean_env, tmp_path):
    path = tmp_path / "kv.json"
    path.write_text(json.dumps({"streams": [{
        "instance_name": "a:1", "endpoint": "tcp://127.0.0.1:5000",
        "replay_endpoint": "tcp://127.0.0.1:5001"}], "max_streams": 4}), encoding="utf-8")
    cfg = load_service_settings(kv_events_config_file=str(path)).kv_events_config()
    assert (len(cfg.streams), cfg.max_streams) == (1, 4)


# -- where a value came from: one answer ---------------------------------------------------------

def test_source_of_is_flag_then_variable_then_default(clean_env, monkeypatch):
    flags = {"port": 9000, "host": None}
    assert settings_module.source_of("port", flags) == settings_module.Source(
        settings_module.Origin.FLAG, "--port", "--port")
    monkeypatch.setenv("KVSVC_HOST", "")   # set, even empty: the variable gave it
    assert settings_module.source_of("host", flags).name == "KVSVC_HOST"
    assert settings_module.source_of("host", flags).field == "KVSVC_HOST"
    default = settings_module.source_of("worker_threads", flags)
    assert (default.origin, default.name, default.field) == (
        settings_module.Origin.DEFAULT, "default", "--worker_threads")
    # pydantic-settings reads variables in any case, so the answer does too.
    assert settings_module.source_of("model", {}, {"kvsvc_model": "m"}).name == "KVSVC_MODEL"
    with pytest.raises(KeyError):
        settings_module.source_of("no_such_setting", {})


def test_every_place_names_the_value_where_it_came_from(clean_env, monkeypatch, capsys):
    monkeypatch.setenv("KVSVC_WORKER_THREADS", "2")
    with pytest.raises(ConfigError) as err:
        load_service_settings()
    assert err.value.field == "KVSVC_WORKER_THREADS"
    with pytest.raises(ConfigError) as err:
        load_service_settings(worker_threads=2)
    assert err.value.field == "--worker_threads"
    monkeypatch.delenv("KVSVC_WORKER_THREADS")
    monkeypatch.setenv("KVSVC_TOKENIZER_PATH", "/no/such/tokenizer")
    args = build_parser().parse_args(["check-config", "--kv_events_config_file", ""])
    with pytest.raises(ConfigError) as err:
        resolve_serve_settings(args)
    assert err.value.field == "KVSVC_TOKENIZER_PATH"   # a check after parsing, renamed once


def test_a_namespace_with_a_slash_is_refused_by_the_table(clean_env):
    with pytest.raises(ConfigError) as err:
        load_service_settings(etcd_namespace="a/b")
    assert (err.value.field, err.value.message) == ("--etcd_namespace",
                                                    "must not contain '/', got 'a/b'")
    assert load_service_settings(etcd_namespace="prod").etcd_namespace == "prod"


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_number_is_named_so_not_a_range(clean_env, value):
    """NaN fails every bound and infinity one of them: the message says what is wrong with the
    value instead of quoting a bound it did not break (issue 19 item 5)."""
    with pytest.raises(ConfigError) as info:
        load_service_settings(upstream_read_timeout_s=value)
    assert info.value.field == "--upstream_read_timeout_s"
    assert info.value.message == f"not a finite number, got {value!r}"
    clean_env.setenv("KVSVC_CAR_PREFILL_LAMBDA", "nan")
    with pytest.raises(ConfigError) as info:
        load_service_settings()
    assert (info.value.field, info.value.message) == (
        "KVSVC_CAR_PREFILL_LAMBDA", "not a finite number, got 'nan'")
