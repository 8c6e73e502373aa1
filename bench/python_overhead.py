"""The engine's own Python cost on a small model: where one rank's step time goes.

A GPT-2-124M-shaped model (`gpt2-124m`: 12 layers, hidden 768, vocabulary 50304) on short
sequences, one rank (`LocalComm`), fp32 on the CPU, against plain PyTorch with activation
checkpointing of every block (`torch.utils.checkpoint`) and torch's fastest AdamW on the same
batch and threads: the like-for-like baseline of the engine's recompute.

The profile table comes from `cProfile` over a few engine steps: every frame's own time
(`tottime`) is either a C call (`{built-in method ...}`, `{method ...}`: the tensor ops and
autograd's engine, the work) or Python code (cephalo's, torch's Python wrappers, the standard
library: the overhead). Python overhead = the Python frames' share of the profiled time.
Target (issue #24): under 10 % of the step.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from _common import Result, alternate, markdown_table, median, print_table, save_figure, verdict

TARGET = 0.10
LR = 1e-4


def _engine(args):
    from cephalo.modeling.registry import build_model
    from cephalo.planner.makers import manual_plan
    from cephalo.runtime.collectives.comm import LocalComm
    from cephalo.runtime.engine.engine import Engine, EngineConfig

    plan = manual_plan(args.model, args.seq_len, [args.batch], [args.micro], [1.0])
    cfg = EngineConfig(compute_dtype="fp32", validate_collectives=False)
    return Engine(build_model(args.model), plan, LocalComm(), cfg)


def _plain(args):
    from torch.utils.checkpoint import checkpoint

    from cephalo.modeling.registry import build_model

    model = build_model(args.model).materialize("cpu", torch.Generator().manual_seed(0))
    units = model.units
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)

    def step(x, y) -> None:
        opt.zero_grad(set_to_none=True)
        h = units[0].module(x)
        for u in units[1:-1]:
            h = checkpoint(u.module, h, use_reentrant=False)
        loss = units[-1].module(h, y) / y.numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()

    return step


def profile_table(engine, x, y, steps: int) -> tuple[list[list[str]], float, float]:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.train_step(x, y, LR)
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
    total = sum(v[2] for v in stats.values())
    python = sum(v[2] for k, v in stats.items() if k[0] != "~")
    by_frame = sorted(stats.items(), key=lambda kv: -kv[1][2])
    rows = []
    for (file, line, name), v in by_frame[:15]:
        where = "C" if file == "~" else "Python"
        label = (
            name
            if file == "~"
            else f"{file.split('site-packages/')[-1].split('src/')[-1]}:{line} {name}"
        )
        rows.append(
            [
                label[:90],
                where,
                f"{v[1] // steps}",
                f"{1e3 * v[2] / steps:.2f}",
                f"{v[2] / total:.1%}",
            ]
        )
    return rows, python / total, total / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt2-124m")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 50304, (args.batch, args.seq_len), generator=g)
    y = torch.randint(0, 50304, (args.batch, args.seq_len), generator=g)
    engine = _engine(args)
    plain = _plain(args)
    systems = {"cephalo": lambda: engine.train_step(x, y, LR), "torch+GC": lambda: plain(x, y)}
    for f in systems.values():
        f()
    times: dict[str, list[float]] = {k: [] for k in systems}
    for name in alternate(args.rounds, list(systems)):
        t0 = time.perf_counter()
        systems[name]()
        times[name].append(time.perf_counter() - t0)
    med = {k: median(v) for k, v in times.items()}
    rows, share, profiled = profile_table(engine, x, y, 2)
    step_rows = [[k, f"{med[k]:.3f}", f"{med[k] / med['torch+GC']:.2f}"] for k in systems]
    print_table("one step", ["system", "median s/step", "vs torch+GC"], step_rows)
    headers = ["frame (own time)", "kind", "calls/step", "ms/step", "share"]
    print_table(f"engine profile: Python overhead {share:.1%}", headers, rows)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 2.5))
    ax.barh(["Python", "C (ops, autograd)"], [share, 1 - share], color=["C3", "C0"])
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of the engine's profiled step time")
    fig.tight_layout()
    fig_name = save_figure(fig, "python_overhead")
    Result(
        name="python_overhead",
        title="The engine's own Python cost on a GPT-2-124M-shaped model (one rank, CPU)",
        summary=[
            markdown_table(["system", "median s/step", "vs torch+GC"], step_rows, "lrr"),
            f"- Target Python overhead < {TARGET:.0%} of the step: {verdict(share < TARGET)} "
            f"({share:.1%} of {profiled:.2f} s profiled per step).",
        ],
        figures=[fig_name],
        details=[
            "## Profile (cProfile, own time per frame, 2 steps)\n\n"
            + markdown_table(headers, rows, "llrrr"),
            "## Setup\n\n"
            f"- `{args.model}`, batch {args.batch} x {args.seq_len} tokens, micro-batch "
            f"{args.micro}, fp32, {args.threads} torch threads; {args.rounds} timed steps per "
            "system in rotated order after a warm-up.\n"
            "- On a GPU the same Python work is a larger share (the ops are faster, the Python "
            "the same): the table says which frames it is.",
        ],
    ).write(time.perf_counter() - started)


if __name__ == "__main__":
    main()
