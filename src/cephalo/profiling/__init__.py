"""Measuring devices and collectives (`cephalo profile`) -> `cephalo.specs.profile` values,
and the profile database.

    from cephalo.profiling.profiler import profile_devices
    from cephalo.costmodel.sources import measured_cost_model
    measured = profile_devices("gpt-tiny", 32, "fp32", Cluster.parse("cpu,cpu:slowdown=2"), comm)
    cm = measured_cost_model(cluster, model.spec, 32, "fp32", measured)

`profiler` runs the measurements inside a job, `measure` holds the timing loops, `database`
the cache, `local` starts local ranks to profile an emulated cluster from one process.
"""
