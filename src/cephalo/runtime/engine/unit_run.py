"""Running one unit on gathered parameters (`UnitRunner`): its module bound to the gathered
views (runtime/bind.py), the per-sample dropout around the units that can drop anything
(runtime/dropout.py), the head's chunked loss (runtime/head_loss.py), and the random
generator states a recompute replays."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from cephalo.modeling.lora import adapters_off
from cephalo.modeling.units import UnitModel, position_kwargs
from cephalo.runtime import head_loss
from cephalo.runtime.bind import UnitBinding
from cephalo.runtime.boundary import BoundaryStore
from cephalo.runtime.capture.blocks import CompiledBlocks
from cephalo.runtime.dropout import SampleDropout, module_uses_dropout
from cephalo.runtime.state.unit_shard import MicroBatch, UnitShard

RngState = tuple[torch.Tensor, torch.Tensor | None]
"""The CPU generator's state and the device's CUDA generator's (None: not on CUDA)."""


class UnitRunner:
    """Runs units of `model` on gathered parameters. Owns each unit's binding (found once),
    the set of units that run under `SampleDropout`, and the step index that keys the dropout
    masks (`step_index`, counted by the engine). Given the model, the compute device, the
    dropout seed and whether per-sample dropout is on (`EngineConfig`)."""

    def __init__(self, model: UnitModel, device: torch.device, seed: int, per_sample_dropout: bool):
        self.model = model
        self.device = device
        self.seed = seed
        self.per_sample_dropout = per_sample_dropout
        self.vocab = model.spec.vocab_size
        self.step_index = 0
        """Train steps run (including fp16-skipped ones): keys the dropout masks."""
        self._dropout_units = {
            i for i, u in enumerate(model.units) if module_uses_dropout(u.module)
        }
        """Units that can drop anything: only they run under `SampleDropout`."""
        self._bindings: dict[int, UnitBinding] = {}
        """Each unit's parameter slots, found once (runtime/bind.py)."""
        self.compiled: CompiledBlocks | None = None
        """The blocks' compiled callables (`parallel.compile`: runtime/capture/apply.py's
        `apply_compile`); None: every unit runs eagerly."""

    def run(
        self, us: UnitShard, params: dict[str, torch.Tensor], x: torch.Tensor, mb: MicroBatch
    ) -> torch.Tensor:
        """Unit `us` on input `x` of micro-batch `mb` (the head: its loss sum)."""
        dropout = self.dropout(us, mb)
        if us.unit.kind == "block" and self.compiled is not None:  # runtime/capture/
            kwargs = position_kwargs(self.model, mb.position_ids)
            masks = dropout if isinstance(dropout, SampleDropout) else None
            return self.compiled.run(us.index, self.binding(us), params, x, kwargs, masks)
        with dropout:
            if us.unit.kind != "head":
                kwargs = position_kwargs(self.model, mb.position_ids)
                return self.binding(us)(params, (x,), kwargs)
            return head_loss.loss(self.head_fn(us, params), x, mb.labels, self.vocab)

    def binding(self, us: UnitShard) -> UnitBinding:
        binding = self._bindings.get(us.index)
        if binding is None:
            binding = self._bindings[us.index] = UnitBinding(us.unit.module)
        return binding

    def head_fn(
        self,
        us: UnitShard,
        params: dict[str, torch.Tensor],
        row_weights: torch.Tensor | None = None,
        per_row: bool = False,
    ) -> head_loss.RunHead:
        """The head on `params` as runtime/head_loss.py runs it, chunk by chunk: the token
        loss sum, weighted per row by `row_weights` ([m, 1], the DPO objective's gradient), or
        `per_row` each row's sum (`modeling.units.LMHead.forward`)."""
        if row_weights is None and not per_row:
            return lambda h, labels: self.binding(us)(params, (h, labels))
        kwargs = {"row_weights": row_weights, "per_row": per_row}
        return lambda h, labels: self.binding(us)(params, (h, labels), kwargs)

    @contextlib.contextmanager
    def reference(self, us: UnitShard) -> Iterator[None]:
        """Inside: unit `us` is the DPO reference under LoRA, the frozen base with its
        adapters off (`modeling.lora.adapters_off`: no second model in memory), in eval mode
        (no dropout: the reference is a fixed function of the data, as TRL's precomputed one
        is)."""
        module = us.unit.module
        was = module.training
        with adapters_off(module):
            module.train(False)
            try:
                yield
            finally:
                module.train(was)

    def dropout(self, us: UnitShard, mb: MicroBatch) -> contextlib.AbstractContextManager:
        if not (
            self.per_sample_dropout and self.model.training and us.index in self._dropout_units
        ):
            return contextlib.nullcontext()
        return SampleDropout(self.seed, self.step_index, us.index, mb.sample_offset)

    def save_rng(self) -> RngState:
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return torch.get_rng_state(), cuda

    def restore_rng(self, state: RngState) -> None:
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], self.device)

    @staticmethod
    def unit_input(
        store: BoundaryStore, u: int, j: int, mb: MicroBatch
    ) -> contextlib.AbstractContextManager[torch.Tensor]:
        """Unit u's input for micro-batch j: the token ids for the embedding, else the stored
        boundary."""
        return contextlib.nullcontext(mb.input_ids) if u == 0 else store.loaded((u, j))
