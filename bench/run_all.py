"""Run every benchmark in sequence (each with a time limit), then regenerate the result
sections of docs/benchmarks.md from bench/results/*.md.

    python bench/run_all.py                 # everything (`make bench`)
    python bench/run_all.py --only lga      # some
    python bench/run_all.py --docs-only     # just rebuild docs/benchmarks.md from the results

docs/benchmarks.md is hand-written around marker pairs `<!-- bench:NAME -->` ...
`<!-- /bench:NAME -->`; between them this script puts the summary of bench/results/NAME.md
(the part between its `<!-- summary -->` markers, or the whole file after its title), its
figure and a link to it. A bench without markers gets a section appended at the end.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS = BENCH_DIR / "results"
DOC = REPO / "docs" / "benchmarks.md"
SUMMARY_BEGIN, SUMMARY_END = "<!-- summary -->", "<!-- /summary -->"
TOTAL_BUDGET_S = 20 * 60
"""`make bench` must finish within 20 minutes on the 2-core development machine."""


@dataclass
class Bench:
    name: str
    """Script stem under bench/ and result stem under bench/results/."""
    title: str
    """Section title in docs/benchmarks.md."""
    timeout_s: int
    """Kill the bench after this long (its results file is then not refreshed)."""


BENCHES = [
    Bench("planner_quality", "Planner quality (predicted, real GPU types)", 120),
    Bench("planner_scaling", "Planner scaling", 240),
    Bench("advise_scaling", "Advisor scaling (cephalo advise vs brute force)", 300),
    Bench("prediction_accuracy", "Cost-model prediction accuracy", 300),
    Bench("lga", "Layered vs standard gradient accumulation", 240),
    Bench("engine_vs_fsdp2", "Engine vs PyTorch FSDP2", 360),
    Bench("gloo_gather", "Equal-size collectives on gloo", 120),
    Bench("hetero_throughput", "Emulated heterogeneous clusters (measured)", 420),
    Bench("pipeline", "Pipeline stages on 3 emulated nodes", 360),
    Bench("data_streaming", "Data preparation streams: memory vs corpus size", 300),
    Bench("hf_overhead", "Cephalo on a Hugging Face model vs plain transformers", 420),
    Bench("optimizer_step", "AdamW on a flat shard vs torch's fastest", 300),
    Bench("python_overhead", "The engine's own Python cost on a small model", 300),
    Bench("launch_count", "Ops per training step: the engine vs plain PyTorch", 420),
    Bench("packing", "Chat fine-tuning: packed vs padded samples", 180),
    Bench("adapters", "Full fine-tuning vs LoRA vs QLoRA", 240),
]


@dataclass
class Outcome:
    bench: Bench
    status: str
    """ok, failed (exit code), timed out, missing."""
    wall_s: float = 0.0


def run_bench(b: Bench, timeout_s: float) -> Outcome:
    script = BENCH_DIR / f"{b.name}.py"
    if not script.exists():
        print(f"== {b.name}: no {script.relative_to(REPO)}; skipped", flush=True)
        return Outcome(b, "missing")
    print(f"== {b.name} (limit {timeout_s:.0f} s)", flush=True)
    started = time.perf_counter()
    # its own process group, so a timeout also ends the ranks it spawned
    proc = subprocess.Popen([sys.executable, str(script)], cwd=REPO, start_new_session=True)
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        wall = time.perf_counter() - started
        print(f"== {b.name}: TIMED OUT after {wall:.0f} s", flush=True)
        return Outcome(b, "timed out", wall)
    wall = time.perf_counter() - started
    status = "ok" if code == 0 else f"failed (exit {code})"
    print(f"== {b.name}: {status} in {wall:.0f} s", flush=True)
    return Outcome(b, status, wall)


def summary_of(name: str) -> str | None:
    """The summary block of bench/results/<name>.md (or its body), links made relative to docs/."""
    path = RESULTS / f"{name}.md"
    if not path.exists():
        return None
    text = path.read_text()
    if SUMMARY_BEGIN in text and SUMMARY_END in text:
        body = text.split(SUMMARY_BEGIN, 1)[1].split(SUMMARY_END, 1)[0]
        head = text.split(SUMMARY_BEGIN, 1)[0]
        provenance = next((ln for ln in head.splitlines() if ln.startswith("_")), "")
        notes = "\n\n".join(ln for ln in head.splitlines() if ln.startswith("> **"))
        body = "\n\n".join(p for p in (provenance, notes, body.strip()) if p)
    else:
        lines = text.splitlines()
        body = "\n".join(lines[1:] if lines and lines[0].startswith("# ") else lines).strip()
        body = re.sub(r"^(#+) ", r"#\1 ", body, flags=re.M)  # one level below the section title
    # relative links of the results file point into bench/results/
    body = re.sub(r"\]\((?!https?:|/|#|\.\./)([^)]+)\)", r"](../bench/results/\1)", body)
    png = RESULTS / f"{name}.png"
    if png.exists() and f"{name}.png" not in body:
        body += f"\n\n![{name}](../bench/results/{name}.png)"
    return body + f"\n\nFull results: [bench/results/{name}.md](../bench/results/{name}.md)."


def run_table(outcomes: list[Outcome], total_s: float) -> str:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    rows = [
        f"| `bench/{o.bench.name}.py` | {o.status} | {o.wall_s:.0f} s | {o.bench.timeout_s} s |"
        for o in outcomes
    ]
    return "\n".join(
        [
            f"_Last `make bench` ({now}): {total_s / 60:.1f} min in total (budget {TOTAL_BUDGET_S // 60} min)._",
            "",
            "| bench | status | wall time | limit |",
            "| :--- | :--- | ---: | ---: |",
            *rows,
        ]
    )


def replace_block(doc: str, key: str, title: str, body: str) -> str:
    begin, end = f"<!-- bench:{key} -->", f"<!-- /bench:{key} -->"
    block = f"{begin}\n{body.strip()}\n{end}"
    if begin in doc and end in doc:
        pre, rest = doc.split(begin, 1)
        return pre + block + rest.split(end, 1)[1]
    return doc.rstrip() + f"\n\n## {title}\n\n{block}\n"


def write_docs(outcomes: list[Outcome] | None, total_s: float | None) -> None:
    doc = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
    if outcomes is not None and total_s is not None:
        table = run_table(outcomes, total_s)
        (RESULTS / "run_all.md").write_text("# make bench: runtimes\n\n" + table + "\n")
    if (RESULTS / "run_all.md").exists():
        table = (RESULTS / "run_all.md").read_text().split("\n", 2)[2].strip()
        doc = replace_block(doc, "run_all", "Runtimes", table)
    for b in BENCHES:
        body = summary_of(b.name)
        if body is not None:
            doc = replace_block(doc, b.name, b.title, body)
    DOC.write_text(doc.rstrip() + "\n")
    print(f"wrote {DOC.relative_to(REPO)}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run only these benches")
    ap.add_argument("--docs-only", action="store_true", help="only rebuild docs/benchmarks.md")
    args = ap.parse_args()
    names = {b.name for b in BENCHES}
    if args.only and not set(args.only) <= names:
        ap.error(f"unknown bench(es) {sorted(set(args.only) - names)}; choose from {sorted(names)}")
    if args.docs_only:
        write_docs(None, None)
        return 0
    selected = [b for b in BENCHES if not args.only or b.name in args.only]
    from _common import raise_priority

    print(f"== niceness {raise_priority()} (inherited by every bench)", flush=True)
    started = time.perf_counter()
    outcomes = []
    for b in selected:
        left = TOTAL_BUDGET_S - (time.perf_counter() - started)
        if left < 30:
            print(
                f"== {b.name}: skipped, the {TOTAL_BUDGET_S // 60}-minute budget is spent",
                flush=True,
            )
            outcomes.append(Outcome(b, "skipped (budget spent)"))
            continue
        outcomes.append(run_bench(b, min(b.timeout_s, left)))
    total = time.perf_counter() - started
    print(f"== all: {total / 60:.1f} min", flush=True)
    write_docs(outcomes if not args.only else None, total if not args.only else None)
    return 0 if all(o.status in ("ok", "missing") for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
