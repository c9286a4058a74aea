"""The reference generated from the tables in code (kvsvc.reference) is what the repository
holds: docs/configuration.md's settings and §8 tables and config/kvsvc.env; check-config's
policy summary comes from the same settings table. A test here fails on drift and names the
command that fixes it."""

from __future__ import annotations

import io
import os
from contextlib import redirect_stderr
from pathlib import Path

import pytest

from kvsvc import reference
from kvsvc.config import DiscoveryConfig, KvEventsConfig, StreamConfig
from kvsvc.settings import (
    SETTINGS,
    PolicyName,
    ServiceSettings,
    load_service_settings,
    policy_summary,
)

FIX = f"run `{reference.REGENERATE}` (or `make docs`)"


@pytest.mark.parametrize("path", sorted(reference.generated_files()),
                         ids=lambda p: str(p.relative_to(reference.ROOT)))
def test_the_generated_file_is_what_the_tables_give(path: Path):
    render = reference.generated_files()[path]
    old = path.read_text(encoding="utf-8")
    assert render(old) == old, f"{path.relative_to(reference.ROOT)} differs from the tables: {FIX}"


def test_configuration_md_has_every_generated_part():
    text = reference.CONFIGURATION_MD.read_text(encoding="utf-8")
    for name, (begin, end) in reference.MARKERS.items():
        assert text.count(begin) == 1 and text.count(end) == 1, (
            f"docs/configuration.md lost the markers of {name!r}; put them back and {FIX}")


def test_check_names_a_stale_file_and_write_fixes_it(tmp_path, monkeypatch):
    doc = tmp_path / "configuration.md"
    env = tmp_path / "kvsvc.env"
    begin, end = reference.MARKERS["config-streams"]
    doc.write_text(f"intro\n{begin}\nstale\n{end}\nrest\n", encoding="utf-8")
    env.write_text("KVSVC_PORT=1\n", encoding="utf-8")
    monkeypatch.setattr(reference, "ROOT", tmp_path)
    monkeypatch.setattr(reference, "generated_files", lambda: {
        doc: reference.render_markdown, env: lambda _old: reference.env_file_text()})
    err = io.StringIO()
    with redirect_stderr(err):
        assert reference.main(["--check"]) == 1
    assert "configuration.md differs" in err.getvalue() and "kvsvc.env differs" in err.getvalue()
    assert reference.main(["--write"]) == 0
    assert reference.main(["--check"]) == 0
    assert doc.read_text(encoding="utf-8") == (
        f"intro\n{begin}\n{reference.config_table(StreamConfig)}{end}\nrest\n")
    with pytest.raises(ValueError, match="without"):
        reference.render_markdown(f"{begin}\nno end\n")


def test_every_config_key_is_in_its_table_with_its_default_and_range():
    top = reference.config_table(KvEventsConfig, skip=("discovery", "streams"))
    assert "| `max_streams` | 128 | 1-128 |" in top and "`streams`" not in top
    streams = reference.config_table(StreamConfig)
    assert "| `endpoint` | required |" in streams
    assert '| `replay_mode` | `"snapshot"` | `snapshot`, `history` |' in streams
    discovery = reference.config_table(DiscoveryConfig)
    assert '| `backends` | `["xllm"]` |' in discovery
    for model, table in ((StreamConfig, streams), (DiscoveryConfig, discovery)):
        for name in model.model_fields:
            assert table.count(f"| `{name}` |") == 1, name


def test_env_file_holds_every_setting_but_the_token_and_loads_as_the_deployment_does(
        monkeypatch):
    text = reference.ENV_FILE.read_text(encoding="utf-8")
    for row in SETTINGS:
        listed = f"\n{row.env}=" in text or f"\n#{row.env}=" in text
        assert listed == reference._in_env_file(row), row.name
    set_lines = dict(line.split("=", 1) for line in text.splitlines()
                     if line.startswith("KVSVC_"))
    for key in [k for k in os.environ if k.startswith("KVSVC_")]:
        monkeypatch.delenv(key)
    for key, value in set_lines.items():
        monkeypatch.setenv(key, value)
    loaded = load_service_settings()
    expected = ServiceSettings(kv_events_config_file="/etc/kvsvc/kv_events.json",
                               etcd_addr="127.0.0.1:2379", max_in_flight_requests=120)
    assert loaded == expected   # every value it sets is the default but these


@pytest.mark.parametrize("policy, expected", [
    ("CAR", "lambda 0.5, host hit weight 0.5"),
    ("TTFT", "host hit weight 0.95, default prefill 10000 tokens/s"),
    ("SLO_AWARE", "target TTFT 1000 ms, target TPOT 50 ms"),
    ("RR", "no parameters"),
])
def test_policy_summary_is_generated_from_the_settings_table(policy, expected):
    assert policy_summary(ServiceSettings(load_balance_policy=policy)) == expected


def test_every_policy_parameter_is_in_its_summary():
    """A setting that names a policy in ``policies`` carries a ``summary`` label, so that
    check-config shows it for that policy (and a policy name there is a real one)."""
    for row in SETTINGS:
        assert set(row.meta.policies) <= set(PolicyName), row.name
        assert bool(row.meta.policies) == bool(row.meta.summary), row.name
    values = ServiceSettings(load_balance_policy="SLO_AWARE", target_ttft=800)
    assert policy_summary(values) == "target TTFT 800 ms, target TPOT 50 ms"
