"""Collectives: LocalComm in-process; gloo/padded on 3 ranks in one process pool."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

from cephalo.errors import CephaloError
from cephalo.runtime.collectives.comm import (
    GlooComm,
    Handle,
    LocalComm,
    NcclComm,
    make_comm,
    shard_offsets,
)
from cephalo.runtime.collectives.dist import check_torch_version, init_distributed, shutdown
from dist_harness import RemoteError, dist_pool_fixture


def test_local_comm_copies_and_counts():
    comm = make_comm()
    assert isinstance(comm, LocalComm) and comm.world_size == 1
    shard = torch.arange(4.0)
    out = torch.empty(4)
    comm.all_gather_v(out, shard, [4], async_op=True).wait()
    assert torch.equal(out, shard)
    red = torch.empty(4)
    comm.reduce_scatter_v(red, torch.arange(4.0) * 2, [4])
    assert torch.equal(red, torch.arange(4.0) * 2)
    t = torch.tensor(3.0)  # all_reduce takes any contiguous shape, scalars too
    comm.all_reduce(t, op="max")
    assert t.item() == 3.0
    assert comm.counters.calls == {"all_gather_v": 1, "reduce_scatter_v": 1, "all_reduce": 1}
    # world size 1 exchanges nothing with other ranks; all_reduce counts the tensor
    assert comm.counters.bytes == {"all_gather_v": 0, "reduce_scatter_v": 0, "all_reduce": 4}
    comm.counters.reset()
    assert sum(comm.counters.calls.values()) == 0


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda c: c.all_gather_v(torch.empty(4), torch.empty(3), [4]), "sizes[0] = 4"),
        (lambda c: c.all_gather_v(torch.empty(5), torch.empty(4), [4]), "sum(sizes) = 4"),
        (lambda c: c.all_gather_v(torch.empty(4), torch.empty(4), [2, 2]), "world size 1"),
        (lambda c: c.all_gather_v(torch.empty(2, 2), torch.empty(4), [4]), "1-D contiguous"),
        (
            lambda c: c.all_gather_v(torch.empty(4), torch.empty(4, dtype=torch.bfloat16), [4]),
            "same dtype",
        ),
        (lambda c: c.reduce_scatter_v(torch.empty(4), torch.empty(4), [-1]), "non-negative"),
        (lambda c: c.all_reduce(torch.empty(4), op="mean"), "unknown op"),
        (lambda c: c.all_reduce(torch.empty(4, 2).t()), "contiguous"),
    ],
)
def test_local_validation(call, message):
    comm = LocalComm()
    with pytest.raises(CephaloError, match=re.escape(message)):
        call(comm)
    assert sum(comm.counters.calls.values()) == 0  # a rejected call is not counted


def test_shard_offsets():
    assert shard_offsets([3, 0, 2]) == [0, 3, 3]


def test_make_comm_rejects_unknown_and_uninitialised():
    with pytest.raises(CephaloError, match="unknown comm implementation"):
        make_comm("mpi")
    with pytest.raises(CephaloError, match="initialised process group"):
        make_comm("gloo")
    with pytest.raises(CephaloError, match="initialised process group"):
        make_comm("nccl")


# ------------------------------------------------------------------ 3 gloo ranks
pool3 = dist_pool_fixture(3, timeout_s=60)

CASES = [[3, 0, 2], [0, 5, 0], [0, 0, 0], [1, 1, 1], [7, 2, 0], [4, 6, 9]]
DTYPES = ["float32", "bfloat16"]


def _rank_data(
    sizes: list[int], dtype: torch.dtype, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic per-rank inputs: a shard and a full-length tensor to reduce."""
    gen = torch.Generator().manual_seed(1000 + rank)
    shard = torch.randn(sizes[rank], generator=gen).to(dtype)
    full = torch.randn(sum(sizes), generator=gen).to(dtype)
    return shard, full


def _gather_scatter_body(impl: str, dtype_name: str, cases: list[list[int]]):
    import torch.distributed as dist

    comm = make_comm(impl)
    dtype = getattr(torch, dtype_name)
    results = []
    for i, sizes in enumerate(cases):
        shard, full = _rank_data(sizes, dtype, dist.get_rank())
        gathered = torch.full((sum(sizes),), float("nan"), dtype=dtype)
        gather = comm.all_gather_v(gathered, shard, sizes, async_op=True)
        reduced = torch.full((sizes[comm.rank],), float("nan"), dtype=dtype)
        # every other case: the reduce-scatter in flight together with the gather
        scatter = comm.reduce_scatter_v(reduced, full.clone(), sizes, async_op=i % 2 == 1)
        gather.wait()
        scatter.wait()
        results.append((gathered, reduced))
    return results, comm.counters.calls, comm.counters.bytes, comm.backend


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["auto", "gloo", "padded"])
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_gather_and_reduce_scatter_uneven(pool3, impl, dtype_name):
    dtype = getattr(torch, dtype_name)
    per_rank = pool3.run(_gather_scatter_body, impl, dtype_name, CASES)
    for case_index, sizes in enumerate(CASES):
        data = [_rank_data(sizes, dtype, r) for r in range(3)]
        expect_gathered = torch.cat([shard for shard, _ in data])
        # the reduction order inside gloo is not ours: compare in fp32 with a dtype tolerance
        expect_sum = torch.stack([full.float() for _, full in data]).sum(0)
        offsets = shard_offsets(sizes)
        for rank, (results, _, _, _) in enumerate(per_rank):
            gathered, reduced = results[case_index]
            assert gathered.dtype == dtype and torch.equal(gathered, expect_gathered)
            want = expect_sum[offsets[rank] : offsets[rank] + sizes[rank]]
            tol = 1e-6 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(reduced.float(), want, atol=tol, rtol=tol)
    for rank, (_, calls, nbytes, backend) in enumerate(per_rank):
        assert backend == "gloo"
        assert calls == {
            "all_gather_v": len(CASES),
            "reduce_scatter_v": len(CASES),
            "all_reduce": 0,
        }
        others = sum(sum(s) - s[rank] for s in CASES) * dtype.itemsize
        assert nbytes == {"all_gather_v": others, "reduce_scatter_v": others, "all_reduce": 0}


def _even_body(even_gather: bool = True):
    import torch.distributed as dist

    comm = make_comm("gloo")
    comm.even_gather = even_gather
    out = []
    for sizes in ([4, 4, 4], [1, 1, 1], [4, 5, 4]):
        shard, full = _rank_data(sizes, torch.float32, dist.get_rank())
        gathered = torch.empty(sum(sizes))
        comm.all_gather_v(gathered, shard, sizes, async_op=True).wait()
        reduced = torch.empty(sizes[comm.rank])
        comm.reduce_scatter_v(reduced, full.clone(), sizes)
        # the list form on the same inputs (what the even path replaces)
        views = list(full.clone().split(sizes))
        listed = torch.empty(sizes[comm.rank])
        dist.reduce_scatter(listed, views)
        out.append(
            (gathered, (reduced - listed).abs().max().item(), dict(comm.counters.even_calls))
        )
    return out


@pytest.mark.slow
def test_equal_sizes_take_the_even_collectives(pool3):
    """Equal sizes run as all_gather_into_tensor / reduce_scatter_tensor (no copy through a
    flattened buffer), with the list forms' result (gloo sums the ranks in another order:
    fp32 rounding); uneven sizes keep the grouped path."""
    for rank, results in enumerate(pool3.run(_even_body)):
        for (gathered, reduce_diff, even), sizes, calls in zip(
            results, ([4, 4, 4], [1, 1, 1], [4, 5, 4]), (1, 2, 2), strict=True
        ):
            expect = torch.cat([_rank_data(sizes, torch.float32, r)[0] for r in range(3)])
            assert torch.equal(gathered, expect), (rank, sizes)
            assert reduce_diff <= 1e-6, (rank, sizes, reduce_diff)
            assert even == {"all_gather_v": calls, "reduce_scatter_v": calls, "all_reduce": 0}
    # gloo's default gathers equal sizes with its broadcasts (faster there): same result
    for results in pool3.run(_even_body, False):
        for (gathered, _, even), sizes in zip(
            results, ([4, 4, 4], [1, 1, 1], [4, 5, 4]), strict=True
        ):
            expect = torch.cat([_rank_data(sizes, torch.float32, r)[0] for r in range(3)])
            assert torch.equal(gathered, expect) and even["all_gather_v"] == 0


def _padded_vs_gloo_body(sizes: list[int]):
    import torch.distributed as dist

    gloo, padded = make_comm("gloo"), make_comm("padded")
    shard, full = _rank_data(sizes, torch.float32, dist.get_rank())
    out_a, out_b = torch.empty(sum(sizes)), torch.empty(sum(sizes))
    gloo.all_gather_v(out_a, shard, sizes)
    padded.all_gather_v(out_b, shard, sizes, async_op=True).wait()
    red_a, red_b = torch.empty(sizes[gloo.rank]), torch.empty(sizes[gloo.rank])
    gloo.reduce_scatter_v(red_a, full.clone(), sizes)
    padded.reduce_scatter_v(red_b, full.clone(), sizes)
    return torch.equal(out_a, out_b), (red_a - red_b).abs().max().item() if red_a.numel() else 0.0


@pytest.mark.slow
def test_padded_equals_gloo(pool3):
    for sizes in ([1000, 3, 517], [0, 64, 1]):
        for same_gather, max_diff in pool3.run(_padded_vs_gloo_body, sizes):
            assert same_gather
            assert max_diff <= 1e-6


def _all_reduce_body(dtype_name: str):
    comm = make_comm()
    dtype = getattr(torch, dtype_name)
    total = torch.tensor([1.0, -2.0, comm.rank], dtype=dtype)
    comm.all_reduce(total)
    biggest = torch.tensor([[float(comm.rank), -float(comm.rank)]], dtype=dtype)  # 2-D is fine
    comm.all_reduce(biggest, op="max")
    return total.tolist(), biggest.flatten().tolist(), comm.counters.calls["all_reduce"]


@pytest.mark.slow
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_all_reduce_sum_and_max(pool3, dtype_name):
    for total, biggest, calls in pool3.run(_all_reduce_body, dtype_name):
        assert total == [3.0, -6.0, 3.0]
        assert biggest == [2.0, 0.0]
        assert calls == 2


def _async_overlap_body(late_s: float):
    import time

    comm = make_comm("gloo", validate=False)  # validation would synchronise the ranks
    sizes = [1 << 16, 1 << 15, 1 << 14]
    shard = torch.full((sizes[comm.rank],), float(comm.rank))
    out = torch.empty(sum(sizes))
    comm.barrier()
    if comm.rank == 2:
        time.sleep(late_s)  # the last rank arrives late: the others must not block in the call
    start = time.perf_counter()
    handle = comm.all_gather_v(out, shard, sizes, async_op=True)
    returned_s = time.perf_counter() - start
    shard.fill_(-1.0)  # the shard may be reused at once
    busy = torch.randn(64, 64) @ torch.randn(64, 64)  # work while the gather is in flight
    handle.wait()
    handle.wait()  # idempotent
    waited_s = time.perf_counter() - start
    expect = torch.cat([torch.full((n,), float(r)) for r, n in enumerate(sizes)])
    return returned_s, waited_s, torch.equal(out, expect), handle.done, bool(busy.isfinite().all())


@pytest.mark.slow
def test_async_all_gather_returns_before_completion(pool3):
    late_s = 1.0
    results = pool3.run(_async_overlap_body, late_s)
    for rank, (returned_s, waited_s, correct, done, _) in enumerate(results):
        assert correct and done
        if rank != 2:
            assert returned_s < 0.5 * late_s, (
                f"rank {rank} blocked {returned_s:.2f}s in an async call"
            )
            assert waited_s > 0.5 * late_s, f"rank {rank} finished before the late rank sent"


def _mismatch_body(kind: str):
    import time

    comm = make_comm("gloo")
    sizes = [4, 2, 3]
    out, shard = torch.empty(9), torch.empty(sizes[comm.rank])
    if kind == "sizes" and comm.rank == 0:
        sizes, shard = [3, 3, 3], torch.empty(3)
    if kind == "shard" and comm.rank == 1:
        shard = torch.empty(5)  # a local error on one rank only
    if kind == "dtype" and comm.rank == 2:
        out, shard = out.bfloat16(), shard.bfloat16()
    start = time.perf_counter()
    try:
        if kind == "collective" and comm.rank == 1:
            comm.reduce_scatter_v(torch.empty(sizes[1]), torch.empty(9), sizes)
        else:
            comm.all_gather_v(out, shard, sizes)
        message = None
    except CephaloError as err:
        message = str(err)
    # the pool must still work after the error: a healthy collective completes
    check = torch.ones(1)
    comm.all_reduce(check)
    return message, time.perf_counter() - start, check.item()


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, expect",
    [
        ("sizes", ["disagree on sizes", "rank 0: [3, 3, 3]", "rank 1: [4, 2, 3]"]),
        ("shard", ["rank(s) [1]"]),
        ("dtype", ["disagree on the dtype", "torch.bfloat16"]),
        ("collective", ["different collectives", "rank 1: reduce_scatter_v"]),
    ],
)
def test_cross_rank_mismatch_raises_everywhere(pool3, kind, expect):
    for rank, (message, elapsed_s, check) in enumerate(
        pool3.run(_mismatch_body, kind, timeout_s=30)
    ):
        assert message is not None, f"rank {rank} did not raise"
        if kind == "shard" and rank == 1:
            assert "rank 1's `shard` has 5 elements" in message
        else:
            for fragment in expect:
                assert fragment in message, (rank, message)
        assert elapsed_s < 5.0  # an error, not a timeout
        assert check == 3.0


# ------------------------------------------------------------ the harness itself
def _raise_on_rank_1():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom from rank 1")
    return dist.get_rank()


def _hang_on_rank_0():
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.barrier()  # nobody else joins: hangs until the process-group timeout
    return dist.get_rank()


def _die_on_rank_2():
    import os

    import torch.distributed as dist

    if dist.get_rank() == 2:
        os._exit(3)
    return dist.get_rank()


def _ranks():
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


@pytest.mark.slow
def test_harness_reports_errors_hangs_and_crashes(pool3):
    with pytest.raises(RemoteError, match=r"(?s)rank\(s\) \[1\].*ValueError: boom from rank 1"):
        pool3.run(_raise_on_rank_1)
    assert pool3.run(_ranks) == [(0, 3), (1, 3), (2, 3)]  # still usable
    with pytest.raises(RemoteError, match=r"rank\(s\) \[0\] did not finish within 3 s"):
        pool3.run(_hang_on_rank_0, timeout_s=3)
    assert pool3.run(_ranks) == [(0, 3), (1, 3), (2, 3)]  # restarted
    with pytest.raises(RemoteError, match=r"rank\(s\) \[2\] died"):
        pool3.run(_die_on_rank_2)
    assert pool3.run(_ranks) == [(0, 3), (1, 3), (2, 3)]


# ------------------------------------------------------------------------ dist.py
def test_init_distributed_without_torchrun_env_is_local(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert isinstance(init_distributed(), LocalComm)
    with pytest.raises(CephaloError, match="needs CUDA"):
        init_distributed(backend="nccl")


def test_init_distributed_bad_env_and_versions(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(CephaloError, match="WORLD_SIZE is not set"):
        init_distributed()
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(CephaloError, match="not an integer"):
        init_distributed()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(CephaloError, match="outside"):
        init_distributed()
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(CephaloError, match="unknown distributed backend"):
        init_distributed(backend="mpi")
    with pytest.raises(CephaloError, match="timeout_s must be positive"):
        init_distributed(timeout_s=0)
    with pytest.raises(CephaloError, match="too old"):
        check_torch_version("2.3.1")
    check_torch_version("2.13.0+cpu")


def test_local_rank_from_any_launcher_and_never_guessed_on_a_multi_gpu_node(monkeypatch):
    """LOCAL_RANK (torchrun), else SLURM's, Open MPI's, MPICH's variable; none of them with
    several ranks on a node of several GPUs is one clear error, not every rank on GPU 0."""
    from cephalo.runtime.collectives import dist as cdist

    assert cdist._local_rank({"LOCAL_RANK": "3", "SLURM_LOCALID": "1"}, 8) == 3
    assert cdist._local_rank({"SLURM_LOCALID": "1"}, 8) == 1
    assert cdist._local_rank({"OMPI_COMM_WORLD_LOCAL_RANK": "2"}, 8) == 2
    with pytest.raises(CephaloError, match="SLURM_LOCALID='x' is not an integer"):
        cdist._local_rank({"SLURM_LOCALID": "x"}, 8)
    assert cdist._local_rank({}, 8) == 0  # this machine: no CUDA device, nothing to pick
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert cdist._local_rank({}, 1) == 0  # one process: GPU 0 is right
    with pytest.raises(CephaloError, match="not LOCAL_RANK .* this node has 4 GPUs"):
        cdist._local_rank({}, 8)


@pytest.mark.parametrize("failed", [False, True])
def test_a_failing_rank_aborts_its_process_group(monkeypatch, failed):
    """`shutdown(failed=True)` aborts the group (destroy_process_group can wait on NCCL work
    the peers never matched); an orderly end destroys it."""
    import torch.distributed as tdist

    from cephalo.runtime.collectives import dist as cdist

    calls = []
    monkeypatch.setattr(tdist, "is_initialized", lambda: True)
    monkeypatch.setattr(tdist, "destroy_process_group", lambda: calls.append("destroy"))
    monkeypatch.setattr(
        tdist.distributed_c10d, "_abort_process_group", lambda: calls.append("abort")
    )
    cdist.shutdown(failed)
    assert calls == (["abort"] if failed else ["destroy"])


def test_init_distributed_world_one_with_env(monkeypatch):
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in dict(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1"
    ).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", str(port))
    try:
        comm = init_distributed(timeout_s=30)
        assert dist.is_initialized() and dist.get_backend() == "gloo"
        assert isinstance(comm, LocalComm)  # world size 1: no collectives needed
        assert isinstance(init_distributed(comm_impl="gloo"), GlooComm)  # reuses the group
    finally:
        shutdown()
    assert not dist.is_initialized()
    shutdown()  # idempotent


def _init_in_pool_body():
    comm = init_distributed()  # the pool's group is already up: reuse it
    return type(comm).__name__, comm.rank, comm.world_size, comm.validate


@pytest.mark.slow
def test_init_distributed_reuses_existing_group(pool3):
    assert pool3.run(_init_in_pool_body) == [("GlooComm", r, 3, True) for r in range(3)]


def _nccl_argument_checks_body():
    # NCCL cannot run here (no GPU); its class still builds on a group and checks arguments
    # locally before touching CUDA when cross-rank validation is off
    comm = NcclComm(validate=False)
    messages = []
    for call in (
        lambda: comm.all_gather_v(torch.empty(5), torch.empty(3), [2, 2, 1]),
        lambda: comm.reduce_scatter_v(torch.empty(2), torch.empty(4), [2, 2, 1]),
        lambda: comm.all_reduce(torch.empty(3), op="avg"),
    ):
        try:
            call()
        except CephaloError as err:
            messages.append(str(err))
    return comm.rank, comm.world_size, messages


@pytest.mark.slow
def test_nccl_comm_validates_arguments(pool3):
    for rank, (got_rank, world, messages) in enumerate(pool3.run(_nccl_argument_checks_body)):
        assert (got_rank, world) == (rank, 3)
        assert len(messages) == 3
        assert f"rank {rank}'s `shard` has 3 elements" in messages[0]
        assert "sum(sizes) = 5" in messages[1]
        assert "unknown op 'avg'" in messages[2]


def _subgroup_body():
    import torch.distributed as dist

    sub = dist.new_group([0, 2])  # every rank must take part in creating it
    if dist.get_rank() == 1:
        return None
    comm = make_comm(group=sub)  # group ranks 0, 1 are global ranks 0, 2
    sizes = [2, 3]
    out = torch.empty(5)
    comm.all_gather_v(out, torch.full((sizes[comm.rank],), float(dist.get_rank())), sizes)
    red = torch.empty(sizes[comm.rank])
    comm.reduce_scatter_v(red, torch.arange(5.0), sizes)
    return comm.rank, comm.world_size, out.tolist(), red.tolist()


@pytest.mark.slow
def test_comm_on_a_subgroup(pool3):
    r0, r1, r2 = pool3.run(_subgroup_body)
    assert r1 is None
    assert r0 == (0, 2, [0.0, 0.0, 2.0, 2.0, 2.0], [0.0, 2.0])
    assert r2 == (1, 2, [0.0, 0.0, 2.0, 2.0, 2.0], [4.0, 6.0, 8.0])


# ------------------------------------------------------------------ scripts/gpu_check.py's checks
GPU_CHECK = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


def _load_gpu_check(path: str):
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _gpu_checks_on_gloo(path: str) -> list[str]:
    check = _load_gpu_check(path)
    cpu = torch.device("cpu")
    import gpu_check_pipeline  # (scripts/ is on the path once gpu_check is loaded)

    return (
        gpu_check_pipeline.check_pipeline_engine(make_comm("auto"), cpu, rel_tol=1e-5)
        + check.check_uneven_collectives(make_comm("auto"), cpu)
        + check.check_uneven_collectives(make_comm("padded"), cpu)
        + check.check_uneven_engine(make_comm("auto"), cpu, rel_tol=1e-5)
        + check.check_uneven_engine(make_comm("auto"), cpu, rel_tol=1e-5, near_even=True)
        + check.check_uneven_engine(_even_gather(make_comm("auto")), cpu, 1e-5, near_even=True)
        + check.check_bf16_cross_reduce(make_comm("auto"), cpu)
    )


def _even_gather(comm):
    """gloo gathering equal sizes as NCCL does (all_gather_into_tensor): the engine then pads
    a near-even split (runtime/collectives/padded.py)."""
    comm.even_gather = True
    return comm


@pytest.mark.slow
def test_gpu_checks_pass_on_gloo(pool3):
    """The world-size >= 2 checks a GPU machine runs on NCCL (scripts/gpu_check.sh), run here
    on gloo: correct collectives and engine pass them."""
    assert pool3.run(_gpu_checks_on_gloo, str(GPU_CHECK)) == [[], [], []]


def test_gpu_collective_check_catches_a_broken_gather():
    class NoCopyComm(LocalComm):
        def _all_gather_v(self, out, shard, sizes, async_op):
            return Handle()  # `out` keeps its old values

    failures = _load_gpu_check(str(GPU_CHECK)).check_uneven_collectives(
        NoCopyComm(), torch.device("cpu")
    )
    # world size 1: the cases with something to gather (4 of 5), 3 dtypes, sync and async
    assert len(failures) == 24 and all(f.startswith("all_gather_v NoCopyComm") for f in failures)


# ------------------------------------------------------------------ start-up barriers
def _late_rank_body(phase: str, delay_s: float, timeout_s: float):
    """Rank 2 reaches the start-up barrier `delay_s` late (a node that loads slowly); every
    rank says how the barrier ended, when it arrived and when it left (one machine's clock)."""
    import time

    from cephalo.runtime.collectives.dist import startup_barrier

    comm = make_comm("gloo")
    if comm.rank == 2:
        time.sleep(delay_s)
    arrived = time.time()
    try:
        startup_barrier(comm, phase, timeout_s)
        outcome = "passed"
    except CephaloError as err:
        outcome = str(err)
    return outcome, arrived, time.time()


@pytest.mark.slow
def test_a_late_rank_within_the_startup_timeout_passes_beyond_it_is_named(pool3):
    """Finding 6: the start-up barrier (store keys, the start-up's own timeout) waits for a
    rank that is late but within its timeout, and names a rank later than it on the others,
    which stop before it arrives: no hang, no collective timeout."""
    results = pool3.run(_late_rank_body, "within", 0.6, 30.0)
    assert [r[0] for r in results] == ["passed"] * 3
    assert min(r[2] for r in results[:2]) >= results[2][1]  # the others waited for it
    results = pool3.run(_late_rank_body, "beyond", 2.0, 0.5)
    for outcome, _, left in results[:2]:
        assert outcome.startswith("rank(s) 2 did not reach start-up phase 'beyond' within 0.5 s")
        assert "parallel.startup_timeout_s" in outcome
        assert left < results[2][1]  # they gave up before it came
    assert "after the other ranks had given up" in results[2][0]
    # the pool's ranks are in step after it: the next barrier of the phase passes
    assert [r[0] for r in pool3.run(_late_rank_body, "beyond", 0.0, 30.0)] == ["passed"] * 3


# ---------------------------------------------------------------- the faithful emulated comm
class _InstantComm(LocalComm):
    """A two-rank comm whose collectives complete at once (the data moves nowhere): what
    `FaithfulComm` adds (queue, link, stream) is then all the time there is."""

    def __init__(self):
        super().__init__(validate=False)
        self.world_size = 2

    def _all_gather_v(self, out, shard, sizes, async_op):
        return Handle()

    def _reduce_scatter_v(self, out, full, sizes, async_op):
        return Handle()


def test_faithful_comm_queues_a_groups_collectives_and_waits_asynchronously():
    """NCCL's semantics (issue 38, finding 8/10): one FIFO queue per process group, two groups
    in parallel, `wait()` returning at once with the stall landing at the stream's next sync."""
    import time

    from cephalo.runtime.collectives.emulated import EmulatedStream, FaithfulComm

    rate = 40e6  # 2 ranks: a ring moves half of the bytes; 4 MB of fp32 -> 50 ms
    link_s = 0.5 * (1 << 20) * 4 / rate
    stream = EmulatedStream()
    group = FaithfulComm(_InstantComm(), stream, rate)
    other = FaithfulComm(_InstantComm(), stream, rate)
    full = torch.zeros(1 << 20)
    t0 = time.perf_counter()
    gather = group.all_gather_v(full, full[: 1 << 19], [1 << 19, 1 << 19], async_op=True)
    scatter = group.reduce_scatter_v(full[: 1 << 19], full, [1 << 19, 1 << 19], async_op=True)
    gather.wait()
    scatter.wait()
    host_s = time.perf_counter() - t0
    assert host_s < 0.5 * link_s, "wait() blocked the host (NCCL only makes the stream wait)"
    # the same group: the scatter starts when the gather has finished
    assert stream.ready_at - t0 == pytest.approx(2 * link_s, rel=0.2)
    slept = stream.sync()
    assert slept == pytest.approx(2 * link_s - host_s, rel=0.25)
    assert stream.sync() == 0.0  # nothing left to wait for
    # two groups run at once: the stream waits for the later one only
    t1 = time.perf_counter()
    handles = [
        comm.all_gather_v(full, full[: 1 << 19], [1 << 19, 1 << 19], async_op=True)
        for comm in (group, other)
    ]
    for h in handles:
        h.wait()
    assert stream.ready_at - t1 == pytest.approx(link_s, rel=0.2)
    # a collective started while the stream still waits starts after that wait (its input
    # is written by the stream): queued behind the stall, not at the host's time
    ready = stream.ready_at
    h = other.reduce_scatter_v(full[: 1 << 19], full, [1 << 19, 1 << 19], async_op=True)
    h.wait()
    assert stream.ready_at == pytest.approx(ready + link_s, abs=0.2 * link_s)
    stream.sync()


def test_step_clock_counts_the_streams_stall_as_communication():
    """The emulated stream's stall is counted where it lands (the next compute, `settle`), as
    CUDA events around the wait measure it on a GPU; the host's own wait stays about 0."""
    import time

    from cephalo.runtime.collectives.emulated import EmulatedStream
    from cephalo.runtime.emulation import ComputeEmulator
    from cephalo.runtime.engine.step_clock import StepClock

    stream = EmulatedStream()
    clock = StepClock(torch.device("cpu"), ComputeEmulator(1.0), stream)
    done = time.perf_counter() + 0.05
    clock.wait(Handle([], lambda: stream.wait_until(done)))
    assert clock.comm_wait_s < 0.02  # the host did not block
    with clock.compute():
        pass
    assert clock.comm_wait_s == pytest.approx(0.05, abs=0.02)
    assert clock.busy_s < 0.02  # the stall is not compute
    stream.wait_until(time.perf_counter() + 0.03)
    before = clock.comm_wait_s
    clock.settle()
    assert clock.comm_wait_s - before == pytest.approx(0.03, abs=0.02)


def test_step_clock_times_a_run_of_compute_with_one_event_pair(monkeypatch):
    """The CUDA events path (issue 39), on the CPU with events that read a made-up stream
    clock (`now`, advanced by hand: exact sums): a run of compute spans (a pass's units, no
    wait between them) costs one pair of events, not one per unit; a wait with something in
    flight ends the run with one event (its own start); an idle handle (one rank) opens no
    span. 18 events before (a pair per span, the idle waits' included), 6 now."""
    from cephalo.runtime.emulation import ComputeEmulator
    from cephalo.runtime.engine.step_clock import StepClock

    now = [0.0]

    class StreamEvent:
        def __init__(self) -> None:
            self.t = now[0]

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, later: StreamEvent) -> float:
            return (later.t - self.t) * 1e3

    clock = StepClock(torch.device("cpu"), ComputeEmulator(1.0))
    clock.events = True

    def record() -> StreamEvent:
        clock.records += 1
        return StreamEvent()

    def advance(s: float) -> None:
        now[0] += s

    monkeypatch.setattr(clock, "_record", record)
    clock.reset()
    for _ in range(3):  # three units of a pass
        with clock.compute():
            advance(0.25)
        clock.wait(Handle())  # one rank's gather: nothing in flight
    clock.wait(Handle([], lambda: advance(0.5)))  # a collective in flight
    with clock.compute():
        advance(0.125)
    times = clock.collect()
    assert clock.records == 6
    assert (times.busy_s, times.comm_wait_s, times.device_step_s) == (0.875, 0.5, 1.375)


def test_emulated_links_rate_is_the_slowest_link_of_the_group():
    from cephalo.runtime.collectives.emulated import EmulatedLinks

    links = EmulatedLinks(8e6, None, (0, 0, 1, 1))
    assert links.rate([0, 1]) is None  # within a node, no declared rate: gloo's own speed
    assert links.rate([0, 1, 2, 3]) == 8e6
    assert EmulatedLinks(8e6, 2e6, (0, 0, 1)).rate([0, 1]) == 2e6
    assert EmulatedLinks(None, None, (0, 0)).rate([0, 1]) is None


def _faithful_gloo_body(rate: float):
    import time

    from cephalo.runtime.collectives.emulated import EmulatedStream, FaithfulComm

    inner = make_comm("gloo", validate=False)
    stream = EmulatedStream()
    comm = FaithfulComm(inner, stream, rate)
    sizes = [1 << 16, 1 << 15, 0]
    shard = torch.full((sizes[comm.rank],), float(comm.rank + 1))
    out = torch.empty(sum(sizes))
    full = torch.ones(sum(sizes))
    part = torch.empty(sizes[comm.rank])
    comm.barrier()
    t0 = time.perf_counter()
    gather = comm.all_gather_v(out, shard, sizes, async_op=True)
    scatter = comm.reduce_scatter_v(part, full, sizes, async_op=True)
    gather.wait()
    scatter.wait()
    host_s = time.perf_counter() - t0
    stream.sync()
    total_s = time.perf_counter() - t0
    t = torch.tensor([float(comm.rank)])
    comm.all_reduce(t)
    expect = torch.cat([torch.full((n,), float(r + 1)) for r, n in enumerate(sizes)])
    return host_s, total_s, torch.equal(out, expect), bool((part == 3.0).all()), float(t)


@pytest.mark.slow
def test_faithful_comm_over_gloo(pool3):
    """The data moves through gloo as before; the gather and the reduce-scatter on one group
    take their sum on the emulated link, not their max, and the host never blocks for it."""
    rate = 12e6
    nbytes = (1 << 16) + (1 << 15)  # elements of both collectives' full buffers
    link_s = 2 / 3 * nbytes * 4 / rate  # each: (n-1)/n of the fp32 buffer, ~21 ms
    for host_s, total_s, gathered, reduced, summed in pool3.run(_faithful_gloo_body, rate):
        assert gathered and reduced and summed == 3.0
        assert total_s >= 2 * link_s * 0.95, "the group's two collectives overlapped"
        assert host_s < total_s


def test_emulated_runs_get_the_faithful_comm_at_their_declared_links():
    """`emulate_links` (the trainer's, `cephalo run`'s) turns the faithful comm on for every
    multi-rank emulated run, at the rates the spec declares and only those."""
    from cephalo.runtime.collectives.shard_groups import emulate_links
    from cephalo.runtime.engine.config import EngineConfig
    from cephalo.specs.cluster import Cluster

    two_nodes = emulate_links(
        EngineConfig(), Cluster.parse("cpu@node0,cpu@node1;inter=20MB/s"), True
    )
    assert two_nodes.links.rate([0, 1]) == 20e6 and two_nodes.inter_node_bytes_per_s == 20e6
    one_node = emulate_links(EngineConfig(), Cluster.parse("cpu,cpu"), True)
    assert one_node.links is not None and one_node.links.rate([0, 1]) is None
    assert one_node.inter_node_bytes_per_s is None
    declared = emulate_links(EngineConfig(), Cluster.parse("cpu,cpu;intra=5MB/s"), True)
    assert declared.links.rate([0, 1]) == 5e6
    assert emulate_links(EngineConfig(), Cluster.parse("cpu,cpu"), False).links is None
    assert emulate_links(EngineConfig(), Cluster.parse("cpu"), True).links is None
