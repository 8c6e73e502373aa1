"""Every rank describes its own device; the cluster is built from the gathered descriptions
(train/discovery.py). The multi-process path, launched with torchrun, is in
tests/test_torchrun.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cephalo.errors import CephaloError
from cephalo.specs.catalog.devices import GiB, device_type_for_gpu
from cephalo.specs.cluster import Cluster
from cephalo.train.config_manager import load_config
from cephalo.train.discovery import (
    check_same_job,
    cluster_from_descriptions,
    describe_own_device,
    node_local_config,
    node_view,
)
from cephalo.train.node_map import check_node_map

# (name as torch.cuda.get_device_name reports it, memory GiB as total_memory reports it)
CUDA_NAMES = [
    ("NVIDIA L4", 22.5, "l4"),
    ("NVIDIA RTX A6000", 47.5, "a6000"),
    ("Tesla P40", 22.4, "p40"),
    ("Tesla T4", 14.6, "t4"),
    ("NVIDIA A10G", 22.1, "a10g"),
    ("NVIDIA L40S", 44.4, "l40s"),
    ("NVIDIA GeForce RTX 3090", 23.7, "rtx3090"),
    ("NVIDIA A100-SXM4-40GB", 39.4, "a100x40"),
    ("NVIDIA A100-SXM4-80GB", 79.2, "a100x80"),
    ("NVIDIA A100 80GB PCIe", 79.2, "a100x80"),
    ("Tesla V100-SXM2-16GB", 15.8, "v100x16"),
    ("Tesla V100-SXM2-32GB", 31.7, "v100x32"),
    ("Tesla V100-PCIE-16GB", 15.8, "v100-pciex16"),
    ("Tesla P100-PCIE-16GB", 15.9, "p100"),
    ("NVIDIA H100 NVL", 93.1, "h100-nvl"),
    # not in the catalog: profiled under their own names
    ("NVIDIA H200", 139.8, "gpu-nvidia-h200"),
    ("NVIDIA H100 80GB HBM3", 79.1, "gpu-nvidia-h100-80gb-hbm3"),
]


@pytest.mark.parametrize(("name", "gib", "key"), CUDA_NAMES)
def test_cuda_names_map_to_catalog_types(name, gib, key):
    assert device_type_for_gpu(name, int(gib * GiB)) == key


def test_an_unlisted_gpu_is_a_device_type_of_its_own():
    cluster = Cluster.parse("gpu-nvidia-h200:mem=140GiB,l4")
    assert cluster.devices[0].type == "gpu-nvidia-h200"
    assert Cluster.parse(cluster.to_spec()).devices == cluster.devices
    assert "nvidia-h200" in cluster.describe()
    with pytest.raises(CephaloError, match="give it with mem="):
        Cluster.parse("gpu-nvidia-h200")


def _cfg(tmp_path, *extra):
    return load_config(None, [f"--logging.dir={tmp_path}", "--model.name=gpt-tiny", *extra])


def test_each_rank_describes_only_itself(tmp_path, monkeypatch):
    """Ranks given different devices through CEPHALO_DEVICE (as a launcher would) build one
    cluster with each rank's own device, nodes numbered in order of appearance."""
    cfg = _cfg(tmp_path, "--parallel.host_memory=8GiB")
    mine = []
    for rank, (spec, group) in enumerate(
        [("cpu:mem=1GiB", "0"), ("cpu:slowdown=3,mem=2GiB", "0"), ("cpu:slowdown=2", "1")]
    ):
        monkeypatch.setenv("CEPHALO_DEVICE", spec)
        monkeypatch.setenv("GROUP_RANK", group)
        mine.append(describe_own_device(cfg, rank, 3))
    cluster = cluster_from_descriptions(mine[::-1])  # gathered order does not matter
    assert [d.slowdown for d in cluster.devices] == [1.0, 3.0, 2.0]
    assert [d.memory_bytes for d in cluster.devices][:2] == [GiB, 2 * GiB]
    assert [d.node for d in cluster.devices] == [0, 0, 1]
    assert cluster.host_memory_of(1) == 8 * GiB


def test_emulated_devices_keep_their_links_and_nodes(tmp_path):
    cfg = _cfg(tmp_path, "--parallel.devices=cpu@node0,cpu@node1:slowdown=2;inter=2GB/s")
    mine = [describe_own_device(cfg, rank, 2) for rank in range(2)]
    cluster = cluster_from_descriptions(mine, Cluster.parse(cfg.parallel.devices))
    assert [d.node for d in cluster.devices] == [0, 1]
    assert cluster.inter_node_bytes_per_s == 2e9


def test_ranks_of_different_jobs_are_told_which_fields_differ(tmp_path):
    a = describe_own_device(_cfg(tmp_path, "--train.steps=30"), 0, 2)
    b = describe_own_device(_cfg(tmp_path, "--train.steps=20"), 1, 2)
    check_same_job([a, a])
    with pytest.raises(CephaloError, match=r"different jobs.*train.steps: 30 on rank 0 vs 20"):
        check_same_job([a, b])


def test_own_device_must_be_one_device(tmp_path, monkeypatch):
    monkeypatch.setenv("CEPHALO_DEVICE", "2xcpu")
    with pytest.raises(CephaloError, match="exactly one device"):
        describe_own_device(_cfg(tmp_path), 0, 1)


def _ranks_on(tmp_path, monkeypatch, ranks, *cfg_extra):
    """Each rank's description, from (CEPHALO_DEVICE, GROUP_RANK, LOCAL_WORLD_SIZE, host)."""
    import cephalo.train.discovery as discovery

    cfg = _cfg(tmp_path, *cfg_extra)
    out = []
    for rank, (spec, group, local, host) in enumerate(ranks):
        for var, value in (("CEPHALO_DEVICE", spec), ("GROUP_RANK", group)):
            if value is None:
                monkeypatch.delenv(var, raising=False)
            else:
                monkeypatch.setenv(var, value)
        if local is None:
            monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        else:
            monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
        monkeypatch.setattr(discovery.socket, "gethostname", lambda host=host: host)
        out.append(describe_own_device(cfg, rank, len(ranks)))
    return out


def test_a_consistent_node_map_passes(tmp_path, monkeypatch):
    # torchrun: two agents (on one machine or two), two ranks each
    ok = [("cpu", "0", 2, "a"), ("cpu", "0", 2, "a"), ("cpu", "1", 2, "a"), ("cpu", "1", 2, "b")]
    with pytest.raises(CephaloError, match="spans machines"):
        check_node_map(_ranks_on(tmp_path, monkeypatch, ok))
    ok[3] = ("cpu", "1", 2, "a")
    check_node_map(_ranks_on(tmp_path, monkeypatch, ok))
    # emulated nodes may split a machine (two @nodes on one host, one torchrun node)
    split = [("cpu@node0", "0", 2, "a"), ("cpu@node1", "0", 2, "a")]
    descriptions = _ranks_on(tmp_path, monkeypatch, split)
    check_node_map(descriptions)
    assert [d.node for d in cluster_from_descriptions(descriptions).devices] == [0, 1]
    # no torchrun: the host name
    check_node_map(_ranks_on(tmp_path, monkeypatch, [("cpu", None, None, "a")] * 2))


@pytest.mark.parametrize(
    "ranks, message",
    [
        (  # some ranks name their node in their device, others learn it from torchrun
            [("cpu@node0", "0", 2, "a"), ("cpu", "0", 2, "a")],
            "the ranks disagree about how they know their node: rank 0 from the cluster spec "
            "(@nodeK); rank 1 from torchrun (GROUP_RANK)",
        ),
        (  # one emulated node on two machines
            [("cpu@node0", None, None, "a"), ("cpu@node0", None, None, "b")],
            "node 'node0' spans machines: rank 0 on host 'a', rank 1 on host 'b'",
        ),
        (  # two torchrun agents given the same --node-rank
            [("cpu", "0", 1, "a"), ("cpu", "0", 1, "b")],
            "node 'group0' spans machines",
        ),
        (  # the same --node-rank on one machine: torchrun's count says so
            [("cpu", "0", 1, "a"), ("cpu", "0", 1, "a")],
            "node 'group0' runs 1 ranks by torchrun's LOCAL_WORLD_SIZE but 2 report it (ranks 0, 1)",
        ),
        (
            [("cpu", "0", 2, "a"), ("cpu", "0", 3, "a")],
            "the ranks of node 'group0' disagree about how many ranks it runs (LOCAL_WORLD_SIZE): "
            "rank 0 say 2, rank 1 say 3",
        ),
        (  # the spec joins two torchrun nodes into one
            [("cpu@node0", "0", 1, "a"), ("cpu@node0", "1", 1, "a")],
            "the cluster spec puts ranks 0, 1 on node0 but torchrun runs them on different nodes "
            "(rank 0 on torchrun node 0, rank 1 on torchrun node 1)",
        ),
    ],
)
def test_ranks_that_disagree_about_their_node_get_one_message(
    tmp_path, monkeypatch, ranks, message
):
    descriptions = _ranks_on(tmp_path, monkeypatch, ranks)
    with pytest.raises(CephaloError, match=re.escape(message)) as err:
        check_node_map(descriptions)
    assert "start every rank the same way" in str(err.value)


# ----------------------------------------------------------------------------- emulated nodes
def test_ranks_may_join_in_another_order_than_the_spec(tmp_path):
    """`parallel.emulate_join_order`: rank i emulates the spec's device P_i, as c10d numbers
    ranks by arrival; the discovered cluster lists the devices in the ranks' order."""
    spec = "cpu,cpu:slowdown=2,cpu@node1:slowdown=3"
    for order, slowdowns, nodes in (
        ("reverse", [3.0, 2.0, 1.0], [1, 0, 0]),
        ("1,2,0", [2.0, 3.0, 1.0], [0, 1, 0]),
    ):
        cfg = _cfg(tmp_path, f"--parallel.devices={spec}", f"--parallel.emulate_join_order={order}")
        mine = [describe_own_device(cfg, rank, 3) for rank in range(3)]
        cluster = cluster_from_descriptions(mine, Cluster.parse(spec))
        assert [d.slowdown for d in cluster.devices] == slowdowns
        assert [d.node for d in cluster.devices] == nodes
    with pytest.raises(CephaloError, match="orders 2 ranks but the job has 3"):
        describe_own_device(
            _cfg(tmp_path, f"--parallel.devices={spec}", "--parallel.emulate_join_order=1,0"), 0, 3
        )
    for bad in ("1,1,0", "first"):
        with pytest.raises(CephaloError, match="permutation of 0..N-1"):
            _cfg(tmp_path, f"--parallel.emulate_join_order={bad}").validate()
    with pytest.raises(CephaloError, match="is not RANK:SECONDS"):
        _cfg(tmp_path, "--parallel.emulate_start_delay=1:-3").validate()


def test_each_emulated_node_has_its_own_host_memory(tmp_path):
    cfg = _cfg(tmp_path, "--parallel.devices=cpu@node0,2xcpu@node1;host=8GiB;host1=3GiB")
    mine = [describe_own_device(cfg, rank, 3) for rank in range(3)]
    assert [d.host_memory_bytes for d in mine] == [8 * GiB, 3 * GiB, 3 * GiB]
    cluster = cluster_from_descriptions(mine, Cluster.parse(cfg.parallel.devices))
    assert (cluster.host_memory_of(0), cluster.host_memory_of(1)) == (8 * GiB, 3 * GiB)
    assert Cluster.parse(cluster.to_spec()).host_memory_of(1) == 3 * GiB
    with pytest.raises(CephaloError, match="host1= host memory"):
        Cluster.parse("cpu;host1=lots")


def test_an_emulated_node_writes_to_its_own_filesystem(tmp_path):
    """`parallel.emulate_node_fs = private`: node 0 (where the job was started) sees paths as
    given; another node sees what it writes under <logging.dir>/node-fs/nodeK/, except under
    `parallel.shared_dir`."""
    run, shared = tmp_path / "run", tmp_path / "nfs"
    cfg = _cfg(tmp_path, f"--logging.dir={run}", "--parallel.emulate_node_fs=private")
    assert node_view(cfg, run / "checkpoints", 0) == run / "checkpoints"
    mine = node_view(cfg, run / "checkpoints", 1)
    assert mine == run / "node-fs" / "node1" / str(run / "checkpoints").lstrip("/")
    local = node_local_config(cfg, 2)
    assert local.checkpoint_dir == node_view(cfg, cfg.checkpoint_dir, 2) != cfg.checkpoint_dir
    assert Path(local.logging.dir) == run / "node-fs" / "node2" / str(run).lstrip("/")
    cfg = _cfg(
        tmp_path,
        f"--logging.dir={run}",
        "--parallel.emulate_node_fs=private",
        f"--parallel.shared_dir={shared}",
    )
    assert node_view(cfg, shared / "ckpt", 1) == shared / "ckpt"
    assert node_view(cfg, tmp_path / "nfs2", 1) != tmp_path / "nfs2"  # a sibling, not under it
    assert node_view(_cfg(tmp_path), run, 1) == run  # shared (the default): as given
    assert node_local_config(_cfg(tmp_path), 1).logging.dir == str(tmp_path)


def test_a_node_plans_with_its_available_memory_less_the_reserves(monkeypatch):
    """Finding 4: the host budget is MemAvailable less the OS's and each local rank's reserve,
    not the physical memory."""
    from cephalo.costmodel.host import HOST_RANK_RESERVE_BYTES, host_budget
    from cephalo.train import discovery

    assert host_budget(20 * GiB, 24 * GiB, 2) == 20 * GiB - 2 * GiB - 2 * HOST_RANK_RESERVE_BYTES
    assert host_budget(100 * GiB, 200 * GiB, 1) == 100 * GiB - 10 * GiB - HOST_RANK_RESERVE_BYTES
    assert host_budget(GiB, 200 * GiB, 8) == 0
    monkeypatch.setattr(discovery, "available_host_bytes", lambda: 40 * GiB)
    monkeypatch.setattr(discovery, "physical_host_memory", lambda: 64 * GiB)
    assert (
        discovery.usable_host_bytes(4)
        == 40 * GiB - int(0.05 * 64 * GiB) - 4 * HOST_RANK_RESERVE_BYTES
    )
    monkeypatch.setattr(discovery, "available_host_bytes", lambda: None)
    assert discovery.usable_host_bytes(1) == host_budget(64 * GiB, 64 * GiB, 1)
