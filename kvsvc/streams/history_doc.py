"""The history-mode state machine's table in the docs (docs/recovery.md), generated from the
table in code (:data:`kvsvc.streams.history.MODE_TABLE`, :func:`~kvsvc.streams.history.
render_mode_table`) between :data:`BEGIN` and :data:`END`; a unit test fails when the file
differs. Rewrite it with ``python -m kvsvc.streams.history_doc docs/recovery.md``."""

from __future__ import annotations

import sys
from pathlib import Path

from kvsvc.streams.history import render_mode_table

BEGIN = ("<!-- mode-table:begin (generated: python -m kvsvc.streams.history_doc "
         "docs/recovery.md) -->")
END = "<!-- mode-table:end -->"


def splice(text: str) -> str:
    """``text`` with the generated table between its markers.

    :raises ValueError: the markers are missing or out of order.
    """
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no {BEGIN!r} ... {END!r} section")
    return text[:start + len(BEGIN)] + "\n\n" + render_mode_table() + "\n" + text[end:]


def main(argv: list[str]) -> int:
    """Rewrite the table in each file named (exit 0), or say which has no markers (exit 2)."""
    for name in argv:
        path = Path(name)
        try:
            path.write_text(splice(path.read_text()))
        except ValueError as exc:
            print(f"{name}: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
