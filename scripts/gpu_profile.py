"""Where an engine step's time goes on a GPU, against plain PyTorch on the same model and batch.

Run under torchrun on one GPU (`scripts/gpu_check.sh` runs the correctness checks; this script
measures): `python -m torch.distributed.run --standalone --nproc-per-node 1
scripts/gpu_profile.py --out DIR`. It writes DIR/gpu_profile.md with:

- ms per step (median of timed steps) of the engine, the engine without prefetch, plain PyTorch,
  and plain PyTorch with every block recomputed (activation checkpointing, as the engine does);
  on CUDA also the engine with its blocks compiled (`parallel.compile`: graphs, inductor);
- from torch.profiler: GPU kernel time per step (so the fraction of the step the GPU is busy),
  kernel launches per step, and the top operators by host time and by GPU time;
- cProfile: the engine's own Python frames by own time and by cumulative time;
- every synchronising CUDA call in one engine step, with the Python stack that made it
  (`torch.cuda.set_sync_debug_mode("warn")`);
- on CUDA, bench/launch_count.py's kernel launches per step at 1, 4 and 16 micro-batches,
  the engine against plain PyTorch with checkpointing (issue 39).

Without a GPU it runs the same measurements on the CPU with a tiny model (`--cpu`), so the
script itself is tested in CI (tests/test_engine_single.py).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import _data, _engine, _sync, _vocab, plain_step  # noqa: E402
from gpu_setup import Setup  # noqa: E402


def _median_step_s(setup: Setup, step: Callable[[], None], steps: int) -> float:
    step()
    step()
    times = []
    for _ in range(steps):
        _sync(setup)
        t0 = time.perf_counter()
        step()
        _sync(setup)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _torch_profile(setup: Setup, step: Callable[[], None], steps: int):
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if setup.cuda else [])
    step()
    _sync(setup)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        _sync(setup)
    events = prof.key_averages()
    # kernels only: an operator's row repeats the time of the kernels it launched
    device_us = sum(e.self_device_time_total for e in events if e.self_cpu_time_total == 0) / steps
    launch_calls = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
    launches = sum(e.count for e in events if e.key in launch_calls) / steps
    syncs = {
        e.key: e.count / steps
        for e in events
        if "Synchronize" in e.key or e.key in ("cudaMemcpyAsync", "cudaStreamWaitEvent")
    }
    by_host = events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)
    by_device = (
        events.table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=60)
        if setup.cuda
        else ""
    )
    return device_us / 1e6, launches, syncs, by_host, by_device


def _cprofile(step: Callable[[], None], steps: int) -> tuple[str, str]:
    step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    out = []
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        stats = pstats.Stats(prof, stream=buf).strip_dirs().sort_stats(key)
        stats.print_stats(35)
        out.append(buf.getvalue())
    return out[0], out[1]


def _sync_stacks(setup: Setup, step: Callable[[], None]) -> list[tuple[int, str]]:
    """Every synchronising CUDA call one step makes, grouped by the Python stack making it."""
    if not setup.cuda:
        return []
    stacks: Counter[str] = Counter()
    saved = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001
        frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
        stacks["".join(traceback.format_list(frames[-8:]))] += 1

    step()
    _sync(setup)
    warnings.showwarning = record
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        warnings.showwarning = saved
    return [(n, s) for s, n in stacks.most_common()]


def run(setup: Setup, out: Path, steps: int) -> str:
    batch = 16 if setup.cuda else 4
    model_name = setup.big_model
    data = _data(_vocab(setup), batch, setup.seq, steps=1)[0]
    tokens = batch * setup.seq
    lines = [
        f"# Engine step profile: {model_name}, batch {batch} x {setup.seq}, {setup.low}, "
        f"{torch.cuda.get_device_name(setup.device) if setup.cuda else 'CPU'}",
        "",
        f"torch {torch.__version__}; {steps} timed steps per variant (median).",
        "",
        "| variant | ms/step | tokens/s | GPU kernel ms/step | GPU busy | launches/step |",
        "| :--- | ---: | ---: | ---: | ---: | ---: |",
    ]
    details = []
    variants: list[tuple[str, Callable[[], Callable[[], None]]]] = [
        ("engine", lambda: _step_of(_engine(setup, model_name, batch, batch, setup.low), data)),
        (
            "engine, no prefetch",
            lambda: _step_of(
                _engine(setup, model_name, batch, batch, setup.low, prefetch=False), data
            ),
        ),
        ("plain", lambda: plain_step(setup, model_name, data, recompute=False)),
        ("plain + recompute", lambda: plain_step(setup, model_name, data, recompute=True)),
    ]
    if setup.cuda:  # the compiled blocks (`parallel.compile`; a CPU compile is minutes of CI)
        for mode in ("graphs", "inductor"):
            variants.append(
                (
                    f"engine, {mode}",
                    lambda mode=mode: _step_of(  # its 2 untimed steps compile / capture
                        _engine(setup, model_name, batch, batch, setup.low, compile=mode), data
                    ),
                )
            )
    for name, make in variants:
        step = make()
        step_s = _median_step_s(setup, step, steps)
        device_s, launches, syncs, by_host, by_device = _torch_profile(setup, step, 2)
        busy = device_s / step_s if setup.cuda else float("nan")
        lines.append(
            f"| {name} | {step_s * 1e3:.1f} | {tokens / step_s:,.0f} | {device_s * 1e3:.1f} | "
            f"{busy:.0%} | {launches:.0f} |"
        )
        print(lines[-1], flush=True)
        details.append(f"\n## {name}: host/device API counts per step\n\n```\n{syncs}\n```\n")
        details.append(f"\n## {name}: operators by host time\n\n```\n{by_host}\n```\n")
        if by_device:
            details.append(f"\n## {name}: operators by GPU time\n\n```\n{by_device}\n```\n")
        if name == "engine":
            own, cumulative = _cprofile(step, 3)
            details.append(f"\n## engine: cProfile, own time (3 steps)\n\n```\n{own}\n```\n")
            details.append(
                f"\n## engine: cProfile, cumulative (3 steps)\n\n```\n{cumulative}\n```\n"
            )
            stacks = _sync_stacks(setup, step)
            text = "\n".join(f"{n} x\n{s}" for n, s in stacks) or "none"
            details.append(
                f"\n## engine: synchronising CUDA calls in one step\n\n```\n{text}\n```\n"
            )
        step = None
        if setup.cuda:
            torch.cuda.empty_cache()
    if setup.cuda:
        details.append(_launch_counts(batch, setup.seq))
    report = "\n".join(lines) + "\n" + "".join(details)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_profile.md").write_text(report)
    return report


def _launch_counts(batch: int, seq: int) -> str:
    """bench/launch_count.py's CUDA path (issue 39): kernel launches per step from
    torch.profiler, the engine (one rank, bf16) against plain PyTorch with every block
    checkpointed, gradient accumulation, foreach clipping and fused AdamW, at 1, 4 and 16
    micro-batches of the same batch; the host-sync ops of each."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import launch_count

    try:
        rows = launch_count.cuda_table(batch, seq, [1, 4, 16])
    except Exception:  # a report section, not the profile: say what failed
        return f"\n## kernel launches per step (bench/launch_count.py)\n\n```\n{traceback.format_exc()}```\n"
    head = "| " + " | ".join(launch_count.CUDA_HEADERS) + " |"
    rule = "| :--- |" + " ---: |" * (len(launch_count.CUDA_HEADERS) - 1)
    body = "\n".join("| " + " | ".join(r) + " |" for r in rows)
    print(head, rule, body, sep="\n", flush=True)
    return (
        "\n## kernel launches per step (bench/launch_count.py, gpt2-124m bf16)\n\n"
        f"{head}\n{rule}\n{body}\n\nTarget (issue 39): launches at most 1.10x plain "
        "PyTorch's at 16 micro-batches, 1.15x at 4; at most one host sync per step.\n"
    )


def _step_of(engine, data) -> Callable[[], None]:
    return lambda: engine.train_step(*data, lr=1e-4)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="report folder")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    parser.add_argument("--cpu", action="store_true", help="tiny model on the CPU (CI)")
    args = parser.parse_args()
    if args.cpu or not torch.cuda.is_available():
        from cephalo.runtime.collectives.comm import LocalComm

        setup = Setup(torch.device("cpu"), LocalComm(), "gpt-tiny", 32, cuda=False)
    else:
        from cephalo.runtime.collectives.dist import init_distributed

        comm = init_distributed(backend="nccl", comm_impl="nccl", timeout_s=120)
        device = torch.device("cuda", torch.cuda.current_device())
        setup = Setup(device, comm, "gpt2-124m", 512, cuda=True)
    run(setup, Path(args.out), args.steps)
    print(f"gpu_profile: wrote {Path(args.out) / 'gpu_profile.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
