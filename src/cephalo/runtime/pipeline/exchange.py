"""Boundary activations and their gradients between two neighbouring stages, re-partitioned for
each stage's batch split (`BoundaryExchange`).

Micro-batch j is samples j x B/M .. (j+1) x B/M of the global batch; stage s splits it over its
ranks in ascending rank order, rank r taking its `micro_batch_size` rows
(`Plan.micro_batch_slices`). Row k of the micro-batch leaves the rank of stage s that holds it
for the rank of stage s + 1 that holds it: each pair of ranks whose slices intersect exchanges
one contiguous run of rows (`pieces`), as point-to-point sends and receives
(`torch.distributed.batch_isend_irecv`, NCCL or gloo, global ranks on the default group), and
the gradients go back the same way. Sends are asynchronous (their tensors are kept until
`finish`, at the step's end); a receive blocks until its rows are in (the pipeline's
dependency: its time is the bubble or the link, counted as communication).

Messages between two ranks in one direction are matched in order (the schedules keep the
same micro-batch order on both sides, runtime/pipeline/schedule.py); each carries its
micro-batch in its tag, which gloo matches on.

Emulation (`EngineConfig.links`): the data moves through gloo at once; its time is the link's.
A rank's sends of one micro-batch to a node cross that node pair's link behind the earlier
ones (a FIFO queue per destination node, `LinkQueue`), charged the whole micro-batch's bytes
that cross from this node to that one (the node's ranks share its link), at
`EmulatedLinks.rate` of the two ranks. Each message is followed by the time its rows arrive
(perf_counter seconds: one clock for every process on the machine); the receiver's emulated
stream waits until then (`EmulatedStream.wait_until`), so the stall lands at its next compute,
as a receive on a GPU's stream does."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from cephalo.planner.plan import Plan
from cephalo.runtime.collectives.emulated import EmulatedLinks, EmulatedStream, LinkQueue

Piece = tuple[int, int, int]
"""(peer global rank, first row, end row) of this rank's micro-batch slice."""


def pieces(plan: Plan, mine: int, other: int, rank: int) -> list[Piece]:
    """The runs of rows rank `rank` of stage `mine` exchanges with the ranks of stage `other`:
    (peer, lo, hi) relative to `rank`'s own slice of each micro-batch, in peer order."""
    start, size = next((a, n) for r, a, n in plan.micro_batch_slices(mine) if r == rank)
    out = []
    for peer, a, n in plan.micro_batch_slices(other):
        lo, hi = max(start, a), min(start + size, a + n)
        if hi > lo:
            out.append((peer, lo - start, hi - start))
    return out


class BoundaryExchange:
    """This rank's sends and receives of boundaries with the stages before and after its own.
    Given the plan, this rank's stage and global rank, the boundary's row shape
    ([seq, hidden]), dtype and device, and on an emulated cluster its links and the rank's
    stream."""

    def __init__(
        self,
        plan: Plan,
        stage: int,
        rank: int,
        row_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        links: EmulatedLinks | None = None,
        stream: EmulatedStream | None = None,
    ):
        stages = plan.stages or []
        self.M = int(plan.num_micro_batches or 1)
        self.rank = rank
        self.row_shape = row_shape
        self.dtype = dtype
        self.device = device
        self.links = links if stream is not None else None
        self.stream = stream
        self.prev = pieces(plan, stage, stage - 1, rank) if stage > 0 else []
        """Rows received from (forward) and sent back to (backward) the stage before."""
        self.next = pieces(plan, stage, stage + 1, rank) if stage + 1 < len(stages) else []
        """Rows sent to (forward) and received back from (backward) the stage after."""
        self._crossing = {
            "next": self._node_bytes(plan, stage, stage + 1) if self.next else {},
            "prev": self._node_bytes(plan, stage, stage - 1) if self.prev else {},
        }
        """Per direction and destination node: the bytes of one micro-batch that cross from
        this rank's node to it (every rank of the node sharing its link)."""
        self._queues: dict[tuple[str, int], LinkQueue] = {}
        self._sending: list[tuple[list, list[torch.Tensor]]] = []
        """Sends in flight (their works) and their tensors (kept alive until `finish`)."""
        self.bytes_sent = 0
        """Boundary bytes this rank has sent (a running count)."""

    def _node_bytes(self, plan: Plan, stage: int, other: int) -> dict[int, int]:
        if self.links is None:
            return {}
        nodes = self.links.nodes
        row = _row_bytes(self.row_shape, self.dtype)
        out: dict[int, int] = {}
        mine = nodes[self.rank]
        for r, a, n in plan.micro_batch_slices(stage):
            if nodes[r] != mine:
                continue
            for peer, b, m in plan.micro_batch_slices(other):
                rows = max(0, min(a + n, b + m) - max(a, b))
                if rows:
                    out[nodes[peer]] = out.get(nodes[peer], 0) + rows * row
        return out

    # ------------------------------------------------------------------ the four moves
    def send_activation(self, j: int, out: torch.Tensor) -> None:
        """Micro-batch j's output of this stage's last unit to the next stage's ranks."""
        self._send(self.next, out, j, "next")

    def recv_activation(self, j: int, rows: int) -> torch.Tensor:
        """Micro-batch j's input of this stage's first unit, from the previous stage's ranks."""
        return self._recv(self.prev, rows, j, "prev")

    def send_grad(self, j: int, grad: torch.Tensor) -> None:
        """Micro-batch j's gradient of this stage's input back to the previous stage."""
        self._send(self.prev, grad, self.M + j, "prev")

    def recv_grad(self, j: int, rows: int) -> torch.Tensor:
        """Micro-batch j's gradient of this stage's output, from the next stage."""
        return self._recv(self.next, rows, self.M + j, "next")

    def finish(self) -> None:
        """Wait for every send of the step (its tensors may go)."""
        for works, _ in self._sending:
            for work in works:
                work.wait()
        self._sending.clear()

    # ------------------------------------------------------------------ moves
    def _send(self, to: list[Piece], t: torch.Tensor, tag: int, direction: str) -> None:
        if not to:
            return
        t = t.detach().contiguous()
        ops = [dist.P2POp(dist.isend, t[lo:hi], peer, tag=tag) for peer, lo, hi in to]
        whens: list[torch.Tensor] = []
        if self.links is not None:
            start = max(time.perf_counter(), self.stream.ready_at)  # after the stream's work
            due: dict[int, float] = {}
            for peer, _, _ in to:
                node = self.links.nodes[peer]
                if node not in due:
                    due[node] = self._queue(direction, peer).enqueue(
                        start, self._crossing[direction].get(node, 0)
                    )
                when = torch.tensor([due[node]], dtype=torch.float64, device=t.device)
                whens.append(when)
                ops.append(dist.P2POp(dist.isend, when, peer, tag=tag + 2 * self.M))
        self.bytes_sent += t.numel() * t.element_size()
        # the sends already through let their tensors go (the cost model holds two crossing
        # buffers, not one per micro-batch of the step)
        self._sending = [s for s in self._sending if not all(_done(w) for w in s[0])]
        self._sending.append((dist.batch_isend_irecv(ops), [t, *whens]))

    def _recv(self, frm: list[Piece], rows: int, tag: int, direction: str) -> torch.Tensor:
        buf = torch.empty((rows, *self.row_shape), dtype=self.dtype, device=self.device)
        if not frm:
            return buf
        ops = [dist.P2POp(dist.irecv, buf[lo:hi], peer, tag=tag) for peer, lo, hi in frm]
        whens = []
        if self.links is not None:
            for peer, _, _ in frm:
                when = torch.zeros(1, dtype=torch.float64, device=self.device)
                whens.append(when)
                ops.append(dist.P2POp(dist.irecv, when, peer, tag=tag + 2 * self.M))
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        if whens:
            self.stream.wait_until(max(float(w.item()) for w in whens))
        return buf

    def _queue(self, direction: str, peer: int) -> LinkQueue:
        node = self.links.nodes[peer]
        key = (direction, node)
        if key not in self._queues:
            self._queues[key] = LinkQueue(self.links.rate([self.rank, peer]))
        return self._queues[key]


def _done(work) -> bool:
    """Whether a point-to-point work has completed (without waiting for it)."""
    is_completed = getattr(work, "is_completed", None)
    return bool(is_completed()) if is_completed is not None else False


def _row_bytes(row_shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for d in row_shape:
        n *= int(d)
    return n * dtype.itemsize
