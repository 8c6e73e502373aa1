"""Checkpoints in the logical layout (store.py: DCP with uneven 1-D chunks, atomic,
verified), in one directory every rank shares or node-local (sites.py: each node's ranks
write their own shards and their own copy of the metadata)."""

from cephalo.train.checkpoint.sites import Sites, sites_from_probe
from cephalo.train.checkpoint.store import (
    DCP_METADATA_FILE,
    FORMAT_VERSION,
    MARKER,
    TRAINER_STATE_FILE,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    resume_target,
    save_checkpoint,
    step_dir_name,
    verify_checkpoint,
)

__all__ = [
    "DCP_METADATA_FILE",
    "FORMAT_VERSION",
    "MARKER",
    "TRAINER_STATE_FILE",
    "Sites",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "resume_target",
    "save_checkpoint",
    "sites_from_probe",
    "step_dir_name",
    "verify_checkpoint",
]
