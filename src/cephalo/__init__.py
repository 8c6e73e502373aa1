"""Cephalo: train Transformers on heterogeneous GPU clusters.

The public API is kept small; everything else is importable from its module but may change.
"""

from cephalo.errors import CephaloError
from cephalo.modeling.registry import build_model
from cephalo.planner.plan import Plan, RankPlan
from cephalo.specs.cluster import Cluster, Device
from cephalo.specs.model import ModelSpec

__version__ = "0.1.0"

__all__ = [
    "CephaloError",
    "Cluster",
    "Device",
    "ModelSpec",
    "Plan",
    "RankPlan",
    "build_model",
    "__version__",
]
