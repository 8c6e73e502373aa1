"""The DPO reference in full fine-tuning: each row's log-probability under the starting
weights, computed once before training and stored next to the prepared dataset.

TRL's `precompute_ref_log_probs`: with no adapter to switch off, the reference would be a
second copy of the weights; instead one no-grad pass over the run's data under the job's own
plan (`Engine.reference_logps`) gives every row's reference log-probability, and the training
steps read them with their batch. No second model is held.

Keyed by content. A row's reference log-probability is a function of its tokens and labels
alone (for one model), so the table maps a 128-bit hash of each row (ids and labels) to its
value. Lookups then hold under any plan, a re-plan, a resume, any shuffle or epoch, and any
`global_batch_size`; a row the table lacks is computed (collectively: every rank of a step
learns every rank's rows, so all hold the same table). The sidecar file lives beside the
prepared dataset, one per model identity (`model_identity`: the model, its weights files, its
compute dtype, the DPO loss), so a second run of the same model on the same data computes
nothing. It also records the walks over a run's batches it covers (`cover`, `covers`:
preference/job.py `walk_key`), so that second run does not read its batches to find that out.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from cephalo.errors import CephaloError
from cephalo.log import logger

if TYPE_CHECKING:
    from cephalo.runtime.engine.engine import Engine

KEY_BYTES = 16


def row_keys(input_ids: torch.Tensor, labels: torch.Tensor) -> list[bytes]:
    """Each row's content hash (blake2b, 16 bytes) of its ids and labels (int64)."""
    ids = input_ids.to(torch.int64).cpu().numpy()
    lab = labels.to(torch.int64).cpu().numpy()
    return [
        hashlib.blake2b(ids[i].tobytes() + lab[i].tobytes(), digest_size=KEY_BYTES).digest()
        for i in range(ids.shape[0])
    ]


def model_identity(
    name: str, init: str, seed: int, dtype: str, dpo_loss: str, fingerprint: str
) -> dict[str, Any]:
    """What a reference log-probability depends on besides the row: the model (its name; a
    local directory's weight and config files by name, size and modification time), how it
    was initialised, its compute dtype, the shape fingerprint and the DPO loss (IPO averages
    over tokens)."""
    files: dict[str, list[int]] = {}
    path = Path(name)
    if path.is_dir():
        for f in sorted(path.iterdir()):
            if f.suffix in (".safetensors", ".bin", ".json", ".pt"):
                st = f.stat()
                files[f.name] = [st.st_size, int(st.st_mtime)]
    return {
        "model": str(path.resolve()) if path.is_dir() else name,
        "files": files,
        "init": init,
        "seed": seed,
        "dtype": dtype,
        "dpo_loss": dpo_loss,
        "shape": fingerprint,
    }


def sidecar_path(data_path: Path, identity: dict[str, Any]) -> Path:
    """`<dataset>.dpo-reference/<hash of the model identity>.pt`, beside the prepared
    dataset."""
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    data_path = Path(data_path)
    return data_path.with_name(data_path.name + ".dpo-reference") / f"{digest}.pt"


class ReferenceTable:
    """Reference log-probabilities by row content (see the module docstring). Owns the
    table and its sidecar file (None: in memory only)."""

    def __init__(self, path: Path | None, identity: dict[str, Any] | None = None):
        self.path = path
        self.identity = identity or {}
        self.values: dict[bytes, float] = {}
        self.walks: dict[str, list[int]] = {}
        """Walks the table covers: walk key -> [steps, evaluation batches] (`cover`)."""
        self._walks_changed = False
        self.computed = 0
        """Rows computed by this process (not read from the sidecar)."""
        if path is not None and path.is_file():
            self._load(path)

    def _load(self, path: Path) -> None:
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
            keys, values = saved["keys"], saved["values"]
        except Exception as err:  # a cut-off or foreign file: recomputed, said once
            logger.warning("DPO reference %s unreadable (%s): recomputing it", path, err)
            return
        raw = keys.numpy().tobytes()
        for i, v in enumerate(values.tolist()):
            self.values[raw[i * KEY_BYTES : (i + 1) * KEY_BYTES]] = v
        try:  # a sidecar written before walks were recorded has none: its run walks once
            walks = json.loads(saved.get("walks", "{}"))
            self.walks = {str(k): [int(s), int(e)] for k, (s, e) in walks.items()}
        except (ValueError, TypeError, AttributeError) as err:
            logger.warning("DPO reference %s: unreadable walk records (%s): ignored", path, err)

    def covers(self, walk: str, steps: int, eval_batches: int) -> bool:
        """Whether a walk over `walk`'s batches of at least `steps` steps and `eval_batches`
        evaluation batches was recorded (a run's batches are a prefix of a longer run's)."""
        done = self.walks.get(walk)
        return done is not None and done[0] >= steps and done[1] >= eval_batches

    def cover(self, walk: str, steps: int, eval_batches: int) -> None:
        """Record that every row of `walk`'s first `steps` steps and `eval_batches` evaluation
        batches is in the table (after `ensure` saw them all)."""
        old = self.walks.get(walk, [0, 0])
        new = [max(old[0], steps), max(old[1], eval_batches)]
        if new != old:
            self.walks[walk] = new
            self._walks_changed = True

    def save(self) -> None:
        """Write the table (atomically: a temporary file per process, then renamed). A
        dataset location that cannot be written is said and skipped: the run goes on."""
        if self.path is None or not (self.computed or self._walks_changed):
            return
        keys = np.frombuffer(b"".join(self.values), dtype=np.uint8).reshape(-1, KEY_BYTES)
        data = {
            "keys": torch.from_numpy(keys.copy()),
            "values": torch.tensor(list(self.values.values()), dtype=torch.float32),
            "identity": json.dumps(self.identity, sort_keys=True),
            "walks": json.dumps(self.walks, sort_keys=True),
        }
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(data, tmp)
            tmp.replace(self.path)
        except OSError as err:
            logger.warning("DPO reference not saved to %s (%s): computed again next run", tmp, err)

    def lookup(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Each row's reference log-probability (fp32 [rows]); a row the table lacks is an
        error (`ensure` first)."""
        out = []
        for k in row_keys(input_ids, labels):
            v = self.values.get(k)
            if v is None:
                raise CephaloError(
                    "a DPO row has no precomputed reference log-probability (internal error: "
                    "the reference pass before training did not cover this batch)"
                )
            out.append(v)
        return torch.tensor(out, dtype=torch.float32)

    def ensure(
        self,
        engine: Engine,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        position_ids: torch.Tensor | None = None,
    ) -> None:
        """Collective (every rank with its slice of the same batch): if any rank lacks a row,
        every rank computes its slice's reference (`Engine.reference_logps`) and all learn
        every rank's rows and values (two all-gathers), so the tables stay the same."""
        keys = row_keys(input_ids, labels)
        missing = sum(k not in self.values for k in keys)
        flag = torch.tensor([float(missing)], dtype=torch.float64, device=engine.device)
        engine.collectives.all_reduce(flag)
        if float(flag.item()) == 0.0:
            return
        values = engine.reference_logps(input_ids, labels, position_ids).double()
        rows = [engine.rows_per_sample * r.batch_size for r in engine.plan.ranks]
        # 2 int64 per row (gloo gathers no uint8 with sizes), read as int64 from the bytes
        # directly: a rank with no rows (a memory-only rank, batch 0) has an empty (0, 16)
        # uint8 array, which torch cannot `view` as int64 (its stride is 0)
        mine = torch.from_numpy(np.frombuffer(b"".join(keys), dtype=np.int64).copy())
        all_keys = torch.empty(2 * sum(rows), dtype=torch.int64, device=engine.device)
        all_values = torch.empty(sum(rows), dtype=torch.float64, device=engine.device)
        world = engine.world
        engine.collectives.wait(
            world.all_gather_v(all_keys, mine.to(engine.device), [2 * r for r in rows])
        )
        engine.collectives.wait(world.all_gather_v(all_values, values.to(engine.device), rows))
        raw = all_keys.cpu().numpy().tobytes()
        for i, v in enumerate(all_values.cpu().tolist()):
            key = raw[i * KEY_BYTES : (i + 1) * KEY_BYTES]
            if key not in self.values:
                self.values[key] = v
                self.computed += 1
