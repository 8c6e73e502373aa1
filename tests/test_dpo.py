"""The DPO objective's pieces (issue 42), cheap and in one process: the row weights against
autograd on the loss written out, the objective / data cross-check both ways, `dpo_beta`,
the engine's refusals, the precomputed reference table and the metrics records. The
equivalence runs (LoRA vs peft, full fine-tuning vs a frozen copy, plan invariance, IPO) are
in tests/test_lora.py's rank pool; the full fine-tuning reference's collective pass and
sidecar through the trainer on 3 uneven ranks (the shared pool) is here, at the end."""

from __future__ import annotations

import functools
import types

import pytest
import torch

from cephalo.errors import CephaloError
from cephalo.modeling.units import IGNORE_INDEX
from cephalo.planner.plan import Plan, RankPlan
from cephalo.preference.job import PreferenceRun
from cephalo.preference.objective import (
    METRICS,
    DpoObjective,
    DpoSettings,
    check_objective,
    metrics_of,
)
from cephalo.preference.reference import ReferenceTable, row_keys, sidecar_path
from cephalo.train.metrics import StepRecord, scalars_of
from dist_harness import dist_pool_fixture
from engine_common import one_thread

__all__ = ["one_thread"]


def _labels(rows: int, tokens: list[int]) -> torch.Tensor:
    labels = torch.full((rows, 8), IGNORE_INDEX)
    for r, n in enumerate(tokens):
        labels[r, :n] = 1
    return labels


@pytest.mark.parametrize("loss", ["sigmoid", "ipo"])
def test_row_weights_are_the_gradient_of_the_pair_loss(loss):
    """The weight each row's token losses get is d(sum of pair losses) / d(the row's
    token-loss sum), against autograd on the losses as the DPO paper / TRL write them."""
    g = torch.Generator().manual_seed(0)
    rows, beta = 6, 0.3
    labels = _labels(rows, [3, 5, 1, 2, 4, 4])
    tokens = (labels != IGNORE_INDEX).sum(1).float()
    ce = (torch.rand(rows, generator=g) * 20).requires_grad_()
    ref = -torch.rand(rows, generator=g) * 20
    logp = -ce / tokens if loss == "ipo" else -ce
    refp = ref / tokens if loss == "ipo" else ref
    h = (logp[0::2] - refp[0::2]) - (logp[1::2] - refp[1::2])
    if loss == "ipo":
        expected = ((h - 1 / (2 * beta)) ** 2).sum()
    else:
        expected = -torch.nn.functional.logsigmoid(beta * h).sum()
    expected.backward()
    obj = DpoObjective(DpoSettings(beta, loss))
    obj.begin(torch.device("cpu"))
    total, weights = obj.pairs(obj.logps(ce.detach(), labels), refp, labels)
    torch.testing.assert_close(total, expected.detach())
    torch.testing.assert_close(weights.reshape(-1), ce.grad)
    sums = obj.sums().tolist()
    assert sums[6] == 3  # pairs
    m = metrics_of(sums)
    chosen = beta * (logp[0::2] - refp[0::2]).detach()
    rejected = beta * (logp[1::2] - refp[1::2]).detach()
    assert m["rewards/margins"] == pytest.approx((chosen - rejected).mean().item(), rel=1e-5)
    assert m["rewards/accuracies"] == pytest.approx((chosen > rejected).float().mean().item())


def test_a_pair_without_completion_counts_nowhere():
    """An evaluation pads its short last batch with empty pairs: no loss, no weight, not
    counted."""
    obj = DpoObjective(DpoSettings())
    obj.begin(torch.device("cpu"))
    labels = _labels(4, [2, 3, 0, 0])
    total, weights = obj.pairs(torch.tensor([-1.0, -2, 0, 0]), torch.zeros(4), labels)
    assert weights[2:].abs().sum() == 0 and obj.sums()[6] == 1
    assert total.item() == pytest.approx(-torch.nn.functional.logsigmoid(torch.tensor(0.1)).item())


def test_objective_and_data_must_agree():
    """Preference data with `sft`, or `dpo` with other data: one message each, before any
    step (the trainer builds its `PreferenceRun` right after opening the data)."""
    with pytest.raises(CephaloError, match='train.objective is "sft".*set train.objective = "dpo"'):
        check_objective("sft", preference_data=True)
    with pytest.raises(CephaloError, match='"dpo" needs preference data'):
        check_objective("dpo", preference_data=False)
    check_objective("sft", False)
    check_objective("dpo", True)
    cfg = types.SimpleNamespace(
        train=types.SimpleNamespace(objective="sft", dpo_loss="sigmoid", eval_every=0),
        model=types.SimpleNamespace(adapter="none"),
    )
    with pytest.raises(CephaloError, match="preference pairs"):
        PreferenceRun(cfg, types.SimpleNamespace(is_preference=True), "data", None)


@pytest.mark.parametrize("beta", [0, -0.1, float("nan"), float("inf")])
def test_dpo_beta_must_be_positive(beta):
    with pytest.raises(CephaloError, match="train.dpo_beta must be > 0"):
        DpoSettings(beta=beta).validate()
    with pytest.raises(CephaloError, match="train.dpo_loss must be one of"):
        DpoSettings(loss="hinge").validate()


def test_engine_refuses_what_dpo_cannot_train():
    """Full fine-tuning DPO without reference log-probabilities, or a batch that is not
    2 rows per planned pair: one message each, before anything runs."""
    from cephalo.modeling.registry import build_model
    from cephalo.runtime.collectives.comm import LocalComm
    from cephalo.runtime.engine.engine import Engine, EngineConfig
    from engine_common import make_plan

    plan = make_plan([2], [1.0], [1])
    engine = Engine(build_model("gpt-tiny"), plan, LocalComm(), EngineConfig(dpo=DpoSettings()))
    x = torch.randint(0, 100, (4, 16))
    y = _labels(4, [3, 3, 3, 3]).repeat(1, 2)
    with pytest.raises(CephaloError, match="precomputed reference log-probability"):
        engine.train_step(x, y, 1e-3)
    with pytest.raises(CephaloError, match=r"a DPO pair is 2 rows.*4 rows"):
        engine.train_step(x[:3], y[:3], 1e-3, ref_logps=torch.zeros(3))
    ref = engine.reference_logps(x, y)
    assert ref.shape == (4,) and bool((ref < 0).all())
    stats = engine.train_step(x, y, 1e-3, ref_logps=ref)
    assert stats.loss == pytest.approx(0.6931472, rel=1e-6)  # policy = reference at step 1
    assert set(stats.dpo) == set(METRICS)


def test_reference_table_round_trips_by_content(tmp_path):
    """The sidecar maps each row's content to its value, whatever order it is asked in; a
    row it lacks is an error, a cut-off file is recomputed."""
    ids = torch.randint(0, 50, (4, 8))
    labels = _labels(4, [1, 2, 3, 4])
    path = sidecar_path(tmp_path / "prepared", {"model": "x"})
    assert path.parent.name == "prepared.dpo-reference"
    table = ReferenceTable(path)
    for k, v in zip(row_keys(ids, labels), [-1.0, -2.0, -3.0, -4.0], strict=True):
        table.values[k] = v
    table.computed = 4
    table.save()
    again = ReferenceTable(path)
    assert again.lookup(ids[[2, 0]], labels[[2, 0]]).tolist() == [-3.0, -1.0]
    with pytest.raises(CephaloError, match="no precomputed reference"):
        again.lookup(ids[:1] + 1, labels[:1])
    path.write_bytes(b"cut")
    assert ReferenceTable(path).values == {}


def test_dpo_metrics_reach_metrics_jsonl_and_trackers():
    m = dict.fromkeys(METRICS, 0.5)
    record = StepRecord(1, 0.6, 1e-3, 1.0, 10, 1.0, 10.0, False, {}, dpo=m).to_dict()
    assert all(record[k] == 0.5 for k in METRICS) and "dpo" not in record
    scalars = scalars_of(record)
    assert scalars["train/rewards/accuracies"] == 0.5
    assert scalars_of({"kind": "eval", "val_loss": 0.7, **m})["val/rewards/margins"] == 0.5
    plain = StepRecord(1, 0.6, 1e-3, 1.0, 10, 1.0, 10.0, False, {}).to_dict()
    assert not any(k in plain for k in METRICS)


class _PairBatches:
    """A stand-in for the data side's `PreferenceBatches` (the contract: `rank_slice(step,
    offset, size)` gives rows 2 offset .. 2 (offset + size), chosen / rejected interleaved;
    what its rows follow from: `meta`, seq_len, max_prompt_len, seed, global_batch_size).
    Counts its batch reads."""

    is_preference = True
    seq_len, max_prompt_len, seed, global_batch_size = 16, None, 0, 2

    def __init__(self, data):
        from cephalo.preference.data import PreferenceMeta

        self.data = data
        self.meta = PreferenceMeta("standard", "template", "tokenizer", "sources", "stat", 0.25)
        self.reads = 0

    def rank_slice(self, step, offset, size):
        self.reads += 1
        x, y = self.data[step % len(self.data)]
        return x[2 * offset : 2 * (offset + size)], y[2 * offset : 2 * (offset + size)]

    def rank_positions(self, step, offset, size):
        return None


def test_a_job_precomputes_the_reference_once_and_reuses_it(tmp_path):
    """Full fine-tuning DPO through the trainer's `PreferenceRun`: the reference is computed
    before the first step under the job's plan, saved beside the dataset, read back by a
    second job (nothing computed, and no batch read before its first step: the sidecar
    records the walk it covers), and the steps equal the engine's with `reference_logps`
    passed by hand. A longer run is not covered: it walks again."""
    from cephalo.modeling.registry import build_model
    from cephalo.runtime.collectives.comm import LocalComm
    from cephalo.runtime.engine.engine import Engine, EngineConfig
    from engine_common import make_plan
    from reference import make_pairs

    data = make_pairs(2, 2, 16, 100, seed=3)
    cfg = types.SimpleNamespace(
        train=types.SimpleNamespace(
            objective="dpo", dpo_loss="sigmoid", eval_every=1, eval_batches=1
        ),
        model=types.SimpleNamespace(
            adapter="none", name="gpt-tiny", init="random", seed=0, dtype="fp32"
        ),
    )
    plan = make_plan([2], [1.0], [1])

    def engine():
        return Engine(build_model("gpt-tiny"), plan, LocalComm(), EngineConfig(dpo=DpoSettings()))

    losses, reads = [], []
    for steps in (2, 2, 3):
        eng = engine()
        batches = _PairBatches(data)
        job = PreferenceRun(cfg, batches, tmp_path / "prepared", eng.model.spec)
        val = make_pairs(1, 2, 16, 100, seed=4)[0]  # the held-out pairs, as evaluate passes them
        job.prepare(eng, steps, functools.partial(job.eval_loss, eng, *val, None))
        reads.append(batches.reads)
        losses.append([job.step(eng, x, y, 1e-3, None).loss for x, y in data])
        computed = job.table.computed
    assert reads == [2, 0, 3], reads  # the second job did not walk its batches; the longer did
    assert computed == 0 and job.table.path.is_file()  # the second job read the sidecar
    eng = engine()
    by_hand = [eng.train_step(x, y, 1e-3, ref_logps=eng.reference_logps(x, y)) for x, y in data[:1]]
    assert losses[0] == losses[1] == losses[2]
    assert job.eval_loss(eng, *val, None) > 0 and set(job.eval_metrics()) == set(METRICS)
    note = job.done_note("ckpt")  # the run's closing line
    assert "rewards/accuracies" in note and note.endswith(", checkpoint ckpt")
    assert losses[0][0] == pytest.approx(by_hand[0].loss, rel=1e-6)


# ----------------------------------------------------------------------------- a job on ranks
pool3 = dist_pool_fixture(3, timeout_s=300)
UNEVEN_DEVICES = "cpu,cpu:slowdown=2,cpu:slowdown=3"


def _dpo_job_args(run_dir, model_dir, data, *extra: str) -> list[str]:
    """A 2-step full fine-tuning DPO job (no adapter, fp32) that evaluates at its last step:
    the reference pass covers the training rows and the held-out ones."""
    return [
        f"--logging.dir={run_dir}",
        "--logging.progress=false",
        f"--model.name={model_dir}",
        "--model.init=random",
        "--model.dtype=fp32",
        "--model.adapter=none",
        f"--data.path={data}",
        "--data.seq_len=96",
        "--data.max_prompt_len=64",
        "--data.val_fraction=0.25",
        "--train.objective=dpo",
        "--train.steps=2",
        "--train.warmup_steps=1",
        "--train.global_batch_size=6",
        "--train.lr=1e-3",
        "--train.eval_every=2",
        "--train.eval_batches=1",
        "--parallel.plan=proportional",
        "--checkpoint.every=0",
        *extra,
    ]


def _counted_dpo_job(args: list[str]) -> tuple[dict[int, float], int, int]:
    """The trainer's job on this rank (1 process, or the pool's process group): its losses,
    how many reference passes (`Engine.reference_logps` calls) this rank ran and how many
    training batches it read (`PreferenceBatches.rank_slice`: the start's walk and the steps)."""
    from unittest import mock

    from cephalo.preference.data import PreferenceBatches
    from cephalo.runtime.engine.engine import Engine
    from cephalo.train.config_manager import load_config
    from cephalo.train.trainer import train

    calls, reads = [], []
    original, read = Engine.reference_logps, PreferenceBatches.rank_slice

    def counted(self, *a, **kw):
        calls.append(1)
        return original(self, *a, **kw)

    def counted_read(self, *a, **kw):
        reads.append(1)
        return read(self, *a, **kw)

    with (
        mock.patch.object(Engine, "reference_logps", counted),
        mock.patch.object(PreferenceBatches, "rank_slice", counted_read),
    ):
        result = train(load_config(None, args))
    return dict(result.losses), len(calls), len(reads)


@pytest.mark.slow
def test_full_finetuning_reference_on_uneven_ranks_is_plan_invariant_and_reused(pool3, tmp_path):
    """Full fine-tuning DPO through the trainer on 3 uneven emulated ranks (one of them
    memory-only: it found that `ReferenceTable.ensure` failed on a rank with no rows): the
    reference table's collective pass (a "missing" all-reduce, then all-gathers of every
    rank's rows) gives every rank the same table, written once as the sidecar beside the
    dataset; a second job on the same data under another plan runs no reference pass on any
    rank and leaves the file alone; and
    the losses equal a 1-rank job's that computed its own reference on a copy of the data
    (plan invariance, rel 1e-5). TRL's metrics reach metrics.jsonl."""
    from cephalo.cli import main as cli_main
    from cephalo.preference.example import write_preference_example
    from cephalo.train.metrics import read_metrics

    example = write_preference_example(tmp_path / "ex", pairs=24, vocab_size=300)
    prepare = ["prepare-data", "--input", str(example.jsonl), "--tokenizer", str(example.model)]
    for name in ("ds1", "ds3"):
        out = ["--output", str(tmp_path / name), "--seq-len", "96", "--max-prompt-len", "64"]
        assert cli_main([*prepare, *out]) == 0

    def args(run: str, data: str, *extra: str) -> list[str]:
        return _dpo_job_args(tmp_path / run, example.model, tmp_path / data, *extra)

    # uneven batches (4, 2, 0 pairs: micro-batches on rank 0, a memory-only rank 2) and shards
    ranks = [
        RankPlan(0, "cpu", 4, 2, 2, 0.5),
        RankPlan(1, "cpu:slowdown=2", 2, 1, 2, 0.3),
        RankPlan(2, "cpu:slowdown=3", 0, 1, 0, 0.2),
    ]
    Plan("manual", str(example.model), 96, 6, "fp32", ranks).to_json(tmp_path / "plan.json")
    devices = f"--parallel.devices={UNEVEN_DEVICES}"
    first = pool3.run(
        _counted_dpo_job, args("run3", "ds3", devices, f"--parallel.plan={tmp_path / 'plan.json'}")
    )
    sidecars = list((tmp_path / "ds3.dpo-reference").glob("*.pt"))
    assert len(sidecars) == 1, sidecars
    stamp = sidecars[0].stat().st_mtime_ns
    # keyed by content: the sidecar serves another plan too (proportional: 3, 2, 1 pairs)
    again = pool3.run(_counted_dpo_job, args("run3-again", "ds3", devices))
    one_losses, one_calls, _ = _counted_dpo_job(args("run1", "ds1"))

    losses = first[0][0]
    assert sorted(losses) == [1, 2] and all(r[0] == losses for r in first), first
    assert all(r[0] == again[0][0] for r in again), again
    # the pass ran on every rank, once per batch: the 2 steps', then the evaluation's
    assert [calls for _, calls, _ in first] == [3, 3, 3] and one_calls == 3, (first, one_calls)
    assert [calls for _, calls, _ in again] == [0, 0, 0], "the second job recomputed the reference"
    # the first job read each step's batch twice (its walk, its step), the second once
    assert [r for _, _, r in first] == [4, 4, 4] and [r for _, _, r in again] == [2, 2, 2]
    assert sidecars[0].stat().st_mtime_ns == stamp
    assert losses[1] == pytest.approx(0.6931472, rel=1e-5)  # policy = reference at step 1
    for other in (one_losses, again[0][0]):  # plan invariance
        assert sorted(other) == [1, 2]
        for step, loss in other.items():
            assert loss == pytest.approx(losses[step], rel=1e-5), (step, other, losses)
    # both tables hold the same rows and values, whoever computed them
    one = ReferenceTable(next((tmp_path / "ds1.dpo-reference").glob("*.pt")))
    three = ReferenceTable(sidecars[0])
    assert one.values.keys() == three.values.keys() and len(one.values) > 0
    for key, value in one.values.items():
        assert three.values[key] == pytest.approx(value, rel=1e-5)

    for run in ("run3", "run1"):
        train_records = read_metrics(tmp_path / run / "metrics.jsonl")
        evals = read_metrics(tmp_path / run / "metrics.jsonl", kind="eval")
        records = train_records + evals
        assert len(train_records) == 2 and len(evals) == 1, records
        assert all(set(METRICS) <= set(r) for r in train_records + evals), records
