"""Mixture-of-experts models: router settings, and the router's load-balancing loss computed
over the GLOBAL batch.

transformers adds `router_aux_loss_coef x aux` to the loss when `output_router_logits` is
set, where (`load_balancing_loss_func`, the same in every MoE family it has)

    aux = E x sum_e (C_e / R) x (P_e / R)

with, over every MoE layer's router and every token of the batch: C_e the number of
top-k choices of expert e, P_e the sum of the router's softmax probabilities of e, and R the
number of (layer, token) rows. It is a product of two means over the whole batch, so it does
not split into per-micro-batch (or per-rank) terms: the aux loss of each micro-batch, summed
or averaged, is a different objective.

Cephalo computes it exactly, whatever the plan:

- forward (LGA runs every micro-batch of a layer before the next layer, without a graph):
  each MoE layer's router logits are reduced at once to per-expert top-k counts and
  probability sums, accumulated over the layers and micro-batches of this rank (`E` counts,
  `E` sums and a row count: nothing of size tokens is kept);
- between the forward and the backward: ONE all-reduce of those 2E + 1 numbers gives C, P
  and R of the global batch, hence the aux loss value, and its gradient: C does not depend
  on the parameters (top-k choices), so d(coef x aux) / dP_e = coef x E x C_e / R^2, a
  constant weight w_e per expert;
- backward: when a layer is recomputed with a graph, its output passes through an identity
  whose backward adds, to each router's logits, the gradient of sum_t sum_e w_e softmax(
  logits_t)_e (times the loss scale). The rest of the layer's backward is the engine's.

The engine's part is three calls (`start`, `reduce` after its forward pass, `finish`) and the
`aux_loss` it reports; the blocks call `after_layer` (`hf.HFBlock`). The standard
(micro-batch-at-a-time) mode runs a micro-batch's backward before the next one's forward,
before the global C is known: it is refused with the aux loss on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from cephalo.errors import CephaloError
from cephalo.log import logger

EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
"""Config fields naming the number of routed experts (the first one present counts)."""


@dataclass(frozen=True)
class RouterSettings:
    """What the router loss and the cost model read from an MoE config."""

    num_experts: int
    """Routed experts per MoE layer."""
    top_k: int
    """Experts each token is routed to."""
    coef: float
    """`router_aux_loss_coef`."""
    enabled: bool
    """`output_router_logits`: transformers adds the aux term to the loss only then."""


def num_experts(config: Any) -> int | None:
    """Routed experts of an MoE config, None for a dense one."""
    for name in EXPERT_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def router_settings(config: Any, label: str = "model") -> RouterSettings | None:
    """The router settings of an MoE config (None for a dense one); one error when experts
    come without what routes tokens to them."""
    experts = num_experts(config)
    if experts is None:
        return None
    top_k = getattr(config, "num_experts_per_tok", None)
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= experts:
        raise CephaloError(
            f"{label}: {experts} experts but num_experts_per_tok = {top_k!r}: an MoE config must "
            f"say how many experts each token is routed to (an integer from 1 to {experts})"
        )
    coef = getattr(config, "router_aux_loss_coef", None)
    enabled = bool(getattr(config, "output_router_logits", False))
    if enabled and (coef is None or isinstance(coef, bool) or not isinstance(coef, int | float)):
        raise CephaloError(
            f"{label}: output_router_logits is true but router_aux_loss_coef is {coef!r}; set it "
            "(e.g. 0.001) or set output_router_logits = false"
        )
    return RouterSettings(experts, top_k, float(coef or 0.0), enabled)


class _AddRouterGrad(torch.autograd.Function):
    """Identity on a layer's output; its backward also gives each router-logits tensor the
    gradient of sum_t sum_e w_e softmax(logits_t)_e."""

    @staticmethod
    def forward(ctx, out, weight, *logits):
        ctx.save_for_backward(weight, *logits)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out):
        weight, *logits = ctx.saved_tensors
        grads = []
        for value in logits:
            p = torch.softmax(value.detach().float(), dim=-1)
            grads.append((p * (weight - (p * weight).sum(-1, keepdim=True))).to(value.dtype))
        return (grad_out, None, *grads)


class RouterAux:
    """The router loss of one model over one step's global batch (see the module docstring).
    A plain object shared by the model's blocks."""

    def __init__(self, settings: RouterSettings):
        self.settings = settings
        self.phase: str | None = None
        self.stats = torch.zeros(2 * settings.num_experts + 1, dtype=torch.float64)
        self.weight: torch.Tensor | None = None
        self.aux_loss = 0.0
        """The last step's aux loss (set by `finish` from the engine's one read of the step)."""

    @property
    def active(self) -> bool:
        return self.phase is not None

    # ------------------------------------------------------------------ engine side
    def start(self, mode: str, device: torch.device) -> None:
        if mode != "lga":
            raise CephaloError(
                "the router load-balancing loss (output_router_logits) is computed over the "
                "global batch, which needs the lga mode (engine mode is "
                f"{mode!r}); use mode lga or set output_router_logits = false"
            )
        # made on the device: a copy up from pageable memory would wait for the host
        self.stats = torch.zeros(
            2 * self.settings.num_experts + 1, dtype=torch.float64, device=device
        )
        self.phase = "forward"
        self.weight = None

    def reduce(self, all_reduce: Callable[[torch.Tensor], None], loss_scale: float) -> torch.Tensor:
        """After the forward pass: the global counts and sums (one all-reduce), the aux loss
        value and the per-expert gradient weights of the backward, all on the device (no host
        sync: the engine reads the aux loss with the step's loss, after the update). Returns
        aux (fp64, 0-dim, on the device); the loss adds coef x aux."""
        all_reduce(self.stats)
        s = self.settings
        e = s.num_experts
        counts, probs = self.stats[:e], self.stats[e:-1]
        rows_sq = self.stats[-1].clamp(min=1.0) ** 2
        aux = s.num_experts * (counts * probs).sum() / rows_sq
        self.weight = (loss_scale * s.coef * s.num_experts * counts / rows_sq).float()
        self.phase = "backward"
        return aux

    def finish(self, aux_loss: float) -> None:
        """The step is over: `aux_loss` is `reduce`'s value as the engine read it."""
        self.aux_loss = aux_loss
        self.phase = None
        self.weight = None

    # ------------------------------------------------------------------ block side
    def after_layer(self, out: torch.Tensor, logits: list[torch.Tensor]) -> torch.Tensor:
        """A layer's output, given the router logits its forward produced: counted in the
        forward pass, given the aux gradient in the backward's recompute."""
        if not logits or self.phase is None:
            return out
        flat = [v.reshape(-1, v.shape[-1]) for v in logits]
        if self.phase == "forward" and not torch.is_grad_enabled():
            e = self.settings.num_experts
            with torch.no_grad():
                for value in flat:
                    p = torch.softmax(value.float(), dim=-1)
                    chosen = torch.topk(p, self.settings.top_k, dim=-1).indices.reshape(-1)
                    # a scatter-add, not bincount: its output size is known without reading
                    # the indices on the host (bincount's is their max + 1: a host sync)
                    ones = torch.ones(chosen.numel(), dtype=torch.float64, device=chosen.device)
                    counts = torch.zeros(e, dtype=torch.float64, device=chosen.device)
                    self.stats[:e] += counts.scatter_add_(0, chosen, ones).to(self.stats.device)
                    self.stats[e:-1] += p.sum(0).to(self.stats.device, torch.float64)
                    self.stats[-1] += value.shape[0]
        elif self.phase == "backward" and torch.is_grad_enabled() and self.weight is not None:
            weight = self.weight.to(out.device)
            return _AddRouterGrad.apply(out, weight, *flat)
        return out


def router_recorder(hf_model: Any) -> tuple[type, int] | None:
    """The router module class and output index transformers records `router_logits` from
    (`_can_record_outputs` of the base model), or None."""
    for module in (hf_model, getattr(hf_model, "base_model", None)):
        spec = (getattr(module, "_can_record_outputs", None) or {}).get("router_logits")
        if spec is None:
            continue
        target = getattr(spec, "target_class", spec)
        index = getattr(spec, "index", 0) or 0
        if isinstance(target, type):
            return target, int(index)
    return None


def log_without_aux(label: str, settings: RouterSettings) -> None:
    logger.info(
        "%s: %d experts, top %d; output_router_logits is off, so no router load-balancing loss "
        "is added (as in transformers); set output_router_logits = true and "
        "router_aux_loss_coef to train with it",
        label,
        settings.num_experts,
        settings.top_k,
    )


__all__ = [
    "RouterAux",
    "RouterSettings",
    "log_without_aux",
    "num_experts",
    "router_recorder",
    "router_settings",
]
