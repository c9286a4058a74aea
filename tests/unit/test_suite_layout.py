"""The test suite's own layout rules: helpers shared between test modules live in
``tests/support/`` and no test module imports another one (a test module is not a fixture
library: importing it runs its module-level code and hides who depends on what); the tier
directories hold only test modules; a module that starts an etcd of its own says so with the
``etcd`` marker. Read from the source files, nothing imported."""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
TIERS = ("unit", "integration", "e2e", "fuzz")
#: What a test module may import from ``tests``: the support package only.
ALLOWED = re.compile(r"^tests\.support(\.|$)")


def _modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if ".venv" not in p.parts)


def _imported_test_modules(source: str, name: str = "<test>") -> list[str]:
    """``module (line)`` of every import of a ``tests`` module outside ``tests.support``, and of
    every relative import (which could reach a sibling test module), in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                found.append(f"{'.' * node.level}{node.module or ''} (line {node.lineno})")
            elif node.module and (node.module == "tests" or node.module.startswith("tests.")):
                names = [node.module + "." + a.name for a in node.names] \
                    if node.module == "tests" else [node.module]
                found += [f"{n} (line {node.lineno})" for n in names if not ALLOWED.match(n)]
        elif isinstance(node, ast.Import):
            found += [f"{a.name} (line {node.lineno})" for a in node.names
                      if a.name.startswith("tests.") and not ALLOWED.match(a.name)]
    return found


def test_no_test_module_imports_another_test_module():
    offenders = {str(p.relative_to(TESTS)): bad for p in _modules()
                 if (bad := _imported_test_modules(p.read_text(), str(p)))}
    assert offenders == {}, ("import shared helpers from tests/support/, never from a test "
                             f"module: {offenders}")


def test_the_check_sees_a_test_module_import():
    source = ("from tests.integration.test_routes import running\n"
              "from tests.support.util import wait_for\nfrom .test_x import y\n"
              "import tests.e2e.test_up\nfrom tests import support, util\n")
    assert _imported_test_modules(source) == [
        "tests.integration.test_routes (line 1)", ".test_x (line 3)",
        "tests.e2e.test_up (line 4)", "tests.util (line 5)"]


def test_tier_directories_hold_only_test_modules():
    stray = [str(p.relative_to(TESTS)) for tier in TIERS for p in (TESTS / tier).glob("*.py")
             if not p.name.startswith("test_") and p.name not in ("__init__.py", "conftest.py")]
    assert stray == [], f"helpers belong in tests/support/: {stray}"


def test_a_module_starting_its_own_etcd_is_marked_etcd():
    """Tests using the ``etcd_server``/``etcd`` fixtures are marked by conftest; one that starts
    an etcd itself (``EtcdServer``, ``LocalEtcd``, the demo) must carry the marker in its text."""
    starts = re.compile(r"\b(EtcdServer|LocalEtcd)\(|\brun_demo\(")
    unmarked = [str(p.relative_to(TESTS)) for tier in TIERS
                for p in (TESTS / tier).glob("test_*.py")
                if starts.search(p.read_text()) and "pytest.mark.etcd" not in p.read_text()]
    assert unmarked == [], f"starts an etcd but has no @pytest.mark.etcd: {unmarked}"


def test_the_unit_tier_refuses_sockets_and_sleeps():
    """tests/unit/conftest.py: a socket bind/connect or a sleep in a unit test fails at once."""
    import socket
    import time

    import pytest
    import zmq

    with pytest.raises(AssertionError, match=r"^unit tier: socket\.bind\(\)"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
    ctx = zmq.Context()
    try:
        with ctx.socket(zmq.PUB) as pub, pytest.raises(AssertionError, match="^unit tier: zmq"):
            pub.bind("tcp://127.0.0.1:*")
    finally:
        ctx.destroy(linger=0)
    with pytest.raises(AssertionError, match=r"time\.sleep\(0\.0001\) from .*test_suite_l"):
        time.sleep(0.0001)
