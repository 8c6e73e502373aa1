"""The engine's AdamW step on one flat shard against torch's fastest AdamW on the same tensors.

One flat fp32 shard of `--numel` elements (100 M by default: a 100M-parameter unit on one
rank), split into weight-decay runs and plain runs as a real unit's shard is (matrices decayed,
norms and biases not), with its gradient and two moments. Variants, timed in rotated order:

- `cephalo`: `ShardedAdamW.step(lr, clip)` with its default kernel (fused where the build has
  it), the clipping coefficient folded into the kernel;
- `cephalo (single)`: the single-tensor path (what the engine ran before issue #24);
- `torch fused`: `torch.optim.AdamW(fused=True)` over the same runs as parameters (two param
  groups: decay and not), gradients clipped by `torch._foreach_mul_` first;
- `torch foreach`: the same with `foreach=True`.

Target (issue #24): cephalo <= 1.2 x torch's fastest.
"""

from __future__ import annotations

import argparse
import time

import torch

from _common import Result, alternate, markdown_table, median, print_table, save_figure, verdict

TARGET = 1.2
LR, CLIP = 1e-4, 0.5


def _runs(n: int, pieces: int) -> list[tuple[int, int, bool]]:
    """`pieces` runs of the shard, every 4th one not decayed (a norm / bias run)."""
    edges = [round(i * n / pieces) for i in range(pieces + 1)]
    return [(a, b, i % 4 != 3) for i, (a, b) in enumerate(zip(edges, edges[1:], strict=False))]


def run(args: argparse.Namespace) -> dict:
    from cephalo.runtime.state.adamw import AdamWHyper, ShardedAdamW, ShardGroup

    torch.set_num_threads(args.threads)
    n = args.numel
    g = torch.Generator().manual_seed(0)
    runs = _runs(n, args.pieces)
    decay = [(a, b) for a, b, d in runs if d]

    def tensors():
        p = torch.randn(n, generator=g) * 0.02
        return p, torch.randn(n, generator=g), torch.zeros(n), torch.zeros(n)

    systems = {}
    for name, kernel in (("cephalo", None), ("cephalo (single)", "single")):
        p, gr, m, v = tensors()
        opt = ShardedAdamW([ShardGroup(p, gr, m, v, decay)], AdamWHyper(), kernel)
        systems[name] = (lambda opt=opt: opt.step(LR, CLIP), opt.kernel)
    for name, flag in (("torch fused", "fused"), ("torch foreach", "foreach")):
        p, gr, _, _ = tensors()
        params = []
        for a, b, _ in runs:
            t = torch.nn.Parameter(p[a:b])
            t.grad = gr[a:b]
            params.append(t)
        groups = [
            {"params": [t for t, (_, _, d) in zip(params, runs, strict=True) if d]},
            {
                "params": [t for t, (_, _, d) in zip(params, runs, strict=True) if not d],
                "weight_decay": 0.0,
            },
        ]
        opt = torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), weight_decay=0.1, **{flag: True})
        grads = [t.grad for t in params]

        def step(opt=opt, grads=grads) -> None:
            torch._foreach_mul_(grads, CLIP)
            opt.step()

        systems[name] = (step, flag)
    for step, _ in systems.values():
        step()  # warm-up (state allocated)
    times: dict[str, list[float]] = {k: [] for k in systems}
    for name in alternate(args.rounds, list(systems)):
        t0 = time.perf_counter()
        systems[name][0]()
        times[name].append(time.perf_counter() - t0)
    return {"times": times, "kernels": {k: v[1] for k, v in systems.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=100_000_000)
    ap.add_argument("--pieces", type=int, default=48, help="runs of the shard (parameters)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    started = time.perf_counter()
    r = run(args)
    med = {k: median(v) for k, v in r["times"].items()}
    fastest = min(med["torch fused"], med["torch foreach"])
    ratio = med["cephalo"] / fastest
    headers = ["variant", "kernel", "median s/step", "min", "max", "vs torch's fastest"]
    rows = [
        [
            k,
            r["kernels"][k],
            f"{med[k]:.3f}",
            f"{min(v):.3f}",
            f"{max(v):.3f}",
            f"{med[k] / fastest:.2f}",
        ]
        for k, v in r["times"].items()
    ]
    print_table(f"AdamW step, {args.numel / 1e6:.0f} M-element shard", headers, rows)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    ax.barh(list(med), [med[k] for k in med], color=["C0", "C7", "C1", "C2"])
    ax.set_xlabel("seconds per optimizer step (median)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig_name = save_figure(fig, "optimizer_step")
    Result(
        name="optimizer_step",
        title="AdamW step on one flat shard: the engine vs torch's fastest",
        summary=[
            markdown_table(headers, rows, "llrrrr"),
            f"- Target cephalo <= {TARGET} x torch's fastest AdamW: {verdict(ratio <= TARGET)} "
            f"({ratio:.2f}).",
        ],
        figures=[fig_name],
        details=[
            "## Setup\n\n"
            f"- One fp32 shard of {args.numel:,} elements in {args.pieces} runs (every 4th without "
            f"weight decay), gradient clipped by {CLIP}; {args.threads} torch threads; "
            f"{args.rounds} timed steps per variant in rotated order after one warm-up.\n"
            "- torch's variants hold the same runs as parameters (views of one buffer) in two "
            "parameter groups, gradients scaled by `torch._foreach_mul_` before `step()`."
        ],
    ).write(time.perf_counter() - started)


if __name__ == "__main__":
    main()
