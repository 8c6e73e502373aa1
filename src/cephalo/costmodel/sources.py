"""Where a cost model's device profiles come from: the catalog (published measurements of
real GPUs, for clusters you do not own yet) or measurements (`cephalo profile`). Either way
the result is the same `CostModel`, so a plan is judged by the same formulas."""

from __future__ import annotations

import copy
import dataclasses

from cephalo.costmodel.collectives import backend_pads
from cephalo.costmodel.host import HostResources
from cephalo.costmodel.model import CostModel
from cephalo.costmodel.shard_groups import Links
from cephalo.errors import CephaloError
from cephalo.specs.adapter import AdapterSpec
from cephalo.specs.catalog.devices import host_optimizer_s_per_param
from cephalo.specs.catalog.published import catalog_profile
from cephalo.specs.cluster import Cluster
from cephalo.specs.model import ModelSpec
from cephalo.specs.profile import CommProfile, DeviceProfile, MeasuredProfiles


def profiles_cost_model(
    cluster: Cluster,
    model_spec: ModelSpec,
    seq_len: int,
    dtype: str,
    profiles: dict[str, DeviceProfile],
    comm: CommProfile | None = None,
    **kw,
) -> CostModel:
    """Any profiles (catalog or measured); collectives from `comm` or the cluster's links."""
    if comm is None:
        comm = CommProfile(
            bytes_per_s=cluster.slowest_link_bytes_per_s(),
            latency_s=cluster.collective_latency_s,
        )
    elif cluster.num_nodes > 1 and all(d.type == "cpu" for d in cluster.devices):
        # emulated nodes: the measured rings ran on one machine; the emulated inter-node link
        # (`;inter=RATE`, a delay per byte) bounds them
        comm = CommProfile(
            bytes_per_s=min(comm.bytes_per_s, cluster.inter_node_bytes_per_s),
            latency_s=comm.latency_s,
        )
    sources = sorted({p.source for p in profiles.values()})
    meta = {"profile_source": ",".join(sources)}
    kw.setdefault("host", host_resources(cluster, profiles))
    kw.setdefault("serial_reduce", True)
    kw.setdefault("links", cluster_links(cluster))
    # the runtime pads near-even splits on NCCL (CUDA GPUs), not on gloo (CPUs): charge it there
    kw.setdefault("padded_collectives", backend_pads([d.type for d in cluster.devices]))
    return CostModel(
        model_spec, seq_len, dtype, list(cluster.devices), profiles, comm, meta=meta, **kw
    )


def cluster_links(cluster: Cluster) -> Links:
    """The cluster's intra- and inter-node links as the cost model charges them."""
    return Links(
        intra_bytes_per_s=cluster.intra_node_bytes_per_s,
        inter_bytes_per_s=cluster.inter_node_bytes_per_s,
        node_of=tuple(d.node for d in cluster.devices),
        latency_s=cluster.collective_latency_s,
    )


def host_resources(cluster: Cluster, profiles: dict[str, DeviceProfile]) -> HostResources:
    """The hosts of a cluster as the cost model sees them. A rank's host AdamW speed is, in
    order: the cluster file's (`host_optimizer_s_per_param`, per node or for all), the one
    measured with its device's profile (`cephalo profile`), or the catalog's default for a host
    shared by that node's ranks (`catalog.host_optimizer_s_per_param`)."""
    speeds = []
    for d in cluster.devices:
        own = cluster.host_optimizer_override(d.node)
        if own is None:
            own = profiles[d.type_key].host_optimizer_s_per_param
        if own is None:
            own = host_optimizer_s_per_param(len(cluster.ranks_on_node(d.node)))
        speeds.append(float(own))
    return HostResources(
        node_of=tuple(d.node for d in cluster.devices),
        memory_bytes={n: cluster.host_memory_of(n) for n in cluster.nodes()},
        optimizer_s_per_param=tuple(speeds),
    )


def catalog_cost_model(
    cluster: Cluster, model_spec: ModelSpec, seq_len: int, dtype: str, **kw
) -> CostModel:
    """Profiles from the catalog (published measurements), links from the cluster spec."""
    profiles = {}
    for d in cluster.devices:
        if d.type_key not in profiles:
            profiles[d.type_key] = catalog_profile(d.type, model_spec, seq_len, dtype)
    return profiles_cost_model(cluster, model_spec, seq_len, dtype, profiles, **kw)


def measured_cost_model(
    cluster: Cluster,
    model_spec: ModelSpec,
    seq_len: int,
    dtype: str,
    measured: MeasuredProfiles,
    **kw,
) -> CostModel:
    """The cost model over measured profiles (`cephalo profile`), each device type's memory
    the smallest of its devices in this cluster.

    Collectives: the measured `CommProfile` when there is one, else the cluster's links."""
    missing = sorted({d.type_key for d in cluster.devices} - set(measured.profiles))
    if missing:
        raise CephaloError(
            f"the profiles have no measurements for {', '.join(missing)} (they cover "
            f"{', '.join(sorted(measured.profiles))}); profile this cluster with `cephalo profile --devices ...`"
        )
    if measured.seq_len != seq_len or measured.dtype != dtype:
        raise CephaloError(
            f"the profiles were measured at seq_len {measured.seq_len} / {measured.dtype}, not "
            f"{seq_len} / {dtype}; profile again with --seq-len {seq_len} --dtype {dtype}"
        )
    profiles = {}
    for k in dict.fromkeys(d.type_key for d in cluster.devices):
        p = copy.copy(measured.profiles[k])
        p.memory_bytes = min(d.memory_bytes for d in cluster.devices if d.type_key == k)
        profiles[k] = p
    return profiles_cost_model(
        cluster, model_spec, seq_len, dtype, profiles, comm=measured.comm, **kw
    )


DEFAULT_MODEL, DEFAULT_SEQ_LEN, DEFAULT_DTYPE = "gpt-2.7b", 512, "fp16"
"""What `cephalo plan` / `simulate` / `advise` assume when neither the command nor measured
profiles say."""


def build_cost_model(
    cluster_spec: str | Cluster,
    model: str | None,
    seq_len: int | None,
    dtype: str | None,
    profiles_path: str | None = None,
    adapter: AdapterSpec | None = None,
    host_memory: int | None = None,
) -> CostModel:
    """A cost model for a cluster spec (or file), from the catalog or from measured profiles.

    Unset model / seq_len / dtype come from the measured profiles, or the defaults.
    `host_memory` (bytes) is every node's host memory, replacing what the cluster says (the
    commands' `--host-memory`). A runnable model (a preset or a directory) refuses a `seq_len`
    past its context as `cephalo run` does (`ModelSpec.check_seq_len`); the catalog's shapes
    do not record a real context. The model's shape fingerprint goes into `meta["model_shape"]`
    so a plan file follows the shape, not the path (`Plan.validate`)."""
    from cephalo.modeling.registry import (  # a model directory's shape (torch)
        list_runnable_models,
        model_directory,
        model_spec_for,
    )

    if seq_len is not None and seq_len < 1:
        raise CephaloError(f"--seq-len must be >= 1, got {seq_len}")
    cluster = cluster_spec if isinstance(cluster_spec, Cluster) else Cluster.from_any(cluster_spec)
    measured = None
    if profiles_path:
        from cephalo.specs.profile import MeasuredProfiles

        measured = MeasuredProfiles.load(profiles_path)
    model = model or (measured.model if measured else DEFAULT_MODEL)
    seq_len = seq_len or (measured.seq_len if measured else DEFAULT_SEQ_LEN)
    dtype = dtype or (measured.dtype if measured else DEFAULT_DTYPE)
    spec = model_spec_for(model)
    if model in list_runnable_models() or model_directory(model) is not None:
        spec.check_seq_len(seq_len, "--seq-len", model)
    if host_memory is not None:
        cluster = dataclasses.replace(
            cluster, host_memory_bytes=host_memory, node_host_memory_bytes={}
        )
    if measured is None and any(d.type == "cpu" for d in cluster.devices):
        raise CephaloError(
            "cpu devices have no catalog profile: measure them with `cephalo profile --devices "
            f"{cluster_spec if isinstance(cluster_spec, str) else cluster.to_spec()} --model {model} --out profiles.json`, then pass --profiles profiles.json"
        )
    if measured is not None:
        from cephalo.costmodel.sources import measured_cost_model

        cm = measured_cost_model(cluster, spec, seq_len, dtype, measured, adapter=adapter)
        cm.meta["profile_source"] = f"measured:{profiles_path}"
    else:
        cm = catalog_cost_model(cluster, spec, seq_len, dtype, adapter=adapter)
        cm.meta["profile_source"] = "catalog"
    cm.meta["cluster_spec"] = str(cluster_spec)
    cm.meta["cluster"] = cluster.to_dict()
    cm.meta["cluster_description"] = cluster.describe()
    cm.meta["model_shape"] = spec.shape_fingerprint()
    return cm
