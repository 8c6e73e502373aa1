"""Full fine-tuning, LoRA and QLoRA side by side on the emulated cluster: step time and ledger
peak memory, each measured and predicted by the cost model for the same plan.

One small Llama-shaped transformers model (random weights, written with save_pretrained),
two gloo ranks, one uneven plan (batches 6 / 2, micro-batches 3 / 1, shards 70 / 30 %) run in
the three modes. The predictions come from the cost model over profiles measured here the way
a job's automatic plan measures them (`trainer.auto_plan`: the model with its adapters; the
frozen base gets no gradient), evaluated on the very plan that runs.
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
    fmt_bytes,
    markdown_table,
    median,
    print_table,
    raise_priority,
    save_figure,
)

MODES = ("none", "lora", "qlora")
LABELS = {"none": "full", "lora": "LoRA", "qlora": "QLoRA"}
R, ALPHA = 16, 32
SEQ = 128
SHAPE = dict(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
PLAN = dict(batches=[6, 2], micros=[3, 1], fractions=[0.7, 0.3])


def _write_model(directory: Path) -> str:
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(**SHAPE)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(str(directory))
    return str(directory)


def _model(directory: str, mode: str, init: str | None = None):
    from cephalo.modeling.lora import AdapterSettings, apply_adapter
    from cephalo.modeling.registry import build_model

    model = build_model(directory, **({"init": init} if init else {}))
    if mode != "none":
        apply_adapter(model, AdapterSettings(mode, r=R, alpha=ALPHA))
    return model


def _plan(directory: str, mode: str):
    from cephalo.planner.makers import manual_plan
    from cephalo.specs.adapter import AdapterSpec

    plan = manual_plan(
        directory, SEQ, PLAN["batches"], PLAN["micros"], PLAN["fractions"], dtype="fp32"
    )
    if mode != "none":
        plan.meta["adapter"] = AdapterSpec(mode, R).to_dict()
    return plan


def _run(directory: str, steps: int) -> dict:
    """Every rank: the three modes' engines side by side, a warm-up step each, then `steps`
    timed steps of each in rotated order; per mode the step walls, the ledger peak of its last
    step and the categories at it, this rank's frozen bytes."""
    import transformers

    from cephalo.runtime.collectives.comm import make_comm
    from cephalo.runtime.engine.engine import Engine, EngineConfig

    transformers.logging.set_verbosity_error()
    comm = make_comm("gloo")
    engines, batches = {}, {}
    for mode in MODES:
        plan = _plan(directory, mode)
        engines[mode] = Engine(_model(directory, mode), plan, comm, EngineConfig(seed=0))
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, SHAPE["vocab_size"], (plan.global_batch_size, SEQ), generator=g)
        first, n = plan.batch_offsets()[comm.rank], plan.ranks[comm.rank].batch_size
        batches[mode] = (x[first : first + n], torch.roll(x, -1, dims=1)[first : first + n])
    walls = {m: [] for m in MODES}
    cpus = {m: [] for m in MODES}
    losses = {m: [] for m in MODES}
    stats = {}
    # one warm-up round, then the modes in rotated order (A B C, B C A, ...): slow drifts of
    # a shared machine hit every mode alike
    for i, mode in enumerate(list(MODES) + alternate(steps, MODES)):
        mine, labels = batches[mode]
        dist.barrier()
        t0, c0 = time.perf_counter(), time.thread_time()
        stats[mode] = engines[mode].train_step(mine, labels, 1e-3)
        if i >= len(MODES):
            walls[mode].append(time.perf_counter() - t0)
            cpus[mode].append(time.thread_time() - c0)
        losses[mode].append(stats[mode].loss)
    return {
        mode: {
            "walls": walls[mode],
            "cpus": cpus[mode],
            "losses": losses[mode],
            "peak": stats[mode].peak_bytes,
            "at_peak": dict(engines[mode].ledger.at_peak_by_category),
            "frozen": engines[mode].frozen.nbytes() if engines[mode].frozen is not None else 0,
        }
        for mode in MODES
    }


def _predict(directory: str) -> dict:
    """Per mode: the cost model's evaluation of the plan, over profiles of this machine."""
    from cephalo.costmodel.sources import measured_cost_model
    from cephalo.profiling.profiler import profile_devices
    from cephalo.profiling.settings import ProfileSettings
    from cephalo.specs.adapter import AdapterSpec
    from cephalo.specs.cluster import Cluster

    settings = ProfileSettings(repeats=3, warmup=1, max_micro_batch=4)
    spec = _model(directory, "none").spec
    out = {}
    for mode in MODES:
        measured = profile_devices(
            _model(directory, mode, init="random"),
            SEQ,
            "fp32",
            Cluster.parse("cpu"),
            settings=settings,
            use_cache=False,
        )
        cm = measured_cost_model(
            Cluster.parse("cpu,cpu"), spec, SEQ, "fp32", measured, adapter=AdapterSpec(mode, R)
        )
        out[mode] = cm.evaluate(_plan(directory, mode))
        if mode == "qlora":  # seconds to dequantize one block once, as the cost model has it
            out["dequant_s"] = cm._time_factors["cpu"]["block"][2]
            # what it would be without the profile's measured rate (the bytes estimate)
            opt_s = measured.profiles["cpu"].optimizer_s_per_param
            out["dequant_bytes_s"] = cm.layout.units["block"].dequant_bytes * opt_s / 30
    return out


def _dequant_s(linears, repeats: int = 3) -> float:
    """Measured: seconds to dequantize one block's NF4 weights once (the runtime's
    `dequantize_into`, torchao's `get_original_weight` per chunk), in this process."""
    from cephalo.modeling.nf4 import dequantize_into, nf4_format, quantize

    pieces = []
    for lin in linears:
        fmt = nf4_format((lin.out_features, lin.in_features))
        raw = quantize(fmt, torch.randn(lin.out_features, lin.in_features) * 0.02)
        pieces.append((fmt, raw, torch.empty(fmt.numel)))

    def once() -> float:  # CPU time of this thread, as the profiles and the steps above
        t0 = time.thread_time()
        for fmt, raw, out in pieces:
            dequantize_into(fmt, raw, out)
        return time.thread_time() - t0

    once()
    return median([once() for _ in range(repeats)])


def _model_categories(at_peak: dict[str, int]) -> dict[str, int]:
    """The ledger's categories under the cost model's names (docs/adapters.md, Planning)."""
    out = dict(at_peak)
    for into, part in (
        ("state", "frozen"),
        ("gathered", "frozen_dequant"),
        ("activations", "grad_transient"),
        ("boundary", "staging"),
    ):
        out[into] = out.get(into, 0) + out.pop(part, 0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        directory = _write_model(Path(tmp) / "llama")
        with RankPool(2, timeout_s=600) as pool:
            ranks = pool.run(_run, directory, args.steps)
        predicted = _predict(directory)
        spec = _model(directory, "none").spec
        dequant_measured = _dequant_s(spec.block_linears)
    dequant_predicted = predicted.pop("dequant_s")
    dequant_estimate = predicted.pop("dequant_bytes_s")
    passes = 2 * SHAPE["num_hidden_layers"]  # each block dequantized in its forward and backward

    rows, data = [], {}
    for mode in MODES:
        ev = predicted[mode]
        # a step ends when the slowest rank ends (the loss all-reduce): rank 0's wall after
        # a barrier is the step's
        step = median(ranks[0][mode]["walls"])
        # the CPU time of the slowest rank's compute thread: what the profiles measure (a
        # CPU rank on one thread is profiled by its thread's CPU time), robust to other jobs
        cpu = max(median(r[mode]["cpus"]) for r in ranks)
        mem = [(r[mode]["peak"], ev.ranks[i].memory) for i, r in enumerate(ranks)]
        peak_ratio = max(p / (m.total - m.reserve) for p, m in mem)
        low_ratio = min(p / (m.total - m.reserve) for p, m in mem)
        data[mode] = {
            "step": step,
            "cpu": cpu,
            "pred_step": ev.step_s,
            "peaks": [p for p, _ in mem],
            "pred_peaks": [m.total - m.reserve for _, m in mem],
            "frozen": [r[mode]["frozen"] for r in ranks],
            "state": [ev.ranks[i].memory.state for i in range(len(ranks))],
            "losses": ranks[0][mode]["losses"],
        }
        rows.append(
            [
                LABELS[mode],
                f"{step * 1e3:.0f}",
                f"{cpu * 1e3:.0f}",
                f"{ev.step_s * 1e3:.0f}",
                f"{cpu / ev.step_s:.2f}",
                " / ".join(fmt_bytes(p) for p, _ in mem),
                " / ".join(fmt_bytes(m.total - m.reserve) for _, m in mem),
                f"{low_ratio:.3f} – {peak_ratio:.3f}",
            ]
        )
    headers = [
        "mode",
        "step ms (wall)",
        "step ms (CPU, slowest rank)",
        "step ms (predicted)",
        "CPU / predicted",
        "ledger peak rank 0 / 1",
        "predicted peak rank 0 / 1",
        "ledger / predicted peak",
    ]
    print_table("Full vs LoRA vs QLoRA (2 gloo ranks, one plan)", headers, rows)

    cat_rows = []
    for mode in MODES:
        for i, r in enumerate(ranks):
            ledger = _model_categories(r[mode]["at_peak"])
            model = predicted[mode].ranks[i].memory.to_dict()
            cat_rows.append(
                [LABELS[mode], i]
                + [
                    f"{fmt_bytes(ledger.get(c, 0))} / {fmt_bytes(model.get(c, 0))}"
                    for c in ("state", "gathered", "grad_accum", "activations", "boundary")
                ]
            )
    cat_headers = ["mode", "rank", "state", "gathered", "grad_accum", "activations", "boundary"]

    full, lora, qlora = (data[m] for m in MODES)
    worst = max(
        abs(p / q - 1)
        for d in data.values()
        for p, q in zip(d["peaks"], d["pred_peaks"], strict=True)
    )
    fig = _plot(data)
    params = spec.total_params
    result = Result(
        name="adapters",
        title="Full fine-tuning vs LoRA vs QLoRA: step time and peak memory, measured and predicted",
        emulated="2 CPU gloo ranks stand in for a 2-GPU cluster; the memory is the engine's "
        "ledger (what it would hold on a device), fp32 compute (the frozen base in fp32 for "
        "LoRA, NF4 bytes for QLoRA).",
        summary=[
            markdown_table(headers, rows, "lrrrrrrr"),
            f"- Ledger peak within {worst * 100:.1f} % of the cost model's prediction on every "
            f"rank of every mode (the target: 5 %).\n"
            f"- Peak memory of rank 0: LoRA {lora['peaks'][0] / full['peaks'][0]:.2f}x, QLoRA "
            f"{qlora['peaks'][0] / full['peaks'][0]:.2f}x full fine-tuning's; the frozen base on "
            f"rank 0 is {fmt_bytes(qlora['frozen'][0])} under QLoRA against "
            f"{fmt_bytes(lora['frozen'][0])} under LoRA "
            f"({qlora['frozen'][0] / lora['frozen'][0]:.3f}x fp32; 0.129x is NF4's "
            "0.516 B against 4 B per weight, the embedding and head stay in fp32).\n"
            f"- Step time (CPU time of the slowest rank's compute thread): LoRA "
            f"{lora['cpu'] / full['cpu']:.2f}x, QLoRA {qlora['cpu'] / full['cpu']:.2f}x full "
            "fine-tuning's (wall clock: "
            f"{lora['step'] / full['step']:.2f}x, {qlora['step'] / full['step']:.2f}x); the cost model "
            f"predicted {lora['pred_step'] / full['pred_step']:.2f}x and "
            f"{qlora['pred_step'] / full['pred_step']:.2f}x. QLoRA's dequantization of a "
            f"block: {dequant_measured * 1e3:.1f} ms of CPU time measured here (torchao), "
            f"{dequant_predicted * 1e3:.1f} ms in the cost model (the profile's measured rate, "
            f"`nf4_dequant_s_per_param`), {passes} per step; without a measured rate the cost model "
            f"estimates {dequant_estimate * 1e3:.2f} ms (the NF4 and fp32 bytes streamed at the "
            "optimizer step's bandwidth), far too little on a CPU.",
        ],
        figures=[fig],
        details=[
            "## Setup\n\n"
            f"- A Llama-shaped transformers model with random weights ({params / 1e6:.1f} M "
            f"parameters: hidden {SHAPE['hidden_size']}, {SHAPE['num_hidden_layers']} layers, "
            f"MLP {SHAPE['intermediate_size']}, vocabulary {SHAPE['vocab_size']}, untied head), "
            f"seq {SEQ}, fp32; LoRA r = {R}, alpha = {ALPHA} on all-linear (peft's layers).\n"
            f"- One plan for the three modes: batches {PLAN['batches']}, micro-batches "
            f"{PLAN['micros']}, state fractions {PLAN['fractions']}; 2 gloo ranks, one intra-op "
            f"thread each; the three modes' engines side by side, one warm-up step each, then "
            f"{args.steps} steps of each in rotated order (full LoRA QLoRA, LoRA QLoRA full, "
            "...), the median of each: rank 0's wall after a barrier, and each rank's compute "
            "thread's CPU time (`time.thread_time`; the slowest rank's), which is what the "
            "profiles measure and what other jobs on the machine do not inflate.\n"
            "- Predicted: the cost model (`CostModel.evaluate`) of this plan, over profiles "
            "measured in this run in the main process (`profile_devices` of the model with its "
            "adapters, as `parallel.plan = auto` takes them: the frozen base without gradients; "
            "QLoRA's dequantization timed by the profiler, added per pass of a block by the cost "
            "model) and the cluster's link model for the "
            "collectives. Absolute times on a shared 2-core machine are noisy; the ratios between "
            "modes are the point.\n"
            "- Memory: the ledger's device peak of the last step against the predicted peak "
            "(without the reserve).",
            "## Ledger / predicted by category at the peak\n\n"
            "The ledger's `frozen` is counted in `state`, `frozen_dequant` in `gathered`, "
            "`grad_transient` in `activations` (docs/adapters.md, Planning).\n\n"
            + markdown_table(cat_headers, cat_rows, "lrrrrrr"),
        ],
    )
    result.write(time.perf_counter() - started)


def _plot(data: dict) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(MODES))
    width = 0.38
    labels = [LABELS[m] for m in MODES]
    ax1.bar(
        [i - width / 2 for i in x],
        [data[m]["cpu"] * 1e3 for m in MODES],
        width,
        label="measured (CPU time, slowest rank)",
    )
    ax1.bar(
        [i + width / 2 for i in x],
        [data[m]["pred_step"] * 1e3 for m in MODES],
        width,
        label="predicted",
    )
    ax1.set_ylabel("step time, ms")
    ax2.bar(
        [i - width / 2 for i in x],
        [data[m]["peaks"][0] / 2**20 for m in MODES],
        width,
        label="ledger peak",
    )
    ax2.bar(
        [i + width / 2 for i in x],
        [data[m]["pred_peaks"][0] / 2**20 for m in MODES],
        width,
        label="predicted peak",
    )
    ax2.set_ylabel("rank 0 device peak, MiB")
    for ax in (ax1, ax2):
        ax.set_xticks(list(x), labels)
        ax.legend(fontsize=8)
    fig.suptitle("Full fine-tuning vs LoRA vs QLoRA on 2 emulated ranks (one plan)")
    return save_figure(fig, "adapters", "emulated: 2 CPU gloo ranks")


if __name__ == "__main__":
    torch.set_num_threads(1)
    raise_priority()
    main()
