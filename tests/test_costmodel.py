"""The cost model's formulas on cases small enough to compute by hand (see each test's arithmetic)."""

import math
from dataclasses import replace

import numpy as np
import pytest

from cephalo import CephaloError, Plan, RankPlan
from planner_helpers import FakeDevice, cost_model, linear_profile, tiny_model

# tiny model: embedding 50, 2 blocks of 100, head 20 params -> P = 270; seq 3, hidden 4, vocab 10, fp16
# F(m) = 1.0 m, B(m) = 2.0 m seconds; activation 1000 m bytes (embedding, block), head curve 0
# two devices, link 100 B/s, latency 0.5 s -> ring factor (n-1)/n = 1/2
#   gather (fp16) / reduce-scatter (fp32):
#   embedding  0.5*50*2/100 + 0.5 = 1.0    0.5*50*4/100 + 0.5 = 1.5
#   block      0.5*100*2/100 + 0.5 = 1.5   0.5*100*4/100 + 0.5 = 2.5
#   head       0.5*20*2/100 + 0.5 = 0.7    0.5*20*4/100 + 0.5 = 0.9
# the gathers overlap compute (prefetch), each reduce-scatter the next unit's backward; the
# embedding's, the last of the backward, is exposed: + 1.5 per step
# These cases keep the unfused order (`fuse_tail=False`); the fused tail has its own test.


def _cm(host_bytes_per_s=1e12, tied=False, async_copies=True, fuse_tail=False):
    prof = linear_profile(
        "x", 1.0, 2.0, 1000.0, optimizer_s_per_param=0.01, host_bytes_per_s=host_bytes_per_s
    )
    prof.async_copies = async_copies
    devs = [FakeDevice("x", 10_000), FakeDevice("x", 10_000)]
    return cost_model(
        devs,
        {"x": prof},
        model=tiny_model(tied),
        bytes_per_s=100.0,
        latency_s=0.5,
        reserve_bytes=100,
        fuse_tail=fuse_tail,
    )


def test_compute_bound_time_and_memory():
    # b=5, m=2: k=3 micro-batches (2, 2, 1). per unit fwd = 2*2 + 1 = 5, bwd = 5 (recompute) + 2*4 + 2 = 15;
    # the head has no recompute (loss and backward in one pass): bwd 10; compute beats every
    # collective, so 3 units x (5 + 15) + (5 + 10) = 75, + the last reduce-scatter 1.5;
    # optimizer 0.5 * 270 * 0.01 = 1.35
    c = _cm().rank_cost(0, batch_size=5, micro_batch_size=2, state_fraction=0.5)
    assert c.step_s == pytest.approx(75 + 1.5 + 1.35)
    assert c.compute_s == pytest.approx(75.0)
    assert c.optimizer_s == pytest.approx(1.35)
    assert c.host_copy_s == 0.0
    # the peak is the largest of the step's phases (boundary 3*4*2 = 24 bytes per sample, act
    # 1000 per sample, logits 3*10*4 = 120 per sample), without the state and the s-part:
    #   head backward:     gathered (20 + 100)*2 + grads 20*4 + logits 2*120 + 3 x 5 boundaries 360 = 920
    #   last block:        (100 + 100)*2 + (100 + 20)*4 + act 2000 + 3 x 5 x 24 = 3240
    #   block before it:   (100 + 50)*2 + (100 + 100)*4 + act 2000 + 2 x 5 x 24 = 3340  <- peak
    #   embedding:         50*2 + (50 + 100)*4 + act 2000 + 1 x 5 x 24 = 2820
    #   end of forward:    (20 + 100)*2 + 360 = 600
    # state 0.5*270*16 = 2160; grad accum 800 + the reduce-scatter output 0.5 * 100 * 4 = 1000;
    # reserve 100
    m = c.memory
    assert (m.state, m.gathered, m.grad_accum, m.activations, m.boundary, m.logits, m.reserve) == (
        2160,
        300,
        1000,
        2000,
        240,
        0,
        100,
    )
    assert c.peak_bytes == 5800 and c.fits
    # what grows with the fraction: the state and the reduce-scatter output
    cm = _cm()
    assert cm.bytes_per_fraction == 270 * 16 + 100 * 4
    assert cm.fraction_bytes(0.5) == m.state + 200


def test_collectives_overlap_compute_but_the_last_reduce_scatter():
    # b=1, m=1: fwd 1, bwd 1 + 2 = 3; per unit max(compute, gather) forward, max(compute,
    # gather + scatter) backward (one process group: its collectives run one after another,
    # NCCL's one stream per communicator): embedding max(1, 1.0) + max(3, 1.0 + 1.5) = 4;
    # blocks max(1, 1.5) + max(3, 1.5 + 2.5) = 5.5, the last one kept gathered (no second
    # gather) max(1, 1.5) + max(3, 2.5) = 4.5; head (no recompute, no second gather: bwd 2)
    # max(1, .7) + max(2, .9) = 3; + the embedding's reduce-scatter 1.5
    c = _cm().rank_cost(0, 1, 1, 0.0)
    assert c.step_s == pytest.approx(4 + 5.5 + 4.5 + 3 + 1.5)
    assert c.comm_s == pytest.approx(3.5 + 2 * 5.5 + 2.3)
    # a slow link (10 B/s): gather / scatter embedding 5.5 / 10.5, block 10.5 / 20.5, head 2.5 / 4.5;
    # embedding 5.5 + 16, blocks 10.5 + 31 and (kept) 10.5 + 20.5, head 2.5 + 2 (the first
    # unit of the backward hides no reduce-scatter: its own runs beside the next), + 10.5
    prof = linear_profile("x", 1.0, 2.0, 1000.0, optimizer_s_per_param=0.0)
    slow = cost_model(
        [FakeDevice("x", 10_000), FakeDevice("x", 10_000)],
        {"x": prof},
        model=tiny_model(False),
        bytes_per_s=10.0,
        latency_s=0.5,
    )
    assert slow.rank_cost(0, 1, 1, 0.0).step_s == pytest.approx(21.5 + 41.5 + 31 + 4.5 + 10.5)
    # the rule is the sum of one queue's collectives, not the max of the three: the max would
    # hide the block's 10.5 s gather under its 20.5 s reduce-scatter
    assert slow.rank_cost(0, 1, 1, 0.0).step_s > 16 + 62 + 7 + 10.5


def test_rank_without_samples_pays_collectives_and_needs_no_activations():
    c = _cm().rank_cost(1, 0, 1, 0.25)
    # comm only: per unit a gather, then gather + scatter (one queue): embedding 1.0 + 2.5,
    # blocks 1.5 + 4.0 and (kept gathered) 1.5 + 2.5, head .7 (its scatter runs beside the
    # next unit's backward), + the last scatter 1.5 = 15.2; optimizer 0.25 * 270 * 0.01 = 0.675
    assert c.step_s == pytest.approx(15.2 + 0.675)
    assert c.memory.activations == c.memory.boundary == c.memory.logits == 0
    assert c.memory.state == 1080


def test_offload_moves_boundaries_to_host_and_costs_copies():
    cm = _cm(host_bytes_per_s=1.0)
    c = cm.rank_cost(0, 5, 2, 0.0, offload=True)
    # one boundary of 5 samples = 5*24 = 120 bytes at 1 B/s = 120 s per copy, dominating compute.
    # The copies are one queue beside compute and collectives: the compute waits for a read of
    # its input at once, for a read of its output gradient after its recompute (fwd 5).
    # embedding: fwd max(5, 1, write 120) = 120; bwd max(15 + (120 - 5), 1 + 1.5, read 120) = 130;
    # each block: fwd max(5 + read 120, 1.5, read + write 240) = 240; bwd max(15 + 120 + 115,
    # 1.5 + 2.5, two reads + a write 360) = 360; head: fwd max(5 + 120, .7, 120) = 125, bwd
    # max(10 + 120, .9, read + write 240) = 240; + the last scatter 1.5
    assert c.step_s == pytest.approx(250 + 2 * 600 + 365 + 1.5)
    # (L + 1) = 3 boundaries written in forward and 3 in backward; 3 inputs read back in
    # forward, 3 inputs and 3 output gradients in backward
    assert c.host_copy_s == pytest.approx(15 * 120)
    # on the device only a block backward's two staging buffers (its input and its output
    # gradient) of one micro-batch: 2 x 2 * 24, at the peak (the block before the last)
    assert c.memory.boundary == 96
    on_device = cm.rank_cost(0, 5, 2, 0.0, offload=False)
    # there: the inputs of units 1..1 and the output gradients at 2, of all 5 samples
    assert on_device.memory.boundary == 2 * 5 * 24
    assert on_device.step_s == pytest.approx(75 + 1.5)  # the head: no recompute


def test_copies_without_async_copies_add_to_compute():
    # a CPU copies on its compute thread: per pass max(compute + copy, collective), and the
    # copies are the staging reads only (fwd: blocks and head 1; bwd: embedding 1, blocks 2, head 1)
    c = _cm(host_bytes_per_s=1.0, async_copies=False).rank_cost(0, 5, 2, 0.0, offload=True)
    # copy 120 s; embedding 5 + (15 + 120); blocks 2 x ((5 + 120) + (15 + 240)); head (5 + 120) +
    # (10 + 120) (no recompute); + the last scatter 1.5
    assert c.step_s == pytest.approx(140 + 760 + 255 + 1.5)
    assert c.host_copy_s == pytest.approx(9 * 120)
    assert c.compute_s == pytest.approx(75 + 9 * 120)
    # small copies: with async copies the writes and the output gradients' reads (beside the
    # recompute) are hidden, only the inputs' reads hold the compute; without, all add up.
    # b=1, m=1, copy 24 B at 24 B/s = 1 s; fwd 1, bwd 3; collectives as in the gather/scatter
    # test (18.5 without offload): embedding 1 + 3 as there; blocks fwd max(1 + 1, 1.5, 2) = 2,
    # bwd max(3 + 1, 1.5 + 2.5, 3) = 4 and (kept) max(3 + 1, 2.5, 3) = 4; head fwd
    # max(1 + 1, .7, 1) = 2, bwd max(2 + 1, .9, 2) = 3; + 1.5
    hidden = _cm(host_bytes_per_s=24.0).rank_cost(0, 1, 1, 0.0, offload=True)
    assert hidden.step_s == pytest.approx(4 + 6 + 6 + 5 + 1.5)
    # embedding max(1, 1.0) + max(3 + 1, 1.0 + 1.5); blocks 2 x (max(1 + 1, 1.5) + max(3 + 2, 1.5 + 2.5));
    # head (1 + 1) + max(2 + 1, .9) (no recompute, no second gather); + 1.5
    added = _cm(host_bytes_per_s=24.0, async_copies=False).rank_cost(0, 1, 1, 0.0, offload=True)
    assert added.step_s == pytest.approx(5 + 14 + 5 + 1.5)
    # without offload there is nothing to copy either way
    assert _cm(host_bytes_per_s=1.0, async_copies=False).rank_cost(
        0, 5, 2, 0.0
    ).step_s == pytest.approx(76.5)


def test_async_copies_round_trip_and_default():
    from cephalo.specs.profile import DeviceProfile

    prof = linear_profile("x", 1.0, 2.0, 0.0, 0.0)
    prof.async_copies = False
    assert DeviceProfile.from_dict(prof.to_dict()).async_copies is False
    # written before the field existed: a CPU-measured profile has no async copies, others do
    old = prof.to_dict()
    del old["async_copies"]
    assert DeviceProfile.from_dict(old).async_copies is True
    old["meta"] = {"host": "cpu:Some CPU@host"}
    assert DeviceProfile.from_dict(old).async_copies is False


def test_tied_head_gathers_the_embedding():
    # head gathers 20 + vocab*hidden = 60 params, and its backward holds the tied gradient
    cm = _cm(tied=True)
    assert cm.gathered_params["head"] == 60
    head = cm._phases("x", np.array(1), np.array(1), np.array(False))[0]
    assert head["gathered"] == (60 + 100) * 2 and head["grad_accum"] == 60 * 4
    # the last block's backward holds the head's gradient (tied part included) in flight
    last_block = cm._phases("x", np.array(1), np.array(1), np.array(False))[1]
    assert last_block["grad_accum"] == (100 + 60) * 4


def test_peak_is_the_largest_phase():
    # a head with huge logits moves the peak into the head's backward
    cm = _cm()

    def big_vocab(fuse_tail: bool):
        return cost_model(
            [FakeDevice("x", 10**9), FakeDevice("x", 10**9)],
            {"x": linear_profile("x", 1.0, 2.0, 1000.0, optimizer_s_per_param=0.0)},
            model=replace(tiny_model(False), vocab_size=1000),
            fuse_tail=fuse_tail,
        )

    c = big_vocab(False).rank_cost(0, 5, 2, 0.0)
    # logits 2 * 3 * 1000 * 4 = 24000 beat any block's 2000 activations
    assert c.memory.logits == 24_000 and c.memory.activations == 0
    # the boundaries then held: every unit input, 3 x 5 x 24
    assert c.memory.boundary == 360
    assert cm.rank_cost(0, 5, 2, 0.0).memory.logits == 0
    # the fused tail (costmodel/rules.py): the head's pass sits on the last block's
    # activations at m = 2 (2000), both units gathered ((20 + 100) * 2) with both fp32
    # gradients ((20 + 100) * 4), and holds the blocks' inputs (2 x 5 x 24) and one
    # micro-batch's head input (2 x 24), not all 5 samples'
    f = big_vocab(True).rank_cost(0, 5, 2, 0.0).memory
    assert (f.logits, f.activations, f.gathered, f.grad_accum, f.boundary) == (
        24_000,
        2000,
        240,
        480,
        288,
    )


def test_single_device_has_no_collectives():
    prof = linear_profile("x", 1.0, 2.0, 0.0, optimizer_s_per_param=0.0)
    for fuse_tail, step in ((False, 4 * (1 + 3) - 1), (True, 4 * (1 + 3) - 2)):
        cm = cost_model(
            [FakeDevice("x", 10**6)],
            {"x": prof},
            bytes_per_s=1.0,
            latency_s=10.0,
            fuse_tail=fuse_tail,
        )
        # the head: no recompute; fused, the last block neither
        assert cm.rank_cost(0, 1, 1, 1.0).step_s == pytest.approx(step)


def test_micro_batch_larger_than_batch_is_clamped_in_memory():
    cm = _cm()
    assert cm.rank_cost(0, 2, 8, 0.0).memory == cm.rank_cost(0, 2, 2, 0.0).memory


def test_evaluate_plan_and_mismatches():
    cm = _cm()
    ranks = [RankPlan(0, "x", 5, 2, 3, 0.5), RankPlan(1, "x", 0, 1, 0, 0.5)]
    plan = Plan("manual", "tiny", 3, 5, "fp16", ranks)
    ev = cm.evaluate(plan)
    assert ev.step_s == pytest.approx(77.85)
    assert ev.samples_per_s == pytest.approx(5 / 77.85)
    assert ev.tokens_per_s == pytest.approx(3 * 5 / 77.85)
    assert ev.fits
    with pytest.raises(CephaloError, match="has 1 ranks but the cluster has 2"):
        cm.evaluate(Plan("manual", "tiny", 3, 5, "fp16", [RankPlan(0, "x", 5, 5, 1, 1.0)]))
    wrong = Plan(
        "manual",
        "tiny",
        3,
        5,
        "fp16",
        [RankPlan(0, "x", 5, 2, 3, 0.5), RankPlan(1, "y", 0, 1, 0, 0.5)],
    )
    with pytest.raises(CephaloError, match="rank 1 of the plan is a 'y'"):
        cm.evaluate(wrong)


def test_over_capacity_is_flagged():
    cm = _cm()
    c = cm.rank_cost(0, 40, 40, 1.0)
    assert not c.fits and c.shortfall_bytes == c.peak_bytes - 10_000 > 0


def test_missing_profile_is_a_clear_error():
    prof = linear_profile("x", 1.0, 2.0, 0.0, 0.0)
    with pytest.raises(CephaloError, match="no profile for device type"):
        cost_model([FakeDevice("y", 100)], {"x": prof})


def test_step_time_is_monotone_in_batch():
    cm = _cm()
    times = [
        min(cm.rank_cost(0, b, m, 0.0).step_s for m in range(1, max(b, 1) + 1))
        for b in range(0, 12)
    ]
    assert all(a <= b + 1e-12 for a, b in zip(times, times[1:], strict=False))
    assert math.isfinite(times[-1])


@pytest.mark.parametrize("async_copies", [True, False])
def test_fastest_passes_bound_every_choice_from_below(async_copies):
    """`step_time_of_passes` of `fastest_pass_times` (offload off) is at most the step time of
    every micro-batch up to the limit, with and without offload: the advisor's bound rests on it.
    Curves with intercepts make small micro-batches slow and the last partial one costly."""
    prof = linear_profile(
        "x", 0.3, 0.7, 1000.0, 0.01, host_bytes_per_s=50.0, fwd_intercept=2.0, bwd_intercept=3.0
    )
    prof.async_copies = async_copies
    devs = [FakeDevice("x", 10_000)] * 3
    cm = cost_model(devs, {"x": prof}, bytes_per_s=40.0, latency_s=0.2)
    bs = np.arange(0, 40)
    for limit in (1, 5, 16):
        floor = cm.step_time_of_passes("x", bs, cm.fastest_pass_times("x", bs, limit), False)[0]
        assert np.all(np.diff(floor) >= 0)  # monotone in b, as the advisor's beta needs
        for m in range(1, limit + 1):
            for offload in (False, True):
                t = cm.step_time_parts("x", bs, m, offload)[0]
                assert np.all(floor <= t + 1e-12), (limit, m, offload)
        # tight where one micro-batch size is best for every pass
        best = np.min(
            [cm.step_time_parts("x", bs, m, False)[0] for m in range(1, limit + 1)], axis=0
        )
        assert np.allclose(floor, best)


def test_step_time_of_passes_is_step_time_parts():
    cm = _cm()
    b, m = np.arange(0, 9)[:, None], np.arange(1, 5)[None, :]
    for offload in (False, True):
        a = cm.step_time_parts("x", b, m, offload)
        c = cm.step_time_of_passes("x", b, cm._pass_times("x", b, m), offload)
        for x, y in zip(a, c, strict=True):
            assert np.array_equal(x, y)
