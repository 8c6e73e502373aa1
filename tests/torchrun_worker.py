"""A `cephalo train` worker for tests that launch with torchrun (tests/test_torchrun.py).

torchrun gives every worker the same environment, so this script is what makes the ranks
differ, and only in what each discovers about itself: it sets `CEPHALO_DEVICE` to entry
LOCAL_RANK of `TEST_DEVICES` (`;`-separated), as a GPU rank would find its own GPU. Extra
config overrides for one rank (`TEST_RANK_EXTRA="1:--train.steps=7"`) make a rank start a
different job. Each rank writes the plan it made to `TEST_OUT/plan_rank{R}.json`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from cephalo.__main__ import quick_exit
from cephalo.errors import CephaloError
from cephalo.runtime.collectives.dist import shutdown
from cephalo.train.config_manager import load_config
from cephalo.train.trainer import train

rank = int(os.environ["LOCAL_RANK"])
os.environ["CEPHALO_DEVICE"] = os.environ["TEST_DEVICES"].split(";")[rank]
args = sys.argv[1:]
extra = os.environ.get("TEST_RANK_EXTRA", "")
if extra and int(extra.split(":", 1)[0]) == rank:
    args.append(extra.split(":", 1)[1])
try:
    result = train(load_config(None, args))
except CephaloError as err:
    print(f"rank {rank}: cephalo: error: {err}", file=sys.stderr, flush=True)
    sys.exit(2)
finally:
    shutdown()  # as `cephalo train` does
result.plan.to_json(Path(os.environ["TEST_OUT"]) / f"plan_rank{rank}.json")
quick_exit(0)  # as `python -m cephalo` ends: without Python's module teardown
