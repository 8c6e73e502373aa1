"""Cephalo: train Transformers on heterogeneous GPU clusters.

The public API is kept small; everything else is importable from its module but may change.
"""

from cephalo.errors import CephaloError
from cephalo.models import ModelSpec
from cephalo.plan import Plan, RankPlan

__version__ = "0.1.0"

__all__ = ["CephaloError", "ModelSpec", "Plan", "RankPlan", "__version__"]
