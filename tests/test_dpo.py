"""The DPO objective's pieces (issue 42), cheap and in one process: the row weights against
autograd on the loss written out, the objective / data cross-check both ways, `dpo_beta`,
the engine's refusals, the precomputed reference table and the metrics records. The
equivalence runs (LoRA vs peft, full fine-tuning vs a frozen copy, plan invariance, IPO) are
in tests/test_lora.py's rank pool."""

from __future__ import annotations

import functools
import types

import pytest
import torch

from cephalo.errors import CephaloError
from cephalo.modeling.units import IGNORE_INDEX
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
    offset, size)` gives rows 2 offset .. 2 (offset + size), chosen / rejected interleaved)."""

    is_preference = True

    def __init__(self, data):
        self.data = data

    def rank_slice(self, step, offset, size):
        x, y = self.data[step % len(self.data)]
        return x[2 * offset : 2 * (offset + size)], y[2 * offset : 2 * (offset + size)]

    def rank_positions(self, step, offset, size):
        return None


def test_a_job_precomputes_the_reference_once_and_reuses_it(tmp_path):
    """Full fine-tuning DPO through the trainer's `PreferenceRun`: the reference is computed
    before the first step under the job's plan, saved beside the dataset, read back by a
    second job (nothing computed), and the steps equal the engine's with
    `reference_logps` passed by hand."""
    from cephalo.modeling.registry import build_model
    from cephalo.runtime.collectives.comm import LocalComm
    from cephalo.runtime.engine.engine import Engine, EngineConfig
    from engine_common import make_plan
    from reference import make_pairs

    data = make_pairs(2, 2, 16, 100, seed=3)
    cfg = types.SimpleNamespace(
        train=types.SimpleNamespace(objective="dpo", dpo_loss="sigmoid", eval_every=1),
        model=types.SimpleNamespace(
            adapter="none", name="gpt-tiny", init="random", seed=0, dtype="fp32"
        ),
    )
    plan = make_plan([2], [1.0], [1])

    def engine():
        return Engine(build_model("gpt-tiny"), plan, LocalComm(), EngineConfig(dpo=DpoSettings()))

    losses = []
    for _ in range(2):
        eng = engine()
        job = PreferenceRun(cfg, _PairBatches(data), tmp_path / "prepared", eng.model.spec)
        val = make_pairs(1, 2, 16, 100, seed=4)[0]  # the held-out pairs, as evaluate passes them
        job.prepare(eng, 2, functools.partial(job.eval_loss, eng, *val, None))
        losses.append([job.step(eng, x, y, 1e-3, None).loss for x, y in data])
        computed = job.table.computed
    assert computed == 0 and job.table.path.is_file()  # the second job read the sidecar
    eng = engine()
    by_hand = [eng.train_step(x, y, 1e-3, ref_logps=eng.reference_logps(x, y)) for x, y in data[:1]]
    assert losses[0] == losses[1]
    assert job.eval_loss(eng, *val, None) > 0 and set(job.eval_metrics()) == set(METRICS)
    note = job.done_note("ckpt")  # the run's closing line
    assert "rewards/accuracies" in note and note.endswith(", checkpoint ckpt")
    assert losses[0][0] == pytest.approx(by_hand[0].loss, rel=1e-6)
