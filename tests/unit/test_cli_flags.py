"""The ``kvsvc`` command as operators type it (issue 13): one flag spelling rule for every
subcommand (``--etcd_addr`` and ``--etcd-addr``), the same names for the same thing across
subcommands, log levels in any case, ``--version``, defaults in every ``--help``, and start-up
warnings printed once and only after validation passed. The serve flags' table tests are in
test_settings.py."""

from __future__ import annotations

import argparse
import logging

import pytest

import kvsvc
from kvsvc.cli import _LAZY_COMMANDS, build_parser, lazy_parser, main, validate_service
from kvsvc.service import Service
from kvsvc.settings import SETTINGS, flag_spellings, load_service_settings

TESTBED = sorted(_LAZY_COMMANDS)


def _flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"kvsvc {kvsvc.__version__}\n"


@pytest.mark.parametrize("name", TESTBED)
def test_every_testbed_flag_has_both_spellings(name):
    parser, _ = lazy_parser(name)
    for action in _flags(parser):
        for flag in action.option_strings:
            assert set(flag_spellings(flag)) <= set(action.option_strings), flag


@pytest.mark.parametrize("name", TESTBED)
def test_every_testbed_help_shows_every_default(name):
    parser, _ = lazy_parser(name)
    text = parser.format_help()
    # "(default:" is one word: line wrapping never splits it.
    assert text.count("(default:") == len(_flags(parser)), text


def test_sim_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["sim", "--help"])
    out = " ".join(capsys.readouterr().out.split())   # undo the wrapping
    for shown in ("--block-size, --block_size BLOCK_SIZE tokens per block (default: 128)",
                  "--replay-port-offset, --replay_port_offset",
                  "--etcd, --etcd_addr, --etcd-addr ETCD",
                  "(default: 127.0.0.1)", "ZMQ topic of the live events (default: empty)",
                  "(default: info)"):
        assert shown in out, shown


@pytest.mark.parametrize("name", ["sim", "demo", "bench-routing"])
@pytest.mark.parametrize("flag", ["--etcd", "--etcd_addr", "--etcd-addr"])
def test_testbed_etcd_flag_also_has_serves_name(name, flag):
    parser, _ = lazy_parser(name)
    assert parser.parse_args([flag, "127.0.0.1:2379"]).etcd == "127.0.0.1:2379"


@pytest.mark.parametrize("name", TESTBED)
def test_a_setting_serve_has_is_spelled_as_serve_spells_it(name):
    """A testbed flag for something serve also has (--host, --etcd_namespace,
    --internal_api_token_file, --tokenizer_path, --log_level, ...) takes serve's spellings."""
    serve = {a.dest: a for a in _flags(next(
        a for a in build_parser()._actions
        if isinstance(a, argparse._SubParsersAction)).choices["serve"])}
    parser, _ = lazy_parser(name)
    shared = [a for a in _flags(parser) if a.dest in serve]
    assert shared, name
    for action in shared:
        assert set(serve[action.dest].option_strings) <= set(action.option_strings), action.dest
    assert {row.name for row in SETTINGS} >= {a.dest for a in shared}


def test_sim_takes_serves_token_file_flag():
    parser, _ = lazy_parser("sim")
    for flag in ("--internal_api_token_file", "--internal-api-token-file"):
        assert parser.parse_args([flag, "/tmp/t"]).internal_api_token_file == "/tmp/t"


@pytest.mark.parametrize("name", TESTBED)
def test_testbed_log_level_in_any_case(name):
    parser, _ = lazy_parser(name)
    assert parser.parse_args(["--log-level", "DEBUG"]).log_level == "debug"
    assert parser.parse_args(["--log_level", "Error"]).log_level == "error"


# -- start-up warnings: once, and after validation ---------------------------------------------

def _warnings(caplog, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno == logging.WARNING and text in r.getMessage()]


def test_car_without_an_index_is_warned_once_at_start_not_while_validating(clean_env, caplog):
    """`serve` validates by building the service, then the worker builds it again: the CAR
    line must come once, from the service's start, not from each build."""
    settings = load_service_settings()
    with caplog.at_level(logging.INFO):
        validate_service(settings)                        # serve's check in the CLI process
        assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
        service = Service(settings, None)                 # the worker's
        service.start()
        service.close()
    warned = _warnings(caplog, "KV index disabled")
    assert len(warned) == 1 and "CAR routes on queue costs only" in warned[0].getMessage()
    assert _warnings(caplog, "CAR") == warned


def test_check_config_warns_once_after_the_summary(clean_env, capsys):
    assert main(["check-config"]) == 0
    captured = capsys.readouterr()
    assert "kv_events_config_file: empty: KV index disabled" in captured.out
    assert captured.err.splitlines() == [
        "kvsvc: warning: kv_events_config_file is empty: KV index disabled, every query "
        "answers no matches (hit ratio 0); routing policy CAR routes on queue costs only",
        "kvsvc: warning: etcd_addr is empty: no instance registry, so no routing candidate: "
        "every OpenAI request is answered 503"]


def test_no_warning_before_a_tokenizer_error(clean_env, tmp_path, capsys, caplog):
    """A bad KVSVC_TOKENIZER_PATH: the error alone, not the CAR warning first (neither on
    stderr nor logged: under pytest a log record is captured, not printed)."""
    clean_env.setenv("KVSVC_TOKENIZER_PATH", str(tmp_path / "missing"))
    with caplog.at_level(logging.WARNING):
        assert main(["check-config"]) == 2
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"kvsvc: invalid configuration: KVSVC_TOKENIZER_PATH: {tmp_path / 'missing'} not found"]
