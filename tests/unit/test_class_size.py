"""No class in kvsvc/ over 400 lines (issue 21 item 2), measured with ast from ``class`` to its
last line, docstrings included. The service's classes are held to it (a few older ones to a
ceiling, :data:`KNOWN`); the tooling's (kvsvc/testbed: the simulated engines, soak) are being
grown by other work right now and are listed, not held (``test_tooling_classes_...``)."""

from __future__ import annotations

import ast
from pathlib import Path

import kvsvc

MAX_LINES = 400
ROOT = Path(kvsvc.__file__).parent
#: Classes over the limit when the limit came in (their sizes then, across the helpers'
#: branches), each with the size it may not exceed; splitting them is left to their owners.
#: Shrinking one is welcome; a new entry is not.
KNOWN = {
    "cluster/registry.py:Registry": 560,        # 508 on main, 544 on the cluster branch
    "directory.py:Directory": 470,              # 299 on main, 451 on the overlay branch
    "index/tier_index.py:TierIndex": 450,       # 413 on main, 436 on the overlay branch
}
#: The tooling's package (not held to the limit yet).
TOOLING = "testbed/"


def class_sizes() -> dict[str, int]:
    """``"path:Class" -> lines`` of every class in kvsvc/ (nested ones too)."""
    sizes = {}
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                name = f"{path.relative_to(ROOT).as_posix()}:{node.name}"
                sizes[name] = node.end_lineno - node.lineno + 1  # type: ignore[operator]
    return sizes


def test_no_class_over_400_lines():
    sizes = class_sizes()
    assert len(sizes) > 50                       # the walk found the package's classes
    over = {name: n for name, n in sizes.items()
            if n > MAX_LINES and n > KNOWN.get(name, 0) and not name.startswith(TOOLING)}
    assert over == {}, f"classes over {MAX_LINES} lines (split them): {over}"


def test_streams_classes_are_within_the_limit_without_exceptions():
    streams = {n: s for n, s in class_sizes().items() if n.startswith("streams/")}
    assert streams and max(streams.values()) <= MAX_LINES
    assert not [n for n in KNOWN if n.startswith("streams/")]


def test_tooling_classes_over_the_limit_are_listed(capsys):
    tooling = {n: s for n, s in class_sizes().items() if n.startswith(TOOLING)}
    over = {n: s for n, s in tooling.items() if s > MAX_LINES}
    with capsys.disabled():
        print(f"\ntooling classes over {MAX_LINES} lines (to split): {over or 'none'}")
    assert len(tooling) > 10                     # the walk reached kvsvc/testbed
