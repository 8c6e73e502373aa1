"""The cost model's memory half: a rank's peak device memory under a plan, by category and
moment, its state and host bytes (`MemoryModel`, a part of `costmodel.model.CostModel`, which
holds the inputs it reads: the model spec, the layout, the profiles).

  peak memory: the largest of the device's totals at the moments where the peak can fall
  (each unit's backward, the end of the forward: `CostModel._phases`), by category at that
  moment, plus what is there throughout:
    state       (s - x) * P * 16 (fp32 master + fp32 gradient shard + two fp32 Adam moments; the
                compute-dtype copy of the parameters only exists in the gathered buffers)
                + x * P * d (the compute-dtype copy of the host-held part, read by the gathers)
    gathered    the unit computing + the prefetched one, in the compute dtype
    grad_accum  the full fp32 gradients of the unit being back-propagated and of the one
                whose reduce-scatter is in flight, plus that reduce-scatter's output, this
                rank's piece, bounded by s * (largest unit) * 4. With the state, the bytes
                that grow with s are s * `bytes_per_fraction`.
    activations the unit's recompute + backward at micro-batch m (profile curve, the
                transient gradients the ledger charges included)
    boundary    boundary activations still held (b samples each), or the micro-batch staging
                buffers in use when offloaded
    logits      in the head's backward: its profile curve, never less than one chunk of its
                fp32 logits, m * min(seq, T // m) * vocab * 4 (T = `head_chunk_tokens`)
    fused tail  (costmodel/rules.py) the head's pass sits on the last block's activations
                at m, with both units gathered and both fp32 gradients alive, and the head's
                inputs are held for one micro-batch, not all b samples (`_phases`)
    reserve     allocator fragmentation (a share of the device: `reserve_fraction`) and what no
                tensor holds on a GPU: the CUDA context, cuBLAS's workspace, one NCCL
                communicator per process group the rank is in (`device_reserve_bytes`)
    With `overlap_reduce` false, a unit's backward holds its own fp32 gradient only.
"""

from __future__ import annotations

import math

import numpy as np

from cephalo.costmodel.collectives import (
    pad_factor,
)
from cephalo.costmodel.host import (
    host_bytes,
)
from cephalo.specs.catalog.devices import DEVICES, is_unlisted

STATE_BYTES_PER_PARAM = 16
"""fp32 master (4) + fp32 gradient (4) + Adam exp_avg (4) + exp_avg_sq (4)."""
GRAD_BYTES = 4
"""Gradients are accumulated and reduced in fp32."""
LOGIT_BYTES = 4
"""The head's softmax runs in fp32."""
HEAD_CHUNK_BYTES = 256 << 20
"""The head runs over chunks of the sequence of about this many bytes of fp32 logits
(runtime/head_loss.py): at most one chunk's logits exist at a time."""


CUDA_CONTEXT_BYTES = 512 << 20
"""A CUDA context with PyTorch's kernels loaded lazily (`CUDA_MODULE_LOADING=LAZY`, the default
since CUDA 11.7): about 0.3-0.6 GiB of device memory that `memory_allocated` never shows.
`scripts/gpu_check.py` measures it (`mem_get_info` before and after) and logs the two."""
CUBLAS_WORKSPACE_BYTES = 32 << 20
"""cuBLAS's workspace for the compute stream (PyTorch's default on Hopper; 8 MiB before)."""
NCCL_COMMUNICATOR_BYTES = 128 << 20
"""One NCCL communicator's buffers: `NCCL_BUFFSIZE` (4 MiB) per channel and peer direction, a
few channels on PCIe boards, up to 32 on NVLink; the planning figure for one process group."""


def communicators(groups: int = 1) -> int:
    """Process groups a rank is in: the world's, and under shard groups (`groups` > 1) its
    group's and (at least) one ring between the groups."""
    return 1 if groups <= 1 else 3


def device_reserve_bytes(type_key: str, groups: int = 1) -> int:
    """Device memory that no tensor holds on a rank of this device type: the CUDA context,
    cuBLAS's workspace and one NCCL communicator per process group on a GPU (a catalog type or
    an unlisted GPU). The CPU stand-in (`cpu`) has none of them (gloo's buffers are in host
    memory), nor have the made-up types of hand-written profiles: 0. The planner plans without
    it, and the emulated device (runtime/device_memory.py) is charged it at start, so the two
    agree on what a device can hold."""
    if type_key not in DEVICES and not is_unlisted(type_key):
        return 0
    return (
        CUDA_CONTEXT_BYTES
        + CUBLAS_WORKSPACE_BYTES
        + communicators(groups) * NCCL_COMMUNICATOR_BYTES
    )


def head_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk of the head's loss (at least one)."""
    return max(1, HEAD_CHUNK_BYTES // (max(vocab_size, 1) * LOGIT_BYTES))


def head_chunk_positions(m, seq_len: int, vocab_size: int):
    """Sequence positions per head chunk for micro-batches of m samples (broadcasts)."""
    m = np.maximum(np.asarray(m, dtype=np.int64), 1)
    return np.clip(head_chunk_tokens(vocab_size) // m, 1, seq_len)


class MemoryModel:
    """Peak memory and state bytes of a rank (the memory half of `CostModel`)."""

    def memory_parts(
        self,
        type_key: str,
        capacity_bytes: int,
        b,
        m,
        offload,
        overlap_reduce=True,
        state_fraction=None,
        host_part=0.0,
        pad=0.0,
        fuse=True,
    ) -> dict[str, np.ndarray]:
        """Device memory by category at the predicted peak of a step, without what grows
        with the state fraction (`state` and the reduce-scatter output in `grad_accum`);
        broadcasts over b, m, offload, overlap_reduce. See `_phases` for the moments compared.

        With `state_fraction` (and `host_part`) the `state` category is included and takes part
        in finding the peak: on a rank without reduce overlap it changes during the step (its
        gradient shards exist from their reduce-scatter to the optimizer step). Without, the
        state counts as constant, all gradients included: an upper bound for those ranks."""
        b = np.asarray(b, dtype=np.int64)
        m = np.maximum(np.asarray(m, dtype=np.int64), 1)
        offload = np.asarray(offload, dtype=bool)
        overlap = np.asarray(overlap_reduce, dtype=bool)
        fuse = np.asarray(fuse, dtype=bool)
        shape = np.broadcast_shapes(b.shape, m.shape, offload.shape, overlap.shape, fuse.shape)
        phases = self._phases(type_key, b, m, offload, overlap, pad, fuse)
        grads = self._phase_grads(not bool(np.all(overlap)))
        if state_fraction is not None:
            s, x = np.asarray(state_fraction), np.asarray(host_part)
            full = self.state_bytes(s, x)
            for ph, alive in zip(phases, grads, strict=True):
                missing = (s - x) * GRAD_BYTES * (self.optimizer_params - alive)
                ph["state"] = np.where(overlap, full, full - missing)
        totals = np.stack(
            [
                sum((np.broadcast_to(v, shape) for v in ph.values()), np.zeros(shape))
                for ph in phases
            ]
        )
        peak = np.argmax(totals, axis=0)  # the first of equal phases
        out = {}
        categories = ("gathered", "grad_accum", "activations", "boundary", "logits")
        if state_fraction is not None:
            categories = ("state", *categories)
        for c in categories:
            stacked = np.stack([np.broadcast_to(ph.get(c, 0.0), shape) for ph in phases])
            out[c] = np.take_along_axis(stacked, peak[None], axis=0)[0].astype(np.float64)
        out["reserve"] = np.zeros(shape) + self.reserve_for(capacity_bytes, type_key)
        return out

    def _phases(
        self, type_key: str, b, m, offload, overlap=True, pad=0.0, fuse=True
    ) -> list[dict[str, np.ndarray]]:
        """Device bytes by category at the moments of a step where the peak can fall (the
        ledger's view, runtime/engine/engine.py); `_phase_grads` says, per moment, whose gradient
        shards a rank without reduce overlap holds then. Units in order: embedding, L blocks,
        head.

        - backward of a unit: its gathered parameters and the next one's (prefetched), its
          fp32 gradient and the previous unit's (whose reduce-scatter is in flight; not with
          `overlap` false), its
          recompute + backward activations at micro-batch m (the profile's curve, transient
          gradients included; the head's never below its fp32 logits), and the boundaries
          still held: the inputs of every unit before it and the output gradients it reads
          (one micro-batch's staging buffers per read entry when offloaded). Checked for the
          head, the last block, the block before it (two block gradients) and the embedding;
          the other blocks hold fewer boundaries than the block before the last.
        - end of the forward: the last block and the head gathered, every boundary stored.
        - without reduce overlap, a rank's gradient shards exist from their reduce-scatter to
          the optimizer step: in a unit's backward, those of the units after it (and the tied
          embedding's once the head has reduced its borrowed slice); none at the end of the
          forward; all in the optimizer step, a moment with nothing else on the device. The
          state then grows through the backward while the boundaries shrink: the first
          block's backward is a candidate too.
        - QLoRA, the start of a block's backward (the same blocks): its NF4 weights are
          dequantized before the previous unit is prefetched and its own gradient buffer
          exists, with no activations yet, but with torchao's temporaries of its largest
          weight on top of the dequantized weights (`UnitLayout.dequant_transient_bytes`). On
          a small model those temporaries outweigh a micro-batch's activations. (The forward's
          dequantizations hold fewer boundaries and no gradient: never larger.)
        """
        L = self.model.num_layers
        kinds = ["embedding"] + ["block"] * L + ["head"]
        units = [self.layout.units[k] for k in kinds]
        # padded-even (`pad` > 0): a unit's gathered buffer and fp32 gradient hold N x u of its
        # trained part, the padding included (collective_cost.py)
        stretch = pad_factor(pad, len(self.devices)) - 1.0
        pad_gathered = [stretch * self.padded_params[k] * self.dtype_bytes for k in kinds]
        pad_grad = [stretch * self.padded_params[k] * GRAD_BYTES for k in kinds]
        # ... and the unit computing holds its parameters that straddle padding as copies
        padded = np.asarray(pad) > 0
        computing = [
            p + np.where(padded, self.straddle_params[k] * self.dtype_bytes, 0.0)
            for p, k in zip(pad_gathered, kinds, strict=True)
        ]
        working = b > 0
        m_eff = np.where(working, np.minimum(m, np.maximum(b, 1)), 0)
        t = self._tables[type_key]
        beta = self.sample_boundary_bytes

        def held(sets: int, staged: int) -> np.ndarray:
            """Boundaries on the device: `sets` of all b samples, or `staged` staging buffers."""
            return np.where(offload, staged * m_eff * beta, sets * b * beta)

        def head_logits() -> np.ndarray:
            """The head's pass at micro-batch m: its profile curve, never below one chunk of
            its fp32 logits (runtime/head_loss.py: one chunk at a time)."""
            chunk = head_chunk_positions(m_eff, self.seq_len, self.model.vocab_size)
            chunk_bytes = m_eff * chunk * self.model.vocab_size * LOGIT_BYTES
            return np.where(working, np.maximum(t.act["head"].at(m_eff), chunk_bytes), 0.0)

        def backward(u: int) -> dict[str, np.ndarray]:
            kind = kinds[u]
            act = t.act[kind].at(m_eff)
            in_flight = (
                units[u + 1].trained * GRAD_BYTES + pad_grad[u + 1] if u + 1 < len(kinds) else 0
            )
            prefetched = units[u - 1].gather_bytes + pad_gathered[u - 1] if u > 0 else 0
            if u == L + 1 and self.fused_tail_possible:
                # the last block stays gathered from its forward to its backward (no second
                # gather, runtime/engine/engine.py `_forward_pass`), as it computed
                prefetched = units[L].held_bytes + computing[L]
            phase = {
                # this unit as it computes, the prefetched one as gathered
                "gathered": units[u].held_bytes + computing[u] + prefetched,
                "grad_accum": units[u].trained * GRAD_BYTES
                + pad_grad[u]
                + np.where(overlap, in_flight, 0),
            }
            if kind == "head":
                phase["logits"] = head_logits()
                phase["boundary"] = held(L + 1, 1)  # every unit input; its own staged
            else:
                phase["activations"] = np.where(working, act, 0.0)
                # inputs of units 1..u and the output gradients at u + 1
                phase["boundary"] = held(u + 1, 1 if kind == "embedding" else 2)
            return phase

        def tail_moments() -> list[dict[str, np.ndarray]]:
            """The fused tail's moments (runtime/engine/tail_pass.py): `tail_head`, the head's pass
            over a full micro-batch on top of the last block's saved activations and transient
            gradients, and `tail_block`, the last micro-batch's block backward after the head
            is released and the block before is prefetched. Both units' fp32 gradients are
            alive throughout; the boundaries are the inputs of the L blocks (or their
            gradients) and one micro-batch's head input (or its gradient)."""
            k = -(-b // np.maximum(m_eff, 1))
            m_last = np.where(working, b - (k - 1) * m_eff, 0)
            grads = (
                units[L + 1].trained * GRAD_BYTES
                + pad_grad[L + 1]
                + units[L].trained * GRAD_BYTES
                + pad_grad[L]
            )
            head = {
                "gathered": units[L + 1].held_bytes
                + computing[L + 1]
                + units[L].held_bytes
                + computing[L],
                "grad_accum": grads,
                "activations": np.where(working, t.act["block"].at(m_eff), 0.0),
                "logits": head_logits(),
                "boundary": (L * b + m_eff) * beta,
            }
            block = {
                "gathered": units[L].held_bytes
                + computing[L]
                + units[L - 1].gather_bytes
                + pad_gathered[L - 1],
                "grad_accum": grads,
                "activations": np.where(working, t.act["block"].at(m_last), 0.0),
                "boundary": (L * b + m_last) * beta,
            }
            return [head, block]

        lean = not bool(np.all(overlap))
        phases = [backward(u) for u in self._backward_candidates(lean)]
        phases.append(
            {
                "gathered": units[-1].held_bytes
                + computing[-1]
                + (
                    units[-2].held_bytes + computing[-2]
                    if self.fused_tail_possible
                    else units[-2].gather_bytes + pad_gathered[-2]
                ),
                # DPO under an adapter: the reference's outputs of the unit just run, kept
                # until the next unit reads them (runtime/engine/step_passes.py)
                "boundary": held(L + 1, 1) + (held(1, 1) if self.adapter.reference_forward else 0),
            }
        )
        # the fused tail (costmodel/rules.py): on a rank that fuses, its moments replace
        # the unfused head's, last block's and end of the forward's (which hold no more)
        fused = self._fused(overlap, offload, fuse)
        if self.fused_tail_possible:
            unfused = np.logical_not(fused)
            for i, u in enumerate(self._backward_candidates(lean)):
                if u >= L:
                    phases[i] = {c: np.where(unfused, v, 0.0) for c, v in phases[i].items()}
            phases[-1] = {c: np.where(unfused, v, 0.0) for c, v in phases[-1].items()}
        if lean:
            phases.append({})  # the optimizer step: the state alone
        for u in self._dequant_candidates(lean):
            # QLoRA: a block's NF4 weights dequantized as its backward starts (before the
            # previous unit's prefetch and its own gradient buffer, no activations yet), with
            # torchao's temporaries of the largest weight on top of all of them
            phases.append(
                {
                    "gathered": units[u].held_bytes
                    + computing[u]
                    + units[u].dequant_transient_bytes,
                    "grad_accum": np.where(
                        overlap, units[u + 1].trained * GRAD_BYTES + pad_grad[u + 1], 0
                    ),
                    "boundary": held(u + 1, 2),
                }
            )
        if self.fused_tail_possible:
            phases += [{c: np.where(fused, v, 0.0) for c, v in ph.items()} for ph in tail_moments()]
        return phases

    def _dequant_candidates(self, lean: bool = True) -> list[int]:
        """The backward candidates (`_backward_candidates`) whose start `_phases` checks as a
        moment of its own: the blocks, under QLoRA (dequantization temporaries); else none."""
        if not self.layout.units["block"].dequant_transient_bytes:
            return []
        L = self.model.num_layers
        return [u for u in self._backward_candidates(lean) if 0 < u <= L]

    def _backward_candidates(self, lean: bool = True) -> list[int]:
        """Units whose backward `_phases` checks, in its order: the head, the last block, the
        block before it, (`lean`: for ranks without reduce overlap, the first block,) the
        embedding."""
        L = self.model.num_layers
        units = {L + 1, L, max(L - 1, 1), 0} | ({1} if lean else set())
        return sorted(units, reverse=True)

    def _phase_grads(self, lean: bool = True) -> list[int]:
        """Per moment of `_phases` (with `lean` as there): the parameters whose gradient
        shards a rank without reduce overlap holds (those reduced so far; all of them at the
        optimizer step)."""
        L = self.model.num_layers
        own = list(self.layout.owned_trained)

        def after(u: int) -> int:
            alive = sum(own[u + 1 :])
            if self.model.tied_embeddings and 0 < u < L + 1:
                alive += own[0]  # the head reduced into the embedding's gradient
            return alive

        grads = [after(u) for u in self._backward_candidates(lean)] + [0]
        grads += [self.optimizer_params] if lean else []
        grads += [after(u) for u in self._dequant_candidates(lean)]
        return grads + ([after(L + 1), after(L)] if self.fused_tail_possible else [])

    def memory_without_state(
        self,
        type_key: str,
        capacity_bytes: int,
        b,
        m,
        offload,
        overlap_reduce=True,
        pad=0.0,
        fuse=True,
    ) -> np.ndarray:
        """`memory_parts`' total: whole bytes per category, exactly as `rank_cost` reports
        them (the planner's tables: one stack of the phases' totals, not one per category).
        Padded to `pad` (> 0), the padded buffers included: the phases' and the u x
        `padding_bytes_per_fraction` a rank holds whatever its own fraction
        (`fraction_bytes(s, pad)` then counts s at the rest of `bytes_per_fraction`)."""
        b = np.asarray(b, dtype=np.int64)
        m = np.maximum(np.asarray(m, dtype=np.int64), 1)
        offload = np.asarray(offload, dtype=bool)
        overlap = np.asarray(overlap_reduce, dtype=bool)
        fuse = np.asarray(fuse, dtype=bool)
        shape = np.broadcast_shapes(b.shape, m.shape, offload.shape, overlap.shape, fuse.shape)
        phases = self._phases(type_key, b, m, offload, overlap, pad, fuse)
        zero = np.zeros(shape)
        raw = np.stack([sum((v for v in ph.values()), zero) for ph in phases])
        whole = np.stack([sum((np.ceil(v) for v in ph.values()), zero) for ph in phases])
        peak = np.argmax(raw, axis=0)  # the first of equal phases, as in `memory_parts`
        total = np.take_along_axis(whole, peak[None], axis=0)[0]
        pad = np.asarray(pad, dtype=np.float64)  # broadcasts too (tests scan the padding)
        padded = np.where(pad > 0, pad * self.padding_bytes_per_fraction, 0.0)
        return total + math.ceil(self.reserve_for(capacity_bytes, type_key)) + padded

    def state_bytes(self, fraction, host_part=0.0) -> np.ndarray:
        """The `state` category at state fraction `fraction`, `host_part` of the model (a part of
        that fraction) on the host: only its compute-dtype copy stays."""
        f = np.asarray(fraction)
        x = np.asarray(host_part)
        return (f - x) * self.layout.state_bytes + x * self.total_params * self.dtype_bytes

    def host_bytes(self, b, offload, host_part) -> np.ndarray:
        """Host memory of a rank: `host_part` x of the model held there, and the boundary
        activations of b samples when offloaded (all of them after the forward)."""
        return host_bytes(self.model, self.seq_len, self.dtype, b, offload, host_part)

    def fraction_bytes(self, fraction, pad=0.0) -> np.ndarray:
        """All bytes that grow with the state fraction (state + reduce-scatter output): what
        `memory_without_state` (with the same `pad`) leaves out."""
        return np.asarray(fraction) * self.bytes_per_fraction_at(pad)

    def bytes_per_fraction_at(self, pad: float = 0.0) -> float:
        """`bytes_per_fraction` under a split padded to `pad`: padded, the reduce-scatter output
        and the fp32 send buffer are held at u, whatever s (`memory_without_state`)."""
        if pad > 0:
            return self.bytes_per_fraction - self.padding_bytes_per_fraction
        return self.bytes_per_fraction

    def host_part_bytes_per_fraction_at(self, pad: float = 0.0) -> float:
        """`host_part_device_bytes_per_fraction` under a split padded to `pad` (the host part's
        share of the reduce-scatter output and its fp32 copy are in the padded buffers)."""
        if pad > 0:
            return self.host_part_device_bytes_per_fraction - self.padding_bytes_per_fraction
        return self.host_part_device_bytes_per_fraction
