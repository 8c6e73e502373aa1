"""The reference trainers agree: FSDP2 on 2 gloo ranks == one process on the whole batch."""

from __future__ import annotations

import functools

import pytest
import torch

from cephalo.modeling.units import IGNORE_INDEX
from dist_harness import dist_pool_fixture
from engine_common import measure_floor
from reference import OptimConfig, model_factory, train_fsdp2, train_reference

pool2 = dist_pool_fixture(2, timeout_s=120)


def _batches(steps: int, batch: int, seq_len: int, vocab: int = 256, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randint(0, vocab, (batch, seq_len), generator=g)
        y = torch.randint(0, vocab, (batch, seq_len), generator=g)
        y[: batch // 2, :5] = IGNORE_INDEX  # uneven token counts across ranks
        out.append((x, y))
    return out


def _max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-12)).item() for k in b)


def test_reference_trains_and_is_deterministic():
    factory = model_factory("gpt-tiny", seed=0, seq_len=16)
    data = _batches(1, 4, 16) * 6  # one batch, repeated: the loss must fall
    cfg = OptimConfig(lr=3e-3, eps=1e-6)
    first, second = train_reference(factory, data, cfg), train_reference(factory, data, cfg)
    assert first.losses == second.losses and len(first.losses) == 6
    assert first.losses[-1] < first.losses[0] - 0.05
    assert first.params.keys() == second.params.keys()
    assert all(torch.equal(first.params[k], second.params[k]) for k in first.params)
    # names follow the engine's `<unit>.<param>` and the tied embedding appears once
    assert all(k.split(".")[0] in {"embedding", "head", "blocks"} for k in first.params)
    assert len(first.params) == len({id(p) for p in factory().parameters()})


@pytest.mark.slow
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_fsdp2_matches_single_process(pool2, dropout):
    factory = model_factory("gpt-tiny", seed=0, seq_len=16, dropout=dropout)
    data = _batches(3, 6, 16)
    # Adam's eps: gradients that are ~0 in exact arithmetic come out as rounding noise whose
    # size depends on the summation order (FSDP2 sums two partial gradients); with a tiny
    # eps Adam turns that noise into lr-sized steps (measured: 1.8e-5 max relative difference
    # after 3 steps with eps=1e-6, 5.9e-6 with eps=1e-4). The grad norms catch scale errors.
    cfg = OptimConfig(lr=[1e-3, 2e-3, 1e-3], eps=1e-4, grad_clip=0.5, seed=7)
    floor = measure_floor(functools.partial(train_reference, factory, data, cfg), 6)
    ref = floor.variants[0]  # fp32, the whole batch
    runs = pool2.run(train_fsdp2, factory, data, cfg, [4, 2])
    for run in runs:
        floor.check_run("FSDP2 on 2 ranks", run)
    if dropout:  # the masks really act (and differ from no dropout)
        plain = train_reference(model_factory("gpt-tiny", seed=0, seq_len=16), data, cfg)
        assert abs(plain.losses[0] - ref.losses[0]) > 1e-3
    # and training moved the parameters by much more than the noise
    assert _max_rel_diff(factory_params(factory), ref.params) > 1e-3
    assert max(floor.param_noise.values()) < 1e-4


def factory_params(factory) -> dict[str, torch.Tensor]:
    from reference import named_unit_params

    return {name: p.detach().clone() for name, p in named_unit_params(factory())}
