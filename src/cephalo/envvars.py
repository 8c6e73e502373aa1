"""Every `CEPHALO_*` environment variable the package reads, and `scoped_environ`.

One home for the names, so a reader (and `docs/`) finds them all here:

| variable | read by | meaning |
|---|---|---|
| `CEPHALO_LOG` | `cephalo.log` | log level (`INFO` by default) |
| `CEPHALO_VERBOSE` | `cephalo.log` | `1` (`cephalo --verbose` sets it): third-party warnings on import shown once instead of captured |
| `CEPHALO_COMM_VALIDATE` | `runtime.collectives.comm` | `0` turns off the cross-rank collective checks |
| `CEPHALO_PROFILE_DB` | `profiling.database` | profile database file |
| `CEPHALO_CACHE` | `data.text` | cache root of prepared datasets |
| `CEPHALO_ERROR_DIR` | `commands.train`, `launch.elastic` | where workers of `cephalo run` write their error reports |
| `CEPHALO_DEVICE` | `train.discovery` | this process's own (emulated) device, one cluster-spec device, e.g. `cpu:slowdown=2,mem=1GiB` (when `parallel.devices` is unset) |
| `CEPHALO_TEST_KILL_AT_STEP`, `CEPHALO_TEST_KILL_RANK` | `train.trainer` | test hook: SIGKILL a rank before a step |
| `CEPHALO_TEST_OOM_AT_STEP` | `train.trainer` | test hook: that rank runs out of memory at a step |
| `CEPHALO_TEST_REPLAN` | `train.replan` | test hook: `STEP:PLAN.json[,STEP:PLAN.json...]`, switch to that plan after that step (no calibration) |
| `CEPHALO_DOCTOR_VERDICT` | `commands.doctor` | set by `cephalo doctor --devices` for its workers: the file where rank 0 writes 0 (every check passed) or 1 |
| `CEPHALO_EMULATE_DRIFT` | `runtime.emulation` | `STEP:RANK:SLOWDOWN[,...]`: an emulated rank computes at another slowdown from a step on (a device that changes speed) |
| `CEPHALO_STRICT_MEMORY` | `train.trainer` | `0` turns off the byte-by-byte accounting of an emulated device's memory (`runtime.device_memory`; on by default for emulated ranks): then only the engine's ledger enforces `mem=` |
| `CEPHALO_TEST_REPLAN_FAIL` | `train.replan` | test hook: a re-plan fails (as an out-of-memory would; in the first attempt only) |
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

LOG_LEVEL = "CEPHALO_LOG"
VERBOSE = "CEPHALO_VERBOSE"
"""`cephalo --verbose` sets it (the workers inherit it): third-party warnings on import are
shown once (cephalo.log.quiet_imports) instead of captured."""
COMM_VALIDATE = "CEPHALO_COMM_VALIDATE"
PROFILE_DB = "CEPHALO_PROFILE_DB"
CACHE_ROOT = "CEPHALO_CACHE"
ERROR_DIR = "CEPHALO_ERROR_DIR"
"""Set by `cephalo run` for its workers: each failing worker writes its error report there."""
DEVICE = "CEPHALO_DEVICE"
"""One emulated device for this process alone (a launcher or a test gives each rank its own)."""
KILL_AT_STEP = "CEPHALO_TEST_KILL_AT_STEP"
KILL_RANK = "CEPHALO_TEST_KILL_RANK"
OOM_AT_STEP = "CEPHALO_TEST_OOM_AT_STEP"
TEST_REPLAN = "CEPHALO_TEST_REPLAN"
TEST_REPLAN_FAIL = "CEPHALO_TEST_REPLAN_FAIL"
EMULATE_DRIFT = "CEPHALO_EMULATE_DRIFT"
DOCTOR_VERDICT = "CEPHALO_DOCTOR_VERDICT"
STRICT_MEMORY = "CEPHALO_STRICT_MEMORY"
"""`0`: an emulated rank's memory is only what its ledger is told (the strict mode is off)."""
"""Set by `cephalo doctor`'s local launch: rank 0 writes its verdict (0 or 1) there."""


@contextlib.contextmanager
def scoped_environ(values: dict[str, str]) -> Iterator[None]:
    """Set `values` in `os.environ` inside the block; restore what was there (or its absence)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
