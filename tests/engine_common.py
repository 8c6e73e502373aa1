"""Helpers shared by the engine tests: plans, data, the reference trainers of
tests/reference.py driven by an engine config, and the parameter comparison."""

from __future__ import annotations

import pytest
import torch

from cephalo.modeling.units import IGNORE_INDEX
from cephalo.planner.makers import manual_plan
from cephalo.planner.plan import Plan
from cephalo.runtime.engine.engine import EngineConfig
from reference import OptimConfig, model_factory, train_reference

# AdamW eps for the equivalence tests. Some gradients are exactly zero in exact arithmetic
# (the attention key bias: softmax is shift-invariant) and come out as ~1e-10 rounding noise
# whose sign depends on summation order; with eps=1e-8 Adam's normalisation turns that noise
# into lr-sized steps, so two correct implementations drift apart by ~lr on those elements.
# eps=1e-6 keeps real gradients (>= 1e-4 here) dominant and the noise harmless.
TEST_EPS = 1e-6
LR = 1e-3


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models on a shared 2-core machine: intra-op threads only add contention (a
    step takes 50x longer with 2 threads under load). Import this into a test module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_plan(
    batches, fractions, micro, seq_len=16, dtype="fp32", offload=False, model="gpt-tiny"
) -> Plan:
    return manual_plan(model, seq_len, batches, micro, fractions, offload=offload, dtype=dtype)


def make_data(steps: int, batch: int, seq_len: int = 16, vocab: int = 256, seed: int = 1):
    """`steps` global batches (input_ids, labels) with some ignored labels."""
    g = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(steps):
        x = torch.randint(0, vocab, (batch, seq_len), generator=g)
        y = torch.randint(0, vocab, (batch, seq_len), generator=g)
        y[:, :3] = IGNORE_INDEX
        data.append((x, y))
    return data


def rank_slice(plan: Plan, rank: int, x: torch.Tensor) -> torch.Tensor:
    start = plan.batch_offsets()[rank]
    return x[start : start + plan.ranks[rank].batch_size]


def optim_config(cfg: EngineConfig, lr: float = LR) -> OptimConfig:
    """The reference trainers' settings for an engine config."""
    return OptimConfig(
        lr=lr,
        betas=cfg.adamw.betas,
        eps=cfg.adamw.eps,
        weight_decay=cfg.adamw.weight_decay,
        grad_clip=cfg.grad_clip,
        seed=cfg.seed,
    )


def run_reference(model: str, overrides: dict, data, cfg: EngineConfig):
    """`train_reference` (one process, whole global batch) for an engine config."""
    return train_reference(model_factory(model, cfg.seed, **overrides), data, optim_config(cfg))


def max_rel_diff(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, str]:
    """max over tensors of max|a - b| / max|b| (and the worst tensor's name)."""
    assert set(ours) == set(ref), set(ours) ^ set(ref)
    worst, name = 0.0, ""
    for k, b in ref.items():
        d = ((ours[k] - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()
        if d > worst:
            worst, name = d, k
    return worst, name
