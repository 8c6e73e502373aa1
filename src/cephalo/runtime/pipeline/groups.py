"""A staged plan's process groups: one per stage (its units' all-gathers and reduce-scatters run
on it, as a shard group's do) and one per pair of stages that share a tied parameter (the
owner's stage and the borrower's: the tied gradient goes to the owners and the updated weight
comes back on it, runtime/pipeline/tie.py). Every rank creates every group in the same order
(torch.distributed's contract), members or not. On an emulated cluster (`EngineConfig.links`)
each group's comm runs at its slowest link, as the shard groups' do
(runtime/collectives/emulated.py)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from cephalo.errors import CephaloError
from cephalo.planner.plan import Plan, Stage
from cephalo.runtime.collectives.comm import Comm, make_comm
from cephalo.runtime.collectives.emulated import EmulatedLinks, EmulatedStream, faithful


@dataclass
class StageGroups:
    """This rank's stage and the communicators of a staged plan. `world`: every rank (the
    token count, the loss and the gradient norm); `comm`: this rank's stage's."""

    plan: Plan
    index: int
    """This rank's stage, in pipeline order."""
    world: Comm
    comm: Comm
    links: EmulatedLinks | None
    stream: EmulatedStream | None
    _made: list[object] = field(default_factory=list)
    """The process groups made here (`close` destroys them)."""
    _pairs: dict[tuple[int, int], Comm | None] = field(default_factory=dict)

    @property
    def stage(self) -> Stage:
        assert self.plan.stages is not None
        return self.plan.stages[self.index]

    @property
    def units(self) -> range:
        """The stage's units (global indices)."""
        first, last = self.stage.units
        return range(first, last + 1)

    def stage_of_unit(self, unit: int) -> int:
        """The stage that runs `unit`."""
        for s, st in enumerate(self.plan.stages or []):
            if st.units[0] <= unit <= st.units[1]:
                return s
        raise CephaloError(f"unit {unit} is in no stage of the plan")

    def pair_comm(self, a: int, b: int) -> Comm | None:
        """The comm of stages a and b's ranks together (in ascending global rank order); None
        on a rank of neither. Collective over the world the first time a pair is asked for:
        every rank asks for the same pairs in the same order."""
        key = (min(a, b), max(a, b))
        if key not in self._pairs:
            stages = self.plan.stages or []
            members = sorted({*stages[a].ranks, *stages[b].ranks})
            pg = dist.new_group(ranks=members)
            self._made.append(pg)
            comm = None
            if self.world.rank in members:
                comm = make_comm(group=pg, validate=self.world.validate)
                if self.links is not None and self.stream is not None:
                    comm = faithful(comm, self.stream, self.links.rate(members))
            self._pairs[key] = comm
        return self._pairs[key]

    def pair_comms(self) -> list[Comm]:
        """The pair comms this rank is in (made so far)."""
        return [c for c in self._pairs.values() if c is not None]

    def close(self) -> None:
        """Destroy the process groups made here (a re-plan drops an engine: its groups go)."""
        for pg in self._made:
            if pg is not None and pg != dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(pg)
        self._made.clear()
        self._pairs.clear()


def pipeline_key(plan: Plan) -> int:
    """A fingerprint of what every rank of a pipeline must agree on: the stages (ranks, units,
    weights kept), the schedule, the micro-batches and every rank's split of them."""
    text = json.dumps(
        [
            [[st.ranks, st.units, st.keep_gathered] for st in plan.stages or []],
            plan.schedule,
            plan.num_micro_batches,
            plan.global_batch_size,
            [[r.batch_size, r.micro_batch_size] for r in plan.ranks],
        ]
    )
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big")


def agree(plan: Plan, world: Comm) -> None:
    """Every rank runs the same pipeline, or every rank stops with one message (ranks given
    different plans would otherwise wait for each other's sends until the timeout)."""
    key = pipeline_key(plan)
    both = torch.tensor([key, -key], dtype=torch.int64, device=_device(world))
    world.all_reduce(both, "max")
    if int(both[0]) != key or int(both[1]) != -key:
        raise CephaloError(
            f"rank {world.rank}: the ranks were given different pipelines (stages, schedule, "
            "micro-batches or their split differ between ranks): give every node the same plan "
            "file"
        )


def _device(world: Comm) -> torch.device:
    """Where the world's collectives take their tensors (NCCL: this rank's GPU)."""
    if world.backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def attach_stages(
    plan: Plan,
    world: Comm,
    links: EmulatedLinks | None = None,
    stream: EmulatedStream | None = None,
) -> StageGroups:
    """This rank's stage and its communicator (collective: every rank creates every stage's
    group). With `links` and `stream` (an emulated cluster) the world's and the stage's comms
    run as NCCL runs them, at their slowest link's rate."""
    stages = plan.stages or []
    if world.world_size > 1 and not dist.is_initialized():
        raise CephaloError("a staged plan needs the process group (torchrun or `cephalo run`)")
    agree(plan, world)
    made, mine, index = [], None, -1
    for s, st in enumerate(stages):
        pg = dist.new_group(ranks=sorted(st.ranks))
        made.append(pg)
        if world.rank in st.ranks:
            mine, index = pg, s
    if mine is None:
        raise CephaloError(f"rank {world.rank} is in no stage of the plan")
    comm = make_comm(group=mine, validate=world.validate)
    if links is not None and stream is not None:
        world = faithful(world, stream, links.rate(range(world.world_size)))
        comm = faithful(comm, stream, links.rate(stages[index].ranks))
    return StageGroups(plan, index, world, comm, links, stream, made)
