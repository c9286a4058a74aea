"""The generated reference: what docs/configuration.md and config/kvsvc.env say about the
settings and the §8 config file, produced from the tables in code so that they cannot drift.

- The settings table (:func:`kvsvc.settings.markdown_table`, from :data:`kvsvc.settings.SETTINGS`).
- The §8 key tables of the ``kv_events_config_file`` (:func:`config_table`, from the pydantic
  models of :mod:`kvsvc.config`: each field's default, its range from its constraints, its
  meaning from its ``description``): the document's limits, ``streams[]`` and ``discovery``.
- ``config/kvsvc.env``, the ``EnvironmentFile=`` template of ``config/kvsvc.service``
  (:func:`env_file_text`): every setting but the token ones, with its help; those whose
  :class:`~kvsvc.settings.Setting` has ``env_file`` set, the rest commented out with their
  default.

In a Markdown file a generated part sits between a begin and an end marker line
(:data:`MARKERS`); the text around it is hand-written. ``python -m kvsvc.reference --write``
(``make docs``) rewrites every generated part and file; ``--check`` exits 1 naming the files
that differ (``tests/unit/test_generated_docs.py`` fails the same way).
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import annotated_types
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from kvsvc.config import DiscoveryConfig, KvEventsConfig, StreamConfig
from kvsvc.settings import README_BEGIN, README_END, SettingRow, by_section, markdown_table

#: The checkout: the generated files are relative to it.
ROOT = Path(__file__).resolve().parent.parent
CONFIGURATION_MD = ROOT / "docs" / "configuration.md"
ENV_FILE = ROOT / "config" / "kvsvc.env"
REGENERATE = "python -m kvsvc.reference --write"


def _number(value: float) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _range_text(field: FieldInfo) -> str:
    """``1-128``, ``≥ 1024``, ``snapshot, history`` (an enum), ``""`` for any value."""
    low = high = ""
    for m in field.metadata:
        if isinstance(m, annotated_types.Ge):
            low = f"≥ {_number(m.ge)}"  # type: ignore[arg-type]
        elif isinstance(m, annotated_types.Gt):
            low = f"> {_number(m.gt)}"  # type: ignore[arg-type]
        elif isinstance(m, annotated_types.Le):
            high = f"≤ {_number(m.le)}"  # type: ignore[arg-type]
        elif isinstance(m, annotated_types.Lt):
            high = f"< {_number(m.lt)}"  # type: ignore[arg-type]
    if low.startswith("≥") and high.startswith("≤"):
        return f"{low[2:]}-{high[2:]}"
    annotation = field.annotation
    choices = getattr(annotation, "__members__", None)
    if choices and not low and not high:
        return ", ".join(f"`{member.value}`" for member in choices.values())
    return ", ".join(part for part in (low, high) if part)


def _plain(value: Any) -> Any:
    """A default as the JSON file writes it (enum members by their value)."""
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return getattr(value, "value", value)


def _default_text(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = (field.default_factory() if field.default_factory is not None  # type: ignore[call-arg]
             else field.default)
    value = _plain(value)
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    return f"`{json.dumps(value)}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def config_table(model: type[BaseModel], skip: Sequence[str] = ()) -> str:
    """The §8 key table of ``model`` (GitHub Markdown): key, default, range, meaning, one row
    per field in declaration order; ends with a newline.

    :param skip: fields left out (the blocks that have their own table).
    :raises TypeError: a field without a ``description``.
    """
    lines = ["| key | default | range | meaning |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        if not field.description:
            raise TypeError(f"{model.__name__}.{name} has no description for the §8 reference: "
                            "give its Field a description= (its line in docs/configuration.md)")
        lines.append(f"| `{name}` | {_cell(_default_text(field))} | {_cell(_range_text(field))} "
                     f"| {_cell(field.description)} |")
    return "\n".join(lines) + "\n"


def _env_help(row: SettingRow) -> list[str]:
    text = row.meta.help.replace("`", "").replace("**", "")
    facts = [f"default {row.default_text()}"]
    if row.range_text():
        facts.append(row.range_text())
    return textwrap.wrap(f"{row.flag}: {text} ({'; '.join(facts)}).", width=94,
                         initial_indent="# ", subsequent_indent="#   ")


def _in_env_file(row: SettingRow) -> bool:
    """Secrets (the internal token, the API key) and the token file's path (the unit passes
    it) are never in the env file."""
    return row.kind is not SecretStr and row.name != "internal_api_token_file"


def env_file_text() -> str:
    """``config/kvsvc.env``: one ``KVSVC_<NAME>=value`` line per setting (secrets aside: never
    in this file), each after its help, by section; a setting whose ``env_file`` is unset is
    commented out with its default."""
    lines = [
        "# /etc/kvsvc/kvsvc.env: settings of config/kvsvc.service, read by both `kvsvc check-config`",
        "# (ExecStartPre) and `kvsvc serve` (ExecStart). One KVSVC_<FLAG>=value per line; every `serve`",
        "# flag has one (docs/configuration.md). No secret here: the internal token comes from",
        "# LoadCredential=; a client API key (KVSVC_API_KEY) belongs in a drop-in with",
        "# Environment=KVSVC_API_KEY=..., mode 0600.",
        f"# Generated from kvsvc/settings.py ({REGENERATE}); a commented line shows the default.",
    ]
    for section, rows in by_section():
        rows = [row for row in rows if _in_env_file(row)]
        if not rows:
            continue
        lines += ["", f"# -- {section} " + "-" * max(0, 90 - len(section))]
        for row in rows:
            lines += _env_help(row)
            chosen = row.meta.env_file
            if chosen is False:
                value = row.env_value(row.default)
                lines.append(f"#{row.env}={'' if value is None else value}")
            else:
                value = chosen if isinstance(chosen, str) else row.env_value(row.default)
                lines.append(f"{row.env}={'' if value is None else value}")
    return "\n".join(lines) + "\n"


#: Generated parts of docs/configuration.md: name -> its text.
PARTS: Mapping[str, Callable[[], str]] = {
    "settings": markdown_table,
    "config-file": lambda: config_table(KvEventsConfig, skip=("discovery", "streams")),
    "config-streams": lambda: config_table(StreamConfig),
    "config-discovery": lambda: config_table(DiscoveryConfig),
}


def markers(name: str) -> tuple[str, str]:
    """The begin and end marker lines of generated part ``name``."""
    if name == "settings":  # the settings table's markers predate the others
        return README_BEGIN, README_END
    return (f"<!-- generated:{name}:begin ({REGENERATE}) -->", f"<!-- generated:{name}:end -->")


#: Marker lines of every part.
MARKERS: Mapping[str, tuple[str, str]] = {name: markers(name) for name in PARTS}


def render_markdown(text: str) -> str:
    """``text`` (a Markdown file) with every generated part it has markers for rewritten.

    :raises ValueError: a begin marker without its end marker after it.
    """
    for name, make in PARTS.items():
        begin, end = MARKERS[name]
        start = text.find(begin)
        if start < 0:
            continue
        stop = text.find(end, start)
        if stop < 0:
            raise ValueError(f"generated part {name!r}: {begin!r} without {end!r}")
        text = f"{text[:start + len(begin)]}\n{make()}{text[stop:]}"
    return text


def generated_files() -> dict[Path, Callable[[str], str]]:
    """Each generated file -> its text from its current text."""
    return {CONFIGURATION_MD: render_markdown, ENV_FILE: lambda _old: env_file_text()}


def stale_files() -> list[Path]:
    """The generated files whose text differs from what the tables give."""
    stale = []
    for path, render in generated_files().items():
        old = path.read_text(encoding="utf-8") if path.exists() else ""
        if render(old) != old:
            stale.append(path)
    return stale


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m kvsvc.reference --write | --check``.

    :returns: 0; 1 for ``--check`` when a generated file differs (each named on stderr).
    """
    parser = argparse.ArgumentParser(prog="python -m kvsvc.reference", description=__doc__
                                     .split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite every generated part")
    mode.add_argument("--check", action="store_true",
                      help="exit 1 when a generated file differs from the tables")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for path in stale:
            print(f"{path.relative_to(ROOT)} differs from the tables in code: run `{REGENERATE}`",
                  file=sys.stderr)
        return 1 if stale else 0
    for path, render in generated_files().items():
        old = path.read_text(encoding="utf-8") if path.exists() else ""
        new = render(old)
        if new != old:
            path.write_text(new, encoding="utf-8")
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
