"""Flat layouts, uneven shard ranges, per-sample dropout, sharded AdamW, loss scaler."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cephalo.errors import CephaloError
from cephalo.runtime.dropout import SampleDropout
from cephalo.runtime.state.adamw import AdamWHyper, ShardedAdamW, ShardGroup
from cephalo.runtime.state.flat import FlatLayout, overlap, shard_ranges
from cephalo.runtime.state.precision import DynamicLossScaler, compute_dtype


@given(
    numel=st.integers(0, 10_000),
    fractions=st.lists(st.floats(0.0, 1.0, allow_nan=False), min_size=1, max_size=8).filter(
        lambda f: sum(f) > 1e-6
    ),
)
@settings(max_examples=200, deadline=None)
def test_shard_ranges_cover_exactly_and_follow_fractions(numel, fractions):
    ranges = shard_ranges(numel, fractions)
    assert len(ranges) == len(fractions)
    start = 0
    for (s, n), f in zip(ranges, fractions, strict=True):
        assert s == start and n >= 0
        # largest remainder: within one element of the ideal share
        assert abs(n - numel * f / sum(fractions)) < 1.0 + 1e-9
        start += n
    assert start == numel


def test_shard_ranges_examples_and_errors():
    assert shard_ranges(10, [0.6, 0.3, 0.1]) == [(0, 6), (6, 3), (9, 1)]
    assert shard_ranges(10, [1, 1, 1]) == [(0, 4), (4, 3), (7, 3)]  # tie -> lower rank
    assert shard_ranges(5, [0.0, 1.0]) == [(0, 0), (0, 5)]
    with pytest.raises(CephaloError, match="sum to 0"):
        shard_ranges(5, [0.0, 0.0])
    with pytest.raises(CephaloError, match=">= 0"):
        shard_ranges(5, [-0.5, 1.5])


def test_flat_layout_views_and_segments():
    params = [("w", torch.zeros(2, 3)), ("b", torch.zeros(3)), ("g", torch.zeros(4))]
    layout = FlatLayout("u", params)
    assert layout.numel == 13
    assert [(s.name, s.offset, s.numel) for s in layout.slots] == [
        ("w", 0, 6),
        ("b", 6, 3),
        ("g", 9, 4),
    ]
    flat = torch.arange(13.0)
    views = layout.views(flat)
    assert views["w"].shape == (2, 3) and views["b"].tolist() == [6.0, 7.0, 8.0]
    views["g"].fill_(-1)  # views write through
    assert flat[9:].tolist() == [-1.0] * 4
    back = layout.flatten({"w": torch.ones(2, 3), "b": torch.full((3,), 2.0), "g": torch.zeros(4)})
    assert back.tolist() == [1.0] * 6 + [2.0] * 3 + [0.0] * 4
    # decay on w and g; shard [4, 11) -> w covers [4, 6), g covers [9, 11) -> relative (0,2), (5,7)
    assert layout.segments_where([True, False, True], 4, 7) == [(0, 2), (5, 7)]
    assert layout.segments_where([True, True, True], 4, 7) == [(0, 7)]  # merged
    assert overlap(0, 5, 5, 3) == (5, 5)
    with pytest.raises(CephaloError, match="layout needs 13"):
        layout.views(torch.zeros(12))


def test_sharded_adamw_matches_torch_adamw():
    torch.manual_seed(0)
    w = torch.randn(5, 4)
    b = torch.randn(7)
    ref = [torch.nn.Parameter(w.clone()), torch.nn.Parameter(b.clone())]
    opt_ref = torch.optim.AdamW(
        [{"params": [ref[0]], "weight_decay": 0.1}, {"params": [ref[1]], "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    layout = FlatLayout("u", [("w", w), ("b", b)])
    flat = layout.flatten({"w": w, "b": b})
    # two "ranks" with shards [0, 17) and [17, 27): the second straddles nothing, the first both
    groups = []
    for start, size in shard_ranges(layout.numel, [0.63, 0.37]):
        groups.append(
            ShardGroup(
                flat[start : start + size].clone(),
                torch.zeros(size),
                torch.zeros(size),
                torch.zeros(size),
                layout.segments_where([True, False], start, size),
            )
        )
    opt = ShardedAdamW(groups, AdamWHyper(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1))
    for step in range(4):
        grads = [torch.randn(5, 4), torch.randn(7)]
        for p, g in zip(ref, grads, strict=True):
            p.grad = g.clone()
        opt_ref.step()
        gflat = layout.flatten({"w": grads[0], "b": grads[1]})
        for grp, (start, size) in zip(
            groups, shard_ranges(layout.numel, [0.63, 0.37]), strict=True
        ):
            grp.grad.copy_(gflat[start : start + size])
        opt.step(lr=1e-2)
        assert opt.step_count == step + 1
    ours = torch.cat([g.param for g in groups])
    theirs = layout.flatten({"w": ref[0], "b": ref[1]})
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-7), (ours - theirs).abs().max()


def test_loss_scaler_backs_off_and_grows():
    s = DynamicLossScaler(scale=8.0, growth_interval=2)
    s.update(found_inf=True)
    assert s.scale == 4.0
    s.update(False)
    s.update(False)
    assert s.scale == 8.0
    s2 = DynamicLossScaler()
    s2.load_state_dict(s.state_dict())
    assert s2.scale == 8.0
    assert compute_dtype("bf16") is torch.bfloat16
    with pytest.raises(CephaloError, match="not one of"):
        compute_dtype("fp8")


def test_sample_dropout_is_per_sample_and_replayable():
    x = torch.ones(4, 8, 16)
    with SampleDropout(seed=1, step=3, unit=2, sample_offset=0):
        whole = torch.nn.functional.dropout(x, 0.5)
    with SampleDropout(seed=1, step=3, unit=2, sample_offset=2):
        tail = torch.nn.functional.dropout(x[2:], 0.5)
    assert torch.equal(whole[2:], tail)  # same masks whatever the grouping
    assert not torch.equal(whole[0], whole[1])  # samples differ
    assert set(whole.unique().tolist()) == {0.0, 2.0}
    with SampleDropout(seed=1, step=4, unit=2, sample_offset=0):
        other_step = torch.nn.functional.dropout(x, 0.5)
    assert not torch.equal(whole, other_step)
    # SDPA with dropout goes through the same masks; without dropout it is untouched
    q = torch.randn(2, 2, 5, 4)
    with SampleDropout(0, 0, 0, 0):
        a = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        d1 = torch.nn.functional.scaled_dot_product_attention(
            q, q, q, dropout_p=0.3, is_causal=True
        )
    with SampleDropout(0, 0, 0, 1):
        d2 = torch.nn.functional.scaled_dot_product_attention(
            q[1:], q[1:], q[1:], dropout_p=0.3, is_causal=True
        )
    assert torch.allclose(
        a, torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    )
    assert torch.allclose(d1[1:], d2) and not torch.allclose(d1, a)
