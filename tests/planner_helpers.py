"""Synthetic models, devices and profiles for the cost-model and planner tests (small enough to reason about by hand)."""

from __future__ import annotations

from dataclasses import dataclass

from cephalo.costmodel.model import CostModel
from cephalo.specs.model import ModelSpec
from cephalo.specs.profile import CommProfile, Curve, DeviceProfile, UnitProfile


@dataclass
class FakeDevice:
    """Stands in for `cephalo.specs.cluster.Device`: the cost model reads only these two fields."""

    type_key: str
    memory_bytes: int


def tiny_model(tied: bool = False) -> ModelSpec:
    """2 blocks of 100 params, embedding 50, head 20: P = 270 (hidden 4, vocab 10)."""
    return ModelSpec(
        name="tiny",
        arch="gpt",
        num_layers=2,
        hidden_size=4,
        num_heads=1,
        vocab_size=10,
        ffn_hidden_size=16,
        params_per_block=100,
        embedding_params=50,
        head_params=20,
        tied_embeddings=tied,
    )


def linear_profile(
    key: str,
    fwd_per_sample: float,
    bwd_per_sample: float,
    act_per_sample: float,
    optimizer_s_per_param: float,
    host_bytes_per_s: float = 1e12,
    memory_bytes: int = 10**6,
    fwd_intercept: float = 0.0,
    bwd_intercept: float = 0.0,
    head_act_per_sample: float = 0.0,
    upto: int = 64,
) -> DeviceProfile:
    """Every unit kind runs at the same lines; the head's activation curve is `head_act_per_sample` x m."""
    unit = UnitProfile(
        Curve.linear(fwd_per_sample, fwd_intercept, upto),
        Curve.linear(bwd_per_sample, bwd_intercept, upto),
        Curve.linear(act_per_sample, 0.0, upto),
    )
    head = UnitProfile(unit.fwd_s, unit.bwd_s, Curve.linear(head_act_per_sample, 0.0, upto))
    return DeviceProfile(
        key,
        memory_bytes,
        {"embedding": unit, "block": unit, "head": head},
        optimizer_s_per_param,
        host_bytes_per_s,
        source="synthetic",
    )


def cost_model(
    devices: list[FakeDevice],
    profiles: dict[str, DeviceProfile],
    model: ModelSpec | None = None,
    seq_len: int = 3,
    dtype: str = "fp16",
    bytes_per_s: float = 1e12,
    latency_s: float = 0.0,
    reserve_bytes: int = 0,
    padded_collectives: bool = False,
    fuse_tail: bool = True,
) -> CostModel:
    return CostModel(
        model or tiny_model(),
        seq_len,
        dtype,
        devices,
        profiles,
        CommProfile(bytes_per_s=bytes_per_s, latency_s=latency_s),
        reserve_bytes=reserve_bytes,
        padded_collectives=padded_collectives,
        fuse_tail=fuse_tail,
    )
