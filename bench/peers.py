"""kvsvc beside the Rust routers on the same engines (issue 22 item 4): a thin wrapper of
``../shared/tools/peers/peers_bench.py``.

Run: ``python bench/peers.py [--smoke] [--window-s S] [--routers LIST] [--out DIR] [--nice N]``.

It runs the harness's trace phase (default: its quick mode, ``sglang-cache_aware, kvsvc-TTFT,
vllm-cache_aware@ids, kvsvc-TTFT@ids``, the first 600 trace seconds of the conversation trace
at 5x on 4 simulated vLLM engines restarted cold per router) inside the harness's own venv,
keeps every request's answer in ``results.json`` (``trace[i]["requests"]``: sent / first /
end wall seconds, prompt and cached tokens, the engine that served it, its simulated queue
and prefill ms), and prints the table in issue 22's columns. The harness installs the Rust
routers from PyPI into venvs under /tmp the first time (its ``bootstrap``).

``--table RESULTS_JSON`` prints the table of an earlier run; ``--placements RESULTS_JSON``
compares the routers' placements request by request (:func:`placements`): where each router
put a request away from the engine holding its longest prefix (an infinite cache per engine,
from that run's own placements, in the trace's 512-token blocks), what that cost in tokens, and
whether the longer prefix was already prefilled when the request was sent (``settled``: the
policy preferred another engine, e.g. a queue term outweighing the prefix) or still in
flight (an index learning it from events could not know it yet; pending prefixes, §16).

Not a test: figures are printed; bench/RESULTS.md keeps them (section "Peers").
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from collections import defaultdict
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
HARNESS = ROOT.parent / "shared" / "tools" / "peers" / "peers_bench.py"
QUICK_ROUTERS = "sglang-cache_aware,kvsvc-TTFT,vllm-cache_aware@ids,kvsvc-TTFT@ids"
IN_VENV = "KVSVC_PEERS_WRAPPED"


def load_harness(path: Path = HARNESS) -> ModuleType:
    """The harness as a module (its top level imports the standard library only)."""
    spec = importlib.util.spec_from_file_location("peers_bench", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"peers: no harness at {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def request_rows(recs: list[dict]) -> list[dict]:
    """The harness's client records, trace order, reduced to what the placement analysis and
    the table need."""
    out = []
    for r in recs:
        usage = r.get("usage") or {}
        timing = r.get("sim_timing") or {}
        out.append({
            "ok": bool(r.get("ok")), "sent": r.get("sent"), "first": r.get("first"),
            "end": r.get("end"), "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
            "engine": timing.get("instance"), "rank": timing.get("rank"),
            "host_only_tokens": timing.get("host_only_tokens"),
            "queue_ms": timing.get("queue_ms"), "prefill_ms": timing.get("prefill_ms"),
            "error": r.get("error")})
    return out


def run_in_venv(harness_args: list[str]) -> int:
    """Inside the harness venv: the harness's ``main`` with each trace summary carrying its
    requests."""
    mod = load_harness()
    summarize = mod.summarize_trace

    def summarize_with_requests(label: str, recs: list[dict], *args: Any, **kw: Any) -> dict:
        s = summarize(label, recs, *args, **kw)
        s["requests"] = request_rows(recs)
        return s

    mod.summarize_trace = summarize_with_requests
    sys.argv = [str(HARNESS), *harness_args]
    return int(mod.main())


def bootstrap_and_exec(harness_args: list[str], out: Path) -> None:
    """The harness's venvs (installed once, as its ``bootstrap``), then this file again in the
    harness venv; returns only if exec fails."""
    mod = load_harness()
    if not (ROOT / ".venv" / "bin" / "kvsvc").exists():
        mod._run(["make", "install"], cwd=ROOT)
    mod.ensure_venv(mod.VLLM_ROUTER_VENV, [mod.VLLM_ROUTER_PIN], "bin/vllm-router")
    mod.ensure_venv(mod.SGLANG_ROUTER_VENV, [mod.SGLANG_ROUTER_PIN], "bin/smg")
    mod.ensure_venv(mod.HARNESS_VENV, ["aiohttp>=3.9", "requests>=2.31"], "bin/.peers-ready")
    (mod.HARNESS_VENV / "bin" / ".peers-ready").touch()
    py = str(mod.HARNESS_VENV / "bin" / "python")
    env = dict(os.environ, PEERS_IN_VENV="1", **{IN_VENV: "1"})
    os.execve(py, [py, str(Path(__file__).resolve()), "--out", str(out), "--",
                   *harness_args], env)


# ---- the table -------------------------------------------------------------------------

def router_name(label: str, versions: dict) -> str:
    """Issue 22's row name of a harness label (``sglang-cache_aware`` -> ``sglang-router
    0.3.2 cache_aware (text)``)."""
    base, _, opts = label.partition("@")
    body = "token ids" if "ids" in opts.split("+") else "text"
    kind, _, policy = base.partition("-")
    if kind == "kvsvc":
        policy = {"CAR": "CAR λ 0.5"}.get(policy, policy)
        return f"kvsvc {policy} ({body})"
    if kind in ("sglang", "vllm"):
        ver = versions.get(f"{kind}-router", "")
        return f"{kind}-router {ver} {policy} ({body})".replace("  ", " ")
    return f"direct, round robin ({body})"


def table(results: dict) -> str:
    """The trace runs of ``results`` as issue 22's table (markdown)."""
    versions = results.get("versions", {})
    lines = ["| router (body) | TTFT p50 / p90 / p99 ms | hit, of ideal | router delay p50 / p99 ms "
             "| router CPU s | failed |", "|---|---|---|---|---|---|"]
    for s in results.get("trace", []):
        name = router_name(s["label"], versions)
        if "error" in s:
            lines.append(f"| {name} | failed: {s['error'][:100]} | | | | |")
            continue
        t, d = s["ttft_ms"], s["router_delay_ms"]
        ideal = s.get("ideal_fraction") or 0.0
        share = f"{100 * s['hit_fraction'] / ideal:.1f}%" if ideal else "-"
        cpu = "-" if s.get("router_cpu_s") is None else f"{s['router_cpu_s']:.1f}"
        lines.append(f"| {name} | {t['p50']:.0f} / {t['p90']:.0f} / {t['p99']:.0f} | {share} | "
                     f"{d['p50']:.0f} / {d['p99']:.0f} | {cpu} | {s['failed']} |")
    return "\n".join(lines)


# ---- placements ------------------------------------------------------------------------

def placements(results: dict, trace_name: str = "conversation") -> str:
    """Per router: the placement analysis of the module docstring, as text."""
    sys.path.insert(0, str(ROOT))
    from kvsvc.testbed.traces import TRACE_BLOCK_TOKENS, load_trace

    meta = results.get("trace_meta", {})
    runs = [s for s in results.get("trace", []) if "requests" in s]
    trace = load_trace(trace_name)[:meta.get("requests", 0)]
    out: list[str] = []
    per_run: dict[str, list[Optional[int]]] = {}
    for s in runs:
        rows = s["requests"]
        engines = sorted({r["engine"] for r in rows if r.get("engine")})
        held: dict[str, dict[int, float]] = defaultdict(dict)  # engine -> block -> prefilled at
        order = sorted((i for i, r in enumerate(rows) if r["ok"] and r.get("engine")),
                       key=lambda i: rows[i]["sent"])
        # engine -> (sent, first, end) of every request, to see each engine's load at a send
        spans: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
        for i in order:
            r = rows[i]
            spans[r["engine"]].append((r["sent"], r["first"], r["end"]))
        lost = {"settled": 0, "in flight": 0}
        cases = {"settled": 0, "in flight": 0}
        load_gap: list[float] = []
        prompt = cached = placed = best_hit = 0
        cached_of: list[Optional[int]] = [None] * len(rows)  # per request, in trace order

        def tokens(req: Any, k: int) -> int:
            return req.input_length if k >= len(req.hash_ids) else TRACE_BLOCK_TOKENS * k

        for i in order:
            r, req = rows[i], trace[i]
            sent = r["sent"]

            def prefix(engine: str, settled_only: bool) -> int:
                k = 0
                for h in req.hash_ids:
                    at = held[engine].get(h)
                    if at is None or (settled_only and at > sent):
                        break
                    k += 1
                return k

            avail = {e: prefix(e, False) for e in engines}
            chosen = avail.get(r["engine"], 0)
            best_engine = max(avail, key=lambda e: (avail[e], e == r["engine"]))
            best = avail[best_engine]
            prompt += r["prompt_tokens"] or 0
            cached += r["cached_tokens"] or 0
            placed += tokens(req, chosen)
            best_hit += tokens(req, best)

            def busy(engine: str) -> int:  # requests in prefill or queued there at ``sent``
                return sum(1 for a, f, _ in spans[engine] if a < sent < f)

            if best > chosen:
                kind = "settled" if prefix(best_engine, True) > chosen else "in flight"
                lost[kind] += tokens(req, best) - tokens(req, chosen)
                cases[kind] += 1
                load_gap.append(busy(best_engine) - busy(r["engine"]))
            cached_of[i] = r["cached_tokens"] or 0
            prefilled = r["first"]
            for h in req.hash_ids:
                held[r["engine"]][h] = min(held[r["engine"]].get(h, prefilled), prefilled)
        per_run[s["label"]] = cached_of
        out.append(f"{s['label']}: {len(order)} requests, prompt {prompt} tokens; engines' "
                   f"cached {cached / max(1, prompt):.1%}; this placement with infinite caches "
                   f"{placed / max(1, prompt):.1%}; the longest prefix each time "
                   f"{best_hit / max(1, prompt):.1%}")
        for kind in ("settled", "in flight"):
            out.append(f"  away from a longer prefix, {kind}: {cases[kind]} requests, "
                       f"{lost[kind]} tokens ({lost[kind] / max(1, prompt):.1%} of prompt)")
        if load_gap:
            more = sum(1 for g in load_gap if g > 0)
            out.append(f"  of those, the longer prefix's engine had more requests in prefill "
                       f"or queued at the send: {more} of {len(load_gap)} (mean gap "
                       f"{sum(load_gap) / len(load_gap):+.2f})")
    labels = list(per_run)
    for a in labels:
        for b in labels:
            if a >= b:
                continue
            pa, pb = per_run[a], per_run[b]
            both = [(x, y) for x, y in zip(pa, pb) if x is not None and y is not None]
            out.append(f"{a} minus {b}: cached tokens {sum(x - y for x, y in both):+d} over "
                       f"{len(both)} requests; {sum(1 for x, y in both if x > y)} requests "
                       f"more cached in {a}, {sum(1 for x, y in both if x < y)} in {b}")
    return "\n".join(out)


def main(argv: Optional[list[str]] = None) -> int:
    """Command line (module docstring)."""
    argv = sys.argv[1:] if argv is None else argv
    if os.environ.get(IN_VENV) == "1":
        sep = argv.index("--")
        out = Path(argv[argv.index("--out") + 1])
        rc = run_in_venv(argv[sep + 1:])
        results = json.loads((out / "results.json").read_text())
        print(table(results))
        return rc
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="", help="output directory (default /tmp/peers-out/<time>)")
    ap.add_argument("--routers", default=QUICK_ROUTERS, help="the harness's --trace-routers")
    ap.add_argument("--window-s", type=float, default=600.0, help="trace seconds replayed")
    ap.add_argument("--smoke", action="store_true", help="the harness's --smoke (60 trace s)")
    ap.add_argument("--nice", type=int, default=0, help="os.nice() increment of the runs")
    ap.add_argument("--table", metavar="RESULTS_JSON", help="print the table of a run and stop")
    ap.add_argument("--placements", metavar="RESULTS_JSON",
                    help="print the per-request placement analysis of a run and stop")
    args, extra = ap.parse_known_args(argv)
    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return 0
    if args.placements:
        print(placements(json.loads(Path(args.placements).read_text())))
        return 0
    import time
    out = Path(args.out or f"/tmp/peers-out/{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    harness_args = ["--kvsvc", str(ROOT), "--out", str(out), "--phases", "trace",
                    "--trace-routers", args.routers, "--window-s", repr(args.window_s),
                    "--nice", str(args.nice), *(["--smoke"] if args.smoke else []), *extra]
    bootstrap_and_exec(harness_args, out)
    return 1


if __name__ == "__main__":
    sys.exit(main())
