"""The docs stay tied to the code: every decision of docs/decisions.md (D1, D2, ...) is cited
from the code that implements it and names tests that exist; the code cites no decision that
is not there; every relative link of README.md and docs/*.md points to a file that exists
(docs announced in the README's map but not written yet excepted)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DECISIONS = ROOT / "docs" / "decisions.md"
#: Docs the README's map announces for other work in progress.
ANNOUNCED = {"docs/xllm.md", "docs/real-clusters.md", "docs/clients.md"}


def _decisions() -> dict[int, str]:
    """D-number -> its section's text."""
    text = DECISIONS.read_text(encoding="utf-8")
    parts = re.split(r"^### D(\d+)\. ", text, flags=re.M)
    return {int(n): body for n, body in zip(parts[1::2], parts[2::2])}


def _code_citations() -> dict[int, list[str]]:
    cited: dict[int, list[str]] = {}
    for path in sorted((ROOT / "kvsvc").rglob("*.py")):
        for n in re.findall(r"\bD(\d+)\b", path.read_text(encoding="utf-8")):
            cited.setdefault(int(n), []).append(str(path.relative_to(ROOT)))
    return cited


def test_decisions_are_numbered_in_order_and_each_names_its_tests():
    decisions = _decisions()
    assert list(decisions) == list(range(1, len(decisions) + 1))
    for n, body in decisions.items():
        for field in ("**Case.**", "**Choice.**", "**Why exact.**", "**Tests.**"):
            assert field in body, f"D{n} has no {field}"


def test_every_test_a_decision_names_exists():
    for n, body in _decisions().items():
        tests_part = body[body.index("**Tests.**"):]
        current = None
        for path, name in re.findall(r"`(tests/[\w/]+\.py)?(?:::(test_\w+))?`", tests_part):
            if path:
                current = ROOT / path
                assert current.is_file(), f"D{n}: {path} does not exist"
            if name:
                assert current is not None, f"D{n}: {name} without a file"
                assert f"def {name}(" in current.read_text(encoding="utf-8"), (
                    f"D{n}: {current.relative_to(ROOT)} has no {name}")


def test_every_decision_is_cited_from_the_code_and_every_citation_exists():
    decisions, cited = _decisions(), _code_citations()
    assert not set(decisions) - set(cited), (
        f"decisions no code cites: {sorted(set(decisions) - set(cited))}")
    assert not set(cited) - set(decisions), (
        f"code cites decisions docs/decisions.md lacks: "
        f"{ {n: cited[n] for n in sorted(set(cited) - set(decisions))} }")


def test_every_doc_is_in_the_readme_map():
    """A newcomer finds every page from the README's documentation map."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for doc in sorted((ROOT / "docs").glob("*.md")):
        assert f"](docs/{doc.name})" in readme, f"docs/{doc.name} is not in README's docs map"
    assert len(readme.splitlines()) <= 400, "README.md is over 400 lines: move text to docs/"


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown file (lower case, punctuation dropped, spaces to
    hyphens), fenced blocks skipped."""
    anchors, fenced = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_relative_links_of_the_docs_point_to_files_and_headings():
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        links = re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", doc.read_text(encoding="utf-8"))
        for target, anchor in links:
            if "://" in target:
                continue
            path = (doc.parent / target).resolve() if target else doc
            rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
            if rel in ANNOUNCED and not path.exists():
                continue
            assert path.exists(), f"{doc.relative_to(ROOT)}: link to {target}"
            if anchor and path.suffix == ".md":
                assert anchor in _anchors(path), f"{doc.relative_to(ROOT)}: no #{anchor} in {rel}"


def _layout_modules() -> set[str]:
    """Module paths named in docs/development.md's layout table: a row's first cell names a
    path (``kvsvc/a/b.py``) and siblings by file name (```c.py```); a folder row
    (``kvsvc/http/``) names its files in the second cell; a name that exists at the top of
    the repository (``wsgi.py``) is that file."""
    text = (ROOT / "docs" / "development.md").read_text(encoding="utf-8")
    named: set[str] = set()
    for line in text.splitlines():
        cells = line.split("|")
        if len(cells) < 3 or not cells[1].strip().startswith("`kvsvc/"):
            continue
        first = re.findall(r"`([^`]+)`", cells[1])
        folder = first[0].rsplit("/", 1)[0] + "/" if not first[0].endswith("/") else first[0]
        names = first if not first[0].endswith("/") else re.findall(r"`([\w.]+\.py)`", cells[2])
        for name in names:
            if name.startswith("kvsvc/") or not (ROOT / name).exists():
                named.add(name if name.startswith("kvsvc/") else folder + name)
    return named


def test_every_service_module_is_in_the_layout_table():
    """A new module of the service lands in development.md's map of the data's path (the
    testbed, the tooling apart, has its own page)."""
    named = _layout_modules()
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "kvsvc").rglob("*.py")
               if p.name != "__init__.py" and "testbed" not in p.parts}
    assert modules, "no modules found under kvsvc/"
    assert sorted(modules - named) == []
    stale = sorted(n for n in named if "testbed" not in n and not (ROOT / n).exists())
    assert stale == []


def _shell_blocks(path: Path) -> list[str]:
    return re.findall(r"```(?:sh|bash)\n(.*?)```", path.read_text(encoding="utf-8"), re.S)


def _ignored(name: str) -> bool:
    """``name`` (a file in the checkout's root) matches a pattern of .gitignore."""
    import fnmatch

    patterns = [line.strip() for line in (ROOT / ".gitignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    return any(fnmatch.fnmatch(name, p.rstrip("/")) for p in patterns)


def test_the_files_the_docs_commands_write_into_the_checkout_are_ignored_by_git():
    """A walkthrough of the README and docs leaves nothing for ``git status`` to show: every
    token file (``--token-file``, the token written by ``> f``) and log a shell block writes
    under a relative name is in .gitignore."""
    written: set[str] = set()
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in _shell_blocks(doc):
            written.update(re.findall(r"--token[-_]file[ =]([\w.-]+)", block))
            written.update(re.findall(r"(?<![\d&])>\s*([\w-][\w.-]*\.(?:token|log|txt|json))\b",
                                      block))
    assert {"kvsvc.token", "xllm.token", "etcd.log"} <= written, written
    assert [n for n in sorted(written) if not _ignored(n)] == []
