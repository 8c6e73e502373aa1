"""The optimizer step of a rank's shards (`ShardUpdate`): the global gradient norm and loss in
one all-reduce, clipping, AdamW on the device part (runtime/state/adamw.py) and on the host-held
part (runtime/state/host_state.py) with its upload, fp16's loss scale; and the device gradient shards
it reads (`GradShards`), which a memory-tight rank holds only from their reduce-scatter to the
step."""

from __future__ import annotations

import math
import time

import torch

from cephalo.log import logger
from cephalo.runtime.collectives.shard_groups import ShardGroupSync
from cephalo.runtime.engine.step_clock import StepClock
from cephalo.runtime.engine.unit_comm import UnitCollectives
from cephalo.runtime.memory import MemoryLedger
from cephalo.runtime.state.adamw import ShardedAdamW, clip_coefficient
from cephalo.runtime.state.host_state import HostAdamW, HostLink
from cephalo.runtime.state.precision import DynamicLossScaler
from cephalo.runtime.state.unit_shard import UnitShard


class GradShards:
    """The device part's fp32 gradient shard of every unit, as the optimizer's groups see it.
    Owns their lifetime on a lean rank (`lean`: allocated by the first reduce-scatter that
    reaches a unit, freed after the step). Given the ledger and the device (the buffers), the
    unit shards and the device optimizer (whose groups point at the buffers)."""

    def __init__(
        self,
        ledger: MemoryLedger,
        device: torch.device,
        shards: list[UnitShard],
        optimizer: ShardedAdamW,
        lean: bool,
    ):
        self.ledger = ledger
        self.device = device
        self.shards = shards
        self.optimizer = optimizer
        self.lean = lean
        self.group = {us.index: k for k, us in enumerate(shards)}
        """Each unit's optimizer group (a pipeline stage holds some units only)."""

    def device_grad(self, us: UnitShard) -> torch.Tensor:
        """The device part's gradient shard (a lean rank allocates it on first use)."""
        if us.grad.numel() != us.dev_n:
            us.grad = self.ledger.alloc("state", us.dev_n, torch.float32, device=self.device)
            us.grad.zero_()
            self.optimizer.groups[self.group[us.index]].grad = us.grad
        return us.grad

    def zero(self) -> None:
        """After the optimizer step: zero the gradient shards, or (lean) free them."""
        if not self.lean:
            self.optimizer.zero_grad()
            return
        for us in self.shards:
            if us.grad.numel():
                self.ledger.free(us.grad)
            us.grad = us.master[0:0]
            self.optimizer.groups[self.group[us.index]].grad = us.grad


class ShardUpdate:
    """The step's update of this rank's shards. Owns nothing but references: the optimizers'
    state is theirs. Given the device optimizer and the host one (None: all state on the
    device) with the units that have a host part, the gradient shards, the collectives (the
    one all-reduce), the clock, the host link (gradients down, parameters up), the fp16 loss
    scaler (None), the shard groups' all-reduce (`group_sync`, None for a flat plan) and the
    clipping threshold (0 / None: no clipping)."""

    def __init__(
        self,
        optimizer: ShardedAdamW,
        host_optimizer: HostAdamW | None,
        hosted: list[UnitShard],
        grads: GradShards,
        collectives: UnitCollectives,
        clock: StepClock,
        link: HostLink,
        scaler: DynamicLossScaler | None,
        group_sync: ShardGroupSync | None,
        grad_clip: float | None,
    ):
        self.optimizer = optimizer
        self.host_optimizer = host_optimizer
        self.hosted = hosted
        self.grads = grads
        self.collectives = collectives
        self.clock = clock
        self.link = link
        self.scaler = scaler
        self.group_sync = group_sync
        self.grad_clip = grad_clip

    @torch.no_grad()
    def step(
        self,
        loss_sum: torch.Tensor,
        loss_scale: float,
        lr: float,
        tokens: torch.Tensor,
        extra: torch.Tensor | None = None,
        loss_count: int | None = None,
    ) -> tuple[bool, float, float, list[float]]:
        """The update after the backward: (skipped, global gradient norm, mean token loss, the
        values read with them). `tokens`: the global token count, a 1-element int64 tensor on
        the device; `extra`: more device values the caller wants on the host (0-dim or 1-D,
        e.g. the router loss), read in the same read as the norm and loss: the read is
        `[n_tokens, *extra]`. `loss_count`: what the loss sum is divided by (DPO: the global
        pairs); None: the token count. That one read is the step's only host sync where the update
        needs none (`device_step`): after the update is queued."""
        opt, host_opt, clock = self.optimizer, self.host_optimizer, self.clock
        clock.settle()  # the stream's waits for the last reduce-scatters (emulated cluster)
        self.link.sync()  # every host gradient piece has arrived
        for us in self.grads.shards:  # (lean: a unit no reduce-scatter reached: zero gradient)
            self.grads.device_grad(us)
        if self.group_sync is not None:  # once per step: sum the groups' gradient shards
            with clock.communication():
                self.group_sync.reduce_engine_grads(self.grads.shards, self.grads.device_grad)
        with clock.optimizer_work():
            if loss_scale != 1.0:
                opt.scale_grads(1.0 / loss_scale)
            # one all-reduce for the squared norm and the loss sum
            red = torch.stack([opt.local_grad_sq_sum(), loss_sum.double()])
        if host_opt is not None:
            t0 = time.perf_counter()
            if loss_scale != 1.0:
                host_opt.scale_grads(1.0 / loss_scale)
            red[0] += host_opt.grad_sq_sum().to(red.device)
            clock.host_s += time.perf_counter() - t0
        self.collectives.all_reduce(red)
        if self.group_sync is not None:  # every group holds the same, whole gradient
            red[0] /= len(self.group_sync.groups)
        if self.scaler is None and host_opt is None and opt.kernel == "fused":
            with clock.optimizer_work():
                self.device_step(red, lr)
            return self._step_outcome(red, tokens, extra, loss_count)
        norm_sq, loss_sum_value, read = _read(red, tokens, extra)
        grad_norm = math.sqrt(norm_sq) if norm_sq >= 0 else math.nan
        loss = loss_sum_value / max(read[0] if loss_count is None else loss_count, 1)
        finite = math.isfinite(grad_norm)
        if self.scaler is not None:
            self.scaler.update(found_inf=not finite)
        if not finite:
            # skip the update on every rank (the norm is global, so they all agree); fp16 has
            # lowered its loss scale above; the trainer decides how many skips it tolerates
            if self.scaler is not None:
                logger.debug(
                    "fp16: non-finite gradient, step skipped; loss scale now %g", self.scaler.scale
                )
            with clock.optimizer_work():
                self.grads.zero()
            self.host_zero_grad()
            return True, grad_norm, loss, read
        coef = clip_coefficient(grad_norm, self.grad_clip) if self.grad_clip else 1.0
        with clock.optimizer_work():
            opt.step(lr, coef)  # (the fused kernel scales the gradients as it reads them)
            self.grads.zero()
        if host_opt is not None:
            # not under the emulated slowdown: the host is not the emulated device. On CUDA
            # the device's optimizer kernels run meanwhile; each unit's upload starts as soon
            # as the host has updated it
            t0 = time.perf_counter()
            if coef < 1.0:
                host_opt.scale_grads(coef)
            with host_opt.threads():  # the node's cores, not torchrun's one thread
                for i, us in enumerate(self.hosted):
                    host_opt.step_group(i, lr, opt.step_count)
                    self.upload(us)
            self.host_zero_grad()
            self.link.wait_uploads()
            clock.host_s += time.perf_counter() - t0
        return False, grad_norm, loss, read

    def device_step(self, red: torch.Tensor, lr: float) -> None:
        """The update without a host sync (all state on the device, no loss scaler, the fused
        kernel): the clipping coefficient is computed and applied on the device, and a
        non-finite norm makes the kernel leave everything as it is (`found_inf`).
        scripts/gpu_check.py runs it under `torch.cuda.set_sync_debug_mode("error")`."""
        norm = red[0].sqrt()
        clip = self.grad_clip
        coef = clip_coefficient(norm, clip) if clip else 1.0
        self.optimizer.step(lr, coef, found_inf=(~torch.isfinite(norm)).to(torch.float32))
        self.grads.zero()

    def _step_outcome(
        self,
        red: torch.Tensor,
        tokens: torch.Tensor,
        extra: torch.Tensor | None,
        loss_count: int | None,
    ) -> tuple[bool, float, float, list[float]]:
        """After `device_step` is queued: (skipped, gradient norm, mean token loss, the values
        read with them), one read of the device's norm, loss sum, token count and `extra`. A
        skipped step is taken back (`step_count`); the trainer decides how many skips it
        tolerates."""
        norm_sq, loss_sum, read = _read(red, tokens, extra)
        loss = loss_sum / max(read[0] if loss_count is None else loss_count, 1)
        grad_norm = math.sqrt(norm_sq) if norm_sq >= 0 else math.nan
        if math.isfinite(grad_norm):
            return False, grad_norm, loss, read
        self.optimizer.step_count -= 1
        return True, grad_norm, loss, read

    def host_zero_grad(self) -> None:
        if self.host_optimizer is not None:
            self.host_optimizer.zero_grad()
        for us in self.hosted:
            us.host_grad_written = False

    def upload(self, us: UnitShard) -> None:
        """The host part's updated parameters up to the device copy the gathers read."""
        assert us.host is not None
        if us.host_upload is None:  # fp32: the master itself
            self.link.up(us.host_copy, us.host.param)
            return
        # cast on the host (the pinned buffer this step's upload reads; the previous step's
        # upload of it completed: the copy stream ran it before this step's gradient copies,
        # which `link.sync` waited for)
        us.host_upload.copy_(us.host.param)
        self.link.up(us.host_copy, us.host_upload)


def _read(
    red: torch.Tensor, tokens: torch.Tensor, extra: torch.Tensor | None
) -> tuple[float, float, list[float]]:
    """The step's one host read: (squared norm, loss sum, [token count, *extra]). fp64: the
    token count is exact to 2**53."""
    parts = [red.double().reshape(-1), tokens.to(red.device, torch.float64).reshape(-1)]
    if extra is not None:
        parts.append(extra.to(red.device, torch.float64).reshape(-1))
    norm_sq, loss_sum, *read = torch.cat(parts).tolist()
    return norm_sq, loss_sum, read
