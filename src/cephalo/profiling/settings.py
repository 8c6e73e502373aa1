"""How thoroughly to profile: the `[profile]` section of the job config, and what
`profile_devices` reads (one object for both; no torch here, the config module imports it)."""

from __future__ import annotations

from dataclasses import dataclass

from cephalo.errors import CephaloError


@dataclass
class ProfileSettings:
    """Measuring the devices for `parallel.plan = "auto"`."""

    cache: str | None = None
    """Profile database file, reused across runs; unset: `<logging.dir>/profile.json` in a
    training job (`cephalo profile`: `$CEPHALO_PROFILE_DB` or `~/.cache/cephalo/profiles.json`)."""
    repeats: int = 3
    """Timed repetitions per measurement (the median is kept)."""
    warmup: int = 1
    """Untimed repetitions before measuring."""
    time_cap_s: float = 60.0
    """Stop profiling larger micro-batches after this many seconds per device (extrapolate beyond)."""
    max_micro_batch: int = 32
    """Largest micro-batch measured (sizes 1, 2, 4, ... up to it); the cost model extrapolates beyond."""
    optimizer_numel: int = 1 << 21
    """Elements of the flat shard the AdamW step is timed on."""
    host_copy_bytes: int = 32 << 20
    """Buffer size of the host-copy bandwidth measurement, bytes."""
    comm_sizes_bytes: tuple[int, int] = (256 << 10, 8 << 20)
    """The two total message sizes, bytes, the collective fit uses (latency and bandwidth)."""
    per_sample_dropout: bool = True
    """Run units under the engine's per-sample dropout mode (as the engine does by default)."""
    concurrent: bool | None = None
    """Measure every rank's device at the same time, by the wall clock, each timed repetition
    started on all ranks together (`cephalo.profiling.profiler`); unset: when all ranks are
    CPU processes on one host, where they contend for the cores in training."""

    def problems(self) -> list[str]:
        """What is out of range, one message per field (empty when valid)."""
        out = []
        if self.repeats < 1:
            out.append(f"profile.repeats must be >= 1, got {self.repeats}")
        if self.warmup < 0:
            out.append(f"profile.warmup must be >= 0, got {self.warmup}")
        if not self.time_cap_s > 0:
            out.append(f"profile.time_cap_s must be > 0, got {self.time_cap_s}")
        if self.max_micro_batch < 1:
            out.append(f"profile.max_micro_batch must be >= 1, got {self.max_micro_batch}")
        if self.optimizer_numel < 1 or self.host_copy_bytes < 1:
            out.append("profile.optimizer_numel and profile.host_copy_bytes must be >= 1")
        if (
            len(self.comm_sizes_bytes) != 2
            or not 0 < self.comm_sizes_bytes[0] < self.comm_sizes_bytes[1]
        ):
            out.append(
                f"profile.comm_sizes_bytes must be two sizes, smaller first, got {list(self.comm_sizes_bytes)}"
            )
        return out

    def validate(self) -> None:
        """Raise `CephaloError` with the first problem."""
        if problems := self.problems():
            raise CephaloError(f"invalid profile settings: {problems[0]}")
