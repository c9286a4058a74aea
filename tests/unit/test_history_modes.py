"""The history-mode state machine's table (kvsvc.streams.history.MODE_TABLE): every (mode,
input) has one handler, the table in docs matches the code, and the rendering is what the docs
show."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsvc.streams import history_doc
from kvsvc.streams.history import MODE_MEANINGS, MODE_TABLE, Input, render_mode_table
from kvsvc.streams.recovery import Mode

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_every_mode_and_input_has_a_documented_handler():
    assert set(MODE_TABLE) == {(m, i) for m in Mode for i in Input}
    assert set(MODE_MEANINGS) == set(Mode)
    assert all((handler.__doc__ or "").strip() for handler in MODE_TABLE.values())


def test_rendered_table_has_a_row_per_mode_and_a_column_per_input():
    lines = render_mode_table().splitlines()
    assert len(lines) == 2 + len(Mode)
    assert lines[0] == "| mode | " + " | ".join(i.value for i in Input) + " |"
    for line, mode in zip(lines[2:], Mode):
        assert line.startswith(f"| **{mode.name}**: ")
        assert line.count(" | ") == len(Input)


def test_docs_table_matches_the_code():
    """Fails on drift: run ``python -m kvsvc.streams.history_doc <file>`` to regenerate."""
    files = [p for p in DOCS.glob("*.md") if history_doc.BEGIN in p.read_text()]
    assert files, f"no docs file holds {history_doc.BEGIN!r}"
    for path in files:
        text = path.read_text()
        assert history_doc.splice(text) == text, f"{path.name}: mode table out of date"


def test_splice_refuses_a_file_without_markers():
    with pytest.raises(ValueError):
        history_doc.splice("no table here\n")
    text = f"a\n{history_doc.BEGIN}\nold\n{history_doc.END}\nb\n"
    assert history_doc.splice(text) == (f"a\n{history_doc.BEGIN}\n\n{render_mode_table()}\n"
                                        f"{history_doc.END}\nb\n")
