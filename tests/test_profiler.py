"""The profiler: measurements, the profile database, the CLI, and planning from measurements."""

from __future__ import annotations

import dataclasses
import gc
import json
import statistics
import time
from pathlib import Path

import pytest
import torch

from cephalo.cli import main
from cephalo.costmodel.sources import measured_cost_model
from cephalo.errors import CephaloError
from cephalo.modeling.registry import build_model
from cephalo.profiling.database import DeviceKey, ProfileDatabase, model_signature
from cephalo.profiling.measure import CollectiveSample, fit_comm
from cephalo.profiling.profiler import (
    cached_profiles,
    materialize_measured,
    measured_units,
    profile_devices,
)
from cephalo.profiling.settings import ProfileSettings
from cephalo.runtime.live_bytes import LiveTensorBytes
from cephalo.specs.cluster import Cluster
from cephalo.specs.profile import Curve, DeviceProfile, MeasuredProfiles, UnitProfile
from dist_harness import dist_pool_fixture

FAST = ProfileSettings(
    repeats=1,
    warmup=0,
    max_micro_batch=8,
    optimizer_numel=1 << 16,
    host_copy_bytes=1 << 20,
    time_cap_s=20.0,
)
SEQ = 16
SLOWDOWN = 6
"""The emulated slow type of these tests: `cpu:slowdown=6` next to `cpu`. Large, because on
a busy 2-core host the measured ratio scatters widely around the nominal one (see
test_slowdown_is_measured and test_two_rank_profiling): at 2, a slowdown that was not
applied at all would measure within the same range."""
SLOW = f"cpu:slowdown={SLOWDOWN}"


def _profile(n: int = 2) -> DeviceProfile:
    xs = [1.0, 2.0, 4.0][:n]
    unit = UnitProfile(
        Curve(xs, [0.001 * x for x in xs]),
        Curve(xs, [0.002 * x for x in xs]),
        Curve(xs, [1000.0 * x for x in xs]),
    )
    return DeviceProfile(
        "cpu",
        1 << 30,
        {"embedding": unit, "block": unit, "head": unit},
        1e-8,
        1e9,
        source="measured",
        meta={"torch_threads": 1},
    )


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Like every launched rank: one thread (several spinning OpenMP threads on a busy
    2-core machine make timings meaningless)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def single(one_thread) -> MeasuredProfiles:
    """One process, two emulated types (measured in-process, no database)."""
    settings = ProfileSettings(
        repeats=3, warmup=1, max_micro_batch=8, optimizer_numel=1 << 16, host_copy_bytes=1 << 20
    )
    return profile_devices(
        "gpt-tiny",
        SEQ,
        "fp32",
        Cluster.parse(f"cpu,{SLOW}"),
        settings=settings,
        use_cache=False,
    )


# ----------------------------------------------------------------------------- database
def test_database_round_trip(tmp_path):
    path = tmp_path / "db.json"
    db = ProfileDatabase.load(path)
    assert db.devices == {} and not path.exists()
    key = DeviceKey("cpu", "abc", 32, "fp32", torch.__version__, "host")
    db.put_device(key, _profile())
    db.save()
    again = ProfileDatabase.load(path)
    got = again.get_device(key)
    assert got is not None and got.to_dict() == _profile().to_dict()
    # any part of the key differing is a miss
    for other in (
        DeviceKey("cpu", "abc", 64, "fp32", torch.__version__, "host"),
        DeviceKey("cpu:slowdown=2", "abc", 32, "fp32", torch.__version__, "host"),
        DeviceKey("cpu", "abd", 32, "fp32", torch.__version__, "host"),
        DeviceKey("cpu", "abc", 32, "bf16", torch.__version__, "host"),
        DeviceKey("cpu", "abc", 32, "fp32", "1.0", "host"),
        DeviceKey("cpu", "abc", 32, "fp32", torch.__version__, "other-host"),
        DeviceKey("cpu", "abc", 32, "fp32", torch.__version__, "host", method=1),
    ):
        assert again.get_device(other) is None
    assert not list(tmp_path.glob("*.tmp"))  # atomic write leaves no temporary


def test_database_errors(tmp_path):
    bad = tmp_path / "db.json"
    bad.write_text("{not json")
    with pytest.raises(CephaloError, match="delete it"):
        ProfileDatabase.load(bad)
    bad.write_text(json.dumps({"version": 99}))
    with pytest.raises(CephaloError, match="version"):
        ProfileDatabase.load(bad)


def test_model_signature_tracks_shape_and_dropout():
    a = build_model("gpt-tiny")
    assert model_signature(a, a.spec) == model_signature(build_model("gpt-tiny"), a.spec)
    b = build_model("gpt-tiny", n_embd=128)
    c = build_model("gpt-tiny", dropout=0.1)
    assert len({model_signature(m, m.spec) for m in (a, b, c)}) == 3


def test_cache_hit_is_fast_and_identical(tmp_path):
    cache = tmp_path / "db.json"
    cluster = Cluster.parse("cpu")
    first = profile_devices("gpt-tiny", SEQ, "fp32", cluster, settings=FAST, cache=cache)
    assert first.measured == ["cpu"] and first.cached == []
    t0 = time.perf_counter()
    second = profile_devices("gpt-tiny", SEQ, "fp32", cluster, settings=FAST, cache=cache)
    assert time.perf_counter() - t0 < 2.0
    assert second.measured == [] and second.cached == ["cpu"]
    assert second.profiles["cpu"].to_dict() == first.profiles["cpu"].to_dict()
    hit = cached_profiles("gpt-tiny", SEQ, "fp32", cluster, cache=cache)
    assert hit is not None and hit.profiles["cpu"].to_dict() == first.profiles["cpu"].to_dict()
    assert cached_profiles("gpt-tiny", SEQ * 2, "fp32", cluster, cache=cache) is None
    refreshed = profile_devices(
        "gpt-tiny", SEQ, "fp32", cluster, settings=FAST, cache=cache, refresh=True
    )
    assert refreshed.measured == ["cpu"]
    # memory is not part of the key: the device's own capacity is reported
    small = profile_devices(
        "gpt-tiny", SEQ, "fp32", Cluster.parse("cpu:mem=1GiB"), settings=FAST, cache=cache
    )
    assert small.measured == [] and small.profiles["cpu"].memory_bytes == 1 << 30


# ----------------------------------------------------------------------------- measurements
def test_measured_curves(single):
    for key in ("cpu", SLOW):
        p = single.profiles[key]
        assert (
            p.source == "measured" and p.optimizer_s_per_param > 0 and p.host_copy_bytes_per_s > 0
        )
        assert p.async_copies is False  # a CPU copies on its compute thread
        for kind in ("embedding", "block", "head"):
            u = p.units[kind]
            assert u.fwd_s.xs == [1.0, 2.0, 4.0, 8.0]
            for curve in (u.fwd_s, u.bwd_s, u.activation_bytes):
                assert all(b >= a for a, b in zip(curve.ys, curve.ys[1:], strict=False))
                assert curve.ys[0] > 0
        # activations are exact byte counts that grow at least linearly with the micro-batch
        # (on top of a constant: the transient parameter gradient the engine charges)
        for kind in ("block", "head"):
            act = p.units[kind].activation_bytes
            assert act(8) - act(4) >= act(4) - act(2) > 0
        # the head keeps at least its fp32 logits
        assert p.units["head"].activation_bytes(4) >= 4 * SEQ * 256 * 4
        # a bigger micro-batch costs more (gpt-tiny at micro-batch 1 is mostly Python overhead)
        block = p.units["block"]
        assert block.fwd_s(8) + block.bwd_s(8) > block.fwd_s(1) + block.bwd_s(1)


# ----------------------------------------------------------------------------- what it holds
HOLD_LIMIT = 0.4
"""Issue 38: profiling may hold at most this fraction of the model's fp32 bytes above what
was live before (the whole model materialised, as before, held more than 1x)."""
LEAN = ProfileSettings(
    repeats=1,
    warmup=0,
    max_micro_batch=2,
    optimizer_numel=1 << 12,
    host_copy_bytes=1 << 16,
    comm_sizes_bytes=(1 << 12, 1 << 16),
)
"""Small fixed measurements (optimizer, host copies, collectives), so that what the peak
holds of the model is what it measures."""


def _fp32_bytes(model) -> int:
    return 4 * sum(p.numel() for p in model.parameters())


def _peak_bytes(fn) -> int:
    """Peak live CPU tensor bytes created while `fn()` runs (the baseline is 0)."""
    gc.collect()
    with LiveTensorBytes() as live:
        fn()
    return live.peak


def test_materialize_units_keeps_the_rest_on_meta_and_ties():
    model = build_model("gpt-tiny", n_layer=4)  # tied embeddings: wte in the embedding and head
    full = build_model("gpt-tiny", n_layer=4).materialize("cpu", torch.Generator().manual_seed(0))
    model.materialize_units("cpu", torch.Generator().manual_seed(0), [0, 1, -1])
    chosen = {0, 1, len(model.units) - 1}
    for i, unit in enumerate(model.units):
        assert all(p.is_meta != (i in chosen) for p in unit.module.parameters()), unit.name
    head_params = {id(p) for p in model.units[-1].module.parameters()}
    assert any(id(p) in head_params for p in model.units[0].module.parameters())  # still tied
    # the first units draw as a full materialisation does (the skipped ones would come next)
    emb = dict(model.units[0].module.named_parameters())
    assert all(torch.equal(p, emb[n]) for n, p in full.units[0].module.named_parameters())
    # every unit chosen: exactly `materialize`
    again = build_model("gpt-tiny", n_layer=4)
    again.materialize_units("cpu", torch.Generator().manual_seed(0), range(len(again.units)))
    assert all(
        torch.equal(a, b) for a, b in zip(again.parameters(), full.parameters(), strict=True)
    )

    # the head alone: its borrowed weight is materialised (and drawn) in both slots
    head_only = build_model("gpt-tiny", n_layer=4)
    head_only.materialize_units("cpu", torch.Generator().manual_seed(0), [-1])
    (tied,) = [p for p in head_only.units[0].module.parameters() if not p.is_meta]
    assert any(p is tied for p in head_only.units[-1].module.parameters())
    assert 0.01 < float(tied.detach().std()) < 0.03  # GPT-2's N(0, 0.02)
    assert all(p.is_meta for u in head_only.units[1:-1] for p in u.module.parameters())


def test_profiling_holds_only_the_measured_units():
    """Issue 38: the profiler materialises the units it measures (embedding, one block, head),
    not the whole model: a 24-block model peaks far below its fp32 bytes. (Materialising the
    whole model, as it did, put the peak above 1x.)"""
    model = build_model("gpt-tiny", n_layer=24, n_embd=128)
    fp32 = _fp32_bytes(model)
    measured = []

    def run():
        measured.append(
            profile_devices(
                model, SEQ, "fp32", Cluster.parse("cpu"), settings=LEAN, use_cache=False
            )
        )

    peak = _peak_bytes(run)
    assert peak <= HOLD_LIMIT * fp32, (peak / 2**20, fp32 / 2**20)
    profile = measured[0].profiles["cpu"]
    assert profile.units["block"].fwd_s.xs == [1.0, 2.0]
    assert all(p.is_meta for p in model.parameters())  # the caller's model is untouched
    # the whole model, materialised as before, is already over the limit
    whole = _peak_bytes(
        lambda: build_model("gpt-tiny", n_layer=24, n_embd=128).materialize(
            "cpu", torch.Generator().manual_seed(0)
        )
    )
    assert whole > HOLD_LIMIT * fp32


def test_profiling_a_qlora_model_materialises_only_the_measured_units():
    """A QLoRA model (peft's layers in the units, the base frozen) is materialised as the
    profiler measures it: the embedding, one block and the head, adapters included."""
    from cephalo.modeling.lora import AdapterSettings, apply_adapter
    from hf_configs import quiet_transformers

    quiet_transformers()
    model = build_model("hf-llama-tiny", init="random", num_hidden_layers=24, tie_embeddings=True)
    apply_adapter(model, AdapterSettings("qlora", r=4, alpha=8))
    fp32 = _fp32_bytes(model)
    held = []
    peak = _peak_bytes(lambda: held.append(materialize_measured(model, torch.device("cpu"))))
    assert peak <= HOLD_LIMIT * fp32, (peak / 2**20, fp32 / 2**20)
    (lean,) = held
    real = {
        i for i, u in enumerate(lean.units) if not any(p.is_meta for p in u.module.parameters())
    }
    assert real == set(measured_units(lean).values())
    assert any(".lora_A." in n for n, _ in lean.units[1].module.named_parameters())
    measured = profile_devices(
        model,
        SEQ,
        "fp32",
        Cluster.parse("cpu"),
        settings=dataclasses.replace(LEAN, max_micro_batch=1),
        use_cache=False,
    )
    meta = measured.profiles["cpu"].meta
    assert meta["adapter"] == "lora" and meta["nf4_dequant_s_per_param"] > 0


def test_slowdown_is_measured(single):
    ratio = _slowdown_ratio(single, SLOW, "cpu")
    # Measured one process at a time, by the thread's CPU time, so other processes do not
    # count; but a busy sibling hyperthread inflates even CPU time, and the two types are
    # measured one after the other under whatever load there is then: on the loaded 2-core
    # machine (load 3.5-7) the ratio at slowdown 2 was 1.12-3.22 over 21 runs, i.e. 0.56 to
    # 1.6 times the nominal slowdown. Bounds: a third to twice the nominal (measured at
    # slowdown 6: 4.33-8.33 over 8 runs at load 4.5-5); without the slowdown applied the
    # ratio would be below 2.
    assert SLOWDOWN / 3 < ratio < 2 * SLOWDOWN, ratio
    # the optimizer step is stretched too, as the engine stretches it
    opt_ratio = (
        single.profiles[SLOW].optimizer_s_per_param / single.profiles["cpu"].optimizer_s_per_param
    )
    assert SLOWDOWN / 3 < opt_ratio < 2 * SLOWDOWN, opt_ratio
    # activations do not depend on speed
    assert (
        single.profiles["cpu"].units["block"].activation_bytes.ys
        == single.profiles[SLOW].units["block"].activation_bytes.ys
    )


def _slowdown_ratio(measured: MeasuredProfiles, slow: str, fast: str) -> float:
    """Median over the block's and head's forward and backward points of slow / fast."""
    ratios = []
    for kind in ("block", "head"):
        for curve in ("fwd_s", "bwd_s"):
            a = getattr(measured.profiles[slow].units[kind], curve).ys
            b = getattr(measured.profiles[fast].units[kind], curve).ys
            ratios += [x / y for x, y in zip(a, b, strict=True)]
    return statistics.median(ratios)


def test_fit_comm_recovers_line():
    n, bw, lat = 3, 2e9, 3e-4
    ring = (n - 1) / n
    samples = [
        CollectiveSample(name, b, lat + ring * b / bw)
        for name in ("all_gather_v", "reduce_scatter_v")
        for b in (1 << 18, 1 << 23)
    ]
    got_bw, got_lat = fit_comm(samples, n)
    assert got_bw == pytest.approx(bw, rel=1e-6) and got_lat == pytest.approx(lat, rel=1e-6)


def test_bad_input():
    with pytest.raises(CephaloError, match="longer than"):
        profile_devices(
            "gpt-tiny", 4096, "fp32", Cluster.parse("cpu"), settings=FAST, use_cache=False
        )
    with pytest.raises(CephaloError, match="dtype"):
        profile_devices(
            "gpt-tiny", SEQ, "fp64", Cluster.parse("cpu"), settings=FAST, use_cache=False
        )
    with pytest.raises(CephaloError, match="unknown model"):
        profile_devices(
            "no-such-model", SEQ, "fp32", Cluster.parse("cpu"), settings=FAST, use_cache=False
        )


# ----------------------------------------------------------------------------- planning
def test_plan_from_measured_profiles(single, tmp_path):
    from cephalo.planner.makers import make_plan

    cluster = Cluster.parse(f"cpu,{SLOW}")
    spec = build_model("gpt-tiny").spec
    path = tmp_path / "profile.json"
    single.save(path)
    measured = MeasuredProfiles.load(path)
    cm = measured_cost_model(cluster, spec, SEQ, "fp32", measured)
    assert cm.meta["profile_source"] == "measured"
    plan = make_plan(cm, 24, "cephalo")
    fast, slow = plan.ranks
    assert fast.batch_size + slow.batch_size == 24
    assert fast.batch_size > slow.batch_size  # the slowed-down rank gets less work
    with pytest.raises(CephaloError, match="no measurements for"):
        measured_cost_model(Cluster.parse("cpu,cpu:slowdown=3"), spec, SEQ, "fp32", measured)
    with pytest.raises(CephaloError, match="seq_len"):
        measured_cost_model(cluster, spec, SEQ * 2, "fp32", measured)
    with pytest.raises(CephaloError, match="not a profile file"):
        (tmp_path / "junk.json").write_text("{}")
        MeasuredProfiles.load(tmp_path / "junk.json")


# ----------------------------------------------------------------------------- CLI
def test_cli_single_device(tmp_path, capsys):
    args = [
        "profile",
        "--devices",
        "cpu",
        "--model",
        "gpt-tiny",
        "--seq-len",
        str(SEQ),
        "--cache",
        str(tmp_path / "db.json"),
        "--repeats",
        "1",
        "--max-micro-batch",
        "4",
        "--out",
        str(tmp_path / "p.json"),
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "measured cpu" in out and "cpu: gpt-tiny, seq 16, fp32" in out
    assert MeasuredProfiles.load(tmp_path / "p.json").profiles["cpu"].units["block"].fwd_s.xs == [
        1,
        2,
        4,
    ]
    assert main(args) == 0
    assert "from the database: cpu" in capsys.readouterr().out
    assert main(["profile", "--devices", "cpu", "--model", "gpt-tiny", "--repeats", "0"]) == 2


# ----------------------------------------------------------------------------- 2 ranks
pool2 = dist_pool_fixture(2, timeout_s=240.0)


def _profile_on_ranks(cache: str, slowdown: float = SLOWDOWN) -> dict:
    from cephalo.runtime.collectives.comm import make_comm

    cluster = f"cpu,cpu:slowdown={slowdown:g}"

    comm = make_comm("auto")
    settings = ProfileSettings(
        repeats=3,
        warmup=1,
        max_micro_batch=4,
        optimizer_numel=1 << 18,
        host_copy_bytes=4 << 20,
        time_cap_s=30.0,
    )
    t0 = time.perf_counter()
    first = profile_devices(
        "gpt-tiny", 32, "fp32", Cluster.parse(cluster), comm, settings=settings, cache=cache
    )
    t1 = time.perf_counter()
    second = profile_devices(
        "gpt-tiny", 32, "fp32", Cluster.parse(cluster), comm, settings=settings, cache=cache
    )
    return {
        "first": first.to_dict(),
        "second": second.to_dict(),
        "first_s": t1 - t0,
        "second_s": time.perf_counter() - t1,
    }


@pytest.mark.slow
def test_two_rank_profiling(pool2, tmp_path):
    results = pool2.run(_profile_on_ranks, str(tmp_path / "db.json"), timeout_s=240.0)
    # every rank gets the same profiles
    assert results[0]["first"]["profiles"] == results[1]["first"]["profiles"]
    assert results[0]["first"]["comm"] == results[1]["first"]["comm"]
    first = MeasuredProfiles.from_dict(results[0]["first"])
    assert sorted(first.measured) == ["comm", "cpu", SLOW]
    assert first.comm is not None and first.comm.bytes_per_s > 1e6 and first.comm.latency_s >= 0

    ratio = _slowdown_ratio(first, SLOW, "cpu")
    # Measured together, by the wall clock, as in training: the emulator stretches a piece
    # to max(its wall time, slowdown x its CPU time), so contention for the cores that
    # already made the pieces k times longer leaves a ratio of about slowdown / k (1 once k
    # exceeds the slowdown). Measured on the loaded 2-core machine: at slowdown 2, 0.92-1.86
    # (load 3.5-7: contention alone, a check of nothing); at slowdown 6, 1.79-3.87 over 13
    # runs (load 4-5): the lower bound holds up to k = 4.6.
    assert 1.3 < ratio < 2 * SLOWDOWN, ratio
    second = MeasuredProfiles.from_dict(results[0]["second"])
    assert second.measured == [] and sorted(second.cached) == ["comm", "cpu", SLOW]
    assert results[0]["second_s"] < 2.0
    db = ProfileDatabase.load(tmp_path / "db.json")
    assert len(db.devices) == 2 and len(db.comm) == 1
    # co-located CPU ranks are measured together, and the database says so
    assert all(p.meta["concurrent"] for p in first.profiles.values())
    assert {e["key"]["peers"] for e in db.devices.values()} == {f"cpu,{SLOW}"}


def _profile_lean(_cache: str) -> dict:
    """Issue 38's report, small: each of 2 co-located ranks profiles a 24-block model
    (together: the concurrent path) and reports the live tensor bytes it peaked at."""
    from cephalo.runtime.collectives.comm import make_comm

    comm = make_comm("auto")
    model = build_model("gpt-tiny", n_layer=24, n_embd=128)
    measured = []
    peak = _peak_bytes(
        lambda: measured.append(
            profile_devices(
                model, SEQ, "fp32", Cluster.parse("cpu,cpu"), comm, settings=LEAN, use_cache=False
            )
        )
    )
    return {"peak": peak, "fp32": _fp32_bytes(model), "measured": measured[0].measured}


@pytest.mark.slow
def test_concurrent_profiling_holds_only_the_measured_units(pool2, tmp_path):
    results = pool2.run(_profile_lean, str(tmp_path), timeout_s=240.0)
    for r in results:
        assert sorted(r["measured"]) == ["comm", "cpu"]
        assert r["peak"] <= HOLD_LIMIT * r["fp32"], (r["peak"] / 2**20, r["fp32"] / 2**20)


def _profile_uneven_sweeps(cache: str) -> dict:
    """Rank 1's memory ends its sweep at micro-batch 2; rank 0 goes on to 8. Then the same
    cluster measured one rank at a time, into the same database."""
    from cephalo.runtime.collectives.comm import make_comm

    comm = make_comm("auto")
    settings = ProfileSettings(
        repeats=1,
        warmup=0,
        max_micro_batch=8,
        optimizer_numel=1 << 16,
        host_copy_bytes=1 << 20,
        time_cap_s=30.0,
    )
    cluster = Cluster.parse("cpu,cpu:slowdown=2,mem=2MiB")
    together = profile_devices(
        "gpt-tiny", 32, "fp32", cluster, comm, settings=settings, cache=cache
    )
    settings.concurrent = False
    alone = profile_devices("gpt-tiny", 32, "fp32", cluster, comm, settings=settings, cache=cache)
    return {"together": together.to_dict(), "alone": alone.to_dict()}


@pytest.mark.slow
def test_concurrent_profiling_with_uneven_sweeps(pool2, tmp_path):
    results = pool2.run(_profile_uneven_sweeps, str(tmp_path / "db.json"), timeout_s=240.0)
    together = MeasuredProfiles.from_dict(results[0]["together"])
    assert together.profiles["cpu"].units["block"].fwd_s.xs == [1.0, 2.0, 4.0, 8.0]
    assert together.profiles["cpu:slowdown=2"].units["block"].fwd_s.xs == [1.0, 2.0]
    alone = MeasuredProfiles.from_dict(results[0]["alone"])
    assert sorted(alone.measured) == ["cpu", "cpu:slowdown=2"]  # another key: not a cache hit
    assert not any(p.meta["concurrent"] for p in alone.profiles.values())
    assert len(ProfileDatabase.load(tmp_path / "db.json").devices) == 4
    # measured together by the wall clock, a profile says how much of it the host's sharing
    # made (runtime/emulation.py "Contention"); by the CPU time alone there is none to say
    assert all(0.0 <= p.meta["contention_share"] < 1.0 for p in together.profiles.values())
    assert not any("contention_share" in p.meta for p in alone.profiles.values())


# ----------------------------------------------------------------------------- launcher
def _rank_or_fail(comm, fail_rank: int, progress=None) -> int:
    if progress:
        progress("working")
    if comm.rank == fail_rank:
        raise CephaloError("this rank was told to fail")
    comm.barrier()  # the healthy rank would wait here for the failed one
    return comm.rank


@pytest.mark.slow
def test_run_ranks_results_and_errors():
    from cephalo.launch.ranks import run_ranks

    seen = []
    assert run_ranks(
        _rank_or_fail, 2, -1, timeout_s=120, on_progress=lambda r, t: seen.append((r, t))
    ) == [0, 1]
    assert sorted(seen) == [(0, "working"), (1, "working")]
    t0 = time.perf_counter()
    with pytest.raises(CephaloError, match="rank 1 failed: this rank was told to fail"):
        run_ranks(_rank_or_fail, 2, 1, timeout_s=120)
    assert time.perf_counter() - t0 < 60  # no waiting for the collective timeout


QLORA_MEM = "8MiB"
"""The emulated devices of the QLoRA profiling case: about 1.6x the model's fp32 bytes (the
issue's case: 600 MiB for a 246M-parameter model, 0.6x; there the NF4 base dominates, here the
bf16 embedding and head)."""


def _qlora_job(root: str, model_dir: str, plan: str, mem: str) -> tuple[int, int | None]:
    """One short QLoRA job of the model directory on this pool's 2 ranks, emulated devices of
    `mem`; the rank's peak of device memory under the strict accounting, over the job and up to
    the end of profiling (None: not profiled)."""
    from cephalo import envvars
    from cephalo.train.config_manager import load_config
    from cephalo.train.trainer import train

    Path(root).mkdir(parents=True, exist_ok=True)
    data = Path(root) / "text.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    with envvars.scoped_environ({envvars.CACHE_ROOT: str(Path(root) / "cache")}):
        cfg = load_config(
            None,
            [
                f"--logging.dir={root}/run",
                "--logging.progress=false",
                f"--model.name={model_dir}",
                "--model.adapter=qlora",
                "--model.dtype=bf16",
                f"--data.path={data}",
                "--data.tokenizer=builtin",
                "--data.seq_len=32",
                "--train.global_batch_size=4",
                "--train.steps=1",
                "--train.warmup_steps=0",
                "--train.eval_every=0",
                f"--parallel.plan={plan}",
                f"--parallel.devices=cpu:mem={mem},cpu:mem={mem}",
                "--profile.repeats=1",
                "--profile.warmup=0",
                "--profile.time_cap_s=1",
                "--profile.max_micro_batch=2",
            ],
        )
        result = train(cfg)
        return result.device_peak_bytes, result.profile_peak_bytes


@pytest.mark.slow
def test_auto_plan_of_a_qlora_llama_fits_where_even_does(pool2, tmp_path):
    """Issue 38's profiling case, scaled down: a Llama-shaped directory (save_pretrained),
    QLoRA, 2 emulated ranks with a tight `mem=`, every byte counted (runtime/device_memory.py).
    `plan = "auto"`'s profiling peaks at most 0.4x the model's fp32 bytes above what
    `plan = "even"` peaks at over its whole job, on every rank, and both jobs fit. (Before, the
    profiler materialised the whole model and timed a fixed 1M-weight NF4 dequantization:
    several times the model's fp32 bytes above `even` here.) The profiling peak, not the auto
    job's: the auto plan may rightly give a rank more than the even share (timing noise between
    two identical devices), and its training then peaks above `even`'s (CI saw +1.8 MiB)."""
    from hf_configs import save_tiny_model

    directory = save_tiny_model(
        "llama",
        tmp_path / "llama",
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=6,
    )
    fp32 = 4 * build_model(str(directory)).spec.total_params
    root = str(tmp_path)
    even = pool2.run(_qlora_job, f"{root}/even", str(directory), "even", QLORA_MEM)
    auto = pool2.run(_qlora_job, f"{root}/auto", str(directory), "auto", QLORA_MEM)
    budget = 8 << 20
    for rank, ((e, _), (a, profiled)) in enumerate(zip(even, auto, strict=True)):
        assert e is not None and a is not None  # the strict accounting was on
        assert profiled is not None and profiled <= a
        assert max(e, a) <= budget
        assert profiled - e <= 0.4 * fp32, (rank, e / 2**20, profiled / 2**20, fp32 / 2**20)
