"""Collectives on gloo (CPU, loopback): which call is faster.

`runtime/collectives/comm.py` chooses how `GlooComm` runs an all-gather and a reduce-scatter
(`Comm.even_gather`). This bench times, side by side in one run, on 2 and 4 gloo ranks and
unit-sized fp32 buffers:
- the all-gather of equal sizes as `all_gather_into_tensor` against one async broadcast per
  source rank (what `GlooComm` does for uneven sizes);
- the reduce-scatter of equal sizes as `reduce_scatter_tensor`, as the list `reduce_scatter`,
  and as an all-reduce in place on the whole buffer followed by a copy of this rank's slice;
- the reduce-scatter of an uneven split (rank r owns a share proportional to r + 1) as the list
  `reduce_scatter` (what `GlooComm` does) and as the all-reduce in place (faster at 4 ranks,
  but it sums the ranks in another fp32 order: runtime/collectives/comm.py says why it is not used).
Each call is started async and waited for at once (call + wait, the slice copy included); the
variants alternate, a barrier before each; medians of rank 0.
"""

from __future__ import annotations

import argparse
import time

import torch

from _common import (
    RankPool,
    Result,
    alternate,
    markdown_table,
    median,
    print_table,
    raise_priority,
    save_figure,
)

VARIANTS = (
    "gather_tensor",
    "gather_broadcasts",
    "scatter_tensor",
    "scatter_list",
    "scatter_allreduce",
    "uneven_list",
    "uneven_allreduce",
)
LABELS = {
    "gather_tensor": "all_gather_into_tensor",
    "gather_broadcasts": "per-source broadcasts",
    "scatter_tensor": "reduce_scatter_tensor",
    "scatter_list": "list reduce_scatter",
    "scatter_allreduce": "all-reduce in place",
    "uneven_list": "uneven: list reduce_scatter",
    "uneven_allreduce": "uneven: all-reduce in place",
}


def _time(numel: int, reps: int) -> dict[str, float]:
    """On every rank: seconds of each variant (median), `numel` elements per rank."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    full = torch.randn(numel * world)
    mine = torch.randn(numel)
    source = torch.randn(numel * world)
    clobbered = torch.empty_like(source)  # the all-reduce sums in place: a fresh copy each call
    # uneven: rank r owns a share proportional to r + 1 (the sizes sum to the same buffer)
    shares = [numel * world * (r + 1) // (world * (world + 1) // 2) for r in range(world)]
    shares[-1] += numel * world - sum(shares)
    start = sum(shares[:rank])
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for name in alternate(reps, list(VARIANTS)):
        clobbered.copy_(source)
        dist.barrier()
        t0 = time.perf_counter()
        if name == "gather_tensor":
            dist.all_gather_into_tensor(full, mine, async_op=True).wait()
        elif name == "gather_broadcasts":
            views = list(full.split(numel))
            views[rank].copy_(mine)
            works = [dist.broadcast(views[r], src=r, async_op=True) for r in range(world)]
            for w in works:
                w.wait()
        elif name == "scatter_tensor":
            dist.reduce_scatter_tensor(mine, full, async_op=True).wait()
        elif name == "scatter_list":
            dist.reduce_scatter(mine, list(full.split(numel)), async_op=True).wait()
        elif name == "scatter_allreduce":
            dist.all_reduce(clobbered, async_op=True).wait()
            mine.copy_(clobbered[rank * numel : (rank + 1) * numel])
        elif name == "uneven_list":
            out = full[: shares[rank]]  # (any buffer of this rank's size)
            dist.reduce_scatter(out, list(source.split(shares)), async_op=True).wait()
        else:
            dist.all_reduce(clobbered, async_op=True).wait()
            full[: shares[rank]].copy_(clobbered[start : start + shares[rank]])
        times[name].append(time.perf_counter() - t0)
    return {v: median(t) for v, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--mib", type=float, nargs="+", default=[0.6, 1.2, 4.8])
    args = ap.parse_args()
    started = time.perf_counter()
    rows, plot, faster, reduce_faster = [], [], 0, 0
    for world in args.worlds:
        with RankPool(world, timeout_s=600) as pool:
            for mib in args.mib:
                numel = int(mib * 2**20 / 4 / world)  # the whole buffer is `mib`
                med = pool.run(_time, numel, args.reps)[0]
                g = med["gather_broadcasts"] / med["gather_tensor"]
                faster += g < 1
                s = med["scatter_allreduce"] / med["scatter_tensor"]
                u = med["uneven_allreduce"] / med["uneven_list"]
                reduce_faster += u < 1
                plot.append((f"{world} ranks\n{mib:g} MiB", g, s, u))
                rows.append(
                    [world, f"{mib:g} MiB"]
                    + [f"{med[v] * 1e3:.2f}" for v in VARIANTS]
                    + [f"**{g:.2f}**", f"**{s:.2f}**", f"**{u:.2f}**"]
                )
    headers = ["ranks", "buffer"] + [f"{LABELS[v]} ms" for v in VARIANTS]
    headers += [
        "broadcasts / all_gather",
        "all-reduce / reduce_scatter_tensor",
        "uneven: all-reduce / list",
    ]
    print_table("collectives on gloo (median ms, rank 0)", headers, rows)
    result = Result(
        name="gloo_gather",
        title="Collectives on gloo (CPU, loopback)",
        summary=[
            markdown_table(headers, rows, "rr" + "r" * (len(headers) - 2)),
            f"- The per-source broadcasts gathered faster in {faster} of {len(rows)} cases: "
            "`GlooComm` gathers equal sizes with them (`Comm.even_gather`, runtime/collectives/comm.py).",
            f"- Uneven splits: the all-reduce in place reduce-scattered faster than the list "
            f"`reduce_scatter` in {reduce_faster} of {len(rows)} cases. These are idle "
            "latencies of one call, noisy at 2 ranks (a few ms either way). `GlooComm` keeps "
            "`reduce_scatter_tensor` for equal sizes and the list form for uneven ones: the "
            "all-reduce sums the ranks in another fp32 order (runtime/collectives/comm.py).",
        ],
        figures=[_plot(plot)],
        details=[
            "## Setup\n\n"
            f"- {args.reps} calls of each variant per size, in rotated order, a barrier before "
            "each; each started async and waited for at once; medians of rank 0. One process "
            "and one torch thread per rank; 4 ranks share the 2 cores two to one.\n"
            "- Buffer: the whole gathered (or reduced) fp32 buffer; each rank owns 1 / ranks of "
            "it (uneven: a share proportional to its rank + 1).",
        ],
    )
    result.write(time.perf_counter() - started)


def _plot(points: list[tuple[str, float, float, float]]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    x = np.arange(len(points))
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.bar(x - 0.27, [p[1] for p in points], 0.27, label="broadcasts / all_gather_into_tensor")
    ax.bar(x, [p[2] for p in points], 0.27, label="all-reduce / reduce_scatter_tensor (equal)")
    ax.bar(
        x + 0.27, [p[3] for p in points], 0.27, label="all-reduce / list reduce-scatter (uneven)"
    )
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(x, [p[0] for p in points], fontsize=8)
    ax.set_ylabel("time ratio (below 1: the first is faster)")
    ax.legend(fontsize=8)
    fig.suptitle("Collectives on gloo")
    return save_figure(fig, "gloo_gather")


if __name__ == "__main__":
    torch.set_num_threads(1)
    raise_priority()
    main()
