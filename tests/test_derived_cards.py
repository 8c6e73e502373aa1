"""Consumer and workstation GPUs derived from measured siblings: the catalog entries, the
derivation itself, and its measured error printed with a plan."""

import pytest

from cephalo.cli import main
from cephalo.specs.catalog import derived, devices, published
from cephalo.specs.catalog.derived import SAME_ARCH_PAIRS, SPECS, derivation_error, time_ratio
from cephalo.specs.catalog.devices import GiB, device_memory_bytes, resolve_device_type
from cephalo.specs.catalog.published import catalog_profile
from cephalo.specs.profile import Curve

CARDS = {
    "rtx3060": 12,
    "rtx3080": 10,
    "rtx3090ti": 24,
    "rtx4060ti": 16,
    "rtx4070tisuper": 16,
    "rtx4080": 16,
    "rtx4090": 24,
    "rtx5090": 32,
    "rtxa4000": 16,
    "rtxa5000": 24,
    "l40": 48,
}


@pytest.mark.parametrize("card,gib", CARDS.items())
def test_consumer_cards_are_in_the_catalog_marked_derived(card, gib):
    assert card in derived.DERIVED and card in devices.DEVICES
    assert device_memory_bytes(card) == gib * GiB
    prof = catalog_profile(card, "gpt-2.7b", 512, "fp32")
    assert prof.meta["timing_source"] == "derived"
    assert "derived from the measured" in prof.meta["derived_method"]
    assert "over" in prof.meta["derived_error"]
    # the bandwidth-bound optimizer step reads the card's own bandwidth
    assert prof.optimizer_s_per_param == pytest.approx(
        devices.ADAMW_BYTES_PER_PARAM / (SPECS[card].bandwidth_gb_s * 1e9 * 0.7)
    )


def test_aliases_resolve():
    assert resolve_device_type("4090") == "rtx4090"
    assert resolve_device_type("A5000") == "rtxa5000"
    assert resolve_device_type("3060") == "rtx3060"


def test_block_times_are_the_siblings_scaled_by_sms_times_clock():
    # RTX 4090 from the L40S (fp32: the L40S was published in fp32 only): 142 x 2520 / (128 x 2520)
    r = time_ratio("rtx4090", "l40s")
    assert r == pytest.approx(142 / 128)
    mine = catalog_profile("rtx4090", "llama-7b", 512, "fp32").units["block"]
    theirs = catalog_profile("l40s", "llama-7b", 512, "fp32").units["block"]
    for b in (1, 4, 8):
        assert mine.fwd_s(b) == pytest.approx(theirs.fwd_s(b) * r, rel=1e-5)
        assert mine.bwd_s(b) == pytest.approx(theirs.bwd_s(b) * r, rel=1e-5)
    # fp16 where the L40S has none: from the L4 (AD104)
    fp16 = catalog_profile("rtx4090", "llama-7b", 512, "fp16").units["block"]
    l4 = catalog_profile("l4", "llama-7b", 512, "fp16").units["block"]
    assert fp16.fwd_s(2) == pytest.approx(l4.fwd_s(2) * 58 * 2040 / (128 * 2520), rel=1e-5)
    # GeForce Ampere from the measured RTX 3090 where it has the entry
    g = catalog_profile("rtx3060", "gpt-2.7b", 512, "fp16").units["block"]
    t = catalog_profile("rtx3090", "gpt-2.7b", 512, "fp16").units["block"]
    assert g.fwd_s(3) == pytest.approx(t.fwd_s(3) * 82 * 1695 / (28 * 1777), rel=1e-5)


def _measured_timings():
    out = {}
    for model, by_dev in published._catalog()["timings"].items():
        out[model] = {d: v for d, v in by_dev.items() if d not in derived.DERIVED}
    return out


def test_derivation_error_is_measured_on_measured_siblings():
    shipped = published._catalog()["derivation_errors"]
    same = derivation_error(_measured_timings(), SAME_ARCH_PAIRS)
    assert same.to_dict() == shipped["same-architecture"]
    assert "RTX 3090 from RTX A6000 (5)" in same.pairs
    # by hand: one entry of the pair, predicted and measured
    t = published._catalog()["timings"]["gpt-2.7b"]
    a6000, rtx3090 = t["a6000"]["512"]["fp16"], t["rtx3090"]["512"]["fp16"]
    measured = Curve.from_dict(rtx3090["fwd_s"])
    predicted = Curve.from_dict(a6000["fwd_s"])
    x = measured.xs[0]
    ratio = predicted(x) * time_ratio("rtx3090", "a6000") / measured(x)
    one = derivation_error(
        {"gpt-2.7b": {"rtx3090": t["rtx3090"], "a6000": t["a6000"]}}, [("rtx3090", "a6000")]
    )
    assert one.n == 1 and one.fwd_median > 0 and ratio > 1  # the A6000 was measured slower
    # the cross-architecture error (the RTX 5090's) is stated and larger
    cross = shipped["cross-architecture"]
    assert cross["fwd_median"] > shipped["same-architecture"]["fwd_median"]
    assert published.derived_meta("rtx5090")["derived_error_scope"] == "cross-architecture"
    assert published.derived_meta("rtx4090")["derived_error_scope"] == "same-architecture"


def test_pooled_flop_scaling_error_leaves_derived_cards_out():
    assert not set(derived.DERIVED) & set(devices.MEASURED_DEVICES)


def test_plan_prints_the_derivation_error(capsys):
    args = ["plan", "--cluster", "rtx3090,rtx3060", "--model", "gpt-2.7b", "--global-batch", "8"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "rtx3060: no published measurements" in out
    assert "Measured error of this derivation (same-architecture" in out


def test_measured_cards_keep_their_measurements_and_fill_their_gaps():
    # the RTX 3090 was published for five GPT/ViT entries: those stay measured ...
    assert catalog_profile("rtx3090", "gpt-2.7b", 512, "fp16").meta["timing_source"] == "fit-total"
    # ... and a Llama entry comes from the A6000, marked derived with its error
    prof = catalog_profile("rtx3090", "llama-7b", 512, "fp16")
    assert prof.meta["timing_source"] == "derived"
    assert "unmeasured entries" in prof.meta["derived_method"]
    a6000 = catalog_profile("a6000", "llama-7b", 512, "fp16").units["block"]
    assert prof.units["block"].fwd_s(4) == pytest.approx(
        a6000.fwd_s(4) * 84 * 1800 / (82 * 1695), rel=1e-5
    )
    # the L40S, published in fp32 only, keeps its fp32 and gets fp16 from the L4
    assert catalog_profile("l40s", "llama-7b", 512, "fp32").meta["timing_source"] != "derived"
    assert catalog_profile("l40s", "llama-7b", 512, "fp16").meta["timing_source"] == "derived"
