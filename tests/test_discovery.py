"""Every rank describes its own device; the cluster is built from the gathered descriptions
(train/discovery.py). The multi-process path, launched with torchrun, is in
tests/test_torchrun.py."""

from __future__ import annotations

import re

import pytest

from cephalo.errors import CephaloError
from cephalo.specs.catalog.devices import GiB, device_type_for_gpu
from cephalo.specs.cluster import Cluster
from cephalo.train.config_manager import load_config
from cephalo.train.discovery import (
    check_same_job,
    cluster_from_descriptions,
    describe_own_device,
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
