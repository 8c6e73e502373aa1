"""Fuzzing the parsers people feed by hand: anything they accept is valid, anything else is ONE
`CephaloError`, never another exception (a traceback from deep inside) and never a hang.

- cluster specs (`Cluster.parse`): grammar-shaped tokens (device names, counts, @node, options)
  and arbitrary text; cluster files as data (`Cluster.from_dict`) with the real keys;
- plan JSON (`Plan.from_json`): valid plans with random mutations (a field deleted, replaced by
  any JSON value, a key added), arbitrary JSON, and arbitrary text (taken as a path);
- job configs (`load_config`): TOML-ish files built from the real sections and keys with any
  values, arbitrary bytes, and command-line overrides with real and made-up keys.

tests/test_cluster.py fuzzes plain spec text as well; this module adds the structure-aware
inputs that reach deeper code paths.
"""

from __future__ import annotations

import json
import math
import string
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cephalo.errors import CephaloError
from cephalo.planner.plan import Plan, RankPlan
from cephalo.specs.catalog.devices import DEVICE_ALIASES
from cephalo.specs.cluster import Cluster
from cephalo.train.config import section_class, section_names
from cephalo.train.config_manager import field_types, load_config

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ----------------------------------------------------------------------------- shared strategies
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-3, max_value=10)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
# Path-like text: long names (over the 255-byte file-name limit), NUL bytes, directories.
pathish = (
    st.text(max_size=40)
    | st.text(alphabet="ab/.", min_size=250, max_size=600)
    | st.sampled_from([".", "/", "..", "/tmp", "a\0b", "/dev/null", "~", ""])
)


def only_cephalo_errors(fn, *args, **kwargs) -> Any:
    """Call `fn`; a `CephaloError` with a message is fine (returns None), anything else fails."""
    try:
        return fn(*args, **kwargs)
    except CephaloError as e:
        assert str(e).strip(), "a CephaloError needs a message"
        return None


# ----------------------------------------------------------------------------- cluster specs
device_names = st.sampled_from([*DEVICE_ALIASES, "gpu", "L4", "A100", "cpu ", "", "x", "h100-nvl"])
option_values = st.sampled_from(
    ["1", "2.5", "0", "-1", "nan", "inf", "1e400", "4GiB", "0GiB", "1e308TiB", "12 GB", "", "x"]
) | st.text(max_size=8)
option_keys = st.sampled_from(["mem", "node", "slowdown", "MEM", "speed", ""])


@st.composite
def device_tokens(draw) -> str:
    token = draw(device_names)
    count = draw(
        st.none()
        | st.integers(min_value=-2, max_value=10**7).map(str)
        | st.sampled_from(["x", "2 x", ""])
    )
    if count is not None:
        token = f"{count}x{token}"
    if draw(st.booleans()):
        token += "@" + draw(
            st.sampled_from(["node", "node1", "1", "node-1", "nodex", ""]) | st.text(max_size=4)
        )
    options = draw(st.lists(st.tuples(option_keys, option_values), max_size=3))
    for key, value in options:
        token += draw(st.sampled_from([":", ","])) + f"{key}={value}"
    return token


cluster_specs = st.lists(device_tokens(), min_size=0, max_size=4).map(",".join) | st.text(
    max_size=40
)


@FUZZ
@given(spec=cluster_specs)
def test_cluster_spec(spec):
    cluster = only_cephalo_errors(Cluster.parse, spec)
    if cluster is not None:
        assert cluster.world_size >= 1
        for d in cluster.devices:
            assert (
                d.memory_bytes > 0 and d.node >= 0 and math.isfinite(d.slowdown) and d.slowdown >= 1
            )
        assert cluster.describe()


device_entries = st.fixed_dictionaries(
    {},
    optional={
        "type": device_names | json_scalars,
        "count": st.integers(min_value=-1, max_value=4)
        | st.sampled_from([10**6 + 1, 10**12])
        | json_scalars,
        "memory": st.sampled_from(["20GiB", "0GB", "-1GiB", "x"]) | json_scalars,
        "memory_bytes": st.integers() | json_scalars,
        "node": st.integers(min_value=-1, max_value=3) | json_scalars,
        "slowdown": st.floats() | json_scalars,
        "colour": json_scalars,
    },
)
cluster_dicts = (
    st.fixed_dictionaries(
        {},
        optional={
            "devices": st.lists(device_entries, max_size=3) | cluster_specs | json_values,
            "intra_node_bandwidth": st.sampled_from(["24GB/s", "0GB/s", "1e400GB/s", "fast"])
            | json_scalars,
            "inter_node_bytes_per_s": json_scalars,
            "collective_latency_s": json_scalars,
            "links": json_values,
        },
    )
    | json_values
)


@FUZZ
@given(data=cluster_dicts)
def test_cluster_file_data(data):
    cluster = only_cephalo_errors(Cluster.from_dict, data)
    if cluster is not None:
        assert cluster.world_size >= 1
        assert cluster.intra_node_bytes_per_s > 0 and cluster.collective_latency_s >= 0


# ----------------------------------------------------------------------------- plan JSON
def valid_plan_dict() -> dict[str, Any]:
    ranks = [
        RankPlan(0, "l4", 5, 2, 3, 0.5, predicted_step_s=0.2, predicted_peak_memory_bytes=2**30),
        RankPlan(1, "cpu:slowdown=2", 3, 3, 1, 0.5, offload_activations=True),
        RankPlan(2, "p40", 0, 1, 0, 0.0),
    ]
    plan = Plan(
        strategy="cephalo",
        model="gpt-tiny",
        seq_len=16,
        global_batch_size=8,
        dtype="fp32",
        ranks=ranks,
        meta={"cluster": "l4 + cpu + p40"},
    )
    return json.loads(plan.to_json())


def _containers(node: Any, path: tuple = ()) -> list[tuple]:
    """Paths of every dict/list inside `node` (including itself)."""
    found = []
    if isinstance(node, dict | list):
        found.append(path)
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in items:
            found.extend(_containers(child, (*path, key)))
    return found


@st.composite
def mutated_plans(draw) -> dict[str, Any] | list:
    doc: Any = valid_plan_dict()
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        path = draw(st.sampled_from(_containers(doc)))
        node = doc
        for key in path:
            node = node[key]
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        op = draw(st.sampled_from(["replace", "delete", "add"] if keys else ["add"]))
        if op == "add":
            if isinstance(node, dict):
                node[draw(st.text(max_size=10) | st.sampled_from(list(valid_plan_dict())))] = draw(
                    json_values
                )
            else:
                node.append(draw(json_values | st.just(valid_plan_dict()["ranks"][0])))
        else:
            key = draw(st.sampled_from(keys))
            if op == "delete":
                del node[key]
            else:
                old = node[key]
                nearby = (
                    st.integers(min_value=-2, max_value=12)
                    if isinstance(old, int) and not isinstance(old, bool)
                    else st.floats(min_value=-0.5, max_value=1.5)
                    if isinstance(old, float)
                    else st.nothing()
                )
                node[key] = draw(nearby | json_values)
    return doc


@FUZZ
@given(
    doc=mutated_plans() | json_values,
    world_size=st.integers(min_value=-1, max_value=5),
    model=st.sampled_from(["gpt-tiny", "gpt-small-demo", ""]),
)
def test_plan_json_mutations(doc, world_size, model):
    plan = only_cephalo_errors(Plan.from_json, json.dumps(doc))
    if plan is None:
        return
    # what the parser accepts satisfies the plan invariants
    assert sum(plan.batch_sizes) == plan.global_batch_size
    assert abs(sum(plan.state_fractions) - 1) < 1e-6
    assert plan.batch_offsets()[-1] + plan.ranks[-1].batch_size == plan.global_batch_size
    only_cephalo_errors(plan.validate, world_size=world_size, model=model)
    assert Plan.from_json(plan.to_json()) == plan  # and round-trips


@FUZZ
@given(
    text=st.text(max_size=60)
    | pathish
    | st.text(alphabet='{}[]":,0123456789.eE-truefalsn ', max_size=60)
)
def test_plan_json_any_text(text):
    only_cephalo_errors(Plan.from_json, text)


# ----------------------------------------------------------------------------- job config
SECTIONS = section_names()
KEYS = {s: list(field_types(section_class(s))) for s in SECTIONS}
toml_scalars = (
    st.integers().map(str)
    | st.integers(min_value=-2, max_value=200).map(str)
    | st.floats(allow_nan=True, allow_infinity=True).map(
        lambda f: "nan" if math.isnan(f) else repr(f).replace("inf", "inf")
    )
    | st.sampled_from(
        [
            "true",
            "false",
            "1e400",
            "-0.0",
            "inf",
            "-inf",
            "nan",
            '""',
            '"auto"',
            '"even"',
            '"fp16"',
            '"gloo"',
            '"never"',
            "[0.9, 0.95]",
            "[1, 2, 3]",
            "[]",
            "{ dropout = 0.1 }",
            "{}",
            "0x10",
        ]
    )
    | st.text(alphabet=string.printable, max_size=15).map(json.dumps)
    | pathish.map(json.dumps)
)
toml_values = st.recursive(
    toml_scalars,
    lambda inner: st.lists(inner, max_size=3).map(lambda v: f"[{', '.join(v)}]"),
    max_leaves=4,
)


@st.composite
def toml_documents(draw) -> str:
    lines = []
    for _ in range(draw(st.integers(min_value=0, max_value=4))):
        section = draw(st.sampled_from([*SECTIONS, "modle", "train.extra"]))
        lines.append(draw(st.sampled_from([f"[{section}]", f"[[{section}]]", f"{section} = 3"])))
        keys = st.sampled_from(KEYS.get(section, ["x"]) + ["bogus"])
        for _ in range(draw(st.integers(min_value=0, max_value=4))):
            lines.append(f"{draw(keys)} = {draw(toml_values)}")
        if draw(st.booleans()):
            lines.append(draw(st.text(max_size=20)))
    return "\n".join(lines)


@pytest.fixture(scope="module")
def config_file(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "job.toml"


@FUZZ
@given(text=toml_documents())
def test_config_files(config_file, text):
    config_file.write_text(text)
    only_cephalo_errors(load_config, config_file)


@FUZZ
@given(raw=st.binary(max_size=80))
def test_config_file_bytes(config_file, raw):
    config_file.write_bytes(raw)
    only_cephalo_errors(load_config, config_file)


@st.composite
def override_lists(draw) -> list[str]:
    args = []
    for _ in range(draw(st.integers(min_value=0, max_value=4))):
        section = draw(st.sampled_from([*SECTIONS, "modle"]))
        key = draw(st.sampled_from([*KEYS.get(section, ["x"]), "bogus", "overrides.dropout"]))
        value = draw(toml_scalars | st.text(max_size=12) | pathish)
        form = draw(st.sampled_from(["eq", "space", "bare"]))
        if form == "eq":
            args.append(f"--{section}.{key}={value}")
        elif form == "space":
            args += [f"--{section}.{key}", value]
        else:
            args.append(draw(st.text(max_size=12)))
    return args


@FUZZ
@given(overrides=override_lists())
def test_config_overrides(overrides):
    cfg = only_cephalo_errors(load_config, None, overrides)
    if cfg is not None:
        cfg.validate()  # what loads is valid


# ----------------------------------------------------------------------------- model overrides
override_keys = st.sampled_from(
    [
        "vocab_size",
        "seq_len",
        "n_layer",
        "n_head",
        "n_embd",
        "dropout",
        "bias",
        "tie_embeddings",
        "block_size",
        "num_hidden_layers",
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "bogus",
    ]
)
override_values = (
    st.integers(min_value=-2, max_value=70)
    | st.sampled_from([10**6, 10**9])
    | st.floats(min_value=-1, max_value=2)
    | json_scalars
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(["gpt-tiny", "hf-gpt2-tiny", "hf-llama-tiny"]),
    overrides=st.dictionaries(override_keys, override_values, max_size=3),
)
def test_model_overrides(name, overrides):
    """`model.overrides` reach the model builders unchecked by the config (any table is valid
    there); the builders must turn bad settings into one error, not a hang or a traceback."""
    from cephalo.modeling.registry import build_model

    model = only_cephalo_errors(build_model, name, **overrides)
    if model is not None:
        assert model.spec.total_params > 0
