"""Launch files for a real cluster: a SLURM `sbatch` script and a SkyPilot task YAML.

A cluster (a spec, or the cluster a plan file recorded) is a list of nodes, each with its own
GPU count and types. The sbatch script asks for exactly those nodes (one heterogeneous-job
component per node where the nodes differ: `#SBATCH hetjob`) and starts one `torchrun` per
node with `srun`, every node's torchrun meeting at a c10d rendezvous on the first node (torch
elastic accepts a different `--nproc-per-node` on each node). The NCCL settings are those of
docs/gpu.md: `NCCL_P2P_DISABLE=1` on nodes of several consumer GPUs, the interface and
InfiniBand lines to uncomment per site, `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` so a restart
can start its process group (pytorch#135712).

SkyPilot launches identical nodes (`num_nodes` x one `accelerators` entry): for a cluster of
mixed nodes the YAML asks for the first node's kind and says so at its top; the sbatch script
is the file for such clusters. Both files are text made here (no YAML package needed to write
them); `cephalo launch-files` and `cephalo advise --launch-files` write them.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from cephalo.errors import CephaloError
from cephalo.planner.plan import Plan
from cephalo.planner.rank_match import plan_devices
from cephalo.specs.cluster import Cluster

SKYPILOT_NAMES = {
    "t4": "T4",
    "l4": "L4",
    "a10g": "A10G",
    "a6000": "A6000",
    "l40s": "L40S",
    "l40": "L40",
    "p40": "P40",
    "p100": "P100",
    "v100x16": "V100",
    "v100x32": "V100-32GB",
    "v100-pciex16": "V100",
    "a100x40": "A100",
    "a100x80": "A100-80GB",
    "h100-nvl": "H100-NVL",
}
"""Catalog type -> SkyPilot's accelerator name (`sky show-gpus`); others: the type in capitals
(RTX3090, RTX4090, ...)."""

_CONSUMER = re.compile(r"^rtx\d{4}")
"""GeForce cards (RTX 30xx / 40xx / 50xx): peer-to-peer over PCIe broken or disabled by the
board (docs/gpu.md); workstation cards (rtxa4000, a6000) are not matched."""


@dataclass(frozen=True)
class Node:
    """One machine of the cluster: its GPUs' catalog types, one per rank."""

    index: int
    types: tuple[str, ...]

    @property
    def gpus(self) -> int:
        return len(self.types)

    @property
    def p2p_broken(self) -> bool:
        """Several consumer GPUs in one machine: NCCL must not use peer-to-peer."""
        return self.gpus > 1 and any(_CONSUMER.match(t) for t in self.types)

    def describe(self) -> str:
        counts = dict.fromkeys(self.types, 0)
        for t in self.types:
            counts[t] += 1
        return " + ".join(f"{n}x {t}" for t, n in counts.items())


@dataclass(frozen=True)
class LaunchSettings:
    """What the files run and ask for."""

    config: str = "my.toml"
    """The job config every node's `cephalo train` reads (the same path on every node)."""
    plan: str | None = None
    """A plan file passed as `--parallel.plan` (None: the config's `parallel.plan`)."""
    job_name: str = "cephalo"
    port: int = 29400
    """The rendezvous port on the first node."""
    time: str = "24:00:00"
    """SLURM's time limit (cephalo saves on SIGUSR1/SIGTERM before it: `--signal`)."""
    partition: str | None = None


def nodes_of_cluster(cluster: Cluster) -> list[Node]:
    """The cluster's nodes in their order, each with its devices' types."""
    if any(d.type == "cpu" for d in cluster.devices):
        raise CephaloError(
            "launch files are for GPU clusters; an emulated (cpu) cluster runs with `cephalo run`"
        )
    return [
        Node(i, tuple(d.type for d in cluster.devices if d.node == node))
        for i, node in enumerate(cluster.nodes())
    ]


def nodes_of_plan(plan: Plan, source: str) -> list[Node]:
    """The nodes of the cluster a plan file recorded (`meta.cluster`); one node where it did
    not record them (a hand-made plan)."""
    devices = plan_devices(plan)
    if any(d.key.startswith("cpu") for d in devices):
        raise CephaloError(
            f"{source} is a plan for emulated (cpu) devices: launch files are for GPU clusters"
        )
    order = list(dict.fromkeys(0 if d.node is None else d.node for d in devices))
    return [
        Node(i, tuple(d.key for d in devices if (0 if d.node is None else d.node) == node))
        for i, node in enumerate(order)
    ]


def _train_args(s: LaunchSettings) -> str:
    args = ["-m", "cephalo", "train", "--config", s.config]
    if s.plan:
        args.append(f"--parallel.plan={s.plan}")
    return " ".join(shlex.quote(a) for a in args)


def _torchrun(nodes: list[Node], node: Node | None, s: LaunchSettings, endpoint: str) -> str:
    per_node = "$SKYPILOT_NUM_GPUS_PER_NODE" if node is None else str(node.gpus)
    return (
        f"torchrun --nnodes={len(nodes)} --nproc-per-node={per_node} "
        f"--rdzv-backend=c10d --rdzv-endpoint={endpoint}:{s.port} --rdzv-id={s.job_name} "
        f"{_train_args(s)}"
    )


NCCL_LINES = """\
# NCCL (docs/gpu.md): uncomment what your network needs
# export NCCL_SOCKET_IFNAME=eth0   # several interfaces: the one that reaches the other nodes (ip -br addr)
# export NCCL_IB_DISABLE=1         # nodes joined by Ethernet only (no InfiniBand / RoCE)
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}   # INFO for a first job: the interface and transport NCCL chose
# a restarted job must not reuse the dead group's rendezvous store (pytorch#135712)
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
"""


def sbatch_script(nodes: list[Node], s: LaunchSettings) -> str:
    """The SLURM batch script: one component per node where the nodes differ (`hetjob`),
    one `srun torchrun` per node, all meeting at the first node's rendezvous."""
    if not nodes:
        raise CephaloError("the cluster has no nodes")
    same = len({(n.gpus, n.p2p_broken) for n in nodes}) == 1
    head = [
        "#!/bin/bash",
        f"# cephalo: {len(nodes)} node(s), {sum(n.gpus for n in nodes)} GPU(s): "
        + "; ".join(f"node {n.index}: {n.describe()}" for n in nodes),
        "# sbatch this file from the directory that holds the config (the same path on every node).",
        f"#SBATCH --job-name={s.job_name}",
        f"#SBATCH --time={s.time}",
        "#SBATCH --signal=B:USR1@300   # cephalo saves and stops on SIGUSR1, 5 min before the limit",
    ]
    if s.partition:
        head.append(f"#SBATCH --partition={s.partition}")
    if same:
        n = nodes[0]
        head += [
            f"#SBATCH --nodes={len(nodes)}",
            "#SBATCH --ntasks-per-node=1",
            f"#SBATCH --gpus-per-node={n.gpus}   # every node: {n.describe()}",
        ]
    else:
        for i, n in enumerate(nodes):
            if i:
                head.append("#SBATCH hetjob")
            head += [
                "#SBATCH --nodes=1",
                "#SBATCH --ntasks-per-node=1",
                f"#SBATCH --gpus-per-node={n.gpus}   # node {n.index}: {n.describe()}",
            ]
    body = [
        "",
        "set -euo pipefail",
        NCCL_LINES,
        "# SLURM's warning (SIGUSR1, --signal above) or scancel's SIGTERM: SIGTERM to every srun,",
        "# which reaches torchrun and its ranks: they finish the step, save and exit 0 (torchrun",
        "# waits 30 s for them: a larger checkpoint needs checkpoint.every_minutes as well)",
        "trap 'kill -TERM $(jobs -p) 2>/dev/null' USR1 TERM",
    ]
    if same:
        body += [
            'HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            ("export NCCL_P2P_DISABLE=1   # several consumer GPUs per node\n")
            if nodes[0].p2p_broken
            else "",
            "srun --ntasks-per-node=1 " + _torchrun(nodes, nodes[0], s, "$HEAD") + " &",
        ]
    else:
        body.append('HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_0" | head -n 1)')
        for i, n in enumerate(nodes):
            export = "--export=ALL,NCCL_P2P_DISABLE=1 " if n.p2p_broken else ""
            body += [
                f"# node {n.index}: {n.describe()}",
                f"srun --het-group={i} --ntasks=1 {export}"
                + _torchrun(nodes, n, s, "$HEAD")
                + " &",
            ]
    body += [
        "until wait; do :; done   # wait again after a trapped signal: the ranks are saving",
        "",
    ]
    return "\n".join(head + [line for line in body if line != ""]) + "\n"


def _yaml_str(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def skypilot_yaml(nodes: list[Node], s: LaunchSettings) -> str:
    """The SkyPilot task: `num_nodes` nodes of the first node's kind (SkyPilot's nodes are
    identical), `torchrun` on each with SkyPilot's node variables."""
    if not nodes:
        raise CephaloError("the cluster has no nodes")
    first = nodes[0]
    kinds = set(first.types)
    if len(kinds) > 1:
        raise CephaloError(
            f"node 0 mixes GPU types ({first.describe()}): SkyPilot asks for one type per node; "
            "use the sbatch script"
        )
    accelerator = SKYPILOT_NAMES.get(first.types[0], first.types[0].upper())
    mixed = any(n.types != first.types for n in nodes)
    lines = [f"# cephalo: {'; '.join(f'node {n.index}: {n.describe()}' for n in nodes)}"]
    if mixed:
        lines.append(
            f"# NOTE: SkyPilot starts identical nodes; this asks for {len(nodes)} x "
            f"{accelerator}:{first.gpus} (node 0's kind). For the mixed cluster use the sbatch script."
        )
    lines += [
        f"name: {s.job_name}",
        f"num_nodes: {len(nodes)}",
        "resources:",
        f"  accelerators: {accelerator}:{first.gpus}",
        "workdir: .",
        "setup: |",
        "  pip install -e '.[hf,data]'",
        "envs:",
        f"  CEPHALO_CONFIG: {_yaml_str(s.config)}",
        "  TORCH_DISABLE_SHARE_RDZV_TCP_STORE: '1'",
        "  NCCL_DEBUG: WARN",
        "run: |",
        '  HEAD=$(echo "$SKYPILOT_NODE_IPS" | head -n 1)',
    ]
    if first.p2p_broken:
        lines.append("  export NCCL_P2P_DISABLE=1   # several consumer GPUs per node (docs/gpu.md)")
    settings = LaunchSettings(**{**s.__dict__, "config": "$CEPHALO_CONFIG"})
    lines.append(
        "  "
        + _torchrun(nodes, None, settings, "$HEAD").replace(
            "'$CEPHALO_CONFIG'", '"$CEPHALO_CONFIG"'
        )
    )
    return "\n".join(lines) + "\n"


def write_launch_files(nodes: list[Node], out_dir: str | Path, s: LaunchSettings) -> list[Path]:
    """`cephalo.sbatch` and `cephalo-sky.yaml` in `out_dir` (made if needed); their paths."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        sbatch = out / "cephalo.sbatch"
        sbatch.write_text(sbatch_script(nodes, s))
        sbatch.chmod(0o755)
        written = [sbatch]
        if len(set(nodes[0].types)) == 1:
            sky = out / "cephalo-sky.yaml"
            sky.write_text(skypilot_yaml(nodes, s))
            written.append(sky)
    except OSError as err:
        raise CephaloError(
            f"cannot write the launch files in {out}: {err.strerror or err}"
        ) from None
    return written
