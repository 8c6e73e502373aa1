"""The fused tail: where the last block is not recomputed.

Under layered gradient accumulation every unit is run twice: without a graph in the forward,
and again with one in the backward (the recompute). The head is the exception: its loss and
its backward run in one pass at the end of the forward (runtime/head_loss.py). The fused tail
extends that pass to the last block. Its forward runs there, per micro-batch, with a graph;
the head's loss and backward follow, then the last block's backward at once
(runtime/engine/tail_pass.py). The last block is neither recomputed nor gathered a second time: one
block forward per micro-batch less, 1/(4L) of an L-block model's compute (5.5 % of the step
of the 4-block `gpt-small-demo`, measured).

Whether a rank fuses is its own choice (`rank_fuses_tail`): its collectives are the same
either way, because where the model allows the fused tail (`fused_tail_possible`) every rank keeps
the last block gathered from its forward to its backward, fused or not, so no rank gathers it
a second time. (An unfused rank held the last block gathered during the head's pass anyway:
it was prefetched there for the backward.) The ranks of a shard group must run the same
collectives in the same order; they do.

The planner chooses it per rank (`RankPlan.fuse_tail`), as it chooses offload and reduce
overlap: its tables hold both orders for a rank that allows the fused tail, and keep each where
it is on the time/memory frontier. So a rank with room for the unfused order only keeps that
order instead of offloading or waiting for its reduce-scatters.

The price is memory in that pass: the last block's saved activations and transient gradients
and both gradient buffers (the head's and the last block's) sit beside the head's chunk of
logits. In exchange the head's inputs are never stored for the whole batch, only one
micro-batch's. The cost model charges this (`CostModel._phases`: the moments `tail_head` and
`tail_block`), so the planner sees it. A rank the planner marks short of memory
(`overlap_reduce` false: one unit gradient alive at a time) keeps the unfused order, and so
does a rank whose boundaries live on the host (`offload`).

Where it does not apply at all:
- mixture-of-experts models: the router's statistics are reduced over the global batch after
  the forward;
- QLoRA: the dequantization moments are charged per block backward;
- hierarchical plans: the head's all-reduce between shard groups is ordered by unit;
- models without a block.

This module is the one place that says where the tail is fused; the engine
(`Engine.fuse_tail`) and the cost model both ask it.
"""

from __future__ import annotations

import numpy as np


def fused_tail_possible(*, blocks: int, moe: bool, quantized: bool, hierarchical: bool) -> bool:
    """Whether a model and plan allow the fused tail on any rank (and so every rank keeps the
    last block gathered from its forward to its backward)."""
    return blocks >= 1 and not moe and not quantized and not hierarchical


def rank_fuses_tail(fusable: bool, overlap_reduce, offload):
    """Whether a rank's other choices allow the fused tail: the model and plan allow it
    (`fused_tail_possible`), the rank overlaps its reduce-scatters and keeps its boundaries on the
    device (its plan's `fuse_tail` then says whether it does). Broadcasts over numpy arrays."""
    return np.logical_and(fusable, np.logical_and(overlap_reduce, np.logical_not(offload)))
