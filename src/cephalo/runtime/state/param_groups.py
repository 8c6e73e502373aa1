"""Which parameters get weight decay: the ONE rule the engine and every reference share.

Matrices (linear weights, embeddings) decay; vectors and scalars (norm gains, biases) do not,
as in GPT-2 / nanoGPT practice: decaying a norm's gain or a bias only pulls the model
towards a worse function without regularising its capacity. The rule looks at the
parameter's LOGICAL shape (the engine calls it before flattening a unit).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def wants_weight_decay(name: str, param: torch.Tensor) -> bool:
    """True if AdamW's decoupled weight decay applies to the parameter `name` (`<unit>.<param>`).

    `name` is part of the contract so that a future rule can use it; today only the shape
    decides (ndim >= 2)."""
    del name  # the shape alone decides, see the module docstring
    return param.dim() >= 2


def adamw_param_groups(
    named_params: Iterable[tuple[str, torch.Tensor]], weight_decay: float
) -> list[dict]:
    """torch.optim param groups: the decayed parameters with `weight_decay`, the others with 0.
    Empty groups are left out (torch.optim accepts them, but they only clutter state dicts)."""
    decay, no_decay = [], []
    for name, param in named_params:
        (decay if wants_weight_decay(name, param) else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]
