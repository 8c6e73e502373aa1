"""`cephalo advise`: which GPUs to rent or buy for a model, and what each device is worth."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from cephalo.advise.advisor import PLANS_PER_LEVEL, Advisor, advise
from cephalo.commands.plan import (
    DEFAULT_DTYPE,
    DEFAULT_MODEL,
    DEFAULT_SEQ_LEN,
    GIB,
    adapter_of,
    add_grouping_arguments,
    add_host_memory_argument,
    add_model_arguments,
)
from cephalo.costmodel.sources import build_cost_model
from cephalo.errors import CephaloError
from cephalo.specs.catalog.devices import DEFAULT_HOST_MEMORY_BYTES
from cephalo.specs.cluster import Cluster, parse_bytes
from cephalo.specs.offers import Offers
from cephalo.views.tables import frontier_table, make_console, marginal_tables

EPILOG = """\
examples:
  cephalo advise --offers configs/offers-example.toml --model gpt-2.7b --global-batch 256
  cephalo advise --offers configs/offers-example.toml --model llama-7b --global-batch 512 \\
                 --budget 20 --target-tokens-per-s 20000 --have 2xa6000 --json advice.json --plot advice.png

The offers file lists GPU types one may rent or buy: [[offer]] tables with type, max_count,
price_per_hour (USD per GPU), optionally per_node (GPUs come in whole nodes) and the node's
inter_node_bandwidth (docs/advise.md; configs/offers-example.toml has on-demand cloud prices
with their sources). Every cluster those offers allow is a candidate; its throughput is what
`cephalo plan --cluster SPEC` (same model settings) predicts for it, and the JSON gives each
cluster as that SPEC. A cluster of several offers is several nodes: as `cephalo plan`, the
planner also tries one shard group per node (--no-hierarchy: flat plans only;
--cross-node-reduce-dtype bf16: the all-reduce between the groups in bf16).

What it prints:
  - the Pareto frontier of price per hour against throughput, with $ per million tokens;
  - with --budget, the most throughput within it; with --target-tokens-per-s, the cheapest
    cluster that reaches it;
  - for the chosen cluster (the best within budget, else the cheapest meeting the target, else
    the lowest price per token), and for --have (a cluster you own), what each device is
    worth (throughput lost without it; whether it pays for itself) and the best device to add.

The search is exact (it equals planning every cluster) until it has made --exact-plans plans;
then it trades exactness for speed, and says by how much: a cluster it skipped has at most the
printed percentage more throughput than the frontier at its price. --exact never trades.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "advise",
        help="which GPUs to rent or buy for a model (price vs throughput), and what each is worth",
        description=__doc__.split(":", 1)[1].strip(),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--offers",
        required=True,
        metavar="FILE",
        help="GPU offers: .toml/.json/.yaml with [[offer]] type, max_count, price_per_hour, ...",
    )
    add_model_arguments(p)
    p.add_argument(
        "--global-batch",
        type=int,
        required=True,
        metavar="B",
        help="samples per optimizer step, summed over all GPUs",
    )
    p.add_argument(
        "--budget",
        type=float,
        metavar="USD_PER_HOUR",
        help="the most to spend per hour: report the best throughput within it",
    )
    p.add_argument(
        "--target-tokens-per-s",
        type=float,
        metavar="T",
        help="the throughput needed: report the cheapest cluster that reaches it",
    )
    p.add_argument(
        "--have",
        metavar="SPEC|FILE",
        help="a cluster you own (spec or file): what each of its devices is worth, and what to add",
    )
    p.add_argument("--json", metavar="PATH", help="write the frontier and the answers as JSON")
    p.add_argument(
        "--plot",
        metavar="PATH.png",
        help="draw the frontier, the chosen point and the marginal values",
    )
    p.add_argument(
        "--launch-files",
        metavar="DIR",
        help="write a SLURM sbatch script and a SkyPilot YAML for the chosen cluster "
        "(as `cephalo launch-files --cluster`)",
    )
    p.add_argument(
        "--launch-config",
        metavar="TOML",
        default="my.toml",
        help="with --launch-files: the job config the nodes run (default my.toml)",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=0.0,
        metavar="PCT",
        help="start with this tolerance, in percent (default 0: exact)",
    )
    p.add_argument(
        "--exact-plans",
        type=int,
        default=PLANS_PER_LEVEL,
        metavar="N",
        help=f"planner calls at one tolerance before the search doubles it (default {PLANS_PER_LEVEL})",
    )
    p.add_argument(
        "--exact",
        action="store_true",
        help="never raise the tolerance (exact, however long it takes)",
    )
    p.add_argument(
        "--no-offload",
        action="store_true",
        help="never keep activations on the host (as `cephalo plan --no-offload`)",
    )
    p.add_argument(
        "--no-host-state",
        action="store_true",
        help="keep all training state on the GPUs (as `cephalo plan --no-host-state`)",
    )
    add_grouping_arguments(p)
    add_host_memory_argument(p, local=False)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.global_batch < 1:
        raise CephaloError(f"--global-batch must be >= 1, got {args.global_batch}")
    if args.plot and Path(args.plot).suffix.lower() not in (".png", ".pdf", ".svg"):
        raise CephaloError(f"--plot {args.plot}: the file must end in .png, .pdf or .svg")
    if not (math.isfinite(args.tolerance) and args.tolerance >= 0):
        raise CephaloError(f"--tolerance must be a percentage >= 0, got {args.tolerance}")
    if args.exact_plans < 1:
        raise CephaloError(f"--exact-plans must be >= 1, got {args.exact_plans}")
    model = args.model or DEFAULT_MODEL
    seq_len = args.seq_len or DEFAULT_SEQ_LEN
    dtype = args.dtype or DEFAULT_DTYPE
    if seq_len < 1:
        raise CephaloError(f"--seq-len must be >= 1, got {seq_len}")
    offers = Offers.from_file(args.offers)
    have = Cluster.from_any(args.have) if args.have else None
    adapter = adapter_of(args)
    # rented nodes are not this machine: an unsaid host memory is the default, said below
    if args.host_memory == "local":
        raise CephaloError(
            "--host-memory local means this machine, but advise plans rented nodes: give their "
            "host memory as a size, e.g. --host-memory 64GiB"
        )
    host_memory = parse_bytes(args.host_memory, "--host-memory") if args.host_memory else None

    def cost_model_for(spec: str):
        # exactly what `cephalo plan --cluster SPEC --host-memory M` plans with
        return build_cost_model(
            spec, model, seq_len, dtype, adapter=adapter, host_memory=host_memory
        )

    console = make_console()
    advisor = Advisor(
        offers,
        cost_model_for,
        args.global_batch,
        allow_offload=not args.no_offload,
        allow_host_state=not args.no_host_state,
        hierarchy=not args.no_hierarchy,
        reduce_dtype=args.cross_node_reduce_dtype,
    )
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    ) as bar:
        task = bar.add_task(f"searching {advisor.clusters:,} clusters", total=None)

        def progress(plans: int, points: int, price: float) -> None:
            bar.update(
                task,
                description=f"searching {advisor.clusters:,} clusters: {plans} planned, "
                f"{points} on the frontier, at ${price:,.2f}/h",
            )

        advice = advise(
            advisor,
            budget=args.budget,
            target_tokens_per_s=args.target_tokens_per_s,
            have=have,
            tolerance=args.tolerance / 100,
            plans_per_level=None if args.exact else args.exact_plans,
            progress=progress,
        )
    console.print(
        f"[bold]{advice.model}[/bold], global batch {advice.global_batch}, seq {advice.seq_len}, "
        f"{advice.dtype}"
        + (f", {adapter.describe()}" if adapter.frozen_base else "")
        + f"; offers: {', '.join(o.name for o in advice.offers)} ({offers.where})"
    )
    if host_memory is None:
        console.print(
            f"host memory: assumed {DEFAULT_HOST_MEMORY_BYTES / GIB:.0f} GiB per node (give "
            "--host-memory, e.g. 64GiB)",
            style="dim",
            soft_wrap=True,
        )
    for note in advice.left_out:
        console.print(f"[yellow]note:[/yellow] {note}")
    console.print(frontier_table(advice))
    stats = advice.search.stats
    console.print(
        f"searched {stats.clusters:,} clusters by planning {stats.plans} in {stats.wall_s:.1f} s "
        f"(planner {stats.planner_s:.1f} s); {advice.search.bound.describe()}",
    )
    for label, p in (
        ("best within the budget", advice.best_under_budget),
        ("cheapest meeting the target", advice.cheapest_meeting_target),
    ):
        if p is not None:
            console.print(
                f"{label}: [bold]{p.cluster}[/bold]  ${p.price_per_hour:,.2f}/h, "
                f"{p.tokens_per_s:,.0f} tokens/s, ${p.usd_per_million_tokens:,.3f} per million tokens",
            )
    for m in advice.marginal:
        for table in marginal_tables(m, advice.seq_len):
            console.print(table)
        best = m.best_to_add
        if best is not None:
            console.print(
                f"best to add next: {best.gpus}x {best.offer} (+${best.price_per_hour:,.2f}/h, "
                f"{best.tokens_per_s_gained:+,.0f} tokens/s)",
            )
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(advice.to_json(), indent=2) + "\n")
        console.print(f"wrote {path}")
    if args.plot:
        from cephalo.views.plots import plot_advice

        console.print(f"wrote {plot_advice(advice, args.plot)}")
    if args.launch_files:
        if advice.chosen is None:
            raise CephaloError("--launch-files: no cluster was chosen (see above)")
        from cephalo.launch.files import LaunchSettings, nodes_of_cluster, write_launch_files

        nodes = nodes_of_cluster(Cluster.parse(advice.chosen.cluster))
        settings = LaunchSettings(config=args.launch_config)
        for path in write_launch_files(nodes, args.launch_files, settings):
            console.print(f"wrote {path}")
    if advice.problems:
        raise CephaloError("; and ".join(advice.problems))
    return 0
