"""Training: the job config (`config`), data (`data`), checkpoints (`checkpoint`), the loop (`trainer`).

Import from the submodules (`from cephalo.train.config import load_config`); this package
imports nothing itself so that `cephalo --help` stays fast.
"""
