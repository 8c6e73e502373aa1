"""Eager vs compiled blocks (`parallel.compile`, issue 39): one rank's engine step on a small
GPT on this machine's CPU, `off` against `inductor` (torch.compile of each block type).

Both engines train the same model (the built-in GPT at gpt-small-demo's shape: 4 blocks of
256, seq 128, dropout 0.1 with the engine's per-sample masks) on the same batch (8 samples,
2 micro-batches of 4: every block but the fused tail's recomputed), fp32, with the same torch
threads. The first steps compile (inductor: two graphs per block type and micro-batch shape,
the grad-free forward and the recompute + backward); the compile time is reported apart, and
the timed steps run in alternating order so drifts of a shared machine hit both alike. The
question: does `inductor` pay on the CPU, and so should `parallel.compile = "auto"` pick it
there (runtime/capture/apply.py `AUTO`)?
"""

from __future__ import annotations

import argparse
import time

import torch

from _common import Result, alternate, markdown_table, median, print_table, save_figure

MODES = ("off", "inductor")


def engine(mode: str, args: argparse.Namespace):
    from cephalo.modeling.registry import build_model
    from cephalo.planner.makers import manual_plan
    from cephalo.runtime.collectives.comm import LocalComm
    from cephalo.runtime.engine.engine import Engine, EngineConfig

    plan = manual_plan(
        "gpt-small-demo", args.seq_len, [args.batch], [args.micro], [1.0], dtype="fp32"
    )
    model = build_model("gpt-small-demo", dropout=args.dropout)
    return Engine(model, plan, LocalComm(), EngineConfig(compile=mode))


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (args.batch, args.seq_len), generator=g)
    y = torch.roll(x, -1, dims=1)
    engines, first, warm = {}, {}, {}
    for mode in MODES:
        t0 = time.perf_counter()
        engines[mode] = engine(mode, args)
        first[mode] = [engines[mode].train_step(x, y, lr=1e-4).loss for _ in range(2)]
        warm[mode] = time.perf_counter() - t0
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for mode in alternate(args.rounds, list(MODES)):
        t0 = time.perf_counter()
        engines[mode].train_step(x, y, lr=1e-4)
        times[mode].append(time.perf_counter() - t0)
    compiled = engines["inductor"].runner.compiled
    return {
        "times": times,
        "warm": warm,
        "first": first,
        "calls": (compiled.calls, compiled.eager_calls, compiled.block_types),
    }


def _plot(meds: dict[str, float], warm: dict[str, float]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3))
    a.bar(list(meds), [v * 1e3 for v in meds.values()], color=["0.5", "tab:blue"])
    a.set_ylabel("ms per step (median)")
    a.set_title("step time")
    b.bar(list(warm), list(warm.values()), color=["0.5", "tab:blue"])
    b.set_ylabel("s")
    b.set_title("build + first 2 steps (compile)")
    fig.tight_layout()
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8, help="timed steps per mode (median)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--dropout", type=float, default=0.1)
    args = ap.parse_args()
    started = time.perf_counter()
    r = run(args)
    meds = {m: median(r["times"][m]) for m in MODES}
    ratio = meds["inductor"] / meds["off"]
    diff = max(
        abs(a - b) / abs(b) for a, b in zip(r["first"]["inductor"], r["first"]["off"], strict=True)
    )
    headers = ["mode", "ms / step (median)", "min / max", "build + 2 steps s", "vs eager"]
    rows = [
        [
            m,
            f"{meds[m] * 1e3:.1f}",
            f"{min(r['times'][m]) * 1e3:.1f} / {max(r['times'][m]) * 1e3:.1f}",
            f"{r['warm'][m]:.1f}",
            f"{meds[m] / meds['off']:.2f}x",
        ]
        for m in MODES
    ]
    print_table("eager vs compiled blocks, one CPU rank", headers, rows)
    calls, eager_calls, types = r["calls"]
    pays = ratio < 0.95
    res = Result("compile_step", "Eager vs compiled blocks on the CPU (parallel.compile)")
    res.summary = [
        markdown_table(headers, rows),
        f"gpt-small-demo shape (4 x 256, seq {args.seq_len}), batch {args.batch} in micro-batches "
        f"of {args.micro}, dropout {args.dropout}, fp32, {args.threads} thread(s): `inductor`'s "
        f"step is **{ratio:.2f}x** eager's; its compile costs {r['warm']['inductor'] - r['warm']['off']:.0f} s "
        f"more at the start. The first two losses differ by {diff:.1e} (relative; 0: bitwise equal). "
        + (
            "Compile pays here."
            if pays
            else "Compile does not pay enough on this CPU to be the default: `auto` stays "
            "`off` on the CPU (runtime/capture/apply.py `AUTO`)."
        ),
    ]
    res.details = [
        f"{types} block type, {calls} compiled block calls and {eager_calls} eager one (the "
        "first call of a shape records its dropout masks). Timed steps alternate between the "
        f"modes, {args.rounds} each; the machine is shared (load in the header)."
    ]
    res.figures = [save_figure(_plot(meds, r["warm"]), "compile_step")]
    print(res.write(time.perf_counter() - started))


if __name__ == "__main__":
    main()
