"""Memory ledger: budget errors, peaks, activation tracking checked against real allocations."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from cephalo.errors import CephaloError, MemoryBudgetExceeded
from cephalo.runtime.live_bytes import LiveTensorBytes
from cephalo.runtime.memory import MemoryLedger

MIB = 1 << 20


def test_budget_error_names_rank_and_category():
    ledger = MemoryLedger(rank=3, device="cpu", budget_bytes=MIB)
    params = ledger.alloc("params", MIB // 8, torch.float32)  # 0.5 MiB
    ledger.alloc("host/activations", 4 * MIB, torch.float32)  # host memory: not on the budget
    with pytest.raises(MemoryBudgetExceeded) as info:
        ledger.alloc("grads", 3 * MIB // 16, torch.float32)  # 0.75 MiB more
    err = info.value
    assert err.rank == 3 and err.category == "grads"
    message = str(err)
    assert "rank 3" in message and "'grads'" in message
    assert (
        "requested 0.8 MiB" in message
        and "0.5 MiB in use" in message
        and "1.0 MiB budget" in message
    )
    assert "params 0.5 MiB" in message  # the largest holders are listed
    # nothing was charged for the failed request; freeing makes room
    assert ledger.current_by_category.get("grads", 0) == 0
    ledger.free(params)
    ledger.alloc("grads", 3 * MIB // 16, torch.float32)
    assert ledger.current_bytes == 3 * MIB // 4


def test_peaks_and_snapshot_at_peak():
    ledger = MemoryLedger(rank=0, device="cpu")
    a = ledger.alloc("params", 1000, torch.float32, zero=True)
    assert torch.count_nonzero(a) == 0 and a.dtype == torch.float32 and a.numel() == 1000
    b = ledger.alloc("grads", 500, torch.bfloat16)
    assert ledger.current_bytes == 5000
    ledger.free(b)
    c = ledger.alloc("optim", 250, torch.float32)
    ledger.charge("logits", 3000)
    assert ledger.peak_bytes == 4000 + 1000 + 3000
    assert ledger.at_peak_by_category == {"params": 4000, "grads": 0, "optim": 1000, "logits": 3000}
    ledger.release("logits", 3000)
    ledger.free(c)
    assert ledger.peak_by_category == {"params": 4000, "grads": 1000, "optim": 1000, "logits": 3000}
    assert ledger.current_bytes == 4000
    ledger.reset_peak()
    assert ledger.peak_bytes == 4000 and ledger.peak_by_category["logits"] == 0
    report = ledger.report()
    assert report["peak_bytes"] == 4000 and report["current_by_category"]["params"] == 4000
    host = ledger.alloc("host/boundary", 100, torch.float32, pin=True)
    assert (
        host.device.type == "cpu"
        and ledger.host_current_bytes == 400
        and ledger.current_bytes == 4000
    )


def test_free_and_release_misuse():
    ledger = MemoryLedger(rank=1, device="cpu")
    buf = ledger.alloc("params", 10, torch.float32)
    with pytest.raises(CephaloError, match="did not allocate"):
        ledger.free(torch.empty(10))
    with pytest.raises(CephaloError, match="not a view"):
        ledger.free(buf[2:])
    ledger.free(buf)
    ledger.free(buf)  # second free is a no-op
    assert ledger.current_bytes == 0
    with pytest.raises(CephaloError, match="holds only 0"):
        ledger.release("params", 4)
    with pytest.raises(CephaloError, match="host buffers"):
        ledger.alloc("params", 4, torch.float32, device="meta")
    with pytest.raises(CephaloError, match="non-negative"):
        MemoryLedger(rank=0, device="cpu", budget_bytes=-1)


def test_adopt_takes_a_whole_storage_without_copying():
    """A tensor that is its whole storage becomes a ledger buffer as it is (the boundary
    store keeps a unit's output so, issue 39); a view into a larger storage, a ledger buffer
    or a host category is refused (the caller copies)."""
    ledger = MemoryLedger(rank=0, device="cpu", budget_bytes=1000)
    out = torch.randn(4, 8)
    assert ledger.adopt("boundary", out)
    assert ledger.current_by_category["boundary"] == 128 and ledger.owns(out)
    larger = torch.randn(4, 16)
    assert not ledger.adopt("boundary", larger[:, :8].contiguous()[:2])  # offset 0, not whole
    assert not ledger.adopt("boundary", larger[1:])
    assert not ledger.adopt("boundary", larger.t())
    assert not ledger.adopt("boundary", out.view(-1))  # already the ledger's
    assert not ledger.adopt("host/boundary", torch.randn(3))
    with pytest.raises(MemoryBudgetExceeded):
        ledger.adopt("boundary", torch.randn(300))
    ledger.free(out)
    assert ledger.current_bytes == 0 and not ledger.owns(out)


def _mlp(width: int, depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers)


def test_tracks_saved_activations_of_linear_gelu_stack():
    batch, width, depth = 8, 32, 3
    model = _mlp(width, depth)
    ledger = MemoryLedger(rank=0, device="cpu")
    x = torch.randn(batch, width)
    with ledger.track_activations():
        out = model(x)
    loss = out.square().sum()  # outside the block: its saved `out` is not counted
    act = batch * width * 4
    # Linear saves its input (x, then each GELU output but the last); GELU saves its input;
    # weights are parameters and are not counted
    expected = act + depth * act + (depth - 1) * act
    assert ledger.current_by_category["activations"] == expected
    loss.backward()
    # released when autograd drops its saved references, although `x` and `out` live on
    assert ledger.current_by_category["activations"] == 0
    assert ledger.peak_by_category["activations"] == expected


def test_activation_tracking_skips_ledger_buffers_and_respects_budget():
    ledger = MemoryLedger(rank=2, device="cpu", budget_bytes=10_000)
    weight = ledger.alloc("gathered", 16 * 16, torch.float32).view(16, 16).requires_grad_(False)
    x = torch.randn(4, 16, requires_grad=True)  # a leaf input: owned by the caller
    with ledger.track_activations():
        y = torch.tanh(x @ weight)  # mm saves x and weight (both skipped), tanh saves y
    assert ledger.current_by_category["activations"] == 4 * 16 * 4
    with pytest.raises(MemoryBudgetExceeded, match="'activations'"), ledger.track_activations():
        torch.tanh(torch.randn(64, 64, requires_grad=True) @ weight.repeat(4, 4))
    del y
    gc.collect()
    assert ledger.current_by_category["activations"] == 0


class _TinyLM(nn.Module):
    def __init__(self, vocab: int = 64, width: int = 48, depth: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(width),
                nn.Linear(width, 4 * width),
                nn.GELU(),
                nn.Linear(4 * width, width),
            )
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block(h)
        logits = self.out(self.norm(h))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_ledger_matches_real_allocations_under_dispatch_mode():
    torch.manual_seed(0)
    model = _TinyLM()
    ledger = MemoryLedger(rank=0, device="cpu")
    real = LiveTensorBytes()
    with real:
        ids = torch.randint(0, 64, (4, 16))
        labels = torch.randint(0, 64, (4, 16))
        base = real.current  # the inputs
        with ledger.track_activations():
            loss = model(ids, labels)
        gc.collect()
        # after forward, what is still alive besides the inputs is what autograd saved (and
        # the scalar loss): every other intermediate died with its last Python reference
        saved_real = real.current - base
        saved_ledger = ledger.current_by_category["activations"]
        loss.backward()
        del loss
        gc.collect()
    assert saved_ledger > 0
    # the ledger also counts `ids` (saved by the embedding); the real count has the loss
    ids_bytes = ids.numel() * ids.element_size()
    assert abs((saved_ledger - ids_bytes) - saved_real) <= 0.02 * saved_real + 64, (
        saved_ledger,
        saved_real,
    )
    assert ledger.peak_by_category["activations"] == saved_ledger  # forward is the peak
    assert ledger.current_by_category["activations"] == 0


def test_emulated_device_counts_every_byte():
    """The strict mode of an emulated device (runtime/device_memory.py): every new CPU storage
    counts from the reserve up, views / in-place / out= results and host memory do not, the
    backward's gradients do, and going over the budget raises what CUDA raises, with the
    live bytes unchanged afterwards."""
    from cephalo.runtime.device_memory import EmulatedDeviceMemory, host_memory

    def nbytes(*ts: torch.Tensor) -> int:
        return sum(t.numel() * t.element_size() for t in ts)

    mode = EmulatedDeviceMemory(rank=5, budget_bytes=4 * MIB, reserve_bytes=MIB // 2)
    assert mode.live_bytes == MIB // 2
    with mode:
        w = torch.randn(128, 128, requires_grad=True)  # 64 KiB
        x = torch.randn(32, 128)
        assert mode.live_bytes == MIB // 2 + nbytes(w, x)
        before = mode.live_bytes
        v = x.view(128, 32)[1:].t()  # views
        x.add_(1.0)  # in place
        y = torch.empty_like(x)
        torch.mul(x, 2.0, out=y)  # out=: y was counted when made
        assert mode.live_bytes == before + nbytes(y)
        del v, y
        before = mode.live_bytes
        (x @ w).square().sum().backward()
        gc.collect()
        assert mode.live_bytes == before + nbytes(w.grad)  # the graph's temporaries died
        with host_memory():
            h = torch.empty(8 * MIB, dtype=torch.uint8)  # larger than the device
        ledger = MemoryLedger(rank=5, device="cpu")
        on_host = ledger.alloc("host/state", MIB, torch.uint8)
        on_device = ledger.alloc("params", 1000, torch.uint8)
        assert mode.live_bytes == before + nbytes(w.grad) + 1000
        live = mode.live_bytes
        with pytest.raises(torch.OutOfMemoryError) as err:
            torch.zeros(4 * MIB, dtype=torch.uint8)
        assert mode.live_bytes == live
        del h, on_host, on_device
    text = str(err.value)
    assert "rank 5" in text and "4.0 MiB (" in text and "of its 4.0 MiB" in text, text
    assert "0.5 MiB of it the reserve" in text, text


class _MlpBlock(nn.Module):
    """A block small enough to compile in seconds, whose activations dwarf its parameters."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 256)
        self.down = nn.Linear(256, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


@pytest.mark.slow
def test_compiled_blocks_compile_and_are_counted_on_an_emulated_device():
    """`parallel.compile = "inductor"` under the strict accounting of an emulated device
    (runtime/capture/counted.py): dynamo compiles under the dispatch mode (its graphs counted),
    and what inductor allocates below the dispatcher is still charged: the compiled forward's
    output and saved activations (invisible to the mode: without the charge it adds ~0 bytes),
    the backward's gradients, and the eager twin's transient before each call, so a budget the
    eager call does not fit fails the compiled one too. ~5 s (one small graph, fwd + bwd)."""
    import torch._inductor.config
    from torch._dynamo.utils import counters

    from cephalo.runtime.bind import UnitBinding
    from cephalo.runtime.capture.blocks import CompiledBlocks
    from cephalo.runtime.device_memory import EmulatedDeviceMemory

    block = _MlpBlock()
    binding = UnitBinding(block)
    blocks = CompiledBlocks(
        "inductor", torch.device("cpu"), lambda fn: torch.compile(fn, dynamic=False)
    )
    mode = EmulatedDeviceMemory(rank=0, budget_bytes=64 * MIB)
    graphs = counters["stats"]["unique_graphs"]
    hidden = 16 * 32 * 256 * 4  # one [16, 32, 256] fp32 activation: 512 KiB

    def call() -> tuple[int, int]:
        """(bytes a call leaves alive, bytes its backward leaves: the gradients)."""
        params = {n: p.detach().clone().requires_grad_() for n, p in block.named_parameters()}
        x = torch.randn(16, 32, 32, requires_grad=True)
        before = mode.live_bytes
        out = blocks.run(0, binding, params, x, {}, None)
        held = mode.live_bytes - before
        del out  # the backward below keeps the graph, not the name
        before = mode.live_bytes
        blocks_out = blocks.run(0, binding, params, x, {}, None)
        blocks_out.sum().backward()
        del blocks_out
        gc.collect()
        return held, mode.live_bytes - before

    # one small graph: compiled in this process (no pool of compile workers to start)
    with mode, torch.random.fork_rng(), torch._inductor.config.patch(compile_threads=1):
        torch.manual_seed(0)
        eager_held, _ = call()  # the first call of its key runs eagerly, measured
        held, grads = call()
        assert blocks.eager_calls == 1 and blocks.calls == 3
        assert counters["stats"]["unique_graphs"] > graphs, "the block must have compiled"
        assert eager_held >= 2 * hidden  # the up projection's and gelu's outputs
        assert held >= hidden, f"compiled activations not charged: {held} bytes"
        params_bytes = sum(p.numel() * 4 for p in block.parameters())
        assert grads >= params_bytes + 16 * 32 * 32 * 4  # parameter and input gradients
        mode.budget_bytes = mode.live_bytes + eager_held // 4
        with pytest.raises(torch.OutOfMemoryError, match="compiled forward"):
            call()
