"""The data a job trains on: its `[data]` as a dataset directory (text prepared by
`text.resolve_dataset`, chat and prompt-completion files rendered once by
`chat_data.prepare_chat_dataset`, preference pairs by `preference.data`), and that dataset's
plan-invariant batches (`batches.Batches`: `GlobalBatches` for text, `DocumentBatches` for
chat, `PreferenceBatches` for preference pairs)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from cephalo.data.batches import Batches, GlobalBatches
from cephalo.data.chat import (
    detect_inputs_format,
)
from cephalo.data.chat_data import DocumentBatches, is_chat_dataset, prepare_chat_dataset
from cephalo.data.hf_tokenizer import tokenizer_fingerprint
from cephalo.data.text import (
    DEFAULT_VAL_FRACTION,
    default_cache_dir,
    resolve_dataset,
    resolve_tokenizer,
)
from cephalo.errors import CephaloError
from cephalo.preference.data import (
    PreferenceBatches,
    check_preference_loss_on,
    is_preference_dataset,
    prepare_preference_dataset,
)


# ----------------------------------------------------------------------------- a job's dataset
def resolve_job_dataset(
    path: str | Path | None,
    tokenizer: str,
    vocab_size: int,
    *,
    fmt: str = "auto",
    loss_on: str = "auto",
    chat_template: str | None = None,
    cache_dir: str | Path | None = None,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    progress: bool = False,
    model_name: str | None = None,
    text_field: str = "text",
) -> Path:
    """A job's `[data]` as a dataset directory: text through `data.resolve_dataset`, chat and
    prompt-completion files rendered once into the cache (`prepare_chat_dataset`), preference
    pairs too (`prepare_preference_dataset`)."""
    if path is not None and is_preference_dataset(path):
        return Path(path)
    if path is None or is_chat_dataset(path) or Path(path).suffix in (".bin", ".json"):
        return resolve_dataset(
            path, tokenizer, vocab_size, cache_dir, val_fraction, progress, model_name, text_field
        )
    if (Path(path) / "train.json").is_file():  # a prepared text dataset
        return resolve_dataset(
            path, tokenizer, vocab_size, cache_dir, val_fraction, progress, model_name, text_field
        )
    fmt = detect_inputs_format([path], fmt)
    if fmt == "text":
        return resolve_dataset(
            path, tokenizer, vocab_size, cache_dir, val_fraction, progress, model_name, text_field
        )
    spec = resolve_tokenizer(tokenizer, model_name)
    if spec is None or not Path(spec).is_dir():
        raise CephaloError(
            f"{path} holds {fmt} records, which need a model's tokenizer with a chat template: "
            f"set model.name to a model directory with data.tokenizer = auto, or data.tokenizer "
            f"to a tokenizer directory (got {tokenizer!r})"
        )
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    where = f"{Path(path).resolve()}\0{fmt}\0{loss_on}\0{chat_template or ''}"
    name = f"{Path(path).name}-{hashlib.sha256(where.encode()).hexdigest()[:8]}"
    kind = "preference" if fmt == "preference" else "chat"
    out_dir = cache / f"{name}-{kind}-hf-{tokenizer_fingerprint(spec)}-val{val_fraction:g}"
    if fmt == "preference":
        check_preference_loss_on(loss_on)
        return prepare_preference_dataset(
            [path],
            out_dir,
            spec,
            fmt,
            chat_template,
            val_fraction,
            progress=progress,
            max_vocab_size=vocab_size,
            model=f"model {model_name}" if model_name else "the model",
        ).path
    return prepare_chat_dataset(
        [path],
        out_dir,
        spec,
        fmt,
        loss_on,
        chat_template,
        val_fraction,
        progress=progress,
        max_vocab_size=vocab_size,
        model=f"model {model_name}" if model_name else "the model",
    ).path


def open_batches(
    path: str | Path,
    seq_len: int,
    global_batch_size: int,
    seed: int = 0,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    model_vocab_size: int | None = None,
    packing: bool = False,
    packing_split: bool = False,
    max_prompt_len: int | None = None,
) -> Batches:
    """The batches of a dataset: `PreferenceBatches` for a preference dataset,
    `DocumentBatches` for a chat dataset, else `GlobalBatches`."""
    if is_preference_dataset(path):
        if packing:
            raise CephaloError(
                f"data.packing packs chat documents; {path} holds preference pairs, each pair "
                f"two rows of its own (a chosen and a rejected): set data.packing = false"
            )
        return PreferenceBatches(
            path, seq_len, global_batch_size, seed, model_vocab_size, max_prompt_len
        )
    if max_prompt_len is not None:
        raise CephaloError(
            f"data.max_prompt_len truncates the prompts of preference pairs; {path} holds no "
            f"preference pairs: leave data.max_prompt_len unset"
        )
    if is_chat_dataset(path):
        return DocumentBatches(
            path, seq_len, global_batch_size, seed, model_vocab_size, packing, packing_split
        )
    if packing:
        raise CephaloError(
            f"data.packing packs documents of a chat dataset; {path} is a text dataset, whose "
            f"samples are already full windows: set data.packing = false"
        )
    return GlobalBatches(path, seq_len, global_batch_size, seed, val_fraction, model_vocab_size)
