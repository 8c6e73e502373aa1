import json

import pytest

from cephalo import CephaloError, Plan, RankPlan


def _plan(**kw):
    ranks = [
        RankPlan(0, "l4", 5, 2, 3, 0.6),
        RankPlan(1, "p40", 2, 1, 2, 0.3, offload_activations=True),
        RankPlan(2, "a6000", 1, 1, 1, 0.1),
    ]
    d = dict(
        strategy="manual",
        model="gpt-tiny",
        seq_len=16,
        global_batch_size=8,
        dtype="fp32",
        ranks=ranks,
    )
    d.update(kw)
    return Plan(**d)


def test_round_trip(tmp_path):
    p = _plan()
    path = tmp_path / "p.json"
    p.to_json(path)
    q = Plan.from_json(path)
    assert q == p
    assert q.batch_offsets() == [0, 5, 7]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.pop("ranks"), "missing field 'ranks'"),
        (lambda d: d.update(version=99), "version 99 is not supported"),
        (lambda d: d.update(global_batch_size=9), "sum to 8, not global_batch_size 9"),
        (lambda d: d["ranks"][0].update(state_fraction=0.7), "sum to"),
        (
            lambda d: d["ranks"][0].update(num_micro_batches=2),
            "ceil(batch_size / micro_batch_size)",
        ),
        (lambda d: d["ranks"][1].update(rank=5), "in order"),
        (lambda d: d["ranks"][1].update(batch_size="2"), "must be an integer"),
        (lambda d: d.update(dtype="fp8"), "dtype 'fp8'"),
        (lambda d: d["ranks"][2].update(micro_batch_size=0), "micro_batch_size must be >= 1"),
    ],
)
def test_validation_messages(mutate, message):
    d = _plan().to_dict()
    mutate(d)
    with pytest.raises(CephaloError, match=None) as ei:
        Plan.from_json(json.dumps(d))
    assert message in str(ei.value)


def test_world_size_mismatch():
    with pytest.raises(CephaloError, match="for 3 ranks but the job has 4"):
        _plan().validate(world_size=4)


def test_not_json(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(CephaloError, match="not valid JSON"):
        Plan.from_json(path)
    with pytest.raises(CephaloError, match="does not exist"):
        Plan.from_json(tmp_path / "missing.json")
