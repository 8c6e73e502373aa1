"""`cephalo launch-files`: a SLURM sbatch script and a SkyPilot YAML for a cluster or a plan."""

from __future__ import annotations

import argparse

from cephalo.errors import CephaloError

EPILOG = """\
examples:
  cephalo launch-files --cluster 4xl4@node0,2xrtx3090@node1 --config my.toml --out launch/
  cephalo plan --cluster 4xl4@node0,2xrtx3090@node1 --model gpt-1.3b --global-batch 64 --json plan.json
  cephalo launch-files --plan plan.json --config my.toml --out launch/   # runs that plan
  cephalo advise --offers offers.toml --model gpt-1.3b --global-batch 256 --launch-files launch/

Writes DIR/cephalo.sbatch (one `srun torchrun` per node, heterogeneous nodes as a SLURM
heterogeneous job, the c10d rendezvous on the first node, the NCCL settings of docs/gpu.md)
and DIR/cephalo-sky.yaml (SkyPilot: identical nodes of the first node's kind). Check the
commented NCCL lines against your network before the first job (docs/gpu.md).
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "launch-files",
        help="write a SLURM sbatch script and a SkyPilot YAML for a cluster or a plan",
        description=__doc__.split(":", 1)[1].strip(),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--cluster", metavar="SPEC", help="a cluster spec or file (nodes: @nodeK)")
    what.add_argument(
        "--plan", metavar="PLAN.json", help="a plan file: its cluster, and the job runs the plan"
    )
    add_launch_arguments(p)
    p.add_argument(
        "--out", metavar="DIR", default="launch", help="where to write them (default launch/)"
    )
    p.set_defaults(func=run)


def add_launch_arguments(p: argparse.ArgumentParser) -> None:
    """The settings of the launch files (also on `cephalo advise`)."""
    p.add_argument(
        "--config",
        dest="launch_config",
        metavar="TOML",
        default="my.toml",
        help="the job config the nodes run (default my.toml)",
    )
    p.add_argument("--job-name", default="cephalo", help="SLURM / SkyPilot job name")
    p.add_argument("--time", default="24:00:00", help="SLURM time limit (default 24:00:00)")
    p.add_argument("--partition", default=None, help="SLURM partition")
    p.add_argument("--port", type=int, default=29400, help="rendezvous port (default 29400)")


def settings_of(args: argparse.Namespace, plan: str | None = None):
    from cephalo.launch.files import LaunchSettings

    if not 1 <= args.port <= 65535:
        raise CephaloError(f"--port must be in 1..65535, got {args.port}")
    return LaunchSettings(
        config=args.launch_config,
        plan=plan,
        job_name=args.job_name,
        port=args.port,
        time=args.time,
        partition=args.partition,
    )


def run(args: argparse.Namespace) -> int:
    from cephalo.launch.files import nodes_of_cluster, nodes_of_plan, write_launch_files
    from cephalo.planner.plan import Plan
    from cephalo.specs.cluster import Cluster

    if args.plan:
        nodes = nodes_of_plan(Plan.from_json(args.plan), args.plan)
    else:
        nodes = nodes_of_cluster(Cluster.from_any(args.cluster))
    for path in write_launch_files(nodes, args.out, settings_of(args, args.plan)):
        print(f"wrote {path}")
    return 0
