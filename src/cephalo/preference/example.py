"""A small preference dataset the project makes itself (no download), from the chat example
(`data.chat_example`): what the README's "Preference tuning (DPO)" and configs/dpo.toml run on.

    DIR/preference.jsonl  TRL's conversational pairs: {"prompt": [...], "chosen": [...],
                          "rejected": [...]}
    DIR/qwen-tiny/        the chat example's tiny Qwen2 directory (its tokenizer and template)

Each pair is one of the chat example's conversations: the prompt is every turn before its last
answer, `chosen` that real answer, `rejected` a worse one: half the time an unhelpful reply
(a refusal, a shrug), half the time the last answer of another conversation (off topic). The
refusals differ from the answers in their words, so even the tiny model tells them apart after
a few steps; the off-topic answers need the question read, and come later.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from cephalo.data.chat_example import example_conversations, write_chat_example

UNHELPFUL = (
    "I am not sure.",
    "I cannot help with that.",
    "Please ask someone else.",
    "That is not something I can answer.",
    "Maybe. It depends.",
)
"""Rejected replies that answer nothing."""


@dataclass(frozen=True)
class PreferenceExample:
    jsonl: Path
    """The pairs."""
    model: Path
    """The tiny model directory (config, tokenizer with its chat template)."""


def example_pairs(n: int, seed: int = 0) -> list[dict]:
    """`n` pairs from the chat example's conversations of the same seed, deterministic."""
    conversations = [c["messages"] for c in example_conversations(n, seed)]
    rng = random.Random(seed + 1)
    out = []
    for i, messages in enumerate(conversations):
        answer = messages[-1]["content"]
        if rng.random() < 0.5:
            worse = rng.choice(UNHELPFUL)
        else:  # another conversation's last answer, never the same text
            others = (conversations[(i + k) % n][-1]["content"] for k in range(1, n))
            worse = next((a for a in others if a != answer), rng.choice(UNHELPFUL))
        out.append(
            {
                "prompt": messages[:-1],
                "chosen": [{"role": "assistant", "content": answer}],
                "rejected": [{"role": "assistant", "content": worse}],
            }
        )
    return out


def write_preference_example(
    out_dir: str | Path, pairs: int = 2000, seed: int = 0, vocab_size: int = 512
) -> PreferenceExample:
    """Write `DIR/preference.jsonl` and the chat example's `DIR/qwen-tiny/` (its byte-level
    tokenizer, trained on the same conversations, spells the unhelpful replies too)."""
    out_dir = Path(out_dir)
    chat = write_chat_example(out_dir, pairs, seed, vocab_size)
    chat.jsonl.unlink()  # the pairs are made of the same conversations
    jsonl = out_dir / "preference.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in example_pairs(pairs, seed)))
    return PreferenceExample(jsonl, chat.model)
