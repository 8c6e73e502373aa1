import json
import re
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cephalo.errors import CephaloError
from cephalo.specs.catalog.devices import GiB, device_memory_bytes
from cephalo.specs.cluster import DEFAULT_INTER_NODE_BYTES_PER_S, Cluster, Device


def test_paper_cluster():
    c = Cluster.parse("2xl4,a6000,p40")
    assert [d.type for d in c.devices] == ["l4", "l4", "a6000", "p40"]
    assert c.world_size == 4
    assert c.device_types() == ["l4", "a6000", "p40"]
    assert [d.memory_bytes for d in c.devices] == [24 * GiB, 24 * GiB, 48 * GiB, 24 * GiB]
    assert c.describe() == "2x L4 (24 GiB) + RTX A6000 (48 GiB) + P40 (24 GiB)"
    # P40 is PCIe gen3: the node's collectives are bounded by its 12 GB/s
    assert c.intra_node_bytes_per_s == 12e9
    assert c.slowest_link_bytes_per_s() == 12e9
    assert c.collective_latency_s == pytest.approx(50e-6)


def test_counts_case_and_aliases():
    c = Cluster.parse(" 3X L4 , A100, v100 ,H100,rtx_3090")
    assert [d.type for d in c.devices] == ["l4"] * 3 + ["a100x80", "v100x16", "h100-nvl", "rtx3090"]
    assert c.devices[3].memory_bytes == 80 * GiB
    assert c.devices[5].memory_bytes == 94 * GiB


def test_cpu_options_and_continuation():
    c = Cluster.parse("cpu,cpu:slowdown=2,cpu:slowdown=4,mem=1GiB")
    assert c.world_size == 3
    assert [d.slowdown for d in c.devices] == [1.0, 2.0, 4.0]
    assert [d.memory_bytes for d in c.devices] == [4 * GiB, 4 * GiB, 1 * GiB]
    assert c.device_types() == ["cpu", "cpu:slowdown=2", "cpu:slowdown=4"]
    # memory is not part of the type key, slowdown is
    assert Device("cpu", 1, slowdown=2.5).type_key == "cpu:slowdown=2.5"
    assert Device("cpu", 7).type_key == Device("cpu", 9).type_key == "cpu"
    assert c.collective_latency_s == pytest.approx(200e-6)
    assert c.describe() == "CPU (4 GiB) + CPU:slowdown=2 (4 GiB) + CPU:slowdown=4 (1 GiB)"


def test_memory_units():
    c = Cluster.parse("l4:mem=20GiB,l4:mem=16GB,cpu:mem=512MiB,cpu:mem=1.5gib")
    assert [d.memory_bytes for d in c.devices] == [
        20 * GiB,
        16 * 10**9,
        512 * 2**20,
        int(1.5 * GiB),
    ]


def test_nodes():
    c = Cluster.parse("4xa100x80@node1,2xl4@0,a6000:node=2")
    assert [d.node for d in c.devices] == [1] * 4 + [0, 0, 2]
    assert c.num_nodes == 3
    assert c.slowest_link_bytes_per_s() == DEFAULT_INTER_NODE_BYTES_PER_S == 10e9
    one_node = Cluster.parse("4xa100x80@node1")
    assert one_node.slowest_link_bytes_per_s() == 200e9  # NVLink
    assert "@node1" in c.describe()


def test_repeat_makes_independent_devices():
    c = Cluster.parse("2xcpu")
    c.devices[0].memory_bytes = 1
    assert c.devices[1].memory_bytes == 4 * GiB


@pytest.mark.parametrize(
    "spec, message",
    [
        ("", "empty cluster spec"),
        ("   ", "empty cluster spec"),
        ("0xl4", "'0xl4': the count must be at least 1"),
        ("2x", "bad device '2x'"),
        ("l4,,a6000", "empty device"),
        ("l4,", "empty device"),
        ("l4:mem=3XB", "bad mem= for 'l4': '3XB'"),
        ("l4:mem=24", "write a number and a unit"),
        ("l4:mem=-1GiB", "must be positive"),
        ("cpu:slowdown=0.5", "bad slowdown '0.5'"),
        ("cpu:slowdown=abc", "bad slowdown 'abc'"),
        ("cpu:slowdown=inf", "must be a number >= 1"),
        ("l4:slowdown=2", "slowdown= only applies to emulated `cpu` devices"),
        ("mem=1GiB,l4", "option 'mem=1GiB' comes before any device"),
        ("l4:foo=1", "bad option 'foo=1'"),
        ("l4:mem", "bad option 'mem'"),
        ("l4:mem=1GiB:mem=2GiB", "option mem given twice"),
        ("l4@nodex", "bad node 'x'"),
        ("l4:node=-1", "bad node '-1'"),
        ("9999999xl4", "not a plausible number"),
    ],
)
def test_spec_errors(spec, message):
    with pytest.raises(CephaloError) as e:
        Cluster.parse(spec)
    assert message in str(e.value)
    if "unknown device type" not in message:
        assert "cluster spec: DEVICE[,DEVICE...]" in str(e.value)  # the grammar is shown


def test_unknown_type_lists_known_and_suggests():
    with pytest.raises(CephaloError) as e:
        Cluster.parse("2xl4,rtx3095")
    msg = str(e.value)
    assert "unknown device type 'rtx3095'" in msg
    assert "Did you mean 'rtx3090'?" in msg
    for known in ("l4", "a6000", "p40", "h100-nvl", "cpu"):
        assert known in msg
    with pytest.raises(CephaloError, match="unknown device type 'zzz'. A GPU the catalog"):
        Cluster.parse("zzz")


@pytest.mark.parametrize(
    "name, suggested, not_suggested",
    [
        ("h200", None, "h100"),  # another chip, not a misspelling
        ("rtx2070", "rtx2080ti", "rtx3070"),  # Turing, not the Ampere of the same digits
        ("rtx3070ti", "rtx3070", "rtx3090ti"),  # the longest shared model number first
    ],
)
def test_unknown_type_names_the_ways_out(name, suggested, not_suggested):
    """An unknown GPU: a suggestion only from its own family, and always the two ways out
    (the unlisted type with its memory, `cephalo profile`)."""
    with pytest.raises(CephaloError) as e:
        Cluster.parse(name)
    msg = str(e.value)
    slug = name.replace("_", "-")
    assert f"gpu-{slug}:mem=SIZE" in msg and "`cephalo profile`" in msg
    assert (f"Did you mean {suggested!r}?" in msg) if suggested else ("Did you mean" not in msg)
    assert f"Did you mean {not_suggested!r}" not in msg
    assert Cluster.parse(f"gpu-{slug}:mem=12GiB").devices[0].memory_bytes == 12 * 1024**3


def test_new_consumer_cards_are_in_the_catalog():
    """The cards users asked for, with their data-sheet memory, derived as the others are."""
    from cephalo.specs.catalog.derived import SPECS, siblings_of

    for key, gib in (
        ("rtx3060ti", 8),
        ("rtx3070", 8),
        ("rtx4070", 12),
        ("rtx2080ti", 11),
        ("rtxa4500", 20),
    ):
        (device,) = Cluster.parse(key).devices
        assert device.memory_bytes == gib * 1024**3 and SPECS[key].memory_gib == gib
        assert siblings_of(key)


def test_dict_round_trip():
    c = Cluster.parse("2xl4@node0,a6000@node1,cpu:slowdown=3,mem=2GiB")
    d = json.loads(json.dumps(c.to_dict()))
    assert Cluster.from_dict(d) == c


TOML = """
intra_node_bandwidth = "20GB/s"
inter_node_bytes_per_s = 5e9
collective_latency_s = 1e-4
[[devices]]
type = "L4"
count = 2
[[devices]]
type = "a6000"
memory = "40GiB"
node = 1
"""


def test_toml_file(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text(TOML)
    c = Cluster.from_file(p)
    assert [d.type for d in c.devices] == ["l4", "l4", "a6000"]
    assert c.devices[2].memory_bytes == 40 * GiB and c.devices[2].node == 1
    assert c.intra_node_bytes_per_s == 20e9 and c.inter_node_bytes_per_s == 5e9
    assert c.collective_latency_s == 1e-4
    assert c.slowest_link_bytes_per_s() == 5e9
    assert Cluster.from_any(str(p)) == c


def test_json_file_and_spec_string_devices(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"devices": "2xl4,p40", "intra_node_bandwidth": 8e9}))
    c = Cluster.from_file(p)
    assert [d.type for d in c.devices] == ["l4", "l4", "p40"] and c.intra_node_bytes_per_s == 8e9
    p.write_text(
        json.dumps({"devices": [{"type": "cpu", "count": 2, "slowdown": 2, "memory": "1GiB"}]})
    )
    c = Cluster.from_file(p)
    assert c.device_types() == ["cpu:slowdown=2"] and c.devices[1].memory_bytes == GiB


def test_yaml_file(tmp_path):
    # `make test` installs the `yaml` extra; without it this is a visible skip, not a pass
    yaml = pytest.importorskip("yaml", reason="PyYAML missing: pip install -e '.[yaml]'")
    p = tmp_path / "c.yaml"
    p.write_text(
        yaml.safe_dump({"devices": [{"type": "t4", "count": 3}], "inter_node_bandwidth": "10 GB/s"})
    )
    c = Cluster.from_file(p)
    assert c.world_size == 3 and c.devices[0].memory_bytes == 16 * GiB


def test_from_any_prefers_spec_when_no_file():
    assert Cluster.from_any("2xl4").world_size == 2


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("c.toml", "devices = [", "cannot parse cluster file"),
        ("c.toml", "[[devices]]\ncount = 2\n", "`type` is required"),
        ("c.toml", "[[devices]]\ntype = 'l4'\ncount = 0\n", "count must be an integer >= 1"),
        ("c.toml", "[[devices]]\ntype = 'l4'\ncolour = 'red'\n", "unknown key(s) colour"),
        ("c.toml", "[[devices]]\ntype = 'k80'\n", "unknown device type 'k80'"),
        ("c.toml", "[[devices]]\ntype = 'l4'\nmemory = 'lots'\n", "bad mem="),
        ("c.toml", "bandwidth = 3\n[[devices]]\ntype = 'l4'\n", "unknown key(s) bandwidth"),
        (
            "c.toml",
            "intra_node_bandwidth = 'fast'\n[[devices]]\ntype = 'l4'\n",
            "bad c.toml: intra_node_bandwidth",
        ),
        (
            "c.toml",
            "collective_latency_s = -1\n[[devices]]\ntype = 'l4'\n",
            "collective_latency_s must be",
        ),
        ("c.toml", "devices = []\n", "`devices` must be a non-empty list"),
        ("c.json", "[1, 2]", "expected a table/object"),
        ("c.json", '{"devices": [3]}', "expected a table/object like"),
        ("c.txt", "whatever", "unknown cluster file type .txt"),
    ],
)
def test_file_errors(tmp_path, name, text, message):
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(CephaloError) as e:
        Cluster.from_file(p)
    assert message in str(e.value).replace(str(tmp_path) + "/", "")


def test_missing_file():
    with pytest.raises(CephaloError, match="cannot read cluster file"):
        Cluster.from_any("/nonexistent/cluster.toml")


def test_yaml_without_pyyaml(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_yaml(name, *a, **kw):
        if name == "yaml":
            raise ImportError("no yaml")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_yaml)
    p = tmp_path / "c.yml"
    p.write_text("devices: 2xl4\n")
    with pytest.raises(CephaloError, match="reading YAML needs PyYAML"):
        Cluster.from_file(p)


def test_memory_defaults_match_catalog():
    for t in ("l4", "a6000", "p40", "t4", "a100x40"):
        assert Cluster.parse(t).devices[0].memory_bytes == device_memory_bytes(t)


@settings(max_examples=400, deadline=None)
@given(
    st.text(alphabet="0123456789xX,:=@.-_ lLaApPcCuUmMeEgGiIbBsSnNoOdDwWt4", max_size=40)
    | st.text(max_size=30)
)
def test_fuzz_only_cephalo_errors(spec):
    try:
        c = Cluster.parse(spec)
    except CephaloError:
        return
    assert c.world_size >= 1
    assert all(d.memory_bytes > 0 and d.slowdown >= 1 and d.node >= 0 for d in c.devices)


def test_explicit_zero_latency_is_kept(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"devices": "l4", "collective_latency_s": 0}))
    assert Cluster.from_file(p).collective_latency_s == 0.0


def test_yaml_without_pyyaml_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "yaml", None)  # `import yaml` raises ImportError
    p = tmp_path / "c.yaml"
    p.write_text("devices: 2xl4\n")
    with pytest.raises(
        CephaloError, match=r"reading YAML needs PyYAML \(`pip install -e '\.\[yaml\]'`"
    ):
        Cluster.from_file(p)


@pytest.mark.parametrize(
    "spec",
    [
        "2xl4,a6000,p40",
        "8xa100x80@node0,8xa100x80@node1;inter=50GB/s",
        "cpu,cpu:slowdown=2,cpu:slowdown=4,mem=1GiB",
        "l4@node1:mem=20GiB",
        "2xl4;intra=9.7e9B/s;latency=0.001",
        "cpu:slowdown=1.2345678901:mem=1000B",
        "3xt4@node2,l4@node0;intra=8GB/s;inter=3.3333333333GB/s",
        "8xt4@node0-3,l4@node4,2xl4@node5-6",
    ],
)
def test_to_spec_parses_back_to_the_same_cluster(spec):
    c = Cluster.parse(spec)
    again = Cluster.parse(c.to_spec())
    assert again.to_dict() == c.to_dict()
    assert again.to_spec() == c.to_spec()


def test_node_ranges():
    """`8xa100@node0-3` is 4 nodes of 8; to_spec writes equal consecutive nodes that way."""
    c = Cluster.parse("8xa100x80@node0-3,l4@node4")
    assert [d.node for d in c.devices] == [n for n in range(4) for _ in range(8)] + [4]
    assert c.num_nodes == 5
    assert Cluster.parse("2xl4@node0,2xl4@node1,3xl4@node2").to_spec() == "2xl4@node0-1,3xl4@node2"
    long = ",".join(f"8xt4@node{i}" for i in range(64))  # longer than a file name may be
    assert Cluster.from_any(long).to_spec() == "8xt4@node0-63"
    for bad, message in (("l4@node3-1", "need 0 <= A <= B"), ("l4@nodea-b", "bad node range")):
        with pytest.raises(CephaloError, match=message):
            Cluster.parse(bad)


def test_inconsistent_node_specs_get_one_message(tmp_path):
    """A node's host settings are given once (a node's ranks disagreeing with torchrun's map at
    launch: tests/test_discovery.py)."""
    p = tmp_path / "c.toml"
    p.write_text(
        '[[devices]]\ntype = "l4"\nnode = 0\n'
        '[[nodes]]\nnode = 0\nhost_memory = "8GiB"\n[[nodes]]\nnode = 0\nhost_memory = "16GiB"\n'
    )
    with pytest.raises(CephaloError, match=r"nodes\[1\]: node 0 is listed twice in `nodes`"):
        Cluster.from_file(p)


def test_to_spec_of_files_and_links(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text(
        'inter_node_bandwidth = "12.5GB/s"\ncollective_latency_s = 0.0\n'
        '[[devices]]\ntype = "l4"\ncount = 2\nnode = 0\n[[devices]]\ntype = "a6000"\nnode = 1\n'
    )
    c = Cluster.from_file(p)
    assert c.to_spec() == "2xl4@node0,a6000@node1;inter=12.5GB/s;latency=0.0"
    assert Cluster.parse(c.to_spec()).to_dict() == c.to_dict()
    assert Cluster.parse("2xl4").to_spec() == "2xl4"  # defaults are left out


@pytest.mark.parametrize(
    "spec, message",
    [
        ("2xl4;foo=1", "bad link option 'foo=1'"),
        ("2xl4;inter=fast", "bad inter= rate 'fast'"),
        ("2xl4;inter=1GB/s;inter=2GB/s", "link option inter given twice"),
        (";inter=1GB/s", "needs devices before its links"),
        ("2xl4;latency=-1", "bad latency '-1'"),
        ("2xl4;inter=0GB/s", "must be a positive number"),
    ],
)
def test_link_option_errors(spec, message):
    with pytest.raises(CephaloError, match=re.escape(message)):
        Cluster.parse(spec)


def test_cluster_file_not_utf8_is_one_message(tmp_path):
    p = tmp_path / "c.toml"
    p.write_bytes(b'devices = "2xl4"\n# \xff\xfe\n')
    with pytest.raises(CephaloError, match=r"cluster file .*c\.toml is not UTF-8 text"):
        Cluster.from_file(p)
