"""A small chat dataset and a tiny chat model directory the project makes itself (no download):
what the README's "Fine-tune on chat data" and `bench/packing.py` run on.

    DIR/chat.jsonl     conversations: {"messages": [{"role": ..., "content": ...}, ...]}
    DIR/qwen-tiny/     a Qwen2 config (random init: no weights), a byte-level BPE trained on the
                       conversations, and a ChatML chat template (with generation markers)

The conversations are small, exact tasks (arithmetic, counting, spelling backwards), one to
four exchanges, some with a system prompt, so their lengths vary as real chat data does
(what packing is for) and the loss on the assistant's answers can fall fast.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from cephalo.errors import CephaloError

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>\n' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML (Qwen's turn format), with `{% generation %}` around the assistant's turns."""
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
WORDS = [
    "planner",
    "shard",
    "gradient",
    "tensor",
    "window",
    "packing",
    "template",
    "rank",
    "batch",
    "token",
    "cluster",
    "optimizer",
    "checkpoint",
    "schedule",
    "device",
    "memory",
    "network",
]
SYSTEM_PROMPTS = ("You are a careful assistant. Answer exactly.", "Answer in one sentence.")


@dataclass(frozen=True)
class ChatExample:
    jsonl: Path
    """The conversations."""
    model: Path
    """The tiny model directory (config, tokenizer with its chat template)."""


def _exchange(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randrange(100), rng.randrange(100)
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    if kind == 1:
        a = rng.randrange(30)
        b = a + rng.randrange(2, 40)
        return f"Count from {a} to {b}.", ", ".join(str(i) for i in range(a, b + 1)) + "."
    if kind == 2:
        word = rng.choice(WORDS)
        return f"Spell '{word}' backwards.", f"'{word}' backwards is '{word[::-1]}'."
    words = [rng.choice(WORDS) for _ in range(rng.randrange(2, 12))]
    return f"Sort these words: {' '.join(words)}.", " ".join(sorted(words)) + "."


def example_conversations(n: int, seed: int = 0) -> list[dict]:
    """`n` conversations, deterministic for a seed."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        messages = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        for _ in range(rng.choice((1, 1, 2, 3, 4))):
            question, answer = _exchange(rng)
            messages += [
                {"role": "user", "content": question},
                {"role": "assistant", "content": answer},
            ]
        out.append({"messages": messages})
    return out


def write_chat_example(
    out_dir: str | Path, conversations: int = 2000, seed: int = 0, vocab_size: int = 512
) -> ChatExample:
    """Write `DIR/chat.jsonl` and `DIR/qwen-tiny/` (see the module docstring)."""
    try:
        import transformers
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as e:
        raise CephaloError(
            f"the chat example needs transformers: pip install 'cephalo[hf]' ({e})"
        ) from e
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    records = example_conversations(conversations, seed)
    jsonl = out_dir / "chat.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
    )
    tok.train_from_iterator((m["content"] for r in records for m in r["messages"]), trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
    )
    fast.chat_template = CHATML_TEMPLATE
    model_dir = out_dir / "qwen-tiny"
    fast.save_pretrained(str(model_dir))
    config = transformers.Qwen2Config(
        vocab_size=len(fast),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
    )
    config.save_pretrained(str(model_dir))
    return ChatExample(jsonl, model_dir)
