"""Collectives: LocalComm in-process; gloo/padded on 3 ranks in one process pool."""

from __future__ import annotations

import re

import pytest
import torch

from cephalo.errors import CephaloError
from cephalo.runtime.comm import LocalComm, make_comm, shard_offsets


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
    t = torch.tensor([3.0])
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
        (lambda c: c.all_reduce(torch.empty(4, 2).t()), "1-D contiguous"),
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
