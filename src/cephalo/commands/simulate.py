"""`cephalo simulate`: evaluate any plan (made by `cephalo plan` or by hand) with the cost model."""

from __future__ import annotations

import argparse

from cephalo.commands.plan import GIB, adapter_of, add_cost_model_arguments, host_memory_of
from cephalo.costmodel.sources import build_cost_model
from cephalo.errors import CephaloError
from cephalo.planner.plan import Plan
from cephalo.specs.adapter import AdapterSpec
from cephalo.views.tables import adapter_lines, host_memory_lines, make_console, plan_table

EPILOG = """\
examples:
  cephalo plan --cluster 2xl4,a6000,p40 --global-batch 64 --json plan.json
  cephalo simulate plan.json                              # cluster from the plan's meta
  cephalo simulate my-plan.json --cluster 2xl4,a6000,p40  # a hand-written plan
  cephalo simulate plan.json --cluster 2xl4,a6000,p40 --profiles measured.json

The plan's model, seq_len, dtype and adapter are used unless --model / --seq-len / --dtype /
--adapter / --lora-r override them. A hand-written plan needs, per rank: rank, device (the cluster's type, e.g. l4),
batch_size, micro_batch_size, num_micro_batches, state_fraction (and optionally
offload_activations, host_state_fraction, overlap_reduce); see docs/plan-format.md. Ranks that
exceed their memory, and nodes whose host memory (--host-memory, `host_memory` in a cluster
file, else as `cephalo plan` assumes it) is too small for the state the plan keeps there, are flagged and the exit status is
then 1.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="evaluate a plan JSON with the cost model (time and memory per rank)",
        description=__doc__.split(":", 1)[1].strip(),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "plan", metavar="PLAN.json", help="a plan file (`cephalo plan --json`, or hand-written)"
    )
    add_cost_model_arguments(p, cluster_required=False)
    p.set_defaults(func=run)


def cluster_spec_of(plan: Plan, override: str | None) -> str:
    """--cluster if given, else what `cephalo plan` stored in the plan's meta."""
    if override:
        return override
    spec = plan.meta.get("cluster_spec")
    if not isinstance(spec, str) or not spec:
        raise CephaloError(
            "the plan does not say which cluster it is for (no meta.cluster_spec); "
            "pass --cluster, e.g. --cluster 2xl4,a6000,p40"
        )
    return spec


def _stage_of(plan: Plan, rank: int) -> str:
    """`, stage 1: units 4-9` for a rank of a staged plan, else nothing."""
    for i, st in enumerate(plan.stages or [] if plan.staged else []):
        if rank in st.ranks:
            return f", stage {i}: units {st.units[0]}-{st.units[1]}"
    return ""


def run(args: argparse.Namespace) -> int:
    plan = Plan.from_json(args.plan)
    spec = cluster_spec_of(plan, args.cluster)
    # the plan's model / seq_len / dtype unless overridden on the command line
    plan.seq_len = args.seq_len or plan.seq_len
    plan.dtype = args.dtype or plan.dtype
    # the plan's adapter settings (`cephalo plan --adapter`) unless overridden
    adapter = adapter_of(args, AdapterSpec.from_dict(plan.meta.get("adapter")))
    plan.meta.pop("adapter", None)  # evaluated under the settings just chosen
    host_memory, host_note = host_memory_of(args, spec)
    cm = build_cost_model(
        spec,
        args.model or plan.model,
        plan.seq_len,
        plan.dtype,
        args.profiles,
        adapter,
        host_memory=host_memory,
    )
    ev = cm.evaluate(plan)
    console = make_console()
    console.print(
        f"[bold]{cm.meta['cluster_description']}[/bold]  {cm.model.name}, global batch "
        f"{plan.global_batch_size}, seq {cm.seq_len}, {cm.dtype}, profiles: {cm.meta['profile_source']}"
    )
    for line in adapter_lines(cm):
        console.print(line)
    console.print(plan_table(plan, ev, title=f"{args.plan} ({plan.strategy})"))
    for line in host_memory_lines(ev) + ([host_note] if host_note else []):
        console.print(line, soft_wrap=True)
    from cephalo.planner.stages.search import stage_lines

    for line in stage_lines(plan):
        console.print(line)
    console.print(
        f"simulated: {ev.samples_per_s:.4g} samples/s, {ev.tokens_per_s:.4g} tokens/s, step {ev.step_s:.4g} s"
    )
    if plan.predicted is not None and abs(plan.predicted.step_s - ev.step_s) > 1e-6 * ev.step_s:
        console.print(
            f"(the plan's own prediction was {plan.predicted.samples_per_s:.3f} samples/s, "
            f"step {plan.predicted.step_s:.3f} s: different profiles or cluster)"
        )
    bad = [c for c in ev.ranks if not c.fits]
    host_short = ev.host_shortfall_message()
    if host_short:
        console.print(f"[red]host memory too small:[/red] {host_short}")
    if bad:
        console.print(
            "[red]does not fit:[/red] "
            + "; ".join(
                f"rank {c.rank} ({c.device}{_stage_of(plan, c.rank)}) needs "
                f"{c.peak_bytes / GIB:.2f} GiB of {c.capacity_bytes / GIB:.2f} GiB "
                f"(short {c.shortfall_bytes / GIB:.2f} GiB)"
                for c in bad
            )
            + (
                ": move the cut so that stage holds fewer units, or give it more nodes"
                if plan.staged
                else ""
            )
        )
        return 1
    return 1 if host_short else 0
