"""The project's one logger. Modules do `from cephalo.log import logger`."""

from __future__ import annotations

import logging
import os

from cephalo import envvars

logger = logging.getLogger("cephalo")


def init_logging(level: str | int | None = None) -> None:
    """Configure the cephalo logger once (rank-aware prefix under torchrun)."""
    if logger.handlers:
        return
    level = level or os.environ.get(envvars.LOG_LEVEL, "INFO")
    rank = os.environ.get("RANK")
    prefix = f"[rank{rank}] " if rank is not None else ""
    handler = logging.StreamHandler()
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s {prefix}%(levelname)s %(message)s", "%H:%M:%S")
    )
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
