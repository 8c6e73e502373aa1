"""Every rank describes its own device; the cluster is built from the gathered descriptions
(train/discovery.py). The multi-process path, launched with torchrun, is in
tests/test_torchrun.py."""

from __future__ import annotations

import pytest

from cephalo.errors import CephaloError
from cephalo.specs.catalog import GiB, device_type_for_gpu
from cephalo.specs.cluster import Cluster
from cephalo.train.config import load_config
from cephalo.train.discovery import (
    check_same_job,
    cluster_from_descriptions,
    describe_own_device,
)

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
