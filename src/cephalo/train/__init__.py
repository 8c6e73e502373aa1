"""Training: the job config (`config`, `config_manager`), each rank's device (`discovery`,
`node_map`), the loop (`trainer`), checkpoints and export (`checkpoint`, `export`),
calibration and re-planning (`calibration`, `replan`), metrics and the schedule.

Import from the submodules (`from cephalo.train.config_manager import load_config`); this package
imports nothing itself so that `cephalo --help` stays fast.
"""
