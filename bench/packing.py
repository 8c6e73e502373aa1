"""Chat fine-tuning, packed against padded samples, on an emulated heterogeneous cluster: the
padding fraction and the speed in real (non-padding) tokens per second, side by side.

The data and model are the project's own chat example (`cephalo.data.chat_example`: 2000
conversations of one to four exchanges, a tiny Qwen2 with a ChatML template), prepared once
(`prepare_chat_dataset`, loss on the assistant's tokens). Both variants train the same model
under the same plan on 3 gloo ranks with emulated slowdowns 1 / 2 / 3 and the same global
batch of samples of `seq_len` tokens:

- `padded`: one conversation per sample, right-padded (`data.packing = false`);
- `packed`: whole conversations packed best-fit decreasing, with per-conversation position
  ids (`data.packing = true`): transformers' packed-sequence masks keep them apart.

A step's time is the slowest rank's wall time; real tokens are the non-padding tokens of the
global batch. The variants alternate step by step (rotated each round) and the medians are
compared, so drifts of a shared machine hit both alike.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from _common import (
    RankPool,
    Result,
    alternate,
    markdown_table,
    median,
    print_table,
    raise_priority,
)

VARIANTS = ("padded", "packed")
SLOWDOWNS = (1.0, 2.0, 3.0)


def _measure(model_dir: str, data_dir: str, args: dict, order: list[str]) -> dict:
    """On every rank: one engine per variant, the steps in `order` (a warm-up step of each
    first); returns this rank's wall time per step, by variant."""
    from cephalo.data.chat_data import DocumentBatches
    from cephalo.modeling.registry import build_model
    from cephalo.planner.makers import manual_plan
    from cephalo.runtime.collectives.comm import make_comm
    from cephalo.runtime.engine.engine import Engine, EngineConfig

    torch.set_num_threads(1)
    comm = make_comm("gloo", validate=False)
    rank = comm.rank
    plan = manual_plan(
        model_dir, args["seq_len"], args["batches"], args["batches"], args["fractions"]
    )
    cfg = EngineConfig(
        compute_dtype="fp32",
        slowdown=SLOWDOWNS[rank],
        validate_collectives=False,
        per_sample_dropout=False,
    )
    start = plan.batch_offsets()[rank]
    size = plan.ranks[rank].batch_size
    systems = {}
    for v in VARIANTS:
        batches = DocumentBatches(
            data_dir, args["seq_len"], plan.global_batch_size, packing=v == "packed"
        )
        systems[v] = [batches, Engine(build_model(model_dir), plan, comm, cfg), 0]
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    real: dict[str, list[int]] = {v: [] for v in VARIANTS}
    for i, v in enumerate(list(VARIANTS) + order):
        batches, engine, step = systems[v]
        x, y = batches.rank_slice(step, start, size)
        pos = batches.rank_positions(step, start, size)
        dist.barrier()
        t0 = time.perf_counter()
        engine.train_step(x, y, 1e-3, position_ids=pos)
        wall = time.perf_counter() - t0
        if i >= len(VARIANTS):  # not the warm-up
            times[v].append(wall)
            real[v].append(batches.real_tokens(step))
        systems[v][2] = step + 1
    stats = {v: systems[v][0].train.stats for v in VARIANTS}
    return {"times": times, "real": real, "stats": stats, "global_batch": plan.global_batch_size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6, help="timed steps per variant (median)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--conversations", type=int, default=2000)
    ap.add_argument("--batches", default="6,4,2", help="the plan's per-rank batches")
    args = ap.parse_args()
    raise_priority()
    started = time.perf_counter()
    from cephalo.data.chat_data import prepare_chat_dataset
    from cephalo.data.chat_example import write_chat_example

    batches = [int(b) for b in args.batches.split(",")]
    spec = {
        "seq_len": args.seq_len,
        "batches": batches,
        "fractions": [b / sum(batches) for b in batches],
    }
    with tempfile.TemporaryDirectory() as tmp:
        example = write_chat_example(Path(tmp) / "example", args.conversations)
        data = prepare_chat_dataset([example.jsonl], Path(tmp) / "data", example.model)
        with RankPool(len(SLOWDOWNS), timeout_s=900) as pool:
            ranks = pool.run(
                _measure,
                str(example.model),
                str(data.path),
                spec,
                alternate(args.rounds, list(VARIANTS)),
            )
    stats = ranks[0]["stats"]
    step_s = {
        v: [max(r["times"][v][i] for r in ranks) for i in range(args.rounds)] for v in VARIANTS
    }
    real = ranks[0]["real"]
    speed = {v: median([t / s for t, s in zip(real[v], step_s[v], strict=True)]) for v in VARIANTS}
    headers = [
        "samples",
        "padding",
        "real tokens / step",
        "median s / step",
        "real tokens / s",
        "vs padded",
    ]
    rows = [
        [
            v,
            f"{stats[v].padding_fraction:.1%}",
            f"{median(real[v]):,.0f}",
            f"{median(step_s[v]):.3f}",
            f"{speed[v]:,.0f}",
            f"**{speed[v] / speed['padded']:.2f}x**" if v == "packed" else "1.00x",
        ]
        for v in VARIANTS
    ]
    title = "packed vs padded chat samples (3 emulated ranks, slowdowns 1/2/3)"
    print_table(title, headers, rows)
    wall = time.perf_counter() - started
    g = ranks[0]["global_batch"]
    Result(
        name="packing",
        title="Chat fine-tuning: packed vs padded samples",
        emulated="3 CPU ranks stand in for devices 1x, 2x and 3x slower (`slowdown=f` makes each "
        "compute piece last f x its CPU time; runtime/emulation.py).",
        summary=[markdown_table(headers, rows, "lrrrrr")],
        details=[
            "## Setup\n\n"
            f"- Data: the chat example ({args.conversations} conversations, "
            f"`cephalo.data.chat_example`), loss on the assistant's tokens; "
            f"{stats['padded'].samples} padded samples or {stats['packed'].samples} packed "
            f"windows of {args.seq_len} tokens.\n"
            f"- Model: the example's tiny Qwen2 (4 layers, hidden 64), fp32, random init.\n"
            f"- Plan: batches {batches} (global batch {g} samples) on ranks with slowdowns "
            f"{list(SLOWDOWNS)}, one micro-batch each; the same for both variants.\n"
            f"- {args.rounds} timed steps per variant after one warm-up, alternated; a step's "
            f"time is the slowest rank's.\n"
            "- Run: `python bench/packing.py`."
        ],
    ).write(wall)


if __name__ == "__main__":
    main()
