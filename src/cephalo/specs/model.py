"""ModelSpec: the shape of a Transformer as the planner sees it (no weights, no code).

A model is a sequence of units: embedding, `num_layers` blocks, head (final norm, output
projection, loss). The planner and cost model only need each unit's parameter count and the
sizes that drive activation memory; the runnable modules live in `cephalo.modeling`.
Built-in specs (`get_model_spec("gpt-2.7b")`) come from the catalog (`cephalo.specs.catalog.published`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field

from cephalo.errors import CephaloError
from cephalo.specs.adapter import Linear

UNIT_KINDS = ("embedding", "block", "head")


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder/encoder Transformer, enough for the cost model."""

    name: str
    """Canonical name, e.g. `gpt-2.7b`."""
    arch: str
    """Family: `gpt`, `llama`, `bert`, `vit`, `mistral`."""
    num_layers: int
    hidden_size: int
    num_heads: int
    vocab_size: int
    """Output classes of the head (vocabulary; classes for ViT)."""
    ffn_hidden_size: int
    params_per_block: int
    """Parameters of one Transformer block."""
    embedding_params: int
    """Parameters of the embedding unit (token + position embeddings, patch projection...)."""
    head_params: int
    """Parameters the head owns (final norm, and the output projection unless tied)."""
    tied_embeddings: bool = False
    """The head's output projection is the token embedding (GPT-2 style)."""
    max_seq_len: int = 2048
    aliases: tuple[str, ...] = field(default=())
    """Other names accepted for this model (the published data's keys)."""
    block_linears: tuple[Linear, ...] = field(default=())
    """The Linear layers of one block (name, in, out): what LoRA adapts (`specs.adapter`). Read
    off the modules for a runnable model, from the family's shape for a catalog one; empty
    when unknown (then only full fine-tuning can be planned)."""
    active_params_per_block: int = 0
    """Mixture of experts: the parameters one token's forward uses in a block (attention,
    router, shared experts and `experts_per_token` of the `num_experts` routed experts),
    which its compute scales with; 0 for a dense block (all of `params_per_block`). Memory
    (state, gathers) always counts `params_per_block`: every expert."""
    num_experts: int = 0
    """Routed experts per block (0: dense)."""
    experts_per_token: int = 0
    """Experts each token is routed to (top-k; 0: dense)."""

    @property
    def compute_params_per_block(self) -> int:
        """Parameters a token's forward multiplies by in one block (FLOP-scaled compute)."""
        return self.active_params_per_block or self.params_per_block

    def unit_kinds(self) -> list[str]:
        return ["embedding"] + ["block"] * self.num_layers + ["head"]

    def unit_params(self) -> list[int]:
        """Parameters owned by each unit, in unit order (tied weights counted once, in the embedding)."""
        return (
            [self.embedding_params] + [self.params_per_block] * self.num_layers + [self.head_params]
        )

    @property
    def total_params(self) -> int:
        return sum(self.unit_params())

    def shape_fingerprint(self) -> str:
        """A short hash of what a plan depends on: every field of the shape but the names and
        the context length (`seq_len` is checked on its own). A plan file records it, so it
        follows the model's shape, not how its path was spelled: `./data/x`, `data/x` and
        another machine's absolute path of the same `config.json` all match."""
        skip = {"name", "aliases", "max_seq_len"}
        shape = {k: v for k, v in dataclasses.asdict(self).items() if k not in skip}
        text = json.dumps(shape, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def check_seq_len(self, seq_len: int, setting: str, name: str | None = None) -> None:
        """Refuse a sequence longer than the model's context, one check for `run` (setting
        `data.seq_len`) and `plan` / `simulate` / `advise` (`--seq-len`): positions past the
        context do not exist, so a plan for them would be a plan for a job that cannot run."""
        context = self.max_seq_len
        if context and seq_len > context:
            raise CephaloError(
                f"{setting} = {seq_len} is longer than model {name or self.name}'s context of "
                f"{context} tokens: set {setting} <= {context}, or enlarge the model's context "
                f"(a job's --model.overrides seq_len={seq_len}; a directory's config.json)"
            )
