"""scripts/gpu_check.py's pipeline-stage checks (issue 40, runtime/pipeline/), in a module of
their own (gpu_check.py is near the 900-line limit).

  pipeline_p2p      world size 1 (NCCL cannot send to itself): the re-partition of every
                    micro-batch between two stages' uneven splits (every row leaves one rank and
                    reaches one, the two sides' pieces match), the schedules' order and what
                    they hold, and the boundary exchange on this device through a loopback in
                    place of `torch.distributed`'s sends: the copies run on a side stream behind
                    a long `torch.cuda._sleep`, the receiver's compute stream waits for their
                    event, and the sender's tensors must stay alive (and unchanged) until
                    `finish` though the sender drops and overwrites its own names meanwhile
  pipeline_engine   world size >= 2 (`--collectives`; tests/test_comm.py runs it on gloo): a
                    2-stage plan (rank 0: the embedding and block 0; the others: block 1 and
                    the head, uneven rows), GPipe and 1F1B, against one process: the losses
                    and gradient norms, the tied embedding's gradient summed across the stages

What needs two GPUs (docs/gpu.md): the point-to-point sends on NCCL themselves
(`batch_isend_irecv` between two devices), 1F1B's sends and receives interleaved with the
stage's collectives on one stream, and the boundary crossing's time over NVLink / PCIe or a
network.
"""

from __future__ import annotations

import types
from collections import defaultdict, deque

import torch

from gpu_setup import Setup


def _plan(world: int, schedule: str = "1f1b"):
    """2 stages: rank 0 runs units 0-1 (all rows); ranks 1.. run units 2-3, rank 1 taking 2 of
    each micro-batch's 3 rows, the others 1 (world 2: rank 1 all 3)."""
    from cephalo.planner.plan import Plan, RankPlan, Stage

    M, per = 4, 3
    later = list(range(1, world))
    rows = [per] if world == 2 else [2, 1] + [0] * (world - 3)
    ranks = [RankPlan(0, "cpu", per * M, per, M, 1.0)]
    weights = [k + 1 for k in range(len(later))]
    for r, m, w in zip(later, rows, weights, strict=True):
        ranks.append(RankPlan(r, "cpu", m * M, max(m, 1), M if m else 0, w / sum(weights)))
    return Plan(
        "manual",
        "gpt-tiny",
        16,
        per * M,
        "fp32",
        ranks,
        stages=[Stage([0], [0, 1]), Stage(later, [2, 3])],
        schedule=schedule,
        num_micro_batches=M,
    )


def check_pipeline_pieces() -> list[str]:
    """Every row of a micro-batch crosses once, and both sides agree on the pieces."""
    from cephalo.planner.plan import Plan, RankPlan, Stage
    from cephalo.runtime.pipeline.exchange import pieces

    failures = []
    for a_rows, b_rows in (([1, 2, 0], [2, 1]), ([3], [1, 1, 1]), ([2, 1], [3]), ([1, 2], [2, 1])):
        n = len(a_rows) + len(b_rows)
        per, M = sum(a_rows), 2
        ranks = [
            RankPlan(r, "cpu", m * M, max(m, 1), M if m else 0, 1.0 / len(side))
            for side, offset in ((a_rows, 0), (b_rows, len(a_rows)))
            for r, m in enumerate(side, start=offset)
        ]
        stages = [
            Stage(list(range(len(a_rows))), [0, 1]),
            Stage(list(range(len(a_rows), n)), [2, 3]),
        ]
        plan = Plan("manual", "gpt-tiny", 16, per * M, "fp32", ranks, stages=stages,
                    schedule="gpipe", num_micro_batches=M)  # fmt: skip
        sent = defaultdict(list)
        got = defaultdict(list)
        covered = [0] * per
        for r in stages[0].ranks:
            start = sum(a_rows[:r])
            for peer, lo, hi in pieces(plan, 0, 1, r):
                sent[(r, peer)].append(hi - lo)
                for k in range(start + lo, start + hi):
                    covered[k] += 1
        for r in stages[1].ranks:
            for peer, lo, hi in pieces(plan, 1, 0, r):
                got[(peer, r)].append(hi - lo)
        if covered != [1] * per:
            failures.append(f"split {a_rows} -> {b_rows}: rows crossed {covered} times")
        if dict(sent) != dict(got):
            failures.append(f"split {a_rows} -> {b_rows}: sent {dict(sent)}, received {dict(got)}")
    return failures


def check_schedules() -> list[str]:
    from cephalo.costmodel.stages import in_flight
    from cephalo.runtime.pipeline.schedule import peak_in_flight, stage_ops

    failures = []
    for schedule in ("gpipe", "1f1b"):
        for S, M in ((2, 2), (3, 8), (4, 4)):
            for s in range(S):
                ops = stage_ops(schedule, s, S, M)
                if peak_in_flight(ops) != in_flight(schedule, s, S, M):
                    failures.append(
                        f"{schedule} stage {s} of {S}, M {M}: holds {peak_in_flight(ops)}"
                    )
    return failures


class _Loopback:
    """`torch.distributed`'s point-to-point calls between two in-process exchanges: a send is
    copied into a mailbox on a side stream (CUDA: behind `torch.cuda._sleep`, so a sender
    that freed or overwrote its tensor early would be caught), a receive's work makes the
    current stream wait for that copy's event."""

    def __init__(self, device: torch.device):
        self.device = device
        self.boxes: dict[tuple[int, int, int], deque] = defaultdict(deque)
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def namespace(self, rank: int) -> types.SimpleNamespace:
        loop = self

        def isend(*args):
            raise AssertionError("isend outside a batch")

        def irecv(*args):
            raise AssertionError("irecv outside a batch")

        class Op:
            def __init__(self, op, tensor, peer, tag=0):
                self.op, self.tensor, self.peer, self.tag = op, tensor, peer, tag

        def batch(ops):
            works = []
            for op in ops:
                key = (rank, op.peer, op.tag) if op.op is isend else (op.peer, rank, op.tag)
                if op.op is isend:
                    works.append(loop.post(key, op.tensor))
                else:
                    works.append(loop.take(key, op.tensor))
            return works

        return types.SimpleNamespace(isend=isend, irecv=irecv, P2POp=Op, batch_isend_irecv=batch)

    def post(self, key, tensor: torch.Tensor):
        copy = torch.empty_like(tensor)
        if self.side is None:
            copy.copy_(tensor)
            self.boxes[key].append((copy, None))
            return types.SimpleNamespace(wait=lambda: None)
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            torch.cuda._sleep(50_000_000)  # ~tens of ms: the sender's Python runs ahead
            copy.copy_(tensor)
            done = torch.cuda.Event()
            done.record(self.side)
        copy.record_stream(self.side)  # (not `tensor`: keeping it is the exchange's part)
        self.boxes[key].append((copy, done))
        return types.SimpleNamespace(
            wait=lambda: torch.cuda.current_stream(self.device).wait_event(done)
        )

    def take(self, key, out: torch.Tensor):
        copy, done = self.boxes[key].popleft()
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)
        out.copy_(copy)
        return types.SimpleNamespace(wait=lambda: None)


def check_exchange_loopback(device: torch.device) -> list[str]:
    """Stage 0's rank 0 sends two micro-batches' boundaries to stage 1's ranks 1 and 2 (2 + 1
    rows) and gets their gradients back, through `_Loopback`: the values arrive intact
    though the sender overwrites and drops its tensors right after sending."""
    from cephalo.runtime.pipeline import exchange as ex

    plan = _plan(3)
    shape = (plan.seq_len, 8)
    loop = _Loopback(device)
    sides = {
        r: ex.BoundaryExchange(plan, 0 if r == 0 else 1, r, shape, torch.float32, device)
        for r in (0, 1, 2)
    }
    real = ex.dist
    failures = []
    try:
        for j in range(2):
            ex.dist = loop.namespace(0)
            out = (
                torch.arange(3 * plan.seq_len * 8, dtype=torch.float32, device=device).view(
                    3, *shape
                )
                + j
            )
            expect = out.clone()
            sides[0].send_activation(j, out)
            del out  # the sender drops it: the exchange must keep it until `finish`
            churn = [torch.full((3, *shape), -1.0, device=device) for _ in range(4)]
            del churn  # (freed blocks the allocator would hand out again)
            for r, rows, lo in ((1, 2, 0), (2, 1, 2)):
                ex.dist = loop.namespace(r)
                got = sides[r].recv_activation(j, rows)
                if not torch.equal(got, expect[lo : lo + rows]):
                    failures.append(f"micro-batch {j}: rank {r} received other rows than sent")
                sides[r].send_grad(j, got * 2)
            ex.dist = loop.namespace(0)
            back = sides[0].recv_grad(j, 3)
            if not torch.equal(back, 2 * expect):
                failures.append(f"micro-batch {j}: the gradient came back wrong")
        for r, side in sides.items():
            ex.dist = loop.namespace(r)
            side.finish()
    finally:
        ex.dist = real
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return failures


def check_pipeline_p2p(setup: Setup) -> tuple[list[str], str]:
    failures = check_pipeline_pieces() + check_schedules()
    failures += check_exchange_loopback(setup.device)
    return failures, "re-partition, schedules, exchange through a side-stream loopback"


def check_pipeline_engine(comm, device: torch.device, rel_tol: float) -> list[str]:
    """A 2-stage plan over `comm`'s ranks (`_plan`), GPipe and 1F1B, 2 steps of gpt-tiny
    (fp32, dropout 0.1) against one process on the whole batch: losses and gradient norms
    within `rel_tol`."""
    from cephalo.modeling.registry import build_model
    from cephalo.planner.makers import manual_plan
    from cephalo.runtime.collectives.comm import LocalComm
    from cephalo.runtime.engine.engine import Engine, EngineConfig
    from cephalo.runtime.pipeline.stage_step import sample_ranges

    failures = []
    for schedule in ("gpipe", "1f1b"):
        plan = _plan(comm.world_size, schedule)
        whole = manual_plan("gpt-tiny", plan.seq_len, [plan.global_batch_size], [3], [1.0])
        cfg = EngineConfig(device=str(device), seed=0, grad_clip=1.0)
        ours = Engine(build_model("gpt-tiny", dropout=0.1), plan, comm, cfg)
        alone = Engine(build_model("gpt-tiny", dropout=0.1), whole, LocalComm(), cfg)
        gen = torch.Generator().manual_seed(0)
        runs = sample_ranges(plan, comm.rank)
        for step in range(2):  # (the second sees the first's update, the tied weight's too)
            x = torch.randint(0, 256, (plan.global_batch_size, plan.seq_len), generator=gen)
            y = torch.roll(x, -1, dims=1)
            mine = [torch.cat([t[a : a + n] for a, n in runs]) for t in (x, y)]
            got = ours.train_step(*mine, lr=1e-3)
            ref = alone.train_step(x, y, lr=1e-3)
            for name in ("loss", "grad_norm"):
                a, b = getattr(got, name), getattr(ref, name)
                if not abs(a - b) <= rel_tol * abs(b):
                    failures.append(f"{schedule} step {step} {name}: {a} vs one process {b}")
        ours.close()
    return failures
