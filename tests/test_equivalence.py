"""The equivalence helper (tests/equivalence.py) against the next machine and against bugs.

- Another CPU: the engine run with every matrix product summed in another order (each GEMM's
  inner dimension cut in chunks added last-first, forward and backward: what another BLAS
  kernel does) and two intra-op threads still passes against the noise floor measured with
  the plain kernels on one thread.
- A bug: the same engine with one gradient element moved by 1e-3 of its shard's largest
  entry at every step fails, and by far (the other kinds of comparison have their mutation
  test beside their equivalence test: FSDP2 and the uneven reference in test_engine_dist,
  transformers in test_hf_dist, peft in test_lora, host state in test_host_state, plan
  invariance in test_plan_invariance).

Why not "1e-3 of the element's own value": AdamW's update m / (sqrt(v) + eps) does not change
when one element's gradient is multiplied by a constant at every step (m and sqrt(v) scale
alike; only eps notices, at 1e-5 of the update). Measured on gpt-tiny: that mutation moves the
parameters by 1.1-1.5 x the noise, within any honest bound. A shift of 1e-3 of the tensor's
scale is what a wrong summand in a reduction does, and AdamW carries it into the update.
"""

from __future__ import annotations

import pytest
import torch

from cephalo.modeling.registry import build_model
from cephalo.runtime.collectives.comm import LocalComm
from cephalo.runtime.engine.engine import Engine, EngineConfig
from cephalo.runtime.state.adamw import AdamWHyper
from engine_common import (
    LR,
    TEST_EPS,
    gradient_mutation,
    make_data,
    make_plan,
    one_thread,
    reference_floor,
)
from equivalence import (
    FP32_FLOOR,
    K,
    NoiseFloor,
    ReorderedGemm,
    Trajectory,
    perturb_one_gradient,
)

__all__ = ["one_thread"]


CFG = EngineConfig(grad_clip=0.5, adamw=AdamWHyper(eps=TEST_EPS, weight_decay=0.1))


def _engine(data, micro: int, reorder: bool = False, threads: int = 1) -> Trajectory:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    mode = ReorderedGemm(chunks=3) if reorder else None
    try:
        engine = Engine(
            build_model("gpt-tiny", dropout=0.1), make_plan([6], [1.0], [micro]), LocalComm(), CFG
        )
        if mode is not None:
            with mode:
                stats = [engine.train_step(x, y, lr=LR) for x, y in data]
            assert mode.calls > 0, "the reordering must have applied"
        else:
            stats = [engine.train_step(x, y, lr=LR) for x, y in data]
        return Trajectory(
            [s.loss for s in stats], [s.grad_norm for s in stats], engine.full_state_dict()
        )
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def floor_and_data():
    data = make_data(5, 6)
    return reference_floor("gpt-tiny", {"dropout": 0.1}, data, CFG), data


def test_reordered_gemms_and_threads_pass_the_derived_bound(floor_and_data):
    """Another machine's kernels, emulated: the bound derived on this one still holds."""
    floor, data = floor_and_data
    plain = _engine(data, micro=2)
    other = _engine(data, micro=3, reorder=True, threads=2)
    floor.check_run("plain kernels", plain)
    floor.check_run("reordered GEMMs, 2 threads", other)
    # and the reordering is real: the two engine runs are not bitwise equal
    assert any(not torch.equal(plain.params[n], other.params[n]) for n in plain.params)


def test_one_wrong_gradient_element_fails_the_bound(floor_and_data):
    """The mutation lands far beyond the bound (the bound is not so loose that bugs pass)."""
    floor, data = floor_and_data
    with gradient_mutation():
        mutated = _engine(data, micro=2)
    bad = floor.violations(mutated.params, mutated.losses, mutated.grad_norms)
    assert bad, "one gradient element moved by 1e-3 of its tensor's scale must fail"
    assert bad[0][0] > 10, f"the mutation must land far beyond the bound: {bad[0]}"
    with pytest.raises(AssertionError, match="beyond"):
        floor.check_run("mutated", mutated)


def test_noise_floor_arithmetic():
    """The bound is K x the worst variant's distance from the truth, plus FP32_FLOOR."""
    f64 = torch.float64
    truth = Trajectory([2.0], [1.0], {"w": torch.tensor([1.0, -2.0], dtype=f64)})
    near = Trajectory([2.0 + 2e-6], [1.0], {"w": torch.tensor([1.0, -2.0 + 2e-6], dtype=f64)})
    nearer = Trajectory([2.0 - 1e-6], [1.0], {"w": torch.tensor([1.0 + 1e-6, -2.0], dtype=f64)})
    floor = NoiseFloor.measure(truth, [near, nearer])
    assert floor.param_noise["w"] == pytest.approx(1e-6, rel=1e-3)
    assert floor.loss_noise[0] == pytest.approx(1e-6, rel=1e-3)
    ok = {"w": torch.tensor([1.0, -2.0 + 2 * (K - 0.5) * 1e-6], dtype=torch.float64)}
    floor.check(params=ok, losses=[2.0 + 2 * (K - 0.5) * 1e-6])
    bad = {"w": torch.tensor([1.0, -2.0 + 2 * (K + 0.5) * 1e-6], dtype=torch.float64)}
    with pytest.raises(AssertionError, match="w: distance"):
        floor.check(params=bad)
    # a perfect fp32 rounding of the truth always passes, even where the variants agree
    exact = NoiseFloor.measure(truth, [truth, truth])
    exact.check(params={"w": truth.params["w"] * (1 + FP32_FLOOR / 2)})
    with pytest.raises(ValueError, match="two"):
        NoiseFloor.measure(truth, [near])


def test_perturb_one_gradient_moves_one_element():
    g = torch.tensor([0.5, -2.0, 1.0, 0.25])
    before = g.clone()
    perturb_one_gradient(g)
    changed = (g != before).nonzero().flatten().tolist()
    assert changed == [2] and g[2].item() == pytest.approx(1.0 + 2e-3)
