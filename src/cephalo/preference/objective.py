"""The DPO objective: each pair's loss from its completions' log-probabilities, the gradient
the engine's head back-propagates, and TRL's metrics.

A pair is two rows of a micro-batch, row 2i its prompt + chosen completion, row 2i+1 the
same prompt + the rejected one (the data side's contract, preference/data.py). The
log-probability of a completion is the sum over its tokens of log softmax at the label
(`logp = -sum of the row's token cross-entropies`, prompt and padding carry no label); under
IPO it is averaged over the completion's tokens, as TRL's `DPOTrainer` averages it
(`loss_type="ipo"`: `all_logps / size_completion`). With p the policy's and r the
reference's, c the chosen row and j the rejected one, the margin is
z = (p_c - r_c) - (p_j - r_j) and the pair's loss

    sigmoid (the DPO paper, eq. 7, TRL's default): -log sigmoid(beta z)
    ipo (Azar et al. eq. 17, TRL's form):           (z - 1 / (2 beta))^2

The step's loss is the mean over the GLOBAL batch of pairs: each rank's pair-loss sum divided
by the global pair count (the plan's global batch size, known on the host: nothing to
all-reduce before the backward).

Why a row weight. The SFT loss is linear in the token losses, so the head knows its output
gradient before its forward. The DPO loss is not, but it is a function of each row's summed
token loss, and the two rows of a pair are in the same micro-batch. So the head first runs a
graph-free chunked forward for each row's log-probability (runtime/engine/head_pass.py), this
module turns those into dL/d(row's token-loss sum) (`row_weights`), and the head's usual one
pass of loss and backward runs with each row's token losses weighted by its row's weight:
the gradient is exact, the head stays token-wise and chunked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cephalo.errors import CephaloError

OBJECTIVES = ("sft", "dpo")
DPO_LOSSES = ("sigmoid", "ipo")
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
"""TRL's names of the DPO metrics (global-batch means), as metrics.jsonl and TensorBoard show
them."""
_N_SUMS = 7
"""Per-step sums kept on the device: loss, chosen reward, rejected reward, accuracy, chosen
logp, rejected logp (margins = chosen - rejected rewards), pairs counted."""


@dataclass(frozen=True)
class DpoSettings:
    """`train.dpo_beta` and `train.dpo_loss` (train/config.py)."""

    beta: float = 0.1
    """The DPO temperature (TRL's `beta`); IPO's regularisation tau."""
    loss: str = "sigmoid"
    """`sigmoid` (the DPO paper's, TRL's default) or `ipo`."""

    def validate(self) -> None:
        if isinstance(self.beta, bool) or not isinstance(self.beta, int | float):
            raise CephaloError(f"train.dpo_beta must be a number > 0, got {self.beta!r}")
        if not (math.isfinite(self.beta) and self.beta > 0):
            raise CephaloError(
                f"train.dpo_beta must be > 0 (DPO's temperature; TRL's default is 0.1), "
                f"got {self.beta!r}"
            )
        if self.loss not in DPO_LOSSES:
            raise CephaloError(
                f"train.dpo_loss must be one of {', '.join(DPO_LOSSES)}, got {self.loss!r}"
            )


def check_objective(objective: str, preference_data: bool) -> None:
    """`train.objective` against the data, before any step: preference pairs need `dpo`, and
    `dpo` needs preference pairs (`is_preference` on the batches, preference/data.py)."""
    if objective not in OBJECTIVES:
        raise CephaloError(
            f"train.objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}"
        )
    if preference_data and objective != "dpo":
        raise CephaloError(
            "the training data is preference pairs (prompt / chosen / rejected) but "
            f'train.objective is "{objective}": set train.objective = "dpo" to train on them, '
            "or give chat or text data for supervised fine-tuning"
        )
    if not preference_data and objective == "dpo":
        raise CephaloError(
            'train.objective = "dpo" needs preference data (records with prompt / chosen / '
            'rejected, data.format = "preference"), but the data is not: give a preference '
            'dataset, or set train.objective = "sft"'
        )


def completion_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Each row's completion tokens (its labels that count), fp32 [rows]."""
    return (labels != -100).sum(dim=1).to(torch.float32)


class DpoObjective:
    """The DPO loss of micro-batches of pairs, their row weights and the step's sums. Owns the
    step's sums on the device (`begin`, `pairs`, `sums`); stateless otherwise."""

    def __init__(self, settings: DpoSettings):
        settings.validate()
        self.settings = settings
        self._sums: torch.Tensor | None = None

    def logps(self, token_loss_sums: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Each row's completion log-probability from its token cross-entropy sum: the sum,
        negated, averaged over the completion's tokens under IPO (TRL)."""
        logp = -token_loss_sums.float()
        if self.settings.loss == "ipo":
            logp = logp / completion_tokens(labels).clamp(min=1)
        return logp

    def begin(self, device: torch.device) -> None:
        """A new step (or evaluation): the sums start at zero."""
        self._sums = torch.zeros(_N_SUMS, dtype=torch.float32, device=device)

    def sums(self) -> torch.Tensor:
        """The step's sums (loss, chosen and rejected rewards, accuracies, chosen and rejected
        logps, pairs) of this rank's pairs so far, a device tensor (fp32 [7])."""
        assert self._sums is not None, "begin() first"
        return self._sums

    def pairs(
        self,
        policy: torch.Tensor,
        reference: torch.Tensor,
        labels: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One micro-batch of pairs: `policy` / `reference` each row's log-probability
        ([2m], `logps`), `labels` the rows' labels. Adds its pairs' loss and metrics to the
        step's sums; returns (the pairs' loss sum, fp32 0-dim; each row's weight on its token
        losses, [2m, 1]: dL_pairs / d(the row's token cross-entropy sum), to be scaled by
        1 / global pairs)."""
        beta = self.settings.beta
        policy, reference = policy.float(), reference.float().to(policy.device)
        pc, pr = policy[0::2], policy[1::2]
        rc, rr = reference[0::2], reference[1::2]
        z = (pc - rc) - (pr - rr)
        if self.settings.loss == "sigmoid":
            loss = -torch.nn.functional.logsigmoid(beta * z)
            dz = -beta * torch.sigmoid(-beta * z)  # d loss / d z
        else:
            loss = (z - 1.0 / (2.0 * beta)) ** 2
            dz = 2.0 * (z - 1.0 / (2.0 * beta))
        # d logp / d (row's token-loss sum): -1, or -1 / tokens under IPO's average
        dlogp = torch.full_like(policy, -1.0)
        if self.settings.loss == "ipo":
            dlogp = dlogp / completion_tokens(labels).to(policy.device).clamp(min=1)
        dpolicy = torch.stack([dz, -dz], dim=1).reshape(-1)  # d loss / d logp, per row
        weights = (dpolicy * dlogp).reshape(-1, 1)
        # a pair without a completion token is padding (an evaluation's short last batch):
        # it counts nowhere (training data has none: preference/data.py refuses them)
        real = (labels[0::2] != -100).any(dim=1).to(policy.device, torch.float32)
        loss = loss * real
        weights = weights * real.repeat_interleave(2).reshape(-1, 1)
        chosen, rejected = beta * (pc - rc) * real, beta * (pr - rr) * real
        part = torch.stack(
            [
                loss.sum(),
                chosen.sum(),
                rejected.sum(),
                ((chosen > rejected).float() * real).sum(),
                (pc * real).sum(),
                (pr * real).sum(),
                real.sum(),
            ]
        )
        if self._sums is not None:
            self._sums += part
        return part[0], weights


def metrics_of(sums: list[float]) -> dict[str, float]:
    """TRL's metrics (global-batch means) from the global sums `DpoObjective.sums` reduced
    over ranks."""
    n = max(sums[6], 1.0)
    chosen, rejected, acc, lc, lr = (v / n for v in sums[1:6])
    return {
        "rewards/chosen": chosen,
        "rewards/rejected": rejected,
        "rewards/accuracies": acc,
        "rewards/margins": chosen - rejected,
        "logps/chosen": lc,
        "logps/rejected": lr,
    }
