"""Instrumented collective counts (comm.counters) per training step.

LGA: each unit is all-gathered once per pass (forward, backward) and reduce-scattered once
per step, whatever the number of micro-batches; the head and the last block once per step
(the head's loss and backward run in one pass, runtime/head_loss.py, and the last block
stays gathered from its forward to its backward; on a rank that fuses its tail,
costmodel/rules.py, its forward and backward run in the head's pass). Tied weights add, per step, one all-gather of the tied
parameter with the head and one reduce-scatter of its gradient (straight into the owner's
shard). Every step also does two all-reduces: the global token
count, then (squared grad norm, loss sum) together.

Standard mode runs the per-unit passes once per micro-batch: k times the gathers and the
reduce-scatters.
"""

from __future__ import annotations

import pytest

from cephalo.modeling.registry import build_model
from cephalo.runtime.collectives.comm import LocalComm
from cephalo.runtime.engine.engine import Engine, EngineConfig
from engine_common import LR, make_data, make_plan, one_thread

__all__ = ["one_thread"]


def _step_calls(
    model: str, overrides: dict, micro_batches: int, mode: str, fuse_tail: bool = True
) -> tuple[dict, int]:
    batch = 4
    plan = make_plan([batch], [1.0], [batch // micro_batches])
    comm = LocalComm()
    cfg = EngineConfig(mode=mode, fuse_tail=fuse_tail)
    engine = Engine(build_model(model, **overrides), plan, comm, cfg)
    (x, y), (x2, y2) = make_data(2, batch)
    engine.train_step(x, y, lr=LR)  # count a steady-state step, not the first
    comm.counters.reset()
    engine.train_step(x2, y2, lr=LR)
    return dict(comm.counters.calls), len(engine.shards)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_lga_collectives_do_not_grow_with_micro_batches(k):
    calls, units = _step_calls("gpt-tiny", {}, k, "lga")  # tied wte / lm_head
    assert calls == {"all_gather_v": 2 * units - 1, "reduce_scatter_v": units + 1, "all_reduce": 2}


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("fuse", [True, False])
def test_untied_model_has_exactly_one_gather_per_unit_per_pass(k, fuse):
    calls, units = _step_calls("gpt-tiny", {"tie_embeddings": False}, k, "lga", fuse)
    # fused or not, the last block stays gathered from its forward to its backward
    assert calls == {"all_gather_v": 2 * units - 2, "reduce_scatter_v": units, "all_reduce": 2}


@pytest.mark.parametrize("k", [1, 2, 4])
def test_standard_mode_collectives_grow_with_micro_batches(k):
    calls, units = _step_calls("gpt-tiny", {"tie_embeddings": False}, k, "standard")
    gathers = (2 * units - 1) * k
    assert calls == {"all_gather_v": gathers, "reduce_scatter_v": units * k, "all_reduce": 2}


@pytest.mark.parametrize("fuse", [True, False])
def test_leaves_made_once_per_unit_backward_and_dropped_before_release(fuse, monkeypatch):
    """Every micro-batch of a unit's backward drains through the same leaves
    (runtime/engine/unit_backward.py): one `LeafDrain` per unit per step, not per micro-batch,
    one drain of all its gradients together per unit and micro-batch, and no per-parameter
    hook (the tied embedding is untied here: a borrowed tied parameter keeps its own). The
    leaves view the gathered parameters, so they are dropped before those are released
    (`UnitGrads.done_with_leaves`): every unit's gradient reaches `start_reduces` without them."""
    import torch

    from cephalo.runtime.engine import unit_backward
    from cephalo.runtime.engine.unit_comm import UnitCollectives

    hooks, made, drained, leftover = [0], [0], [0], []
    register = torch.Tensor.register_post_accumulate_grad_hook

    def counting(self, hook):
        hooks[0] += 1
        return register(self, hook)

    class CountedDrain(unit_backward.LeafDrain):
        def __init__(self, *args, **kwargs):
            made[0] += 1
            super().__init__(*args, **kwargs)

    drain_together = unit_backward.drain_together

    def counted_drain(*args):
        drained[0] += 1
        return drain_together(*args)

    start = UnitCollectives.start_reduces

    def checking(self, us, grads):
        if grads.leaves is not None:
            leftover.append(us.index)
        return start(self, us, grads)

    monkeypatch.setattr(torch.Tensor, "register_post_accumulate_grad_hook", counting)
    monkeypatch.setattr(unit_backward, "LeafDrain", CountedDrain)
    monkeypatch.setattr(unit_backward, "drain_together", counted_drain)
    monkeypatch.setattr(UnitCollectives, "start_reduces", checking)
    k = 4
    plan = make_plan([4], [1.0], [1])  # 4 micro-batches
    model = build_model("gpt-tiny", tie_embeddings=False)
    units = len(model.units)
    engine = Engine(model, plan, LocalComm(), EngineConfig(fuse_tail=fuse))
    assert engine.fuse_tail == fuse
    (x, y), (x2, y2) = make_data(2, 4)
    engine.train_step(x, y, lr=LR)
    hooks[0] = made[0] = drained[0] = 0
    engine.train_step(x2, y2, lr=LR)
    assert (hooks[0], made[0], drained[0]) == (0, units, units * k)
    assert leftover == []
