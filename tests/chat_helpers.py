"""Chat data for the tests: three chat templates written for them (ChatML with generation
markers, a Llama-3-style one without, a Gemma-style one with no system role), a tokenizer
trained in-process that knows their special tokens, and small conversations."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from cephalo.modeling.units import IGNORE_INDEX
from data_helpers import EOS, topics

SPECIAL = [
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<bos>",
    "<start_of_turn>",
    "<end_of_turn>",
]

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{% if m['role'] == 'assistant' %}"
    "{% generation %}{{ m['content'] + '<|im_end|>\n' }}{% endgeneration %}"
    "{% else %}{{ m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML with `{% generation %}` markers (transformers' `return_assistant_tokens_mask`)."""

LLAMA3 = (
    "{{ '<|begin_of_text|>' }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim"
    " + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
"""Llama-3-style, without generation markers."""

GEMMA = (
    "{{ '<bos>' }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + m['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
"""Gemma-style: no system role (the template raises), user / model alternating."""

TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "gemma": GEMMA}
END_OF_TURN = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "gemma": "<end_of_turn>"}


def save_chat_tokenizer(
    directory: Path, template: str | None = CHATML, vocab_size: int = 300, model_vocab: int = 320
) -> Path:
    """A byte-level BPE trained in-process with the templates' special tokens, saved as a
    model directory's tokenizer (with `template` as its chat template, or none)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[EOS, *SPECIAL],
        show_progress=False,
    )
    tok.train_from_iterator(topics(10), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, additional_special_tokens=SPECIAL
    )
    if template is not None:
        fast.chat_template = template
    directory.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(directory)
    config = {"model_type": "qwen2", "vocab_size": model_vocab}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def conversations(n: int = 9, system: bool = True, seed: int = 0) -> list[dict]:
    """`n` small multi-turn conversations of different lengths (1 to 3 exchanges)."""
    import random

    rng = random.Random(seed)
    words = [
        "the",
        "a",
        "model",
        "learns",
        "token",
        "data",
        "batch",
        "plan",
        "rank",
        "shard",
        "loss",
        "step",
        "chat",
        "turn",
    ]
    out = []
    for i in range(n):
        msgs = [{"role": "system", "content": "Answer briefly."}] if system and i % 2 == 0 else []
        for t in range(1 + i % 3):
            q = " ".join(rng.choice(words) for _ in range(2 + (i + t) % 5))
            a = " ".join(rng.choice(words) for _ in range(1 + (i * 3 + t) % 7))
            msgs += [
                {"role": "user", "content": f"Q{t}: {q}?"},
                {"role": "assistant", "content": f"A{t}: {a}."},
            ]
        out.append({"messages": msgs})
    return out


def write_chat_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def reference_loss(directory: Path, path: Path) -> float:
    """Plain transformers, each conversation alone: masked cross-entropy summed, divided by
    the loss tokens of all of them."""
    import transformers

    from cephalo.data.token_files import TokenFile

    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory)).eval()
    tokens = TokenFile(path, "train").tokens
    mask = np.fromfile(path / "train.mask.bin", np.uint8).astype(bool)
    starts = np.fromfile(path / "train.docs.bin", np.int64)
    total, count = 0.0, 0
    with torch.no_grad():
        for a, b in zip(starts[:-1], starts[1:], strict=True):
            ids = torch.from_numpy(np.asarray(tokens[a:b], dtype=np.int64))[None]
            labels = torch.where(torch.from_numpy(mask[a:b]), ids[0], IGNORE_INDEX)[1:]
            logits = model(ids).logits[0, :-1].float()
            total += float(
                torch.nn.functional.cross_entropy(
                    logits, labels, ignore_index=IGNORE_INDEX, reduction="sum"
                )
            )
            count += int((labels != IGNORE_INDEX).sum())
    return total / count
