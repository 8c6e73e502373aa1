"""`cephalo plan`: choose each GPU's batch, micro-batch, state fraction and offload for a cluster."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from cephalo.costmodel.sources import (
    DEFAULT_DTYPE,
    DEFAULT_MODEL,
    DEFAULT_SEQ_LEN,
    build_cost_model,
)
from cephalo.errors import CephaloError, PlanDoesNotFit
from cephalo.planner.plan import DTYPES, Plan
from cephalo.specs.adapter import ADAPTER_MODES, DEFAULT_LORA_R, AdapterSpec
from cephalo.specs.catalog.devices import DEFAULT_HOST_MEMORY_BYTES
from cephalo.specs.cluster import Cluster, parse_bytes
from cephalo.views.tables import (
    adapter_lines,
    estimate_lines,
    host_memory_lines,
    make_console,
    moe_lines,
    plan_table,
    strategy_line,
)

STRATEGY_CHOICES = ("cephalo", "even", "proportional", "all")
GIB = 1024**3

EPILOG = """\
examples:
  cephalo plan --cluster 2xl4,a6000,p40 --model gpt-2.7b --global-batch 64
  cephalo plan --cluster 2xl4,a6000,p40 --model gpt-2.7b --global-batch 64 --strategy all
  cephalo plan --cluster 8xa100x80,16xv100x32 --model llama-7b --global-batch 512 --seq-len 2048 \\
               --json plan.json --plot plan.png
  cephalo plan --cluster cluster.toml --model gpt-1.3b --global-batch 128 --no-offload
  cephalo plan --cluster 2xl4,a6000 --model ./Qwen2.5-0.5B --global-batch 32 --seq-len 1024
  cephalo plan --cluster 2xl4,a6000,p40 --model gpt-6.7b --global-batch 64 --no-host-state
  cephalo plan --cluster rtx3090,rtx3060 --model ./llama3-8b-shape --global-batch 16 \
               --adapter qlora --lora-r 16
  cephalo plan --cluster "4xa6000@node0,4xl4@node1,4xv100x16@node2;inter=3.1GB/s" \
               --model llama-7b --global-batch 64 --seq-len 1024 --dtype fp16 --stages auto

What it decides, per GPU (rank): how many samples of the global batch it processes
(batch), in micro-batches of what size (layered gradient accumulation runs them one layer
at a time), which fraction of the sharded training state (fp32 master weights, gradients,
Adam moments) it owns, and whether its layer-boundary activations live on the host.
Where memory is short it may also keep part of a GPU's state shard in host memory
(`on host`: its fp32 master, gradient and Adam moments; the host CPU runs their AdamW step;
the node's host memory, --host-memory or `host_memory` in a cluster file, is shared by its
GPUs; full fine-tuning only) and let a GPU wait for each reduce-scatter (`rs wait`: one unit gradient less), only
where that makes the step faster. It maximises samples/s under every GPU's memory, using the cost model fed by the catalog
(published measurements of real GPUs; `cephalo catalog`) or by measured profiles
(`cephalo profile --out P.json`, then --profiles P.json). A model the catalog never
measured (a transformers directory) gets its block times from the same GPU's published
profiles scaled by FLOPs; the plan prints that estimate's leave-one-out error.

With --adapter lora|qlora only LoRA adapters (rank --lora-r, every Linear of the blocks) are
trained: the state shards hold the frozen base (compute dtype; NF4 for qlora) and 16 bytes per
adapter parameter, and only the adapters' gradients are reduced (docs/adapters.md, Planning).

With --stages auto (or N) it also tries pipeline stages of whole nodes, each running a
contiguous range of layers (docs/planner.md, "Pipeline stages"); `cephalo run` / `train` run a
staged plan as a pipeline.

strategies: cephalo (the optimiser), even (plain FSDP: equal batches and shards),
proportional (batches proportional to speed, equal shards), all (compare the three).
The plan JSON (--json) is documented in docs/plan-format.md; `cephalo simulate` evaluates it
and `cephalo train` runs it.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="plan per-GPU batch, micro-batch, state fraction and offload for a cluster",
        description=__doc__.split(":", 1)[1].strip(),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_cost_model_arguments(p, cluster_required=True)
    p.add_argument(
        "--global-batch",
        type=int,
        required=True,
        metavar="B",
        help="samples per optimizer step, summed over all GPUs",
    )
    p.add_argument(
        "--strategy",
        choices=STRATEGY_CHOICES,
        default="cephalo",
        help="which plan to make (default cephalo); `all` prints every strategy and keeps cephalo's",
    )
    p.add_argument(
        "--no-offload",
        action="store_true",
        help="never keep activations on the host (the planner offloads only when it pays)",
    )
    p.add_argument(
        "--no-host-state",
        action="store_true",
        help="keep all training state on the GPUs (the planner keeps it on the host only where it pays)",
    )
    add_grouping_arguments(p)
    add_stage_arguments(p)
    p.add_argument("--json", metavar="PATH", help="write the plan as JSON (docs/plan-format.md)")
    p.add_argument(
        "--plot",
        metavar="PATH.png",
        help="draw per GPU its batch, state fraction, memory vs capacity and busy time",
    )
    p.set_defaults(func=run)


def add_grouping_arguments(p: argparse.ArgumentParser) -> None:
    """--no-hierarchy, --cross-node-reduce-dtype: the shard groups the planner may form (shared
    with `advise`)."""
    p.add_argument(
        "--no-hierarchy",
        action="store_true",
        help="one flat replica over every GPU (by default the planner also tries one shard group "
        "per node, or per few nodes, with a gradient all-reduce between them once per step)",
    )
    p.add_argument(
        "--cross-node-reduce-dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="dtype of the once-per-step gradient all-reduce between shard groups (default fp32; "
        "bf16 halves the bytes over the inter-node network)",
    )


def add_stage_arguments(p: argparse.ArgumentParser) -> None:
    """--stages, --schedule: the pipeline stages the planner may form (issue 40: `cephalo
    simulate` evaluates them, the runtime runs them, runtime/pipeline/)."""
    p.add_argument(
        "--stages",
        default="off",
        metavar="auto|off|N",
        help="pipeline stages of whole nodes, each running a contiguous range of layers: `auto` "
        "(the planner compares 2.. stages with the flat and shard-group plans and keeps the "
        "fastest), N (exactly N stages, where faster), `off` (default); `cephalo run` runs "
        "a staged plan as a pipeline",
    )
    p.add_argument(
        "--schedule",
        choices=("auto", "gpipe", "1f1b"),
        default="auto",
        help="pipeline schedule of a staged plan (default auto: 1f1b, as fast as gpipe in the "
        "cost model and holding fewer micro-batches)",
    )


def add_model_arguments(
    p: argparse.ArgumentParser, default: Callable[[object], str] = lambda v: f"default {v}"
) -> None:
    """--model, --seq-len, --dtype: what is trained (shared with `simulate` and `advise`);
    `default(value)` says where an unset one comes from."""
    p.add_argument(
        "--model",
        metavar="NAME|DIR",
        help="a model from `cephalo catalog`, a preset, or a transformers model directory "
        f"(config.json; its shape is read, no weights) ({default(DEFAULT_MODEL)})",
    )
    p.add_argument(
        "--seq-len", type=int, metavar="N", help=f"tokens per sample ({default(DEFAULT_SEQ_LEN)})"
    )
    p.add_argument("--dtype", choices=DTYPES, help=f"compute dtype ({default(DEFAULT_DTYPE)})")
    p.add_argument(
        "--adapter",
        choices=ADAPTER_MODES,
        help="what is trained: none (full fine-tuning), lora (adapters on a frozen base in the "
        "compute dtype) or qlora (adapters on an NF4 base) (default none)",
    )
    p.add_argument(
        "--lora-r",
        type=int,
        metavar="N",
        help=f"LoRA rank, adapters on every Linear of the blocks (default {DEFAULT_LORA_R})",
    )


def adapter_of(args: argparse.Namespace, default: AdapterSpec | None = None) -> AdapterSpec:
    """--adapter / --lora-r as the cost model's `AdapterSpec`; unset ones from `default` (a
    plan's own, for `simulate`), else full fine-tuning and rank 16."""
    base = default or AdapterSpec()
    mode = args.adapter or base.mode
    r = args.lora_r if args.lora_r is not None else base.r
    if args.lora_r is not None and mode == "none":
        raise CephaloError("--lora-r needs --adapter lora or --adapter qlora")
    return AdapterSpec(mode, r, base.targets)


def add_cost_model_arguments(p: argparse.ArgumentParser, cluster_required: bool) -> None:
    """The options that build a cost model (shared with `cephalo simulate`)."""

    def default(value: object) -> str:
        return (
            "default: the plan's"
            if not cluster_required
            else f"default: the profiles' with --profiles, else {value}"
        )

    p.add_argument(
        "--cluster",
        required=cluster_required,
        metavar="SPEC|FILE",
        help="devices in rank order, e.g. 2xl4,a6000,p40 or a .toml/.json file (grammar: `cephalo catalog`)",
    )
    add_model_arguments(p, default)
    p.add_argument(
        "--profiles",
        "--profile",
        metavar="PATH",
        help="measured profiles from `cephalo profile --out PATH` instead of the catalog",
    )
    add_host_memory_argument(p)


def add_host_memory_argument(p: argparse.ArgumentParser, local: bool = True) -> None:
    """--host-memory: every node's host memory (shared with `advise`, whose rented nodes are
    not this machine: there `local` is not offered)."""
    if not local:
        p.add_argument(
            "--host-memory",
            metavar="SIZE",
            help="host memory of every rented node, e.g. 64GiB (host-held state and offloaded "
            "activations must fit it; docs/training.md, 'Host memory'); default 256 GiB, said "
            "in the output",
        )
        return
    p.add_argument(
        "--host-memory",
        metavar="SIZE|local",
        help="host memory of every node, e.g. 64GiB, or `local`: this machine's available memory "
        "less the OS's and each rank's reserve (docs/training.md, 'Host memory'; host-held state "
        "and offloaded activations must fit it); default: `;host=SIZE` in the spec or a "
        "cluster file's host_memory, else this machine's available memory less reserves when "
        "the cluster is this machine, else 256 GiB (said in the output)",
    )


def local_host_memory(ranks: int = 1) -> int:
    """This machine's host memory for planning a node of `ranks` ranks, read through the one
    function that knows it (train/discovery.py: its available memory less the OS's and the
    ranks' reserves, the budget a job here would get; physical memory where the available
    cannot be read)."""
    from cephalo.train.discovery import usable_host_bytes

    return usable_host_bytes(ranks)


def _is_this_machine(cluster: Cluster) -> bool:
    """A one-node cluster of this machine's devices: emulated CPU ranks, or exactly the CUDA
    GPUs found here (types as the catalog names them)."""
    if len(cluster.nodes()) != 1:
        return False
    types = sorted(d.type for d in cluster.devices)
    if all(t == "cpu" for t in types):
        return True
    import torch

    if not torch.cuda.is_available():
        return False
    from cephalo.specs.catalog.devices import device_type_for_gpu

    local = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        local.append(device_type_for_gpu(props.name, props.total_memory))
    return sorted(local) == types


def host_memory_of(args: argparse.Namespace, cluster_spec: str) -> tuple[int | None, str | None]:
    """(every node's host memory in bytes, or None for the cluster's own; the line that says
    what was assumed, or None when the user said it). A plan that counts on host memory the
    machine does not have fails at run time, so an unsaid value is always named."""
    cluster = Cluster.from_any(cluster_spec)
    per_node = max(len(cluster.ranks_on_node(n)) for n in cluster.nodes())
    if args.host_memory and args.host_memory.strip().lower() == "local":
        return local_host_memory(per_node), None
    if args.host_memory:
        return parse_bytes(args.host_memory, "--host-memory"), None
    if cluster.host_memory_bytes != DEFAULT_HOST_MEMORY_BYTES or cluster.node_host_memory_bytes:
        return None, None  # the cluster file says it
    if _is_this_machine(cluster):
        local = local_host_memory(per_node)
        return local, (
            f"host memory: {local / GIB:.1f} GiB, this machine's available memory less "
            "reserves (--host-memory to plan for another)"
        )
    return None, (
        f"host memory: assumed {DEFAULT_HOST_MEMORY_BYTES / GIB:.0f} GiB per node "
        "(give --host-memory, e.g. 64GiB, or host_memory in a cluster file)"
    )


def run(args: argparse.Namespace) -> int:
    from cephalo.planner.makers import make_plan
    from cephalo.planner.shard_groups import grouping_lines, make_hierarchical_plan
    from cephalo.planner.stages.search import make_staged_plan, parse_stages, stage_lines

    if args.global_batch < 1:
        raise CephaloError(f"--global-batch must be >= 1, got {args.global_batch}")
    if args.plot and Path(args.plot).suffix.lower() not in (".png", ".pdf", ".svg"):
        raise CephaloError(f"--plot {args.plot}: the file must end in .png, .pdf or .svg")
    stages = parse_stages(args.stages)
    host_memory, host_note = host_memory_of(args, args.cluster)
    cm = build_cost_model(
        args.cluster,
        args.model,
        args.seq_len,
        args.dtype,
        args.profiles,
        adapter_of(args),
        host_memory=host_memory,
    )
    console = make_console()
    allow_offload = not args.no_offload
    host_state = not args.no_host_state
    strategies = ("cephalo", "even", "proportional") if args.strategy == "all" else (args.strategy,)
    plans: dict[str, Plan | PlanDoesNotFit] = {}
    for s in strategies:
        try:
            if s == "cephalo":
                plans[s] = make_staged_plan(
                    cm,
                    args.global_batch,
                    stages=stages,
                    schedule=args.schedule,
                    hierarchy=not args.no_hierarchy,
                    reduce_dtype=args.cross_node_reduce_dtype,
                    allow_offload=allow_offload,
                    allow_host_state=host_state,
                )
            else:
                plans[s] = make_plan(
                    cm,
                    args.global_batch,
                    s,
                    allow_offload=allow_offload,
                    allow_host_state=host_state,
                )
        except PlanDoesNotFit as e:
            if len(strategies) == 1 or s == "cephalo":
                raise
            plans[s] = e
    # the baselines' line needs `even` as the yardstick even when only one strategy was asked for
    even = plans.get("even")
    if even is None:
        try:
            even = make_plan(cm, args.global_batch, "even", allow_offload=allow_offload)
        except PlanDoesNotFit as e:
            even = e
    main_plan = plans["cephalo"] if "cephalo" in plans else plans[strategies[0]]
    assert isinstance(main_plan, Plan)
    ev = cm.evaluate(main_plan)
    console.print(
        f"[bold]{cm.meta['cluster_description']}[/bold]  {cm.model.name}, global batch "
        f"{args.global_batch}, seq {cm.seq_len}, {cm.dtype}, profiles: {cm.meta['profile_source']}"
    )
    for line in adapter_lines(cm) + moe_lines(cm):
        console.print(line)
    for line in estimate_lines(cm):
        console.print(line, style="yellow")
    console.print(plan_table(main_plan, ev, title=f"{main_plan.strategy} plan"))
    for line in host_memory_lines(ev) + ([host_note] if host_note else []):
        console.print(line, style="dim")
    for line in grouping_lines(main_plan) + stage_lines(main_plan):
        console.print(line)
    for s in strategies:
        console.print(strategy_line(s, plans[s], even))
    uses_host = isinstance(main_plan, Plan) and any(
        r.host_state_fraction > 0 and r.state_fraction > 0 for r in main_plan.ranks
    )
    if "cephalo" in strategies and uses_host:
        try:
            device_only: Plan | PlanDoesNotFit = make_hierarchical_plan(
                cm,
                args.global_batch,
                hierarchy=not args.no_hierarchy,
                reduce_dtype=args.cross_node_reduce_dtype,
                allow_offload=allow_offload,
                allow_host_state=False,
            )
        except PlanDoesNotFit as e:
            device_only = e
        if isinstance(device_only, Plan):
            ratio = main_plan.predicted.samples_per_s / device_only.predicted.samples_per_s
            line = (
                f"  without host state: {device_only.predicted.samples_per_s:.4g} samples/s "
                f"(host state: {ratio:.2f}x)"
            )
        else:
            line = "  without host state: does not fit"
        console.print(line, style="dim")
    if "even" not in strategies:
        console.print(strategy_line("even", even, even), style="dim")
    console.print(f"planned in {main_plan.meta['planner_wall_s'] * 1000:.1f} ms")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        main_plan.to_json(path)
        console.print(f"wrote {path}  (evaluate it with `cephalo simulate {path}`)")
    if args.plot:
        from cephalo.views.plots import plot_plan

        console.print(f"wrote {plot_plan(main_plan, ev, args.plot)}")
    return 0
