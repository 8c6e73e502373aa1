"""Helpers shared by the engine tests: plans, data, a unit-by-unit single-process reference
(with the engine's per-sample dropout masks), and the parameter comparison."""

from __future__ import annotations

import math

import pytest
import torch

from cephalo.modeling.registry import build_model
from cephalo.modeling.units import IGNORE_INDEX
from cephalo.plan import Plan, RankPlan
from cephalo.runtime.dropout import SampleDropout
from cephalo.runtime.engine import EngineConfig
from cephalo.runtime.param_groups import wants_weight_decay

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


def make_plan(batches, fractions, micro, seq_len=16, dtype="fp32", offload=False, model="gpt-tiny") -> Plan:
    ranks = [
        RankPlan(i, "cpu", b, m, math.ceil(b / m), f, offload_activations=offload)
        for i, (b, f, m) in enumerate(zip(batches, fractions, micro, strict=True))
    ]
    return Plan("manual", model, seq_len, sum(batches), dtype, ranks)


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


def reference_train(model_name: str, overrides: dict, data, cfg: EngineConfig, lr: float = LR):
    """One process, whole global batch, torch.optim.AdamW + clip_grad_norm_; the units run
    in order under the same per-sample dropout masks as the engine. Returns (params by
    `<unit>.<param>`, per-step losses, per-step grad norms)."""
    model = build_model(model_name, **overrides).materialize("cpu", torch.Generator().manual_seed(cfg.seed))
    named = [(f"{u}.{n}", p) for u, n, p in model.named_unit_parameters()]
    decay = [p for n, p in named if wants_weight_decay(n, p)]
    no_decay = [p for n, p in named if not wants_weight_decay(n, p)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=cfg.betas, eps=cfg.eps,
    )
    model.train()
    losses, norms = [], []
    for step, (x, y) in enumerate(data):
        h = x
        for i, unit in enumerate(model.units):
            with SampleDropout(cfg.seed, step, i, 0):
                h = unit.module(h, y) if unit.kind == "head" else unit.module(h)
        loss = h / (y != IGNORE_INDEX).sum()
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_([p for _, p in named], cfg.grad_clip if cfg.grad_clip else math.inf)
        opt.step()
        losses.append(loss.item())
        norms.append(norm.item())
    return {n: p.detach().clone() for n, p in named}, losses, norms


def max_rel_diff(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, str]:
    """max over tensors of max|a - b| / max|b| (and the worst tensor's name)."""
    assert set(ours) == set(ref), set(ours) ^ set(ref)
    worst, name = 0.0, ""
    for k, b in ref.items():
        d = ((ours[k] - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()
        if d > worst:
            worst, name = d, k
    return worst, name
