"""A cluster's hosts: host memory per node, the host AdamW speed, the emulated link (`pcie=`),
and how they reach the cost model."""

from __future__ import annotations

import pytest

from cephalo.costmodel.sources import catalog_cost_model, host_resources
from cephalo.errors import CephaloError
from cephalo.specs.catalog.devices import DEFAULT_HOST_MEMORY_BYTES, host_optimizer_s_per_param
from cephalo.specs.catalog.models import get_model_spec
from cephalo.specs.cluster import Cluster

GiB = 1024**3


def test_defaults_and_per_node_overrides_round_trip():
    c = Cluster.parse("2xl4,a6000@node1")
    assert c.host_memory_of(0) == c.host_memory_of(1) == DEFAULT_HOST_MEMORY_BYTES
    f = Cluster.from_dict(
        {
            "devices": "2xl4,a6000@node1",
            "host_memory": "64GiB",
            "host_optimizer_s_per_param": 2e-9,
            "nodes": [{"node": 1, "host_memory": "32GiB", "host_optimizer_s_per_param": 5e-9}],
        }
    )
    assert (f.host_memory_of(0), f.host_memory_of(1)) == (64 * GiB, 32 * GiB)
    assert (f.host_optimizer_override(0), f.host_optimizer_override(1)) == (2e-9, 5e-9)
    back = Cluster.from_dict(f.to_dict())
    assert back.to_dict() == f.to_dict()


def test_host_resources_in_the_cost_model():
    spec = get_model_spec("gpt-1.3b")
    c = Cluster.parse("2xl4,a6000@node1")
    host = catalog_cost_model(c, spec, 512, "fp16").host
    assert host.node_of == (0, 0, 1)
    # the catalog's default: the node's host bandwidth shared by its ranks
    assert host.optimizer_s_per_param == (
        host_optimizer_s_per_param(2),
        host_optimizer_s_per_param(2),
        host_optimizer_s_per_param(1),
    )
    assert host_optimizer_s_per_param(2) == 2 * host_optimizer_s_per_param(1)
    f = Cluster.from_dict(
        {"devices": "2xl4,a6000@node1", "nodes": [{"node": 1, "host_optimizer_s_per_param": 1e-8}]}
    )
    profiles = catalog_cost_model(f, spec, 512, "fp16").profiles
    profiles["l4"].host_optimizer_s_per_param = 3e-9  # measured wins over the default ...
    speeds = host_resources(f, profiles).optimizer_s_per_param
    assert speeds == (3e-9, 3e-9, 1e-8)  # ... and the cluster file over both


def test_pcie_option_for_emulated_devices():
    c = Cluster.parse("cpu:slowdown=2,mem=1GiB,pcie=12GB/s,cpu")
    d = c.devices[0]
    assert d.pcie_bytes_per_s == 12e9 and d.type_key == "cpu:slowdown=2:pcie=12GB/s"
    assert c.devices[1].pcie_bytes_per_s is None and c.devices[1].type_key == "cpu"
    assert Cluster.from_dict(c.to_dict()).devices[0].pcie_bytes_per_s == 12e9
    with pytest.raises(CephaloError, match="pcie= only applies to emulated `cpu` devices"):
        Cluster.parse("l4:pcie=12GB/s")
    with pytest.raises(CephaloError, match="bad pcie="):
        Cluster.parse("cpu:pcie=fast")


def test_cluster_file_host_errors(tmp_path):
    cases = [
        ({"devices": "cpu", "host_memory": "lots"}, "host_memory"),
        ({"devices": "cpu", "host_memory": "1GiB", "host_memory_bytes": 5}, "not both"),
        ({"devices": "cpu", "host_optimizer_s_per_param": -1}, "positive number of seconds"),
        (
            {"devices": "cpu", "nodes": [{"node": 3, "host_memory": "1GiB"}]},
            "node 3 has no devices",
        ),
        ({"devices": "cpu", "nodes": [{"node": 0, "ram": "1GiB"}]}, r"unknown key\(s\) ram"),
        ({"devices": "cpu", "nodes": {"node": 0}}, "must be a list"),
    ]
    for data, message in cases:
        with pytest.raises(CephaloError, match=message):
            Cluster.from_dict(data)
    path = tmp_path / "c.toml"
    path.write_text(
        'devices = "2xcpu"\nhost_memory = "8GiB"\n[[nodes]]\nnode = 0\nhost_memory = "4GiB"\n'
    )
    assert Cluster.from_file(path).host_memory_of(0) == 4 * GiB
