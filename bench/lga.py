"""Layered gradient accumulation (LGA) vs standard accumulation: communication bytes and
device peak memory against the number of micro-batches (1..16).

One even plan on 2 gloo ranks, a fixed batch per rank split into k micro-batches. The
engine runs it in mode `lga` (each unit gathered once per pass, reduced once per step:
all micro-batches go through a unit before the next one) and in mode `standard`
(micro-batch outermost: FSDP-style accumulation with per-unit recompute, whose
collectives grow with k), and in mode `lga` with boundary activations offloaded to the
host. Bytes are the engine's `comm.counters`; memory is its ledger's device peak.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from _common import (
    RankPool,
    Result,
    fmt_bytes,
    markdown_table,
    print_table,
    raise_priority,
    save_figure,
)

SERIES = (("lga", False), ("standard", False), ("lga", True))


def _label(mode: str, offload: bool) -> str:
    return f"{mode} + offload" if offload else mode


def _sweep(model: str, overrides: dict, seq_len: int, batch: int, ks: list[int]) -> list[dict]:
    """Runs on every rank: for each (series, k) one warm-up-free step (bytes and ledger
    peaks are deterministic), its counters, ledger peaks and wall time."""
    from _systems import OursTrainer, make_data
    from cephalo.planner.makers import manual_plan

    world = dist.get_world_size()
    x, y = make_data(world * batch, seq_len, overrides.get("vocab_size", 256))
    out = []
    for mode, offload in SERIES:
        for k in ks:
            m = batch // k
            plan = manual_plan(model, seq_len, [batch] * world, [m] * world, [1.0 / world] * world)
            plan.ranks = [
                r.__class__(**{**r.__dict__, "offload_activations": offload}) for r in plan.ranks
            ]
            trainer = OursTrainer(model, overrides, plan, mode=mode)
            trainer.comm.counters.reset()
            dist.barrier()
            t0 = time.perf_counter()
            stats = trainer.step(x, y)
            wall = time.perf_counter() - t0
            c = trainer.comm.counters
            out.append(
                {
                    "mode": mode,
                    "offload": offload,
                    "k": k,
                    "m": m,
                    "wall_s": wall,
                    "ag_calls": c.calls["all_gather_v"],
                    "ag_bytes": c.bytes["all_gather_v"],
                    "rs_calls": c.calls["reduce_scatter_v"],
                    "rs_bytes": c.bytes["reduce_scatter_v"],
                    "ar_bytes": c.bytes["all_reduce"],
                    "peak": stats.peak_bytes,
                    "by_cat": dict(stats.peak_by_category),
                    "host_peak": trainer.engine.ledger.host_peak_bytes,
                }
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-per-rank", type=int, default=16)
    ap.add_argument("--n-layer", type=int, default=4)
    args = ap.parse_args()
    started = time.perf_counter()
    model, seq_len, world = "gpt-small-demo", 128, 2
    ks = [k for k in (1, 2, 4, 8, 16) if args.batch_per_rank % k == 0]
    overrides = {"n_layer": args.n_layer}
    with RankPool(world, timeout_s=600) as pool:
        rows = pool.run(_sweep, model, overrides, seq_len, args.batch_per_rank, ks)[0]  # rank 0

    headers = [
        "accumulation",
        "micro-batches",
        "all-gathers",
        "all-gather bytes",
        "reduce-scatters",
        "reduce-scatter bytes",
        "device peak (ledger)",
        "host peak",
        "step s (one run)",
    ]
    table = [
        [
            _label(r["mode"], r["offload"]),
            f"{r['k']} x {r['m']}",
            r["ag_calls"],
            fmt_bytes(r["ag_bytes"]),
            r["rs_calls"],
            fmt_bytes(r["rs_bytes"]),
            fmt_bytes(r["peak"]),
            fmt_bytes(r["host_peak"]),
            f"{r['wall_s']:.2f}",
        ]
        for r in rows
    ]
    print_table("LGA vs standard accumulation (rank 0)", headers, table)

    def pick(mode: str, offload: bool, k: int) -> dict:
        return next(
            r for r in rows if r["mode"] == mode and r["offload"] == offload and r["k"] == k
        )

    kmax = ks[-1]
    lga, std = pick("lga", False, kmax), pick("standard", False, kmax)
    comm_ratio = (std["ag_bytes"] + std["rs_bytes"]) / (lga["ag_bytes"] + lga["rs_bytes"])
    lga_flat = all(
        pick("lga", False, k)["ag_bytes"] == pick("lga", False, 1)["ag_bytes"] for k in ks
    )
    off = pick("lga", True, kmax)
    fig = _plot(rows, ks)
    result = Result(
        name="lga",
        title="Layered vs standard gradient accumulation: bytes and peak memory",
        summary=[
            markdown_table(headers, table, "lrrrrrrrr"),
            f"- At {kmax} micro-batches standard accumulation moves {comm_ratio:.1f}x the all-gather + "
            f"reduce-scatter bytes of LGA; LGA's bytes are the same at every micro-batch count: "
            f"{'yes' if lga_flat else 'no'}.\n"
            f"- Device peak at {kmax} micro-batches: LGA {fmt_bytes(lga['peak'])} (keeps every micro-batch's "
            f"boundary activations), standard {fmt_bytes(std['peak'])}, LGA + offload {fmt_bytes(off['peak'])} "
            f"(boundaries on the host: {fmt_bytes(off['host_peak'])}).",
        ],
        figures=[fig],
        details=[
            "## Setup\n\n"
            f"- Model `{model}` (n_layer={args.n_layer}, untied embeddings, no dropout), seq {seq_len}, fp32, "
            f"{world} gloo ranks, {args.batch_per_rank} samples per rank split into k micro-batches, even "
            "shards. One step per point (bytes and ledger peaks do not vary between steps; the step time "
            "column is a single noisy run, for orientation only).\n"
            "- Bytes: rank 0's `comm.counters` (all-gather: bytes received; reduce-scatter: bytes sent). "
            "Device peak: the ledger's peak of device categories (state, gathered units, gradient "
            "buffers, boundaries, saved activations); host peak: its `host/` categories.",
        ],
    )
    result.write(time.perf_counter() - started)


def _plot(rows: list[dict], ks: list[int]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    styles = {
        ("lga", False): ("tab:blue", "o-"),
        ("standard", False): ("tab:orange", "s-"),
        ("lga", True): ("tab:green", "^--"),
    }
    for (mode, offload), (color, style) in styles.items():
        sel = [r for r in rows if r["mode"] == mode and r["offload"] == offload]
        ax1.plot(
            ks,
            [(r["ag_bytes"] + r["rs_bytes"]) / 2**20 for r in sel],
            style,
            color=color,
            label=_label(mode, offload),
        )
        ax2.plot(
            ks, [r["peak"] / 2**20 for r in sel], style, color=color, label=_label(mode, offload)
        )
    ax1.set_ylabel("all-gather + reduce-scatter MiB per step (rank 0)")
    ax2.set_ylabel("device peak MiB (ledger, rank 0)")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_xlabel("micro-batches per step")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.suptitle("Layered (LGA) vs standard gradient accumulation")
    return save_figure(fig, "lga")


if __name__ == "__main__":
    torch.set_num_threads(1)
    raise_priority()
    main()
