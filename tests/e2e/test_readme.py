"""Every shell block of README.md and of docs/*.md runs, so the docs cannot drift from the code.

The fenced blocks in ``sh``, ``bash``, ``console`` or ``shell`` are extracted in order: the
README's first, then each ``docs/*.md`` in name order. An HTML comment on the line before a
block (blank lines between allowed) marks it:

- none, or ``<!-- readme-test: run -->``: run.
- ``<!-- readme-test: try -->``: run, and again at the end of the "Running the service" session
  (the Quick start's curl lines against the cluster built by hand).
- ``<!-- readme-test: skip REASON -->``: not run; the reason is required.
- ``<!-- readme-test: background until-output TEXT -->`` / ``background until COMMAND``: a
  long-running foreground command, started in the background; the session continues once its
  output shows TEXT or COMMAND exits 0 (bounded; a background command that exits fails).

Two sessions, each one ``bash -e -o pipefail`` script in a temporary directory shaped like the
checkout (``config/`` and ``.venv/`` linked), its own process group, curl failing on HTTP
errors (``--fail-with-body`` from a ``.curlrc``), ``KVSVC_PORT`` a free port and no other
``KVSVC_*`` variable: "Running the service" (with an etcd of the test's in ``KVSVC_ETCD_ADDR``)
(after the Quick start's ``. .venv/bin/activate``, which it assumes) and every other section
of the README and of the docs (against the Quick start's ``kvsvc up``, so a docs block may use
the Quick start's ``$URL``, ``$AUTH`` and ``$PROMPT``). Afterwards the session's processes get
SIGTERM; every one of them and of their children must be gone within a bound, and the
temporary directories ``kvsvc up`` named must be removed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from kvsvc.testbed.etcd_launcher import LocalEtcd
from kvsvc.testbed.ports import free_port_run

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
SHELL_LANGS = {"sh", "bash", "console", "shell"}
MARKER = re.compile(r"^<!-- readme-test: (.*) -->\s*$")
MANUAL_SECTION = "## Running the service"
SESSION_TIMEOUT_S = 120.0   # three local clusters (Quick start, xLLM, vLLM) on 2 shared cores
STOP_TIMEOUT_S = 30.0
PROMPT = list(range(1, 1025))  # the README's $(seq -s, 1 1024)


@dataclass(frozen=True)
class Block:
    """One shell block: its file (relative to the checkout), the line of its fence, section
    (``## `` heading), mode, text."""

    file: str
    line: int
    section: str
    mode: str          # run, try, skip, background
    arg: str           # skip: the reason; background: "until-output TEXT" / "until CMD"
    text: str


def parse_readme(text: str, name: str = "README.md") -> list[Block]:
    """The shell blocks of ``text`` (the file ``name``) with their markers.

    :raises AssertionError: an unknown marker, a skip without a reason, a marker not followed
        by a shell block, an unterminated fence.
    """
    lines = text.splitlines()
    blocks: list[Block] = []
    section = ""
    marker: tuple[int, str] | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            section = line.strip()
        m = MARKER.match(line)
        if m:
            assert marker is None, f"{name} line {marker[0]}: marker not followed by a block"
            marker = (i + 1, m.group(1).strip())
        elif line.startswith("```"):
            lang = line[3:].strip()
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
            assert end is not None, f"{name} line {i + 1}: unterminated fence"
            if lang in SHELL_LANGS:
                mode, _, arg = (marker[1] if marker else "run").partition(" ")
                assert mode in ("run", "try", "skip", "background"), \
                    f"{name} line {i + 1}: unknown readme-test mode {mode!r}"
                if mode == "skip":
                    assert arg.strip(), f"{name} line {i + 1}: skip needs a reason"
                if mode == "background":
                    assert re.match(r"until(-output)? \S", arg), \
                        f"{name} line {i + 1}: background needs 'until-output TEXT' or 'until CMD'"
                blocks.append(Block(name, i + 1, section, mode, arg.strip(),
                                    "\n".join(lines[i + 1:end])))
            else:
                assert marker is None, f"{name} line {marker[0]}: marker before a {lang!r} block"
            marker = None
            i = end
        elif line.strip() and marker is not None:
            raise AssertionError(f"{name} line {marker[0]}: marker not followed by a block")
        i += 1
    return blocks


def _q(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def session_script(blocks: list[Block]) -> str:
    """One bash script running ``blocks`` in order (see the module docstring)."""
    out = ["set -e -o pipefail"]
    for n, b in enumerate(blocks):
        out.append(f"echo {_q(f'### {b.file} line {b.line} ({b.mode})')}")
        if b.mode != "background":
            out.append(b.text)
            continue
        log = f"background-{n}.log"
        kind, _, what = b.arg.partition(" ")
        ready = (f"grep -qF -- {_q(what)} {log}" if kind == "until-output"
                 else f"( {what} ) > /dev/null 2>&1")
        out.append(f"{{\n{b.text}\n}} > {log} 2>&1 &")
        out.append(f"""bgpid=$!
deadline=$((SECONDS + {int(SESSION_TIMEOUT_S)}))
until {ready}; do
  if ! kill -0 $bgpid 2>/dev/null; then echo "background block exited:"; cat {log}; exit 1; fi
  if (( SECONDS > deadline )); then echo "background block not ready:"; cat {log}; exit 1; fi
  sleep 0.1   # polling another process, bounded by the deadline
done
cat {log}""")
    return "\n".join(out) + "\n"


def _procs() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, pgid) of every process."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            out[int(entry)] = (int(fields[1]), int(fields[2]))
    return out


def _group_and_children(pgid: int) -> set[int]:
    procs = _procs()
    found = {pid for pid, (_, g) in procs.items() if g == pgid}
    while True:
        more = {pid for pid, (ppid, _) in procs.items() if ppid in found} - found
        if not more:
            return found
        found |= more


class Session:
    """A temporary checkout-shaped directory, its environment and a script run in it."""

    def __init__(self, tmp: Path, extra_env: dict[str, str]) -> None:
        self.dir = tmp
        (tmp / "config").symlink_to(ROOT / "config")
        venv = Path(sys.prefix)
        if (venv / "bin" / "activate").is_file():
            (tmp / ".venv").symlink_to(venv)
        else:  # not in a virtualenv: an activate that puts this interpreter's scripts first
            (tmp / ".venv" / "bin").mkdir(parents=True)
            (tmp / ".venv" / "bin" / "activate").write_text(
                f'export PATH={_q(str(Path(sys.executable).parent))}:"$PATH"\n')
        curl_home = tmp / "curl-home"
        curl_home.mkdir()
        (curl_home / ".curlrc").write_text("fail-with-body\nshow-error\nmax-time = 30\n")
        self.port = free_port_run(1)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("KVSVC_")}
        self.env.update(KVSVC_PORT=str(self.port), KVSVC_RPC_PORT="0", CURL_HOME=str(curl_home),
                        NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost",
                        PYTHONUNBUFFERED="1", **extra_env)
        self.url = f"http://127.0.0.1:{self.port}"
        self.output = ""
        self._proc: subprocess.Popen[bytes] | None = None

    def run(self, blocks: list[Block]) -> None:
        """Run the blocks; the background ones keep running until :meth:`stop`.

        :raises AssertionError: a command failed (the output is in the message).
        """
        script = self.dir / "session.sh"
        script.write_text(session_script(blocks))
        log = self.dir / "session.log"
        with open(log, "wb") as out:
            self._proc = subprocess.Popen(["bash", str(script)], cwd=self.dir, env=self.env,
                                          stdin=subprocess.DEVNULL, stdout=out,
                                          stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code = self._proc.wait(SESSION_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                code = None
        self.output = log.read_text(encoding="utf-8", errors="replace")
        assert code == 0, f"README session failed (exit {code}):\n{self.output[-6000:]}"

    def token(self) -> str:
        return (self.dir / "kvsvc.token").read_text(encoding="utf-8").strip()

    def stop(self) -> None:
        """SIGTERM to the session's process group; every process of it and its children must
        be gone within the bound (SIGKILL then, and fail)."""
        if self._proc is None:
            return
        pgid = self._proc.pid
        pids = _group_and_children(pgid)
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while time.monotonic() < deadline:
            pids = {p for p in pids if p in _procs()}
            if not pids:
                return
            time.sleep(0.1)  # waiting for other processes to exit, bounded
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        raise AssertionError(f"processes left {STOP_TIMEOUT_S:.0f} s after SIGTERM: {sorted(pids)}")


def _docs() -> list[Path]:
    """README.md, then every docs/*.md in name order."""
    return [README, *sorted(DOCS.glob("*.md"))]


def _blocks() -> list[Block]:
    blocks: list[Block] = []
    for path in _docs():
        blocks += parse_readme(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    return blocks


def _manual(b: Block) -> bool:
    """The block belongs to the README's "Running the service" session."""
    return b.file == "README.md" and b.section == MANUAL_SECTION


def _assert_prompt_hits(url: str, token: str) -> None:
    with requests.Session() as http:
        http.trust_env = False
        http.headers["X-Internal-Token"] = token
        matches = http.post(url + "/v1/internal/kv-cache/query", json={"token_ids": PROMPT},
                            timeout=10).json()["matches"]
        hit = [m["instance_name"] for m in matches if m["device_hit_tokens"] == len(PROMPT)]
        assert hit, matches
        route = http.post(url + "/v1/internal/route", json={"token_ids": PROMPT},
                          timeout=10).json()
        assert route["prefill"] in hit, route


def test_every_shell_block_is_run_or_marked_with_a_reason():
    assert len(_docs()) >= 8, _docs()  # the README and the docs it maps
    blocks = _blocks()
    assert len(blocks) >= 15
    assert all(b.mode != "skip" or len(b.arg) > 10 for b in blocks)
    run = [b for b in blocks if b.mode != "skip"]
    assert len(run) >= 8, [b.line for b in run]
    texts = "\n".join(b.text for b in run)
    for needed in ("kvsvc up", "kvsvc sim --serve", "kvsvc serve", "/health", "/ready",
                   "/metrics", "/v1/internal/route", "/v1/internal/kv-cache/query",
                   "/v1/completions", "/v1/chat/completions", '\\"stream\\": true',
                   '"stream": true', "check-config"):
        assert needed in texts, f"no README command that runs shows {needed!r}"
    with pytest.raises(AssertionError, match="skip needs a reason"):
        parse_readme("<!-- readme-test: skip -->\n```sh\nfalse\n```\n")
    with pytest.raises(AssertionError, match="unknown readme-test mode"):
        parse_readme("<!-- readme-test: sometimes -->\n```sh\nfalse\n```\n")
    with pytest.raises(AssertionError, match="not followed by a block"):
        parse_readme("<!-- readme-test: run -->\ntext\n```sh\nfalse\n```\n")


@pytest.mark.etcd  # kvsvc up starts its own etcd
def test_quick_start_and_the_other_sections_run_against_kvsvc_up(tmp_path):
    blocks = [b for b in _blocks() if not _manual(b) and b.mode != "skip"]
    assert any(b.mode == "background" and b.text.strip() == "kvsvc up" for b in blocks)
    session = Session(tmp_path, {})
    try:
        session.run(blocks)
        out = session.output
        assert "kvsvc up: ready" in out and '{"status":"ok"}' in out
        # Every streamed answer completed: the Quick start's two and docs/xllm.md's two
        # (its native xLLM cluster, answers written from Generations).
        assert out.count("data: [DONE]") == 4
        assert 'kvsvc_instance_state{instance="127.0.0.1:' in out
        # docs/vllm-sglang.md's vLLM cluster with 2 DP ranks: the rank that served, the route
        # naming a rank; the README's embeddings answer.
        assert re.search(r"^x-sim-rank: [01]\s*$", out, re.M | re.I), out
        assert re.search(r'"prefill_dp_rank":[01]\b', out), out
        assert '"object":"embedding"' in out.replace(" ", "")
        _assert_prompt_hits(session.url, session.token())
        up_dirs = set(re.findall(r"(/tmp/kvsvc-up-\w+)/router\.log", out))
        assert up_dirs
    finally:
        session.stop()
    assert not [d for d in up_dirs if os.path.exists(d)]


@pytest.mark.etcd
def test_running_the_service_by_hand(tmp_path):
    all_blocks = _blocks()
    manual = [b for b in all_blocks if _manual(b) and b.mode != "skip"]
    assert any("kvsvc sim --serve" in b.text for b in manual)
    tries = [b for b in all_blocks if b.mode == "try"]
    assert len(tries) >= 3
    # The Quick start's activation, which "Running the service" assumes.
    activate = [b for b in all_blocks if b.text.startswith(". .venv/bin/activate")]
    assert len(activate) == 1 and activate[0].mode == "run"
    with LocalEtcd(name="readme-test") as etcd:
        session = Session(tmp_path, {"KVSVC_ETCD_ADDR": etcd.addr})
        try:
            session.run(activate + manual + tries)
            assert session.output.count("data: [DONE]") == 2
            _assert_prompt_hits(session.url, session.token())
        finally:
            session.stop()
