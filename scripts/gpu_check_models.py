"""scripts/gpu_check.py's model-family checks: `hf_models` (tiny transformers directories:
their own first loss on the device, bf16 training), `adapters` (LoRA and QLoRA) and
`chat_packed` (packed chat windows against padded samples). gpu_check.py imports this file
when those checks run; each returns its failures and a note, on the GPU or (`--cpu`) on the
CPU."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from gpu_setup import Setup


def check_adapters(setup: Setup) -> tuple[list[str], str]:
    """LoRA and QLoRA (model.adapter) on a tiny Qwen2: the first fp32 loss is transformers'
    own (LoRA starts with B = 0), bf16 training lowers the loss, the NF4 base holds at most
    0.3x the bf16 base's bytes, and NF4 codes made on this device equal the CPU's."""
    import tempfile

    import transformers

    from cephalo.errors import CephaloError
    from cephalo.modeling.lora import AdapterSettings, apply_adapter
    from cephalo.modeling.registry import build_model
    from cephalo.planner.plan import Plan, RankPlan
    from cephalo.runtime.engine.engine import Engine, EngineConfig

    try:
        from cephalo.modeling.nf4 import nf4_backend, nf4_roundtrip

        nf4_backend()
        kinds = ("lora", "qlora")
    except CephaloError as err:
        kinds, skipped = ("lora",), str(err)
    transformers.logging.set_verbosity_error()
    failures, notes, frozen = [], [], {}
    seq, batch = 64, 4
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 512, (batch, seq), generator=gen)
    y = torch.roll(x, -1, dims=1)
    with tempfile.TemporaryDirectory() as tmp:
        directory = _tiny_hf_dir(tmp, "qwen2")
        hf = transformers.AutoModelForCausalLM.from_pretrained(directory).to(setup.device)
        with torch.no_grad():
            logits = hf(input_ids=x.to(setup.device)).logits.float()
            expected = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), y.to(setup.device).reshape(-1)
            ).item()
        del hf
        dtypes = (("fp32", 1), ("bf16", 6)) if setup.cuda else (("fp32", 4),)
        for kind in kinds:
            for dtype, steps in dtypes:
                model = build_model(directory)
                apply_adapter(model, AdapterSettings(kind=kind, r=8, alpha=16))
                frozen_numel = {
                    f"{u}.{n}": p.numel()
                    for u, n, p in model.named_unit_parameters()
                    if not p.requires_grad
                }
                quantized = sum(frozen_numel.get(k, 0) for k in model.quantized_parameters)
                bound = (0.53 * quantized + 2 * (sum(frozen_numel.values()) - quantized)) / (
                    2 * sum(frozen_numel.values())
                )
                plan = Plan(
                    "manual", directory, seq, batch, dtype, [RankPlan(0, "gpu", batch, 2, 2, 1.0)]
                )
                cfg = EngineConfig(device=str(setup.device), compute_dtype=dtype)
                engine = Engine(model, plan, setup.comm, cfg)
                losses = [engine.train_step(x, y, lr=1e-2).loss for _ in range(steps)]
                if dtype == "fp32":
                    # QLoRA's base is the NF4 round trip: close to, not equal to, the original
                    tol = 1e-4 if kind == "lora" else 5e-2
                    if abs(losses[0] / expected - 1) > tol:
                        failures.append(
                            f"{kind}: first loss {losses[0]:.5f} vs transformers' {expected:.5f}"
                        )
                if steps > 1:
                    if not losses[-1] < losses[0] - 0.05:
                        failures.append(f"{kind} {dtype}: loss did not fall: {losses}")
                    frozen[kind] = engine.frozen.nbytes()
                    notes.append(f"{kind} {dtype} {losses[0]:.3f} -> {losses[-1]:.3f}")
                del engine
    if setup.cuda and "qlora" in frozen and "lora" in frozen:  # both bf16 (tests/test_lora.py: CPU)
        # NF4 holds the Linear weights in ~0.52 B each; embeddings and norms stay in bf16
        # (the Linear share of a tiny model is smaller than of a real one: 0.3x there)
        ratio = frozen["qlora"] / frozen["lora"]
        notes.append(f"NF4 base {ratio:.3f}x bf16's bytes (bound {bound:.3f})")
        if ratio > bound:
            failures.append(
                f"the NF4 base takes {ratio:.3f}x the bf16 base's bytes (> {bound:.3f})"
            )
    if "qlora" in kinds and setup.cuda:
        w = torch.randn(256, 512, generator=torch.Generator().manual_seed(1))
        if not torch.equal(nf4_roundtrip(w.to(setup.device)).cpu(), nf4_roundtrip(w)):
            failures.append("NF4 made on the GPU differs from NF4 made on the CPU")
    if "qlora" not in kinds:
        notes.append(f"qlora SKIPPED: {skipped}")
    return failures, "; ".join(notes)


def check_chat_packed(setup: Setup) -> tuple[list[str], str]:
    """Chat data (data/chat_data.py): the same conversations packed into windows (position
    ids restarting per conversation, transformers' block-diagonal masks on this device's
    attention kernels) and padded one per sample give the same loss over the assistant's
    tokens: attention never crosses conversations. Then a packed bf16 training step."""
    import tempfile
    from pathlib import Path

    from cephalo.data.chat_data import DocumentBatches, prepare_chat_dataset
    from cephalo.data.chat_example import write_chat_example
    from cephalo.modeling.registry import build_model
    from cephalo.planner.plan import Plan, RankPlan
    from cephalo.runtime.engine.engine import Engine, EngineConfig

    seq, failures, losses = 512, [], {}
    with tempfile.TemporaryDirectory() as tmp:
        example = write_chat_example(tmp, conversations=24)
        data = prepare_chat_dataset(
            [example.jsonl], Path(tmp) / "ds", example.model, val_fraction=0.0
        ).path
        for packing in (False, True):
            n = DocumentBatches(data, seq, 1, packing=packing).num_train_windows
            batches = DocumentBatches(data, seq, n, packing=packing)
            x, y = batches.batch(0)
            positions = batches.rank_positions(0, 0, n)
            for dtype in ("fp32",) + ((setup.low,) if packing else ()):
                plan = Plan(
                    "manual",
                    str(example.model),
                    seq,
                    n,
                    dtype,
                    [RankPlan(0, "gpu", n, 4, -(-n // 4), 1.0)],
                )
                cfg = EngineConfig(device=str(setup.device), compute_dtype=dtype)
                engine = Engine(build_model(str(example.model)), plan, setup.comm, cfg)
                if dtype == "fp32":
                    losses[packing] = (engine.eval_loss(x, y, position_ids=positions), n)
                else:
                    step = engine.train_step(x, y, 1e-3, position_ids=positions)
                    if not math.isfinite(step.loss):
                        failures.append(f"a packed {dtype} step gave loss {step.loss}")
                del engine
    (padded, n_padded), (packed, n_packed) = losses[False], losses[True]
    diff = abs(packed / padded - 1)
    if diff > 1e-4:
        failures.append(f"packed loss {packed:.6f} != padded {padded:.6f} ({diff:.1e})")
    return (
        failures,
        f"{n_padded} padded samples vs {n_packed} packed windows: loss within {diff:.0e}",
    )


def _tiny_hf_dir(tmp: str, model_type: str) -> str:
    """A tiny `model_type` directory written by save_pretrained (no tokenizer)."""
    from pathlib import Path

    import transformers

    kwargs = dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        sliding_window=32,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    extra = {
        "qwen2": dict(use_sliding_window=True, max_window_layers=2, tie_word_embeddings=True),
        "gemma2": dict(head_dim=32, final_logit_softcapping=30.0),
        # interleaved local / global layers with their own rotary tables
        "gemma3_text": dict(head_dim=32, sliding_window_pattern=2),
        # the router loss over the global batch: transformers' outputs.loss includes it
        "qwen3_moe": dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            output_router_logits=True,
            router_aux_loss_coef=0.1,
        ),
    }[model_type]
    directory = Path(tmp) / model_type
    config = transformers.AutoConfig.for_model(model_type, **kwargs, **extra)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(directory))
    return str(directory)


def check_hf_models(comm, device: torch.device) -> list[str]:
    """Transformers model directories through the engine on `device`: tiny Qwen2 (sliding-window
    layers, tied embeddings), Gemma 2 (eager attention, soft-capping, embedding scale), Gemma 3
    (rotary per layer type) and Qwen3-MoE (experts, the router loss of the global batch)."""
    import tempfile
    from pathlib import Path

    import transformers

    from cephalo.modeling.registry import build_model
    from cephalo.planner.plan import Plan, RankPlan
    from cephalo.runtime.engine.engine import Engine, EngineConfig

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    failures = []
    seq, batch = 128, 4
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 512, (batch, seq), generator=gen)
    y = torch.full_like(x, -100)
    y[:, :-1] = x[:, 1:]
    dtypes = (("fp32", 1), ("bf16", 6)) if device.type == "cuda" else (("fp32", 3),)
    with tempfile.TemporaryDirectory() as tmp:
        for model_type in ("qwen2", "gemma2", "gemma3_text", "qwen3_moe"):
            directory = Path(_tiny_hf_dir(tmp, model_type))
            hf = transformers.AutoModelForCausalLM.from_pretrained(str(directory)).to(device)
            with torch.no_grad():
                expected = hf(input_ids=x.to(device), labels=x.to(device)).loss.item()
            del hf
            for dtype, steps in dtypes:
                plan = Plan(
                    "manual",
                    str(directory),
                    seq,
                    batch,
                    dtype,
                    [RankPlan(0, "gpu", batch, 2, batch // 2, 1.0)],
                )
                engine = Engine(
                    build_model(str(directory)),
                    plan,
                    comm,
                    EngineConfig(device=str(device), compute_dtype=dtype),
                )
                losses = [engine.train_step(x, y, lr=1e-3).loss for _ in range(steps)]
                if dtype == "fp32" and abs(losses[0] / expected - 1) > 1e-4:
                    failures.append(
                        f"{model_type}: first-step loss {losses[0]:.6f} != transformers' "
                        f"{expected:.6f} on {device}"
                    )
                if steps > 1 and not losses[-1] < losses[0]:
                    failures.append(f"{model_type} {dtype}: loss did not fall: {losses}")
                del engine
    return failures


def check_hf(setup: Setup) -> tuple[list[str], str]:
    import transformers

    return check_hf_models(setup.comm, setup.device), f"transformers {transformers.__version__}"
