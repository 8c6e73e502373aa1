"""Measuring devices and collectives (`cephalo profile`), and the profile database.

from cephalo.profiling import profile_devices, cost_model_from_profiles
measured = profile_devices("gpt-tiny", 32, "fp32", Cluster.parse("cpu,cpu:slowdown=2"), comm)
cm = cost_model_from_profiles(cluster, model.spec, 32, "fp32", measured)
"""

from cephalo.profiling.database import ProfileDatabase, default_db_path
from cephalo.profiling.profiler import (
    MeasuredProfiles,
    ProfileSettings,
    cost_model_from_profiles,
    measure_device,
    profile_devices,
)

__all__ = [
    "MeasuredProfiles",
    "ProfileDatabase",
    "ProfileSettings",
    "cost_model_from_profiles",
    "default_db_path",
    "measure_device",
    "profile_devices",
]
