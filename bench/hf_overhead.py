"""One rank of cephalo on a Hugging Face model against plain transformers on the same batch:
what the unit adapter and the engine cost over `AutoModelForCausalLM` itself.

Both start from the same model directory (a random Llama-style model written with
`save_pretrained`: blocks dominate the compute, as in real models), train on the same
global batch with the same number of torch threads, fp32, AdamW + global-norm clipping:

- `cephalo`: `Engine` on one rank (`LocalComm`), the directory's weights read as pretrained,
  layered gradient accumulation with ONE micro-batch: every unit is recomputed in backward.
- `transformers+GC`: `model.activation_checkpointing_enable()` (each decoder layer recomputed
  in backward, as the engine does), `torch.optim.AdamW`, `clip_grad_norm_`: the like-for-like
  baseline.
- `transformers`: the same without checkpointing (keeps every activation), for context.

The variants run in rotated order in one process and the medians are compared, so drifts
of a shared machine hit all alike. Target (issue #13): cephalo / transformers+GC <= 1.1.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from _common import (
    Result,
    alternate,
    fmt_bytes,
    markdown_table,
    median,
    print_table,
    raise_priority,
    save_figure,
    verdict,
)

VARIANTS = ("cephalo", "hf_gc", "hf")
LABELS = {"cephalo": "cephalo (1 rank)", "hf_gc": "transformers+GC", "hf": "transformers"}
LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 1e-4, (0.9, 0.95), 1e-8, 0.1, 1.0
TARGET = 1.1


def write_model(directory: Path, args: argparse.Namespace) -> Path:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads // 2,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(directory))
    return directory


class Cephalo:
    def __init__(self, directory: Path, batch: int, seq_len: int):
        from cephalo.modeling.registry import build_model
        from cephalo.planning.planner import manual_plan
        from cephalo.runtime.comm import LocalComm
        from cephalo.runtime.engine import Engine, EngineConfig
        from cephalo.runtime.optim import AdamWHyper

        plan = manual_plan(str(directory), seq_len, [batch], [batch], [1.0])
        cfg = EngineConfig(
            compute_dtype="fp32",
            adamw=AdamWHyper(betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY),
            grad_clip=CLIP,
            validate_collectives=False,
            per_sample_dropout=False,
        )
        self.model = build_model(str(directory))
        self.engine = Engine(self.model, plan, LocalComm(), cfg)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        return self.engine.train_step(x, y, LR).loss

    def persistent(self) -> list[torch.Tensor]:
        return [
            t for us in self.engine.shards for t in (us.master, us.grad, us.exp_avg, us.exp_avg_sq)
        ]


class Transformers:
    def __init__(self, directory: Path, checkpointing: bool):
        import transformers

        from cephalo.runtime.param_groups import adamw_param_groups

        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(directory), dtype=torch.float32
        ).train()
        if checkpointing:
            self.model.activation_checkpointing_enable()
        named = list(self.model.named_parameters())
        self.params = [p for _, p in named]
        self.opt = torch.optim.AdamW(
            adamw_param_groups(named, WEIGHT_DECAY), lr=LR, betas=BETAS, eps=EPS
        )

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.opt.zero_grad(set_to_none=True)
        logits = self.model(input_ids=x, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, CLIP)
        self.opt.step()
        return loss.item()

    def persistent(self) -> list:
        return [self.model, self.opt]


def run(args: argparse.Namespace) -> dict:
    from cephalo.runtime.live_bytes import tracked_peak_bytes

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        directory = write_model(Path(tmp) / "model", args)
        g = torch.Generator().manual_seed(1)
        x = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=g)
        y = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=g)
        systems = {
            "cephalo": Cephalo(directory, args.batch, args.seq_len),
            "hf_gc": Transformers(directory, checkpointing=True),
            "hf": Transformers(directory, checkpointing=False),
        }
        first = {v: systems[v].step(x, y) for v in VARIANTS}  # warm-up, and the same loss
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for name in alternate(args.rounds, list(VARIANTS)):
            t0 = time.perf_counter()
            systems[name].step(x, y)
            times[name].append(time.perf_counter() - t0)
        peaks = {
            v: tracked_peak_bytes(lambda v=v: systems[v].step(x, y), systems[v].persistent())
            for v in VARIANTS
        }
        params = sum(p.numel() for p in systems["hf"].params)
    return {"times": times, "first_loss": first, "peaks": peaks, "params": params}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="timed steps per variant (median)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for every variant")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    args = ap.parse_args()
    started = time.perf_counter()
    r = run(args)
    med = {v: median(r["times"][v]) for v in VARIANTS}
    ratio = med["cephalo"] / med["hf_gc"]
    headers = ["system", "median s/step", "vs transformers+GC", "peak memory", "first loss"]
    rows = [
        [
            LABELS[v],
            f"{med[v]:.3f}",
            f"**{med[v] / med['hf_gc']:.2f}**"
            if v == "cephalo"
            else f"{med[v] / med['hf_gc']:.2f}",
            fmt_bytes(r["peaks"][v]),
            f"{r['first_loss'][v]:.6f}",
        ]
        for v in VARIANTS
    ]
    print_table("one step, same batch and threads", headers, rows)
    fig = _plot(med, r["times"])
    result = Result(
        name="hf_overhead",
        title="Cephalo on a Hugging Face model vs plain transformers (one rank, CPU)",
        summary=[
            markdown_table(headers, rows, "lrrrr"),
            f"- Target cephalo / transformers+GC <= {TARGET}: {verdict(ratio <= TARGET)} "
            f"({ratio:.2f}).",
        ],
        figures=[fig],
        details=[
            "## Setup\n\n"
            f"- A random Llama-style model written with `save_pretrained`: {args.layers} layers, "
            f"hidden {args.hidden}, MLP {args.ffn}, {args.heads} heads ({args.heads // 2} key/value), "
            f"vocabulary {args.vocab}, untied ({r['params'] / 1e6:.1f} M parameters); batch "
            f"{args.batch} x {args.seq_len} tokens, fp32, {args.threads} torch thread(s).\n"
            "- cephalo: `build_model(DIR)` (pretrained weights) and `Engine` on one rank "
            "(`LocalComm`), one micro-batch, collective checks off; every unit is recomputed in "
            "backward (layered gradient accumulation), its parameters live in flat fp32 shards "
            "and AdamW runs on those.\n"
            "- transformers+GC: `AutoModelForCausalLM.from_pretrained(DIR)`, "
            "`activation_checkpointing_enable()` (transformers 5: the former `gradient_checkpointing_enable`; decoder layers recomputed; the embedding and the "
            "LM head are not), `torch.optim.AdamW` with weight decay on matrices, "
            "`clip_grad_norm_`. transformers: the same without checkpointing.\n"
            "- The first (warm-up) step's loss is printed for each: the same weights and batch "
            "give the same loss.\n"
            f"- {args.rounds} timed steps per variant after one warm-up step, in rotated order; "
            "medians. Peak memory: live CPU tensor storage during one more step "
            "(`LiveTensorBytes`), persistent state (parameters / shards, optimizer) included.\n"
            "- Measured on a shared development machine while other jobs ran: absolute seconds "
            "are noisy; the ratio of medians taken side by side is the figure that matters. "
            "Re-run on a quiet machine for clean numbers.",
        ],
    )
    result.write(time.perf_counter() - started)
    print(f"cephalo / transformers+GC = {ratio:.2f} (target <= {TARGET})")


def _plot(med: dict, times: dict) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    colors = {"cephalo": "tab:blue", "hf_gc": "tab:orange", "hf": "tab:gray"}
    for i, v in enumerate(VARIANTS):
        ax.bar(i, med[v], color=colors[v], label=LABELS[v])
        ax.plot([i] * len(times[v]), times[v], "k.", markersize=4)
        ax.text(i, med[v], f"{med[v] / med['hf_gc']:.2f}x", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(range(len(VARIANTS)), [LABELS[v] for v in VARIANTS], fontsize=9)
    ax.set_ylabel("step time (s): median bar, every step a dot")
    ax.set_title("One training step, same model, batch and threads", fontsize=10)
    return save_figure(fig, "hf_overhead")


if __name__ == "__main__":
    raise_priority()
    main()
