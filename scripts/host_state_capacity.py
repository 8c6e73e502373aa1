"""The largest catalog model each of a few clusters can train, without and with host state.

For each cluster (catalog profiles, global batch 64, seq 512, fp16, the default host: 256 GiB
per node), every catalog model with published profiles on all of the cluster's device types
is planned twice: all state on the GPUs (`allow_host_state=False`) and with host state where
it pays. The table (markdown, for docs/planner.md) gives the largest model that fits each way
and the predicted samples/s of both plans for it and for the largest model that fits without.

    python scripts/host_state_capacity.py [--clusters 2xl4,a6000,p40 4xt4 2xa10g]
"""

from __future__ import annotations

import argparse

from cephalo.costmodel.sources import catalog_cost_model
from cephalo.errors import PlanDoesNotFit
from cephalo.planner.makers import make_plan
from cephalo.specs.catalog.models import list_models
from cephalo.specs.catalog.published import available_profiles
from cephalo.specs.cluster import Cluster

SEQ, DTYPE, BATCH = 512, "fp16", 64
DEFAULT_CLUSTERS = ("2xl4,a6000,p40", "4xt4", "2xa10g")


def _rate(cm, host: bool) -> float | None:
    try:
        return make_plan(cm, BATCH, allow_host_state=host).predicted.samples_per_s
    except PlanDoesNotFit:
        return None


def capacity(spec: str) -> dict:
    cluster = Cluster.parse(spec)
    types = {d.type for d in cluster.devices}
    have: dict[str, set[str]] = {}
    for model, device, seq, dtype in available_profiles():
        if seq == SEQ and dtype == "fp16":
            have.setdefault(model, set()).add(device)
    models = sorted(
        (m for m in list_models() if types <= have.get(m.name, set())),
        key=lambda m: m.total_params,
    )
    rows = []
    for m in models:
        cm = catalog_cost_model(cluster, m, SEQ, DTYPE)
        rows.append((m, _rate(cm, False), _rate(cm, True)))
    without = [r for r in rows if r[1] is not None]
    with_host = [r for r in rows if r[2] is not None]
    return {
        "cluster": cluster,
        "without": without[-1] if without else None,
        "with": with_host[-1] if with_host else None,
    }


def _cell(row, which: int) -> str:
    if row is None:
        return "none"
    m = row[0]
    rate = row[which]
    return f"{m.name} ({m.total_params / 1e9:.1f} B): {rate:.3f} samples/s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clusters", nargs="+", default=list(DEFAULT_CLUSTERS))
    args = ap.parse_args()
    print(
        "| cluster | largest without host state | same model with host state | "
        "largest with host state |"
    )
    print("| :--- | :--- | :--- | :--- |")
    for spec in args.clusters:
        r = capacity(spec)
        same = r["without"]
        with_same = None if same is None else (same[0], None, same[2])
        print(
            f"| `{spec}` ({r['cluster'].describe()}) | {_cell(same, 1)} | {_cell(with_same, 2)} "
            f"| {_cell(r['with'], 2)} |"
        )


if __name__ == "__main__":
    main()
