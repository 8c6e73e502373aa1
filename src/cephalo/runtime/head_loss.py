"""The head's loss and its backward in ONE pass, over chunks of the sequence.

The head is the last unit: in a training step the engine knows its output gradient (1 /
global tokens, times the loss scale) before the forward reaches it. So the head runs once
per micro-batch, with a graph, and back-propagates at once (`loss_and_backward`): its
parameter gradients are drained into the unit's fp32 buffer and the input gradient replaces
the stored input, ready for the last block's backward. Nothing of the head is recomputed in
the backward pass, and the head is not gathered there.

Chunks. The logits of a micro-batch (m x seq x vocab, and their fp32 softmax) are the
largest activation of a language model. The head runs over `chunk_len` positions of the
sequence at a time (`costmodel.memory.head_chunk_tokens`: about `HEAD_CHUNK_BYTES` of
fp32 logits per chunk), so at most one chunk's logits exist at once; the cost model charges
that chunk. A head must therefore be token-wise (the `LMHead` contract: a final norm, a
projection, a token cross-entropy sum). Loss sums and gradients are added chunk by chunk:
the same values up to fp32 summation order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cephalo.costmodel.memory import head_chunk_tokens

RunHead = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(h[m, c, d], labels[m, c]) -> fp32 0-dim loss sum, under the caller's parameters (with
per-row weights on the token losses under DPO; `row_sums`: fp32 [m] per-row sums)."""


def chunk_len(m: int, seq: int, vocab: int) -> int:
    """Sequence positions per chunk for a micro-batch of m samples."""
    return max(1, min(seq, head_chunk_tokens(vocab) // max(m, 1)))


def chunks(m: int, seq: int, vocab: int) -> list[tuple[int, int]]:
    c = chunk_len(m, seq, vocab)
    return [(a, min(a + c, seq)) for a in range(0, seq, c)]


def loss(run: RunHead, h: torch.Tensor, labels: torch.Tensor, vocab: int) -> torch.Tensor:
    """The loss sum without a graph (evaluation, a forward without backward)."""
    m, seq = labels.shape
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for a, b in chunks(m, seq, vocab):
        total += run(h[:, a:b], labels[:, a:b]).float()
    return total


def row_sums(run: RunHead, h: torch.Tensor, labels: torch.Tensor, vocab: int) -> torch.Tensor:
    """Each row's token-loss sum ([m], fp32) without a graph, chunk by chunk: `run` returns a
    chunk's per-row sums (the head with `per_row`). The DPO objective's log-probabilities."""
    m, seq = labels.shape
    total = torch.zeros(m, dtype=torch.float32, device=h.device)
    with torch.no_grad():
        for a, b in chunks(m, seq, vocab):
            total += run(h[:, a:b], labels[:, a:b]).float()
    return total


def loss_and_backward(
    run: RunHead,
    h: torch.Tensor,
    labels: torch.Tensor,
    vocab: int,
    out_grad: torch.Tensor,
    leaves: list[torch.Tensor],
    input_grad: bool,
    on_chunk: Callable[[torch.Tensor], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Loss sum (fp32, detached) and the input gradient (None unless `input_grad`) of the
    head over `h`, back-propagating `out_grad` (0-dim) into `leaves` chunk by chunk (their
    post-accumulate hooks drain each chunk's gradients). `on_chunk(loss)` is called after each
    chunk's forward, before its backward (the engine charges transient bytes there)."""
    m, seq = labels.shape
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    spans = chunks(m, seq, vocab)
    # one chunk: its input gradient is the whole one (no buffer to copy it into)
    dx = torch.empty_like(h) if input_grad and len(spans) > 1 else None
    for a, b in spans:
        hc = h[:, a:b].detach()
        if input_grad:
            hc.requires_grad_()
        with torch.enable_grad():
            out = run(hc, labels[:, a:b])
            if on_chunk is not None:
                on_chunk(out)
            inputs = ([hc] if input_grad else []) + leaves
            torch.autograd.backward(out, grad_tensors=out_grad, inputs=inputs)
        total += out.detach().float()
        del out
        if input_grad and dx is None:
            dx = hc.grad
        elif dx is not None:
            dx[:, a:b] = hc.grad
        hc.grad = None
    return total, dx
