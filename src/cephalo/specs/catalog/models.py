"""Built-in model shapes (`MODELS`: the models the Cephalo authors measured): layers, hidden size,
heads, vocabulary, FFN width, and the parameter counts derived from a shape (one function per
family, checked against the published totals in the tests)."""

from __future__ import annotations

from dataclasses import dataclass

from cephalo.errors import CephaloError
from cephalo.specs.adapter import default_block_linears
from cephalo.specs.catalog.devices import _suggest
from cephalo.specs.model import ModelSpec


# ------------------------------------------------------------------------------- models
@dataclass(frozen=True)
class ModelShape:
    """A built-in model's architecture, as far as the cost model needs it."""

    name: str
    arch: str
    num_layers: int
    hidden_size: int
    num_heads: int
    ffn_hidden_size: int
    vocab_size: int
    """Vocabulary (classes for ViT)."""
    data_keys: tuple[str, ...]
    """The published data's keys for this model, in order of preference (the first is the
    one whose measurements win when two keys measured the same thing)."""
    num_kv_heads: int | None = None
    """Grouped-query attention (Mistral); None = one K/V head per query head."""
    max_seq_len: int = 2048
    extra_aliases: tuple[str, ...] = ()
    fallback_keys: tuple[str, ...] = ()
    """Keys of a model with the SAME layer shape whose measurements stand in when this one
    has none (Llama 2 layers are Llama layers)."""


# ViT: the authors' ViTs take 224x224 images in 16x16 patches (196 patches + a class token)
# and classify 10 classes; this reproduces their published parameter totals exactly.
VIT_PATCH, VIT_TOKENS, VIT_CHANNELS = 16, 197, 3


MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in [
        ModelShape("gpt-test", "gpt", 12, 512, 8, 2048, 50257, ("deepspeedgpt_test",)),
        ModelShape("gpt-1.3b", "gpt", 24, 2048, 16, 8192, 50257, ("deepspeedgpt_1.3b", "gpt_1.3b")),
        ModelShape(
            "gpt-2.7b", "gpt", 32, 2560, 32, 10240, 50257, ("deepspeedgpt_2.7b", "gpt_2.7b")
        ),
        ModelShape(
            "gpt-6.7b", "gpt", 32, 4096, 32, 16384, 50257, ("deepspeedgpt_6.7b", "gpt_6.7b")
        ),
        ModelShape("gpt-175b", "gpt", 96, 12288, 96, 49152, 50257, ("deepspeedgpt_175b",)),
        ModelShape(
            "llama-1.1b",
            "llama",
            22,
            2048,
            32,
            5632,
            32000,
            ("deepspeedllama_tiny",),
            extra_aliases=("llama-tiny", "tinyllama"),
        ),
        ModelShape("llama-3b", "llama", 26, 3200, 32, 8640, 32000, ("deepspeedllama_3b",)),
        ModelShape("llama-7b", "llama", 32, 4096, 32, 11008, 32000, ("deepspeedllama_7b",)),
        ModelShape("llama-13b", "llama", 40, 5120, 40, 13824, 32000, ("deepspeedllama_13b",)),
        ModelShape(
            "llama-33b",
            "llama",
            60,
            6656,
            52,
            17920,
            32000,
            ("deepspeedllama_33b",),
            extra_aliases=("llama-30b",),
        ),
        ModelShape("llama-65b", "llama", 80, 8192, 64, 22016, 32000, ("deepspeedllama_65b",)),
        ModelShape(
            "llama2-1.1b",
            "llama",
            22,
            2048,
            32,
            5632,
            32000,
            ("deepspeedllamav2_tiny",),
            max_seq_len=4096,
            extra_aliases=("llama2-tiny",),
            fallback_keys=("deepspeedllama_tiny",),
        ),
        ModelShape(
            "llama2-3b",
            "llama",
            26,
            3200,
            32,
            8640,
            32000,
            ("deepspeedllamav2_3b",),
            max_seq_len=4096,
            fallback_keys=("deepspeedllama_3b",),
        ),
        ModelShape(
            "llama2-7b",
            "llama",
            32,
            4096,
            32,
            11008,
            32000,
            ("deepspeedllamav2_7b",),
            max_seq_len=4096,
            fallback_keys=("deepspeedllama_7b",),
        ),
        ModelShape(
            "llama2-13b",
            "llama",
            40,
            5120,
            40,
            13824,
            32000,
            ("deepspeedllamav2_13b",),
            max_seq_len=4096,
            fallback_keys=("deepspeedllama_13b",),
        ),
        ModelShape(
            "mistral-7b",
            "mistral",
            32,
            4096,
            32,
            14336,
            32000,
            ("deepspeedmistral_7b", "mistral_7b"),
            num_kv_heads=8,
            max_seq_len=8192,
        ),
        ModelShape(
            "bert-base", "bert", 12, 768, 12, 3072, 30522, ("deepspeedbert_base",), max_seq_len=512
        ),
        ModelShape(
            "bert-large",
            "bert",
            24,
            1024,
            16,
            4096,
            30522,
            ("deepspeedbert_large", "bert_large"),
            max_seq_len=512,
        ),
        ModelShape(
            "bert-xlarge",
            "bert",
            36,
            1536,
            24,
            6144,
            30522,
            ("deepspeedbert_xlarge", "bert_xlarge"),
            max_seq_len=512,
        ),
        ModelShape(
            "vit-h", "vit", 32, 1280, 16, 5120, 10, ("deepspeedvit_h",), max_seq_len=VIT_TOKENS
        ),
        ModelShape(
            "vit-g",
            "vit",
            48,
            1664,
            16,
            8192,
            10,
            ("deepspeedvit_g", "vit_g"),
            max_seq_len=VIT_TOKENS,
        ),
        ModelShape(
            "vit-e",
            "vit",
            56,
            1792,
            16,
            15360,
            10,
            ("deepspeedvit_e", "vit_e"),
            max_seq_len=VIT_TOKENS,
        ),
    ]
}


def block_params(s: ModelShape) -> int:
    """Parameters of one Transformer block (weights + biases + norms), by family.

    gpt/bert: QKV+O (4h^2 + 4h), MLP (2*h*f + f + h), two LayerNorms (4h).
    llama/mistral: Q,O (2h^2) + K,V (2*h*h_kv), SwiGLU MLP (3*h*f), two RMSNorms (2h), no biases.
    vit: as gpt/bert with its own MLP width.
    """
    h, f = s.hidden_size, s.ffn_hidden_size
    if s.arch in ("llama", "mistral"):
        kv = h * (s.num_kv_heads or s.num_heads) // s.num_heads
        return 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
    return 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h


def embedding_params(s: ModelShape) -> int:
    """Parameters of the embedding unit.

    gpt: token (V*h) + learned positions (max_seq*h). llama/mistral: token (V*h).
    bert: token + positions (512) + token types (2) + LayerNorm (2h).
    vit: patch projection (3*16*16*h + h) + class token (h) + positions (197*h).
    """
    h, v = s.hidden_size, s.vocab_size
    if s.arch == "gpt":
        return v * h + s.max_seq_len * h
    if s.arch in ("llama", "mistral"):
        return v * h
    if s.arch == "bert":
        return v * h + s.max_seq_len * h + 2 * h + 2 * h
    if s.arch == "vit":
        return VIT_CHANNELS * VIT_PATCH * VIT_PATCH * h + h + h + VIT_TOKENS * h
    raise ValueError(s.arch)


def head_params(s: ModelShape) -> int:
    """Parameters the head owns.

    gpt: final LayerNorm (2h) + untied output projection (V*h): the authors' GPTs keep a
    separate output matrix (their totals hold two vocabulary-sized matrices).
    llama/mistral: final RMSNorm (h) + untied output projection (V*h).
    bert: pooler (h^2 + h) + MLM transform (h^2 + h + 2h) + decoder bias (V); the decoder
    weight is tied to the token embedding.
    vit: final LayerNorm (2h) + classifier (h*C + C).
    """
    h, v = s.hidden_size, s.vocab_size
    if s.arch == "gpt":
        return 2 * h + v * h
    if s.arch in ("llama", "mistral"):
        return h + v * h
    if s.arch == "bert":
        return (h * h + h) + (h * h + h + 2 * h) + v
    if s.arch == "vit":
        return 2 * h + h * v + v
    raise ValueError(s.arch)


def _model_spec(s: ModelShape) -> ModelSpec:
    return ModelSpec(
        name=s.name,
        arch=s.arch,
        num_layers=s.num_layers,
        hidden_size=s.hidden_size,
        num_heads=s.num_heads,
        vocab_size=s.vocab_size,
        ffn_hidden_size=s.ffn_hidden_size,
        params_per_block=block_params(s),
        embedding_params=embedding_params(s),
        head_params=head_params(s),
        tied_embeddings=s.arch == "bert",
        max_seq_len=s.max_seq_len,
        aliases=(*s.extra_aliases, *s.data_keys),
        block_linears=default_block_linears(
            s.arch, s.hidden_size, s.ffn_hidden_size, s.num_heads, s.num_kv_heads
        ),
    )


def _model_alias_table() -> dict[str, str]:
    table: dict[str, str] = {}
    for s in MODELS.values():
        for name in (s.name, *s.extra_aliases, *s.data_keys):
            table[name.lower()] = s.name
    return table


MODEL_ALIASES = _model_alias_table()


def list_models() -> list[ModelSpec]:
    """Every built-in model, in catalog order."""
    return [_model_spec(s) for s in MODELS.values()]


def model_shape(name: str) -> ModelShape:
    key = MODEL_ALIASES.get(name.strip().lower().replace("_", "-")) or MODEL_ALIASES.get(
        name.strip().lower()
    )
    if key is None:
        raise CephaloError(
            f"unknown model {name!r}.{_suggest(name, MODEL_ALIASES)} Known models: {', '.join(MODELS)}"
        )
    return MODELS[key]


def get_model_spec(name: str) -> ModelSpec:
    """A built-in model by friendly name (`gpt-2.7b`) or published key (`deepspeedgpt_2.7b`)."""
    return _model_spec(model_shape(name))
