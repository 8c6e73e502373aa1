"""How the engine runs a step (`EngineConfig`) and what one step did (`StepStats`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from cephalo.errors import CephaloError
from cephalo.preference.objective import DpoSettings
from cephalo.runtime.capture.apply import check_compile_mode
from cephalo.runtime.collectives.emulated import EmulatedLinks
from cephalo.runtime.state.adamw import AdamWHyper

MODES = ("lga", "standard")


@dataclass
class EngineConfig:
    """How the engine runs a step (the plan says who does what; this says how)."""

    mode: str = "lga"
    """`lga` (layered gradient accumulation) or `standard` (micro-batch at a time, FSDP-like)."""
    compute_dtype: str | None = None
    """`fp32`, `bf16` or `fp16` for gathered parameters and activations; None: the plan's dtype.
    Gradients are accumulated and reduced in fp32; master weights and AdamW state are fp32."""
    adamw: AdamWHyper = field(default_factory=AdamWHyper)
    """AdamW betas, epsilon and decoupled weight decay (applied where `wants_weight_decay`
    says: not norms, biases)."""
    grad_clip: float = 1.0
    """Max global gradient norm (0 = no clipping)."""
    padded_collectives: bool | None = None
    """Units whose split is near even (`costmodel.collectives.padded_even`) gather and reduce with
    the even collectives on padded buffers (runtime/collectives/padded.py); False: always the grouped
    collectives of the exact sizes; None: where the comm gathers equal sizes with the even
    collective (`Comm.even_gather`: NCCL, not gloo)."""
    prefetch: bool = True
    """Start the next unit's all-gather while computing the current one."""
    fuse_tail: bool = True
    """Run the last block's forward and backward in the head's pass, where the plan allows
    it (costmodel/rules.py): the last block is neither recomputed nor gathered again.
    The cost model assumes it on; off only to compare (tests, benchmarks)."""
    overlap_reduce: bool = True
    """Reduce-scatter a unit's gradient while the next unit's backward computes (one more
    fp32 unit gradient is then alive at a time) where the plan's `overlap_reduce` for this
    rank says so (the planner turns it off on a rank short of memory); False: never, wait for
    each at once."""
    offload: bool | None = None
    """Keep boundary activations on the host; None: the plan's `offload_activations`."""
    seed: int = 0
    """Seeds the initial weights (identical on every rank) and the dropout masks."""
    slowdown: float = 1.0
    """CPU device emulation: compute is stretched by this factor (see emulation.py)."""
    inter_node_bytes_per_s: float | None = None
    """Emulated inter-node link of a hierarchical plan: the all-reduce between shard groups is
    charged a delay per byte sent (None: as fast as it runs)."""
    links: EmulatedLinks | None = None
    """An emulated multi-rank cluster's links (`emulate_links`): its collectives then run as
    NCCL runs them (runtime/collectives/emulated.py: one FIFO queue per process group at its
    link's rate, `wait()` asynchronous, the stall counted where the stream next runs);
    None: the comm as given."""
    memory_budget_bytes: int | None = None
    """Budget for a ledger the engine creates itself (None = unlimited)."""
    host_memory_budget_bytes: int | None = None
    """Host memory budget for a ledger the engine creates itself (None = unlimited): this
    rank's share of its node's host memory."""
    host_adamw: str | None = None
    """AdamW kernel of the host-held state: `fused` (fastest), `foreach` (bitwise the device
    path's arithmetic on a CPU); None: fused where this torch build has it for CPU tensors."""
    host_threads: int | None = None
    """Intra-op threads of the host AdamW step (only around it: `HostAdamW.threads`): the
    node's cores shared by its ranks; None: the process's setting (torchrun's
    OMP_NUM_THREADS=1 would run it on one core). Emulated CPU ranks keep None: their compute's
    emulation times one thread per rank (runtime/emulation.py)."""
    adamw_kernel: str | None = None
    """AdamW kernel of the device-held state (runtime/state/adamw.py): `fused`, `foreach` (bitwise
    the host's `foreach` on a CPU) or `single`; None: fused where this torch build has it for
    the device, else foreach."""
    host_copy_bytes_per_s: float | None = None
    """CPU device emulation: every host <-> device copy lasts at least its bytes / this
    bandwidth (`cpu:...,pcie=12GB/s`), outside the compute stretch; None: memcpy speed."""
    validate_collectives: bool | None = None
    """Cross-rank size checks before each collective; None: the comm's own setting."""
    validate_every_step: bool = False
    """With validation on: check the collectives of every step. False: of the first training
    step and the first evaluation only; the plan fixes the call sequence after that, and the
    check's small blocking exchange would otherwise synchronise the ranks at every prefetch."""
    device: str | None = None
    """Compute device; None: the current CUDA device under NCCL, else the CPU."""
    per_sample_dropout: bool = True
    """Plan-invariant dropout masks (see dropout.py); False: the global RNG stream
    (faster on GPUs, but masks then depend on the micro-batching)."""
    pinned_arena: bool | None = None
    """Offloaded boundary activations in one exact-size page-locked block per rank
    (runtime/state/pinned.py), sized from the plan by `Engine.boundary_host_bytes`; None: on CUDA
    only (True also on the CPU, where nothing is page-locked: its bookkeeping is tested)."""
    compile: str = "off"
    """The blocks compiled (runtime/capture/apply.py): `off` (eager), `inductor`
    (torch.compile per block type), `graphs` (CUDA graphs per block type and micro-batch
    shape; CUDA only), `auto` (what was measured to pay on the device). The job's
    `parallel.compile` sets it; the engine alone defaults to eager."""
    loss_scale_init: float = 2.0**16
    """fp16 only: the initial dynamic loss scale."""
    loss_scale_growth_interval: int = 200
    """fp16 only: good steps before the loss scale doubles."""
    dpo: DpoSettings | None = None
    """The DPO objective (preference/objective.py): batches are pairs of rows, the plan's batch
    sizes count pairs; None: the SFT objective (mean token loss)."""

    def validate(self) -> None:
        """Raise `CephaloError` naming the first bad field."""
        if self.mode not in MODES:
            raise CephaloError(f"engine mode {self.mode!r} is not one of {', '.join(MODES)}")
        self.adamw.validate()
        if not (self.grad_clip >= 0 and math.isfinite(self.grad_clip)):
            raise CephaloError(
                f"engine setting grad_clip must be a finite number >= 0, got {self.grad_clip}"
            )
        if self.loss_scale_init <= 0 or self.loss_scale_growth_interval < 1:
            raise CephaloError("loss_scale_init must be > 0 and loss_scale_growth_interval >= 1")
        check_compile_mode(self.compile)
        if self.dpo is not None:
            self.dpo.validate()
        bw = self.host_copy_bytes_per_s
        if bw is not None and not (bw > 0 and math.isfinite(bw)):
            raise CephaloError(
                f"engine setting host_copy_bytes_per_s must be a positive number, got {bw}"
            )


@dataclass
class StepStats:
    """What one `train_step` did (the same on every rank except timings and memory)."""

    loss: float
    """Mean token loss over the global batch (before the update); DPO: the mean pair loss."""
    grad_norm: float
    """Global gradient norm before clipping (unscaled)."""
    n_tokens: int
    """Tokens with a label in the global batch."""
    skipped: bool
    """fp16: the step was skipped because the gradient was not finite."""
    busy_s: float
    """Seconds of unit compute (stretched by the emulated slowdown; CUDA: stream time)."""
    comm_wait_s: float
    """Seconds the step waited for collectives: on the CPU host time blocked in them; on CUDA
    the compute stream's time stalled in them, from events (a wait there only orders streams,
    so host time would be ~0: runtime/engine/step_clock.py)."""
    step_s: float
    """Wall-clock seconds of the whole step."""
    peak_bytes: int
    """Ledger peak of device memory during the step."""
    peak_by_category: dict[str, int] = field(default_factory=dict)
    """Ledger peak per category during the step."""
    loss_scale: float = 1.0
    """fp16: the loss scale used for this step."""
    host_peak_bytes: int = 0
    """Ledger peak of host memory during the step (host state, offloaded boundaries)."""
    host_s: float = 0.0
    """Host seconds of the host-state optimizer step (AdamW and the uploads it issues)."""
    aux_loss: float | None = None
    """MoE with `output_router_logits`: the router load-balancing loss of the global batch
    (transformers' `aux_loss`); `loss` includes `router_aux_loss_coef` x it."""
    optimizer_s: float = 0.0
    """Seconds of the device optimizer phase (norm, clipping, AdamW; collectives and
    host-state work excluded): host time on the CPU, the compute stream's time from events on
    CUDA. runtime/step_timing.py splits a step with it."""
    dpo: dict[str, float] | None = None
    """DPO: TRL's metrics of the global batch (`preference.objective.METRICS`), read with the
    loss; None: SFT."""
    contention_s: float = 0.0
    """Of `busy_s`, the seconds the host's other threads (co-located ranks, other jobs) took
    from this rank's compute: its wall time beyond slowdown x its CPU time (a CPU rank on one
    intra-op thread; runtime/emulation.py, "Contention"); 0 where the CPU time does not
    measure the work (CUDA). What the emulated device lost that a real one would not."""
    device_step_s: float | None = None
    """CUDA: the compute stream's span of the step (events); `busy_s`, `comm_wait_s` and
    `optimizer_s` are disjoint parts of it, the rest the device waiting for the host. None
    where the host times the step (CPU, an emulated slowdown)."""
