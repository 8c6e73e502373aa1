"""AdamW on flat fp32 shards.

Each rank updates only its slice of every unit: master weights, gradient, and the two
moments are 1-D fp32 tensors of the same length. Weight decay applies to the runs of the
slice listed in `decay_segments` (built once from `wants_weight_decay`).

Kernels (`ShardedAdamW(kernel=)`): `fused` (default where this torch build has one for the
device: CUDA, and recent CPU builds) is torch's `_fused_adamw_` over every run of every
unit at once, two launches per step (decayed runs, the rest), with the clipping coefficient
passed as its `grad_scale` tensor (no pass over the gradients of its own; the engine computes
it on the device, `clip_coefficient`, and a non-finite norm skips the update through the
kernel's `found_inf`: no host sync before the update); `foreach` is
torch's multi-tensor AdamW, bitwise the single-tensor arithmetic on the CPU; `single`
repeats, op for op, `torch.optim.AdamW`'s single-tensor path. All match a single-process
reference to fp32 rounding (fused rounds a little differently: about 1e-8 per step on
0.02-sized weights).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.optim import adamw as torch_adamw

from cephalo.errors import CephaloError

ADAMW_KERNELS = ("fused", "foreach", "single")


def clip_coefficient(norm, max_norm: float):
    """The factor gradient-norm clipping multiplies the gradients by: min(1, max_norm / (norm +
    1e-6)), as torch's `clip_grad_norm_`. `norm` a float, or a tensor: then the result is a
    tensor on its device (no host sync)."""
    if isinstance(norm, torch.Tensor):
        return (max_norm / (norm + 1e-6)).clamp(max=1.0)
    return min(1.0, max_norm / (norm + 1e-6))


def nonempty_grads(groups) -> list[torch.Tensor]:
    """The groups' gradient shards that hold elements (foreach kernels take them as a list)."""
    return [g.grad for g in groups if g.grad.numel()]


SQ_SUM_CHUNK = 1 << 22
"""Elements widened to fp64 at a time by `grad_sq_sum` on the CPU: one reused 32 MiB buffer,
so a GPT-2-124M shard is a few dozen chunks of two ops each (issue 39: 2^18-element chunks
made the norm a quarter of a small step's ops)."""


def grad_sq_sum(
    grads: list[torch.Tensor], device: torch.device, chunk: int = SQ_SUM_CHUNK
) -> torch.Tensor:
    """Sum of the squared entries of `grads` (non-empty tensors: `nonempty_grads`), fp64 0-dim
    on `device`. Each entry is widened to fp64 before it is squared and summed (an fp32
    square is exact in fp64), so the norm does not depend (beyond fp64 rounding) on how the
    entries are split between ranks, or between a rank's device and its host.

    On CUDA one fused norm kernel over all of them (no squared copy of a shard in memory, one
    launch instead of three per group). On the CPU that kernel widens element by element
    (about 2 ns per element, measured: 6x the time of the whole fused AdamW step on a
    100M-element shard), so there the entries are widened `chunk` at a time into one reused
    fp64 buffer and summed by BLAS's fp64 dot product (0.3 ns per element), each chunk's dot
    written into its own slot of a vector summed once at the end: two ops per chunk."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    if all(g.device.type == "cpu" for g in grads):
        pieces = [p for g in grads for p in g.reshape(-1).split(chunk)]
        wide = torch.empty(max(p.numel() for p in pieces), dtype=torch.float64)
        dots = torch.empty(len(pieces), dtype=torch.float64)
        for i, piece in enumerate(pieces):
            w = wide[: piece.numel()]
            w.copy_(piece)
            torch.dot(w, w, out=dots[i])
        return dots.sum().to(device)
    norms = torch._foreach_norm(grads, 2, dtype=torch.float64)
    return torch.stack(norms).square().sum()


def default_adamw_kernel(device: torch.device | str) -> str:
    """`fused` where this torch build has a fused AdamW for the device type, else `foreach`."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        fused = torch.device(device).type in _get_fused_kernels_supported_devices()
    except ImportError:  # an older torch
        fused = False
    return "fused" if fused else "foreach"


def split_runs(n: int, decay_segments: list[tuple[int, int]]) -> tuple[list, list]:
    """([a, b) runs with weight decay, the other runs) of a slice of n elements."""
    plain, at = [], 0
    for a, b in sorted(decay_segments):
        if a > at:
            plain.append((at, a))
        at = max(at, b)
    if at < n:
        plain.append((at, n))
    return [(a, b) for a, b in decay_segments if b > a], plain


@dataclass
class ShardGroup:
    """One unit's slice on this rank."""

    param: torch.Tensor
    """fp32 master slice (updated in place)."""
    grad: torch.Tensor
    """fp32 gradient slice (already reduced, unscaled and clipped)."""
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    decay_segments: list[tuple[int, int]] = field(default_factory=list)
    """[a, b) runs of the slice that get weight decay."""


@dataclass
class AdamWHyper:
    """AdamW hyper-parameters (the learning rate comes with each step)."""

    betas: tuple[float, float] = (0.9, 0.95)
    """Coefficients of the moment averages (beta1, beta2)."""
    eps: float = 1e-8
    """Added to the second moment's square root."""
    weight_decay: float = 0.1
    """Decoupled weight decay (on the slice runs in `ShardGroup.decay_segments`)."""

    def validate(self) -> None:
        """Raise `CephaloError` naming the first bad field."""
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise CephaloError(f"AdamW betas must be two numbers in [0, 1), got {self.betas}")
        if not (self.eps > 0 and math.isfinite(self.eps)):
            raise CephaloError(f"AdamW eps must be a finite number > 0, got {self.eps}")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise CephaloError(
                f"AdamW weight_decay must be a finite number >= 0, got {self.weight_decay}"
            )


class ShardedAdamW:
    """AdamW over a list of `ShardGroup`s; `step` counts the updates applied."""

    def __init__(self, groups: list[ShardGroup], hyper: AdamWHyper, kernel: str | None = None):
        self.groups = groups
        self.hyper = hyper
        self.step_count = 0
        device = groups[0].param.device if groups else torch.device("cpu")
        self.kernel = kernel or default_adamw_kernel(device)
        if self.kernel not in ADAMW_KERNELS:
            raise CephaloError(
                f"AdamW kernel {self.kernel!r} is not one of {', '.join(ADAMW_KERNELS)}"
            )
        self._runs = [split_runs(g.param.numel(), g.decay_segments) for g in groups]

    @torch.no_grad()
    def step(
        self,
        lr: float,
        grad_scale: float | torch.Tensor = 1.0,
        found_inf: torch.Tensor | None = None,
    ) -> None:
        """One update with every gradient multiplied by `grad_scale` first (the clipping
        coefficient, a float or a 0-dim tensor on the device; the fused kernel applies it as it
        reads the gradients). `found_inf` (fused only): a 0-dim tensor, nonzero to leave every
        parameter and moment as it is (the caller then takes the step back: `step_count`)."""
        if found_inf is not None and self.kernel != "fused":
            raise ValueError("found_inf needs the fused AdamW kernel")
        on_device = isinstance(grad_scale, torch.Tensor)
        if self.kernel == "single":
            if on_device or grad_scale != 1.0:
                self.scale_grads(grad_scale)
            self._single_step(lr)
            return
        self.step_count += 1
        beta1, beta2 = self.hyper.betas
        fused = self.kernel == "fused"
        scale = None
        if on_device or grad_scale != 1.0:
            if fused and on_device:  # the kernel divides by it (in fp64, then rounded: as below)
                scale = (1.0 / grad_scale).to(torch.float32)
            elif fused:
                device = self.groups[0].param.device
                scale = torch.full((), 1.0 / grad_scale, dtype=torch.float32, device=device)
            else:
                self.scale_grads(grad_scale)
        if found_inf is not None:
            found_inf = found_inf.to(torch.float32)
        for k, wd in enumerate((self.hyper.weight_decay, 0.0)):
            views = [
                (g.param[a:b], g.grad[a:b], g.exp_avg[a:b], g.exp_avg_sq[a:b])
                for g, runs in zip(self.groups, self._runs, strict=True)
                for a, b in runs[k]
                if g.param.numel()
            ]
            if not views:
                continue
            params, grads, m, v = (list(t) for t in zip(*views, strict=True))
            # the functional form counts the step itself (+1 before the update)
            steps = torch.full(
                (len(params),), float(self.step_count - 1), device=params[0].device
            ).unbind(0)
            torch_adamw.adamw(
                params,
                grads,
                m,
                v,
                [],
                list(steps),
                foreach=not fused,
                fused=fused,
                grad_scale=scale,
                found_inf=found_inf,
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=lr,
                weight_decay=wd,
                eps=self.hyper.eps,
                maximize=False,
            )

    def _single_step(self, lr: float) -> None:
        self.step_count += 1
        beta1, beta2 = self.hyper.betas
        wd = self.hyper.weight_decay
        bias_correction1 = 1 - beta1**self.step_count
        bias_correction2 = 1 - beta2**self.step_count
        step_size = lr / bias_correction1
        bias_correction2_sqrt = math.sqrt(bias_correction2)
        for g in self.groups:
            if g.param.numel() == 0:
                continue
            if wd != 0.0:
                for a, b in g.decay_segments:
                    g.param[a:b].mul_(1 - lr * wd)
            g.exp_avg.lerp_(g.grad, 1 - beta1)
            g.exp_avg_sq.mul_(beta2).addcmul_(g.grad, g.grad, value=1 - beta2)
            denom = (g.exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(self.hyper.eps)
            g.param.addcdiv_(g.exp_avg, denom, value=-step_size)

    def zero_grad(self) -> None:
        """One foreach launch for every group (not one per group)."""
        grads = nonempty_grads(self.groups)
        if grads:
            torch._foreach_zero_(grads)

    def local_grad_sq_sum(self) -> torch.Tensor:
        """Sum of squared gradient entries on this rank (fp64 0-dim; summed across ranks
        gives the squared global norm): `grad_sq_sum` over the groups' gradients."""
        device = self.groups[0].grad.device if self.groups else torch.device("cpu")
        return grad_sq_sum(nonempty_grads(self.groups), device)

    def scale_grads(self, factor: float | torch.Tensor) -> None:
        if isinstance(factor, torch.Tensor):  # fp32, as a Python float factor is applied
            factor = factor.to(torch.float32)
        grads = nonempty_grads(self.groups)
        if grads:
            torch._foreach_mul_(grads, factor)
