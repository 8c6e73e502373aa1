"""Memory of `prepare_dataset` vs corpus size, per input format (streaming check).

Each point is one fresh Python process that tokenizes a corpus of N MiB (pydoc topics,
repeated) with the byte tokenizer (and, for one row, a model's Hugging Face tokenizer
trained here on pydoc) and reports its peak resident-set growth during the call (Linux:
/proc/self/clear_refs resets the peak, then VmHWM), the peak of its anonymous memory
(sampled every 5 ms), and the throughput. Bounded memory means flat lines: the growth
must not follow the corpus size. Target: from the smallest to the largest corpus (about 15x
the data), the peak RSS growth rises by less than a tenth of the source bytes added, for JSON
Lines, Parquet and text (datasets directories are memory-mapped by `datasets`: their resident
file pages follow the file, so there their anonymous memory is what must stay flat).

Run: python bench/data_streaming.py   (about a minute; writes bench/results/data_streaming.md/.png)
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import (
    REPO_ROOT,
    Result,
    markdown_table,
    print_table,
    raise_priority,
    save_figure,
    verdict,
)

sys.path.insert(0, str(REPO_ROOT / "tests"))
from data_helpers import save_tokenizer, write_corpus  # noqa: E402

SIZES_MIB = (8, 32, 128)
FORMATS = ("jsonl", "parquet", "text", "datasets")
PIECE_CHARS = 1 << 20  # the default

WORKER = """
import json, sys, threading, time
from pathlib import Path
from cephalo.data.corpus import Corpus
from cephalo.data.text import prepare_dataset

def status():
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key = line.split(":")[0]
        if key in ("VmRSS", "VmHWM", "RssAnon"):
            out[key] = int(line.split()[1]) * 1024
    return out

source, out_dir, tokenizer = sys.argv[1], sys.argv[2], sys.argv[3]
corpus = Corpus.from_paths([source])
size = corpus.size_bytes()
peak_anon, done = [0], []

def sample():
    while not done:
        peak_anon[0] = max(peak_anon[0], status()["RssAnon"])
        time.sleep(0.005)

Path("/proc/self/clear_refs").write_text("5")
before = status()
sampler = threading.Thread(target=sample)
sampler.start()
t0 = time.perf_counter()
res = prepare_dataset(corpus, out_dir, tokenizer=tokenizer, progress=False, force=True)
seconds = time.perf_counter() - t0
done.append(1)
sampler.join()
after = status()
print(json.dumps({
    "source_bytes": size, "seconds": seconds, "tokens": res.num_tokens,
    "rss_growth": after["VmHWM"] - before["VmRSS"], "anon_growth": peak_anon[0] - before["RssAnon"],
}))
"""


def measure(source: Path, out_dir: Path, tokenizer: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, str(source), str(out_dir), tokenizer],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def main() -> None:
    raise_priority()
    started = time.perf_counter()
    rows, points = [], {}
    with tempfile.TemporaryDirectory(prefix="cephalo-bench-data-") as tmp:
        root = Path(tmp)
        model_dir = save_tokenizer(root / "model", vocab_size=2048)
        cases = [(fmt, size, "byte") for fmt in FORMATS for size in SIZES_MIB]
        cases.append(("jsonl", SIZES_MIB[1], str(model_dir)))
        for fmt, size, tokenizer in cases:
            source = root / f"c{size}.{fmt}"
            if not source.exists():
                write_corpus(source, fmt, size)
            m = measure(source, root / f"out-{fmt}-{size}", tokenizer)
            label = "byte" if tokenizer == "byte" else "model BPE 2048 (transformers)"
            if tokenizer == "byte":
                points.setdefault(fmt, []).append(
                    (m["source_bytes"], m["rss_growth"], m["anon_growth"])
                )
            rows.append(
                [
                    fmt,
                    label,
                    mib(m["source_bytes"]),
                    f"{m['tokens']:,}",
                    "+" + mib(m["rss_growth"]),
                    "+" + mib(m["anon_growth"]),
                    f"{m['source_bytes'] / 2**20 / m['seconds']:.1f}",
                ]
            )
            print(rows[-1], flush=True)
            for f in root.glob(f"out-{fmt}-{size}/*.bin"):
                f.unlink()
    headers = [
        "format",
        "tokenizer",
        "source MiB",
        "tokens",
        "peak RSS growth MiB",
        "peak anon growth MiB",
        "MiB/s",
    ]
    print_table("prepare_dataset memory vs corpus size", headers, rows)

    checks = []
    for fmt, pts in points.items():
        (small, *small_mem), (large, *large_mem) = pts[0], pts[-1]
        which = 1 if fmt == "datasets" else 0  # anonymous for datasets, else resident
        rise, added = large_mem[which] - small_mem[which], large - small
        checks.append((fmt, rise, added, rise < added / 10))
    met = all(ok for *_, ok in checks)
    lines = ", ".join(
        f"{fmt} {'+' if rise >= 0 else '-'}{mib(abs(rise))} MiB for {mib(added)} MiB more "
        f"source ({verdict(ok)})"
        for fmt, rise, added, ok in checks
    )

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for fmt, pts in points.items():
        xs = [p[0] / 2**20 for p in pts]
        ys = [(p[2] if fmt == "datasets" else p[1]) / 2**20 for p in pts]
        label = f"{fmt} ({'anonymous' if fmt == 'datasets' else 'resident'})"
        ax.plot(xs, ys, marker="o", label=label)
    top = max(p[0] for pts in points.values() for p in pts) / 2**20
    ax.plot([0, top], [0, top], "k--", lw=0.8, label="the whole corpus in memory")
    ax.set_xlabel("corpus (source bytes, MiB)")
    ax.set_ylabel("peak memory growth while preparing (MiB)")
    ax.set_title("prepare_dataset streams: memory does not follow the corpus size")
    ax.set_ylim(0, max(40, top * 0.5))
    ax.legend(fontsize=8)
    figure = save_figure(fig, "data_streaming", "byte tokenizer, pieces of 1M characters")

    result = Result(
        "data_streaming",
        "Data preparation streams: memory vs corpus size",
        summary=[
            markdown_table(headers, rows),
            f"Target (flat: from the smallest to the largest corpus the peak growth rises by less "
            f"than a tenth of the source bytes added; anonymous memory for datasets directories, "
            f"which `datasets` memory-maps): {lines}. Overall "
            f"{verdict(met)}.",
        ],
        details=[
            "Method: each row is a fresh Python process running `prepare_dataset` on a corpus "
            "of pydoc topics repeated (one record per topic for JSON Lines, Parquet and "
            "datasets; one long document for text), default pieces of 1M characters. `peak "
            "RSS growth`: VmHWM after the call minus VmRSS before it (the peak is reset "
            "through /proc/self/clear_refs). `peak anon growth`: the largest RssAnon sampled "
            "every 5 ms, minus its value before. Memory-mapped file pages count as resident "
            "but are reclaimable; anonymous memory is what a corpus larger than RAM would "
            "exhaust. Throughput depends on the machine's load (shared 2-core box)."
        ],
        figures=[figure],
    )
    result.write(time.perf_counter() - started)


if __name__ == "__main__":
    main()
