"""The engine's head pass: the head's loss and backward in one pass at the end of the forward,
one micro-batch at a time, over chunks of the sequence (runtime/head_loss.py). `HeadPass` is a
part the engine's passes (runtime/engine/step_passes.py) and the fused tail (runtime/engine/tail_pass.py)
hold; it is given what it uses."""

from __future__ import annotations

import torch

from cephalo.preference.objective import DpoObjective
from cephalo.runtime import head_loss
from cephalo.runtime.autograd import BackwardCharges
from cephalo.runtime.boundary import BoundaryStore
from cephalo.runtime.engine.step_state import StepState
from cephalo.runtime.engine.unit_backward import UnitBackward, graph_key
from cephalo.runtime.engine.unit_comm import UnitCollectives, UnitGrads
from cephalo.runtime.engine.unit_run import UnitRunner
from cephalo.runtime.memory import MemoryLedger
from cephalo.runtime.state.unit_shard import MicroBatch, UnitShard


class HeadPass:
    """The head's one pass of loss and backward. Owns nothing across steps: the reduce-scatters
    it starts go into the step's `StepState` (`head_reducing`). Given the ledger and the compute
    device and dtype, the unit collectives (gradient buffers, reduce-scatters), the unit
    backward (the head's parameters as draining leaves), the unit runner, the activation
    charges, whether this rank overlaps its reduce-scatters (else it waits for them here), and
    the DPO objective (None: the SFT loss)."""

    def __init__(
        self,
        ledger: MemoryLedger,
        device: torch.device,
        dtype: torch.dtype,
        collectives: UnitCollectives,
        unit_backward: UnitBackward,
        runner: UnitRunner,
        charges: BackwardCharges,
        overlap_reduce: bool,
        dpo: DpoObjective | None = None,
    ):
        self.dpo = dpo
        """The DPO objective (None: SFT): its row weights replace the constant output gradient."""
        self.ledger = ledger
        self.device = device
        self.dtype = dtype
        self.collectives = collectives
        self.unit_backward = unit_backward
        self.runner = runner
        self.charges = charges
        self.overlap_reduce = overlap_reduce

    def run(
        self,
        us: UnitShard,
        params: dict[str, torch.Tensor],
        mbs: list[MicroBatch],
        store: BoundaryStore,
        head_grad: torch.Tensor,
        state: StepState,
    ) -> torch.Tensor:
        """The head's loss and backward in one pass at the end of the forward
        (runtime/head_loss.py): its gradient buffers filled, its input gradients stored in its
        inputs' place, its reduce-scatters started into `state.head_reducing` (finished during
        the last block's backward). Returns the loss sum."""
        coll = self.collectives
        grads = coll.grad_buffers(us)
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        for j, mb in enumerate(mbs):
            mb.rng[us.index] = self.runner.save_rng()
            loss_sum += self.micro_batch(us, params, mb, j, store, head_grad, grads)
        grads.done_with_leaves()  # (the caller releases the head's parameters)
        state.head_reducing = coll.start_reduces(us, grads)
        if not self.overlap_reduce:
            for r in state.head_reducing:
                coll.finish_reduce(r)
            state.head_reducing = []
        return loss_sum

    def micro_batch(
        self,
        us: UnitShard,
        params: dict[str, torch.Tensor],
        mb: MicroBatch,
        j: int,
        store: BoundaryStore,
        head_grad: torch.Tensor,
        grads: UnitGrads,
    ) -> torch.Tensor:
        """The head over micro-batch j, chunk by chunk (runtime/head_loss.py), its output
        gradient `head_grad` (1 / global tokens, times the loss scale: an fp32 0-dim tensor on
        the device, so the token count is never read on the host; DPO: 1 / global pairs, on
        each row's token losses weighted by the objective's row weight): loss sum returned,
        parameter gradients drained into `grads`, input gradient stored in the input's place."""
        u = us.index
        leaves = self.unit_backward.leaves(us, params, grads)
        key = graph_key(u, mb, store)
        out_grad = head_grad
        param_grad = self.unit_backward.grad_bytes(grads)
        charged = [0]

        def on_chunk(out: torch.Tensor) -> None:  # this chunk's transient gradients
            self.ledger.release("grad_transient", charged[0])
            charged[0] = self.charges.transient(key, out, param_grad)
            self.ledger.charge("grad_transient", charged[0])

        full = {**params, **leaves}
        with self.runner.unit_input(store, u, j, mb) as x_in:
            dpo_loss = None
            if self.dpo is not None:  # the row weights: a graph-free pass first (head_loss)
                weights, dpo_loss = self._dpo_weights(us, full, mb, x_in)
                run = self.runner.head_fn(us, full, row_weights=weights)
            else:
                run = self.runner.head_fn(us, full)
            self.runner.restore_rng(mb.rng[u])
            with self.charges.activations(key), self.runner.dropout(us, mb):
                loss, dx = head_loss.loss_and_backward(
                    run,
                    x_in,
                    mb.labels,
                    self.runner.vocab,
                    out_grad,
                    list(leaves.values()),
                    u > 0,
                    on_chunk,
                )
            self.unit_backward.drain(grads)
            if dpo_loss is not None:
                loss = dpo_loss
            self.ledger.release("grad_transient", charged[0])
        if u > 0:
            store.put((u, j), dx)  # replaces the input: the last block's output gradient
        return loss

    def _dpo_weights(
        self,
        us: UnitShard,
        params: dict[str, torch.Tensor],
        mb: MicroBatch,
        x_in: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """DPO (preference/objective.py): each row's log-probability from a graph-free chunked
        pass of the head over `x_in` (no more memory than the pass with a graph that follows),
        the pairs' loss added to the objective's sums; returns (each row's weight on its token
        losses, [rows, 1]; the pairs' loss sum). The weighted pass back-propagates them times
        the output gradient `head_grad` (loss scale / global pairs)."""
        assert self.dpo is not None and mb.ref_logps is not None, "DPO needs reference logps"
        self.runner.restore_rng(mb.rng[us.index])
        with self.runner.dropout(us, mb):
            sums = head_loss.row_sums(
                self.runner.head_fn(us, params, per_row=True),
                x_in,
                mb.labels,
                self.runner.vocab,
            )
        policy = self.dpo.logps(sums, mb.labels)
        loss, weights = self.dpo.pairs(policy, mb.ref_logps, mb.labels)
        return weights, loss

    def row_logps(
        self, us: UnitShard, params: dict[str, torch.Tensor], mb: MicroBatch, x: torch.Tensor
    ) -> torch.Tensor:
        """Each row's completion log-probability (`DpoObjective.logps`) of the head over `x`,
        without a graph: evaluation, the reference's pass."""
        assert self.dpo is not None
        with self.runner.dropout(us, mb):
            sums = head_loss.row_sums(
                self.runner.head_fn(us, params, per_row=True), x, mb.labels, self.runner.vocab
            )
        return self.dpo.logps(sums, mb.labels)
