"""Write a `config.json` with Llama-3-8B's shape (no weights, no tokenizer): enough for
`cephalo plan --model DIR`, which reads the shape and builds the model on the meta device.

    python scripts/llama3_8b_shape.py /tmp/llama3-8b-shape
    cephalo plan --cluster rtx3090,rtx3060 --model /tmp/llama3-8b-shape --global-batch 16 \\
        --seq-len 1024 --dtype bf16 --adapter qlora

The numbers are those of meta-llama/Meta-Llama-3-8B's published config.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(LLAMA3_8B, indent=2) + "\n")
    print(f"wrote {out / 'config.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
