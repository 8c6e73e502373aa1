"""How many operations one training step issues: the engine against plain PyTorch (issue 39).

On a GPU the host, not the device, often sets the pace of a small model's step: every kernel
launch costs a few microseconds of Python and driver time whatever its size. So the number
of operations a step dispatches, the number that make the host wait for the device, and the
Python calls around them are what a lean step keeps small. They are counted here, side by
side in one run, for the engine (one rank, `LocalComm`) and for plain PyTorch on the same
model and batch: every block checkpointed (`torch.utils.checkpoint`, non-reentrant), the loss
summed over micro-batches with gradient accumulation, foreach gradient clipping and fused
AdamW (torch's fastest). The counts do not depend on the machine, only on the step's
structure: they are exact and repeatable (unlike timings), so `tests/test_launch_count.py`
checks the same ratios on a tiny model.

On the CPU (no GPU here):

- **ops that do work**: every aten op a `TorchDispatchMode` sees
  (`cephalo.runtime.host_syncs.OpCounter`), except
  (1) views and other aliasing ops, by their schema (`OpOverload.is_view`: `view`, `t`,
  `transpose`, `slice`, `select`, `split`, `unbind`, `expand`, `permute`, `detach`, `alias`,
  `as_strided`, ...), (2) `_unsafe_view` (a view the schema does not mark) and (3) the
  allocations and metadata queries that launch no kernel on a GPU: `empty`, `empty_like`,
  `empty_strided`, `promote_types`, `result_type`, `sym_size`/`sym_stride`/`sym_numel`,
  `is_same_size`, `_has_compatible_shallow_copy_type`, `lift_fresh` (`NO_WORK`).
  Everything else is one launch or more on a GPU (`zeros`, `copy_`, casts, `arange`...).
- **host-sync ops**: the operations that would make the host wait for a GPU
  (`cephalo.runtime.host_syncs.HostSyncs`: `.item()` / `aten._local_scalar_dense`,
  `.tolist()`, `.numpy()`, `nonzero`, boolean-mask indexing, device-to-host copies...).
- **Python calls**: Python function calls (`sys.setprofile` "call" events; C calls not
  counted), the host's own work around the ops.

On CUDA (`--device cuda`, and `scripts/gpu_profile.py`'s `launch_count` entry): kernel
launches per step from `torch.profiler` (CUDA runtime/driver launch calls, CUDA-graph launches
counted as one) and the kernels the device ran, with the same host-sync count.

The model is GPT-2-124M-shaped (hidden 768, 12 heads, vocabulary 50304). Ops per block are
what matters, so on the CPU the counts can be taken on fewer layers and scaled to 12
(`--layers`, default 2: the counts at 1 and 2 layers, the per-block difference scaled
linearly: exact while every block issues the same ops; `--layers 12` measures the full
model, a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cephalo.runtime.host_syncs import NO_WORK, HostSyncs, OpCounter

LR = 1e-4
SMALL_NOTE = (
    " narrowed to hidden 64, 4 heads, vocabulary 256 (`--small`: the same ops per block; the "
    "CPU norm's chunks, a few dozen more ops at full width, fewer)"
)
MODEL = "gpt2-124m"
VOCAB = 50304
FULL_LAYERS = 12
TARGETS = {16: 1.10, 4: 1.15}
"""Micro-batches -> the most ops that do work the engine may issue per plain PyTorch's
(issue 39's "done when"), and at most one host-sync op per step."""
MAX_SYNCS = 1


@dataclass
class Counts:
    """One step's counts for one system."""

    ops: int
    syncs: int
    python_calls: int
    by_op: collections.Counter

    def scaled(self, per_block: Counts, blocks: int) -> Counts:
        """These counts plus `blocks` more blocks' worth of `per_block`."""
        return Counts(
            self.ops + blocks * per_block.ops,
            self.syncs + blocks * per_block.syncs,
            self.python_calls + blocks * per_block.python_calls,
            self.by_op + collections.Counter({k: blocks * v for k, v in per_block.by_op.items()}),
        )

    def minus(self, other: Counts) -> Counts:
        by = collections.Counter(self.by_op)
        by.subtract(other.by_op)
        return Counts(
            self.ops - other.ops,
            self.syncs - other.syncs,
            self.python_calls - other.python_calls,
            by,
        )


def count_step(step: Callable[[], object]) -> Counts:
    """Run `step` once under the op counter, then once under the host-sync counter and the
    Python profiler (separately, so that no counter counts another's work)."""
    with OpCounter() as ops:
        step()
    with HostSyncs(count_cpu_copies=True) as syncs:
        step()
    calls = [0]

    def profile(frame, event, arg) -> None:
        if event == "call":
            calls[0] += 1

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return Counts(ops.work(), len(syncs.events), calls[0], ops.by_op())


def engine_step(
    layers: int, batch: int, micro: int, seq: int, device: str, dtype: str, **shape: int
) -> Callable[[], object]:
    """The engine's training step on one rank (after one warm-up step: the first measures
    its activations once)."""
    from cephalo.modeling.registry import build_model
    from cephalo.planner.makers import manual_plan
    from cephalo.runtime.collectives.comm import LocalComm
    from cephalo.runtime.engine.engine import Engine, EngineConfig

    keys = ["gpu" if device == "cuda" else "cpu"]
    plan = manual_plan(MODEL, seq, [batch], [micro], [1.0], device_keys=keys, dtype=dtype)
    cfg = EngineConfig(compute_dtype=dtype, validate_collectives=False, device=device)
    engine = Engine(build_model(MODEL, n_layer=layers, **shape), plan, LocalComm(), cfg)
    x, y = batch_data(batch, seq, device, shape.get("vocab_size", VOCAB))
    engine.train_step(x, y, LR)
    return lambda: engine.train_step(x, y, LR)


def plain_step(
    layers: int, batch: int, micro: int, seq: int, device: str, dtype: str, **shape: int
) -> Callable[[], object]:
    """Plain PyTorch on the same model and batch: every block checkpointed, gradient
    accumulation over the micro-batches (the loss divided by the batch's tokens), foreach
    clipping, fused AdamW. Its loss is not read (issue 39's baseline; the engine reads its
    loss and norm once, after the update is queued: its one host sync)."""
    from torch.utils.checkpoint import checkpoint

    from cephalo.modeling.registry import build_model

    model = build_model(MODEL, n_layer=layers, **shape).materialize(
        device, torch.Generator().manual_seed(0)
    )
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    units = model.units
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=LR, fused=True)
    x, y = batch_data(batch, seq, device, shape.get("vocab_size", VOCAB))
    tokens = y.numel()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        for a in range(0, batch, micro):
            xm, ym = x[a : a + micro], y[a : a + micro]
            h = units[0].module(xm)
            for u in units[1:-1]:
                h = checkpoint(u.module, h, use_reentrant=False)
            loss = units[-1].module(h, ym) / tokens
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()

    step()
    return step


def batch_data(
    batch: int, seq: int, device: str, vocab: int = VOCAB
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (batch, seq), generator=g)
    y = torch.randint(0, vocab, (batch, seq), generator=g)
    return x.to(device), y.to(device)


SYSTEMS = {"cephalo": engine_step, "torch+GC": plain_step}


def counts_at(
    system: str, layers: int, batch: int, micro: int, seq: int, scale_to: int, **shape: int
) -> Counts:
    """CPU counts of `system` at `layers` blocks, scaled to `scale_to` blocks by the per-block
    difference between `layers - 1` and `layers` blocks (exact counts: no noise to average).
    `shape`: overrides of the model's config (tests: a tiny model)."""
    make = SYSTEMS[system]
    top = count_step(make(layers, batch, micro, seq, "cpu", "fp32", **shape))
    if layers == scale_to:
        return top
    below = count_step(make(layers - 1, batch, micro, seq, "cpu", "fp32", **shape))
    return top.scaled(top.minus(below), scale_to - layers)


LAUNCH_CALLS = frozenset(
    {
        "cudaLaunchKernel",
        "cudaLaunchKernelExC",
        "cuLaunchKernel",
        "cuLaunchKernelEx",
        "cudaGraphLaunch",
    }
)
"""CUDA runtime / driver calls that launch work on the device (a CUDA graph's launch: one)."""


def cuda_launches(step: Callable[[], object]) -> tuple[int, int]:
    """(kernel launches, kernels run) in one step on CUDA, from torch.profiler: the CUDA
    runtime / driver calls that launch a kernel (a CUDA graph's launch is one), and the
    device's kernel events."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    launches = kernels = 0
    for e in prof.events():
        name = e.name
        if name in LAUNCH_CALLS:
            launches += 1
        if e.device_type == torch.autograd.DeviceType.CUDA and not name.startswith(
            ("Memcpy", "Memset")
        ):
            kernels += 1
    return launches, kernels


def cuda_table(batch: int, seq: int, micros: list[int], dtype: str = "bf16") -> list[list[str]]:
    """Kernel launches per step on the GPU at each micro-batch count (`scripts/gpu_profile.py`
    calls this): one row per micro-batch count, the engine's and plain PyTorch's launches."""
    rows = []
    for n_micro in micros:
        micro = batch // n_micro
        got = {}
        for name, make in SYSTEMS.items():
            step = make(FULL_LAYERS, batch, micro, seq, "cuda", dtype)
            launches, kernels = cuda_launches(step)
            with HostSyncs(count_cpu_copies=False) as syncs:
                step()
            got[name] = (launches, kernels, len(syncs.events))
            del step
            torch.cuda.empty_cache()
        e, p = got["cephalo"], got["torch+GC"]
        rows.append(
            [
                f"{n_micro} x {micro}x{seq}",
                str(e[0]),
                str(p[0]),
                f"{e[0] / p[0]:.2f}",
                str(e[1]),
                str(p[1]),
                str(e[2]),
                str(p[2]),
            ]
        )
    return rows


CUDA_HEADERS = [
    "micro-batches",
    "launches cephalo",
    "launches torch+GC",
    "ratio",
    "kernels cephalo",
    "kernels torch+GC",
    "syncs cephalo",
    "syncs torch+GC",
]


def main() -> None:
    from _common import Result, markdown_table, print_table, save_figure, verdict

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument(
        "--layers", type=int, default=2, help="blocks counted (scaled to 12; 12: the full model)"
    )
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--small",
        action="store_true",
        help="a narrow model (hidden 64, vocabulary 256): the same ops per block, quickly",
    )
    args = ap.parse_args()
    shape = {"n_embd": 64, "n_head": 4, "vocab_size": 256} if args.small else {}
    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    if args.device == "cuda":
        rows = cuda_table(args.batch, args.seq_len, args.micro_batches)
        print_table("kernel launches per step (CUDA)", CUDA_HEADERS, rows)
        return
    if not 1 <= args.layers <= FULL_LAYERS:
        sys.exit(f"--layers must be between 1 and {FULL_LAYERS}")
    results: dict[int, dict[str, Counts]] = {}
    for n_micro in args.micro_batches:
        micro = args.batch // n_micro
        results[n_micro] = {
            name: counts_at(
                name, args.layers, args.batch, micro, args.seq_len, FULL_LAYERS, **shape
            )
            for name in SYSTEMS
        }
    headers = [
        "micro-batches",
        "ops cephalo",
        "ops torch+GC",
        "ratio",
        "target",
        "syncs cephalo",
        "syncs torch+GC",
        "Python calls cephalo",
        "Python calls torch+GC",
    ]
    rows, ok = [], True
    for n_micro, got in results.items():
        e, p = got["cephalo"], got["torch+GC"]
        ratio = e.ops / p.ops
        target = TARGETS.get(n_micro)
        met = (target is None or ratio <= target) and e.syncs <= MAX_SYNCS
        ok = ok and met
        rows.append(
            [
                f"{n_micro} x {args.batch // n_micro}x{args.seq_len}",
                f"{e.ops:,}",
                f"{p.ops:,}",
                f"{ratio:.2f}",
                f"<= {target:.2f}" if target else "—",
                str(e.syncs),
                str(p.syncs),
                f"{e.python_calls:,}",
                f"{p.python_calls:,}",
            ]
        )
    print_table("ops per step (CPU)", headers, rows)
    op_rows = []
    for n_micro, got in results.items():
        e, p = got["cephalo"].by_op, got["torch+GC"].by_op
        diff = {k: e.get(k, 0) - p.get(k, 0) for k in set(e) | set(p)}
        for k, d in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:8]:
            op_rows.append([str(n_micro), k, str(e.get(k, 0)), str(p.get(k, 0)), f"{d:+d}"])
    op_headers = ["micro-batches", "op", "cephalo", "torch+GC", "difference"]
    print_table("where the ops differ", op_headers, op_rows)

    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    labels = [r[0] for r in rows]
    xs = range(len(labels))
    width = 0.38
    ax.bar(
        [i - width / 2 for i in xs],
        [results[n]["cephalo"].ops for n in results],
        width,
        label="cephalo",
    )
    ax.bar(
        [i + width / 2 for i in xs],
        [results[n]["torch+GC"].ops for n in results],
        width,
        label="torch+GC",
    )
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("ops that do work per step")
    ax.legend()
    fig.tight_layout()
    fig_name = save_figure(fig, "launch_count")
    scaled = (
        "the full model"
        if args.layers == FULL_LAYERS
        else f"counted at {args.layers - 1} and {args.layers} blocks, scaled to 12 by the "
        "per-block difference"
    )
    Result(
        name="launch_count",
        title="Ops per training step: the engine vs plain PyTorch (GPT-2-124M shape, CPU)",
        summary=[
            markdown_table(headers, rows, "lrrrrrrrr"),
            f"- Targets (issue 39): ops that do work at most {TARGETS[16]:.2f}x plain "
            f"PyTorch's at 16 micro-batches and {TARGETS[4]:.2f}x at 4, at most {MAX_SYNCS} "
            f"host-sync op per step: {verdict(ok)}.",
        ],
        figures=[fig_name],
        details=[
            "## Where the ops differ (ops that do work, per aten op, largest differences)\n\n"
            + markdown_table(op_headers, op_rows, "lrrrr"),
            "## Setup\n\n"
            f"- `{MODEL}` shape{SMALL_NOTE if args.small else ''}, {scaled}; batch {args.batch} x {args.seq_len} tokens, fp32, "
            "one rank (`LocalComm`). Plain PyTorch: every block checkpointed "
            "(non-reentrant), gradient accumulation, foreach clipping, fused AdamW, the loss "
            "not read (the engine reads its loss and norm once per step).\n"
            "- Ops that do work: aten ops under a `TorchDispatchMode`, views (`is_view`) and "
            f"{', '.join(f'`{n}`' for n in sorted(NO_WORK))} excluded. Host syncs: "
            "`cephalo.runtime.host_syncs.HostSyncs`. Python calls: `sys.setprofile` call "
            "events. Counts are exact: one step each, after a warm-up step.",
        ],
    ).write(time.perf_counter() - started)


if __name__ == "__main__":
    main()
