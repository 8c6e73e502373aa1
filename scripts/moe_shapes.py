"""Write `config.json` files shaped like Qwen3-30B-A3B and gpt-oss-20b (no weights, no
tokenizer): enough for `cephalo plan --model DIR`, which builds the model on the meta device.

    python scripts/moe_shapes.py /tmp/moe-shapes
    cephalo plan --cluster 2xl4,a6000,p40 --model /tmp/moe-shapes/qwen3-30b-a3b \\
        --global-batch 8 --dtype bf16 --adapter lora

The numbers are those of the published config.json files (Qwen/Qwen3-30B-A3B,
openai/gpt-oss-20b; gpt-oss without its MXFP4 quantization_config: the bf16 release).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
    "torch_dtype": "bfloat16",
}

GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.9,
    "torch_dtype": "bfloat16",
}

SHAPES = {"qwen3-30b-a3b": QWEN3_30B_A3B, "gpt-oss-20b": GPT_OSS_20B}


def write(out: Path) -> list[Path]:
    written = []
    for name, config in SHAPES.items():
        directory = out / name
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        written.append(directory)
    return written


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    for directory in write(Path(sys.argv[1])):
        print(directory)
