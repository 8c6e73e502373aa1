"""Checkpoints: logical layout (save under one sharding, load under any), atomic, verified."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import pytest
import torch

from cephalo.errors import CephaloError
from cephalo.planner.makers import manual_plan
from cephalo.runtime.state.flat import FlatShard
from cephalo.train.checkpoint import (
    MARKER,
    Sites,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    resume_target,
    save_checkpoint,
    sites_from_probe,
    verify_checkpoint,
)
from cephalo.train.checkpoint import store as ckpt
from dist_harness import dist_pool_fixture

# Logical tensors as the engine names them. Two "units", each one flat buffer sharded by the
# fractions, so pieces start mid-tensor and small tensors land wholly on one rank (others empty).
UNITS = {
    "embedding": {"embedding.wte.weight": (37, 8), "embedding.wpe.weight": (5, 8)},
    "head": {"head.ln_f.weight": (8,), "head.ln_f.bias": (8,), "head.scale": (1,)},
}
NAMES = [n for unit in UNITS.values() for n in unit] + [
    f"optim.exp_avg.{n}" for unit in UNITS.values() for n in unit
]


def _shape(name: str) -> tuple[int, ...]:
    base = name.removeprefix("optim.exp_avg.")
    return next(unit[base] for unit in UNITS.values() if base in unit)


def reference(name: str) -> torch.Tensor:
    """The true value of each logical tensor (deterministic per name)."""
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(_shape(name), generator=gen)


def _ranges(numel: int, fractions: list[float]) -> list[tuple[int, int]]:
    bounds = [round(numel * sum(fractions[:i]) / sum(fractions)) for i in range(len(fractions) + 1)]
    return [(bounds[i], bounds[i + 1] - bounds[i]) for i in range(len(fractions))]


def make_shards(fractions: list[float], rank: int, fill: float | None = None, dtype=torch.float32):
    """This rank's pieces as views into one flat buffer per (unit, state kind), like the engine.

    fill=None: the reference values; otherwise a constant (to be overwritten by a load).
    Returns (shards, buffers)."""
    shards, buffers = [], []
    for prefix in ("", "optim.exp_avg."):
        for unit in UNITS.values():
            numel = sum(math.prod(s) for s in unit.values())
            start, size = _ranges(numel, fractions)[rank]
            buf = torch.full((size,), float("nan") if fill is None else fill, dtype=dtype)
            buffers.append(buf)
            pos = 0
            for name, shape in unit.items():
                n = math.prod(shape)
                lo, hi = max(pos, start), min(pos + n, start + size)
                hi = max(lo, hi)
                view = buf[lo - start : hi - start] if hi > lo else buf[0:0]
                full_name = prefix + name
                if fill is None and hi > lo:
                    view.copy_(reference(full_name).reshape(-1)[lo - pos : hi - pos])
                shards.append(
                    FlatShard(full_name, torch.Size(shape), lo - pos if hi > lo else 0, view)
                )
                pos += n
    return shards, buffers


def assert_holds_reference(shards: list[FlatShard], dtype=torch.float32) -> None:
    for s in shards:
        want = reference(s.name).reshape(-1)[s.offset : s.offset + s.local.numel()].to(dtype)
        assert torch.equal(s.local, want), s.name


def save_single(root: Path, step: int, **kw) -> Path:
    shards, _ = make_shards([1.0], 0)
    return save_checkpoint(root, step, shards, {"step": step}, {"step": step, "tokens": 123}, **kw)


# ------------------------------------------------------------------ one process


def test_round_trip_fills_live_views_in_place(tmp_path: Path):
    path = save_single(tmp_path, 10)
    assert path == tmp_path / "step_000010" and (path / MARKER).is_file()
    shards, buffers = make_shards([1.0], 0, fill=-7.0)
    step, extra, trainer = load_checkpoint(tmp_path, shards)
    assert (step, extra, trainer) == (10, {"step": 10}, {"step": 10, "tokens": 123})
    assert_holds_reference(shards)
    assert all(bool((b != -7.0).all()) for b in buffers)  # the engine's own buffers were written


def test_marker_records_shapes_sizes_and_versions(tmp_path: Path):
    marker = json.loads((save_single(tmp_path, 3) / MARKER).read_text())
    assert marker["step"] == 3 and marker["world_size"] == 1
    assert marker["tensors"]["embedding.wte.weight"] == {"shape": [37, 8], "dtype": "float32"}
    assert set(marker["tensors"]) == set(NAMES)
    assert ".metadata" in marker["sha256"] and all(size > 0 for size in marker["files"].values())
    assert marker["cephalo_version"]


def test_load_converts_dtype(tmp_path: Path):
    save_single(tmp_path, 1)
    shards, _ = make_shards([1.0], 0, fill=0.0, dtype=torch.bfloat16)
    load_checkpoint(tmp_path / "step_000001", shards)
    assert_holds_reference(shards, dtype=torch.bfloat16)


def test_keep_last(tmp_path: Path):
    for step in (1, 2, 3, 4, 5):
        save_single(tmp_path, step, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000004", "step_000005"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000005"


def test_same_step_saved_again_replaces_it(tmp_path: Path):
    save_single(tmp_path, 7)
    shards, _ = make_shards([1.0], 0)
    save_checkpoint(tmp_path, 7, shards, {}, {"second": True})
    assert load_checkpoint(tmp_path, make_shards([1.0], 0, fill=0.0)[0])[2] == {"second": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000007"]


def test_crash_between_write_and_rename_keeps_previous(tmp_path: Path, monkeypatch):
    save_single(tmp_path, 10)

    def crash(tmp: Path, final: Path) -> None:
        raise OSError("simulated crash before the rename")

    monkeypatch.setattr(ckpt, "_publish", crash)
    with pytest.raises(CephaloError, match="previous checkpoint is untouched"):
        save_single(tmp_path, 20)
    monkeypatch.undo()
    staging = tmp_path / "step_000020.tmp"
    assert staging.is_dir() and (staging / ".metadata").is_file()  # fully written, not published
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000010"
    assert load_checkpoint(tmp_path, make_shards([1.0], 0, fill=0.0)[0])[0] == 10
    save_single(tmp_path, 30)  # the next save clears the leftover
    assert not staging.exists()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000010", "step_000030"]


def _data_file(path: Path) -> Path:
    return next(p for p in path.iterdir() if p.suffix == ".distcp")


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda p: (p / MARKER).unlink(), "no COMPLETE marker"),
        (lambda p: (p / MARKER).write_text("{not json"), "unreadable COMPLETE marker"),
        (lambda p: os.truncate(_data_file(p), _data_file(p).stat().st_size // 2), "truncated"),
        (lambda p: _data_file(p).unlink(), "is missing"),
        (
            lambda p: (p / ".metadata").write_bytes(b"x" * (p / ".metadata").stat().st_size),
            "checksum",
        ),
        (
            lambda p: (p / "trainer_state.pt").write_bytes(
                b"\0" * (p / "trainer_state.pt").stat().st_size
            ),
            "checksum",
        ),
    ],
    ids=[
        "no-marker",
        "bad-marker",
        "truncated",
        "missing-file",
        "corrupt-metadata",
        "corrupt-state",
    ],
)
def test_damaged_checkpoint_falls_back_or_explains(tmp_path: Path, caplog, damage, reason: str):
    save_single(tmp_path, 10)
    newest = save_single(tmp_path, 20)
    damage(newest)
    with pytest.raises(CephaloError, match=reason):
        verify_checkpoint(newest)
    with caplog.at_level(logging.WARNING, logger="cephalo"):
        caplog.handler.setLevel(logging.WARNING)
        logging.getLogger("cephalo").addHandler(caplog.handler)
        try:
            assert latest_checkpoint(tmp_path) == tmp_path / "step_000010"
            step, _, _ = load_checkpoint(tmp_path, make_shards([1.0], 0, fill=0.0)[0])
        finally:
            logging.getLogger("cephalo").removeHandler(caplog.handler)
    assert step == 10
    assert "step_000020" in caplog.text and reason.split()[0] in caplog.text
    assert "loaded step_000010 instead" in caplog.text
    # asked for explicitly: an error naming what is wrong and the alternatives
    with pytest.raises(CephaloError) as err:
        load_checkpoint(newest, make_shards([1.0], 0, fill=0.0)[0])
    assert reason.split()[0] in str(err.value) and "step_000010" in str(err.value)


def test_data_corruption_found_by_dcp_falls_back(tmp_path: Path):
    # same size, garbage content: passes the size check, fails when DCP reads it
    save_single(tmp_path, 10)
    newest = save_single(tmp_path, 20)
    data = _data_file(newest)
    data.write_bytes(b"\x00" * data.stat().st_size)
    shards, _ = make_shards([1.0], 0, fill=0.0)
    assert load_checkpoint(tmp_path, shards)[0] == 10
    assert_holds_reference(shards)


def test_no_checkpoint_at_all(tmp_path: Path):
    assert latest_checkpoint(tmp_path / "nothing") is None
    assert latest_checkpoint(tmp_path) is None
    with pytest.raises(CephaloError, match="no checkpoint"):
        load_checkpoint(tmp_path, make_shards([1.0], 0)[0])
    (tmp_path / "step_000005").mkdir()  # a torn directory only
    with pytest.raises(CephaloError, match="no usable checkpoint.*resume"):
        load_checkpoint(tmp_path, make_shards([1.0], 0)[0])


def test_model_mismatch_is_an_error_not_a_fallback(tmp_path: Path):
    save_single(tmp_path, 10)
    save_single(tmp_path, 20)
    shards, _ = make_shards([1.0], 0, fill=0.0)
    wrong = [
        FlatShard(s.name, (4, 2), 0, torch.zeros(8)) if s.name == "head.ln_f.weight" else s
        for s in shards
    ]
    with pytest.raises(
        CephaloError, match=r"head.ln_f.weight has shape \[8\] there and \[4, 2\] in the model"
    ):
        load_checkpoint(tmp_path, wrong)
    with pytest.raises(
        CephaloError, match="the checkpoint has tensors the model lacks: head.scale"
    ):
        load_checkpoint(tmp_path, [s for s in shards if s.name != "head.scale"])
    extra = FlatShard("blocks.9.new", (3,), 0, torch.zeros(3))
    with pytest.raises(
        CephaloError, match="the model has tensors the checkpoint lacks: blocks.9.new"
    ):
        load_checkpoint(tmp_path, [*shards, extra])


@pytest.mark.parametrize(
    "pieces, message",
    [
        ([FlatShard("a", (4,), 0, torch.zeros(3))], "cover 3 of its 4 elements"),
        ([FlatShard("a", (4,), 2, torch.zeros(4))], "outside the tensor's 4 elements"),
        ([FlatShard("a", (4,), 0, torch.zeros(2, 2))], "must be a 1-D tensor"),
        (
            [FlatShard("a", (4,), 0, torch.zeros(4)), FlatShard("a", (4,), 0, torch.zeros(4))],
            "two pieces",
        ),
    ],
)
def test_bad_pieces_are_rejected_before_writing(tmp_path: Path, pieces, message):
    with pytest.raises(CephaloError, match=message):
        save_checkpoint(tmp_path, 1, pieces, {}, {})
    assert not any(tmp_path.iterdir())


def test_state_must_be_plain_data(tmp_path: Path):
    class Opaque:
        pass

    shards, _ = make_shards([1.0], 0)
    with pytest.raises(CephaloError, match="extra state must be plain data"):
        save_checkpoint(tmp_path, 1, shards, {"x": Opaque()}, {})
    with pytest.raises(CephaloError, match="trainer state must be plain data"):
        save_checkpoint(tmp_path, 1, shards, {}, {"x": Opaque()})
    assert not any(tmp_path.iterdir())


def test_resume_target(tmp_path: Path):
    assert resume_target("never", tmp_path) is None
    assert resume_target("auto", tmp_path) is None
    path = save_single(tmp_path, 4)
    assert resume_target("auto", tmp_path) == path
    assert resume_target(str(path), tmp_path) == path
    with pytest.raises(CephaloError, match="no such checkpoint.*step_000004"):
        resume_target(str(tmp_path / "step_000099"), tmp_path)


def test_sites_come_from_the_probe_or_say_why_not():
    """The sets of ranks that see one directory (each rank's lowest peer), from who found whose
    probe file; a rank that sees another but not the same others is no directory per node."""
    assert sites_from_probe([[0], [1, 2], [1, 2]]) == ((0, 1, 1), None)
    assert sites_from_probe([[0, 1, 2]] * 3) == ((0, 0, 0), None)
    sites, why = sites_from_probe([[0, 1], [0, 1, 2], [1, 2]])
    assert sites is None and why.startswith("ranks 0 and 1 see each other's files but not the same")
    assert Sites.of([0, 1, 1]).groups(3) == [[0], [1, 2]] and Sites.of([0, 0, 0]).shared


def test_a_node_local_copy_verifies_as_the_parts_it_holds(tmp_path: Path):
    """A node-local marker (`parts`): a copy holding one part whole verifies (another node's
    files absent), one holding a part in part names the missing file, none is said."""
    path = save_single(tmp_path, 3)
    marker = json.loads((path / MARKER).read_text())
    mine = ["__0_0.distcp", "extra_rank00000.pt"]
    marker["files"]["__1_0.distcp"] = 10  # node 1's shards, in node 1's copy only
    marker["parts"] = [{"ranks": [0], "files": mine}, {"ranks": [1], "files": ["__1_0.distcp"]}]
    (path / MARKER).write_text(json.dumps(marker))
    assert verify_checkpoint(path)["step"] == 3
    (path / "extra_rank00000.pt").unlink()
    with pytest.raises(CephaloError, match="file extra_rank00000.pt is missing"):
        verify_checkpoint(path)
    (path / "__0_0.distcp").unlink()
    with pytest.raises(CephaloError, match="holds none of the node-local checkpoint's parts"):
        verify_checkpoint(path)


# ------------------------------------------------------------------ 3 gloo ranks

pool3 = dist_pool_fixture(3, timeout_s=90)
LAYOUT_A = [0.6, 0.3, 0.1]
LAYOUT_B = [0.5, 0.5]
LAYOUT_A2 = [0.1, 0.1, 0.8]


def _save_a(root: str, step: int):
    import torch.distributed as dist

    from cephalo.runtime.collectives.comm import make_comm

    rank = dist.get_rank()
    shards, _ = make_shards(LAYOUT_A, rank)
    extra = {"rank": rank, "rng": torch.Generator().manual_seed(rank).get_state()}
    path = save_checkpoint(
        root, step, shards, extra, {"saved_by": rank, "step": step}, make_comm("gloo")
    )
    return str(path)


def _load_b(root: str):
    """2 of the 3 ranks, in a subgroup, each loading half of every unit."""
    import torch.distributed as dist

    group = dist.new_group([0, 1])  # every rank of the default group must create it
    rank = dist.get_rank()
    if rank > 1:
        return None
    shards, _ = make_shards(LAYOUT_B, rank, fill=0.0)
    step, extra, trainer = load_checkpoint(root, shards, group)
    return step, extra["rank"], trainer, [(s.name, s.offset, s.local.clone()) for s in shards]


def _load_a2(root: str):
    import torch.distributed as dist

    rank = dist.get_rank()
    shards, _ = make_shards(LAYOUT_A2, rank, fill=0.0)
    step, extra, _ = load_checkpoint(root, shards)
    return step, extra.get("rank"), [(s.name, s.offset, s.local.clone()) for s in shards]


def _check_pieces(pieces) -> None:
    for name, offset, local in pieces:
        want = reference(name).reshape(-1)[offset : offset + local.numel()]
        assert torch.equal(local, want), name


@pytest.mark.slow
def test_save_3_ranks_load_2_ranks_1_process_and_other_split(pool3, tmp_path: Path):
    root = tmp_path / "ckpt"
    paths = pool3.run(_save_a, str(root), 10)
    assert paths == [str(root / "step_000010")] * 3
    marker = verify_checkpoint(root / "step_000010")
    assert marker["world_size"] == 3
    # the pieces of every tensor were saved as chunks of one logical tensor, by 3 ranks
    assert {f for f in marker["files"] if f.endswith(".distcp")} == {
        "__0_0.distcp",
        "__1_0.distcp",
        "__2_0.distcp",
    }

    # layout B: 2 ranks [0.5, 0.5] (a subgroup)
    results = pool3.run(_load_b, str(root))
    assert results[2] is None
    for rank, (step, extra_rank, trainer, pieces) in enumerate(results[:2]):
        assert step == 10 and extra_rank == rank and trainer == {"saved_by": 0, "step": 10}
        _check_pieces(pieces)

    # layout A2: 3 ranks, other fractions
    for rank, (step, extra_rank, pieces) in enumerate(pool3.run(_load_a2, str(root))):
        assert step == 10 and extra_rank == rank
        _check_pieces(pieces)

    # layout C: this process alone, no process group
    shards, _ = make_shards([1.0], 0, fill=0.0)
    step, extra, trainer = load_checkpoint(root, shards)
    assert step == 10 and extra["rank"] == 0 and trainer["saved_by"] == 0
    assert_holds_reference(shards)

    # and back: a 1-process checkpoint loads on 3 ranks
    one = tmp_path / "one"
    save_single(one, 5)
    for step, _, pieces in pool3.run(_load_a2, str(one)):
        assert step == 5
        _check_pieces(pieces)


def _save_with_bad_rank(root: str, what: str):
    import torch.distributed as dist

    rank = dist.get_rank()
    shards, _ = make_shards(LAYOUT_A, rank)
    extra: dict = {}
    if rank == 1 and what == "gap":
        shards = shards[1:]  # rank 1 forgets a piece: the tensor is not covered
    if rank == 2 and what == "opaque":
        extra = {"x": object()}
    try:
        save_checkpoint(root, 1, shards, extra, {})
    except CephaloError as e:
        return str(e)
    return "no error"


def _load_with_bad_rank(root: str):
    import torch.distributed as dist

    rank = dist.get_rank()
    shards, _ = make_shards(LAYOUT_A, rank, fill=0.0)
    if rank == 2:
        shards = [
            FlatShard(s.name, (99,), 0, s.local[:0]) if s.name == "head.scale" else s
            for s in shards
        ]
    try:
        load_checkpoint(root, shards)
    except CephaloError as e:
        return str(e)
    return "no error"


@pytest.mark.slow
def test_one_bad_rank_fails_every_rank_without_hanging(pool3, tmp_path: Path):
    root = tmp_path / "bad"
    errors = pool3.run(_save_with_bad_rank, str(root), "gap", timeout_s=60)
    assert all("do not tile" in e or "cover" in e for e in errors), errors
    errors = pool3.run(_save_with_bad_rank, str(root), "opaque", timeout_s=60)
    assert all(e.startswith("rank 2:") and "plain data" in e for e in errors), errors
    assert not list_checkpoints(root)
    pool3.run(_save_a, str(root), 3)
    errors = pool3.run(_load_with_bad_rank, str(root), timeout_s=60)
    assert all("head.scale has shape [1] there and [99] in the model" in e for e in errors), errors


def _probe_body(run_dir: str, *overrides: str):
    """The checkpoint directory's probe (the doctor's, run before training) on this rank's view
    of it: the emulated cluster `cpu@node0,2xcpu@node1` with the given options."""
    import torch.distributed as dist

    from cephalo.runtime.collectives.comm import make_comm
    from cephalo.train.config_manager import load_config
    from cephalo.train.discovery import node_view
    from cephalo.train.doctor import checkpoint_check

    cfg = load_config(
        None, [f"--logging.dir={run_dir}", "--parallel.devices=cpu@node0,2xcpu@node1", *overrides]
    )
    node = 0 if dist.get_rank() == 0 else 1
    directory = node_view(cfg, cfg.checkpoint_dir, node)
    row = checkpoint_check(directory, make_comm("gloo"), cfg.checkpoint.node_local)
    return row.status, row.found, row.fix


@pytest.mark.slow
def test_the_probe_fails_across_emulated_nodes_without_a_shared_directory(tmp_path, pool3):
    """Finding 5, on the emulator with per-node roots: node 1's ranks see each other's probe
    but not node 0's, so the probe fails (every rank the same row), naming the pairs; with the
    checkpoints under a declared shared directory it passes, and under `checkpoint.node_local`
    with a directory per node (its sets of ranks named); the probe files are gone."""
    private = ("--parallel.emulate_node_fs=private",)
    rows = pool3.run(_probe_body, str(tmp_path / "run"), *private)
    for status, found, fix in rows:  # the same row on every rank, for its own view
        assert status == "FAIL" and found.endswith("do not see each other's files: 0<->1, 0<->2")
        assert "shared storage" in fix
    assert "node-fs/node1" in rows[1][1] and "node-fs" not in rows[0][1]
    shared = (
        f"--parallel.shared_dir={tmp_path / 'nfs'}",
        f"--checkpoint.dir={tmp_path / 'nfs' / 'ck'}",
    )
    rows = pool3.run(_probe_body, str(tmp_path / "run"), *private, *shared)
    assert rows == [("ok", f"{tmp_path / 'nfs' / 'ck'}: shared by all 3 rank(s)", "")] * 3
    node_local = pool3.run(
        _probe_body, str(tmp_path / "run"), *private, "--checkpoint.node_local=true"
    )
    for status, found, _ in node_local:  # checkpoint.node_local: a directory per node passes
        assert status == "ok" and found.endswith("node-local, 2 directories: [0] | [1, 2]")
    assert not list((tmp_path / "nfs" / "ck").iterdir())


def _train_body(run_dir: str, *overrides: str):
    """`cephalo train`'s job on this rank (the pool's process group), its error's message."""
    from cephalo.train.config_manager import load_config
    from cephalo.train.trainer import train
    from run_common import tiny_job_args

    try:
        train(load_config(None, tiny_job_args(run_dir, *overrides)))
    except CephaloError as err:
        return str(err)
    return "trained"


@pytest.mark.slow
def test_training_stops_before_its_first_step_on_a_late_rank_or_a_private_directory(
    tmp_path, pool3
):
    """Findings 5 and 6 in the trainer, on the emulator: a rank later than `parallel.
    startup_timeout_s` is named on the others (and stops itself) before discovery; emulated
    nodes with filesystems of their own and no shared checkpoint directory stop at the probe
    before the first step, with what to do."""
    late = ("--parallel.emulate_start_delay=2:2", "--parallel.startup_timeout_s=0.5")
    out = pool3.run(_train_body, str(tmp_path / "late"), "--parallel.devices=3xcpu", *late)
    for message in out[:2]:
        assert message.startswith("rank(s) 2 did not reach start-up phase 'discovery'"), out
    assert "after the other ranks had given up" in out[2]
    devices = "--parallel.devices=cpu@node0,2xcpu@node1"
    out = pool3.run(
        _train_body, str(tmp_path / "private"), devices, "--parallel.emulate_node_fs=private"
    )
    for message in out:
        assert message.startswith("the checkpoint directory is not one every rank can use"), out
        assert "0<->1, 0<->2" in message and "parallel.shared_dir" in message
        assert "checkpoint.node_local = true" in message
    assert not (tmp_path / "private" / "metrics.jsonl").exists()


def _train_losses(run_dir: str, *overrides: str):
    """`cephalo train`'s job on this rank: its losses by step, or its error's message."""
    from cephalo.train.config_manager import load_config
    from cephalo.train.trainer import train
    from run_common import tiny_job_args

    try:
        return train(load_config(None, tiny_job_args(run_dir, *overrides))).losses
    except CephaloError as err:
        return str(err)


SHORT = ("--train.steps=2", "--train.warmup_steps=1", "--checkpoint.every=1")
NODE_LOCAL = ("--parallel.emulate_node_fs=private", "--checkpoint.node_local=true", *SHORT)


@pytest.mark.slow
def test_node_local_checkpoints_resume_on_their_nodes_and_together_under_any_plan(tmp_path, pool3):
    """`checkpoint.node_local` on 2 emulated nodes with filesystems of their own (no shared
    directory): the probe passes, each node's directory holds its own ranks' shards and a copy
    of the metadata and marker; resuming there continues the uninterrupted run's losses bit for
    bit; with the ranks on other nodes, or under another plan, the resume stops with one
    message saying what differs;
    the two directories copied together resume as one checkpoint under another plan (one
    process), within fp32 noise."""
    import shutil

    run = tmp_path / "run"
    devices = "--parallel.devices=cpu@node0,2xcpu@node1"
    whole = pool3.run(_train_losses, str(run), devices, *NODE_LOCAL)
    assert isinstance(whole[0], dict) and sorted(whole[0]) == [1, 2], whole
    node0 = run / "checkpoints"
    node1 = run.absolute() / "node-fs" / "node1" / (run.absolute() / "checkpoints").relative_to("/")
    mine = {p.name for p in (node0 / "step_000002").iterdir()}
    theirs = {p.name for p in (node1 / "step_000002").iterdir()}
    common = {MARKER, ".metadata", "trainer_state.pt"}
    assert mine == common | {"__0_0.distcp", "extra_rank00000.pt"}, mine
    assert theirs == common | {f"__{r}_0.distcp" for r in (1, 2)} | {
        f"extra_rank0000{r}.pt" for r in (1, 2)
    }, theirs
    marker = json.loads((node0 / "step_000002" / MARKER).read_text())
    assert marker == json.loads((node1 / "step_000002" / MARKER).read_text())
    assert [p["ranks"] for p in marker["parts"]] == [[0], [1, 2]]

    # interrupted after step 1 (its checkpoint the newest on both nodes): resumed, same loss
    for root in (node0, node1):
        shutil.rmtree(root / "step_000002")
    resumed = pool3.run(_train_losses, str(run), devices, *NODE_LOCAL)
    assert all(r == {2: whole[0][2]} for r in resumed), (resumed, whole[0])

    # the ranks on other nodes: rank 1 does not find its shards on node 0
    moved = pool3.run(
        _train_losses, str(run), "--parallel.devices=2xcpu@node0,cpu@node1", *NODE_LOCAL
    )
    for message in moved:
        assert isinstance(message, str) and "is node-local" in message, moved
        assert "rank 1 does not find its shards there: it lacks __1_0.distcp" in message
        assert "([0] | [1, 2] saved, [0, 1] | [2] now)" in message
        assert "copy every node's step_000002 directory into one directory" in message
    # the same nodes, another plan (other state shards: rank 0 now needs node 1's file)
    plan = tmp_path / "plan.json"
    manual_plan("gpt-tiny", 16, [2, 2, 2], [2, 2, 2], [0.5, 0.3, 0.2]).to_json(plan)
    other = pool3.run(_train_losses, str(run), devices, f"--parallel.plan={plan}", *NODE_LOCAL)
    for message in other:
        assert isinstance(message, str) and "rank 0 does not find its shards there" in message
        assert "the plan (ranks 0, 1, 2 hold other shards)" in message, message
        assert "the ranks of each directory" not in message

    # copied together: one checkpoint, resumed by one process (another plan, world size)
    together = tmp_path / "together" / "step_000001"
    shutil.copytree(node0 / "step_000001", together)
    shutil.copytree(node1 / "step_000001", together, dirs_exist_ok=True)
    verify_checkpoint(together)
    one = _train_losses(str(tmp_path / "one"), *SHORT, f"--checkpoint.resume={together}")
    assert sorted(one) == [2], one
    assert one[2] == pytest.approx(whole[0][2], rel=1e-5), (one, whole[0])
