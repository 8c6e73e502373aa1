"""`cephalo prepare-data`: tokenize text, JSON Lines, Parquet or a datasets directory into a token dataset (train / val splits)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from cephalo.data.chat import FORMATS, LOSS_ON, detect_inputs_format
from cephalo.data.chat_data import DocumentBatches, prepare_chat_dataset
from cephalo.data.corpus import DEFAULT_TEXT_FIELD, Corpus
from cephalo.data.hf_tokenizer import declared_vocab_size
from cephalo.data.text import DEFAULT_VAL_FRACTION, DEFAULT_VOCAB_SIZE, prepare_dataset
from cephalo.data.tokenizer import BYTE_TOKENIZER
from cephalo.errors import CephaloError
from cephalo.preference.data import (
    PreferenceBatches,
    check_preference_loss_on,
    prepare_preference_dataset,
)

EPILOG = """\
inputs (read as a stream: memory stays bounded, whatever the size):
  *.txt *.md           one document per file
  *.jsonl *.ndjson     one document per line: the record's --text-field (default "text")
  *.parquet            one document per row of the --text-field column (needs cephalo[data])
  a datasets dir       written by Dataset.save_to_disk (its 'train' split for a DatasetDict);
                       one document per row of the --text-field column (needs cephalo[data])
  a directory          searched recursively for the suffixes above, sorted by path

examples:
  # text and markdown, a BPE of 2048 ids trained on them
  cephalo prepare-data --input notes/ book.txt --output data/mine
  # JSON Lines whose text is in the field "content"
  cephalo prepare-data --input corpus.jsonl --text-field content --output data/jsonl
  # a directory of Parquet shards, with the tokenizer of a model saved by save_pretrained
  cephalo prepare-data --input shards/ --output data/pq --tokenizer ~/models/qwen2-0.5b
  # a directory written by datasets' save_to_disk, same tokenizer
  cephalo prepare-data --input ~/hf/my_dataset --output data/ds --tokenizer ~/models/qwen2-0.5b
  # raw bytes (vocab 256), or the bundled corpus (no download)
  cephalo prepare-data --input corpus/ --output data/bytes --tokenizer byte
  cephalo prepare-data --default --output data/pydoc --vocab-size 512

chat data (detected per file, or --format):
  {"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}]}   conversations
  {"prompt": ..., "completion": ...}         prompt-completion (strings or lists of messages)
  rendered with the tokenizer's chat template (--chat-template for one that has none); the
  loss mask (--loss-on) is stored with the tokens. --seq-len N reports the samples it makes:
  cephalo prepare-data --input chat.jsonl --output data/chat --tokenizer MODEL_DIR --seq-len 512

preference pairs (TRL's formats, detected by their 'chosen' and 'rejected', or --format):
  {"prompt": [messages], "chosen": [assistant messages], "rejected": [...]}    conversational
  {"prompt": "...", "chosen": "...", "rejected": "..."}                         standard
  rendered as TRL's DPOTrainer renders them (docs/data.md, "Preference data"); --seq-len N
  (and --max-prompt-len M) reports the pairs truncated and dropped at that length:
  cephalo prepare-data --input pairs.jsonl --output data/pairs --tokenizer MODEL_DIR --seq-len 512

--tokenizer MODEL_DIR uses the model's own tokenizer (tokenizer.json / tokenizer_config.json,
local files only) and puts its EOS token between documents; a tokenizer with more ids than
the directory's config.json vocab_size is refused. The output directory holds train.bin/.json,
val.bin/.json and the tokenizer; point a config's data.path at it. Format: docs/data.md.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "prepare-data",
        help="tokenize text, JSON Lines, Parquet or a datasets directory into a token dataset",
        description=__doc__.split(":", 1)[1].strip(),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--input",
        nargs="+",
        metavar="PATH",
        help="files (text, .jsonl, .parquet), datasets directories, or directories to search",
    )
    src.add_argument(
        "--default",
        action="store_true",
        help="the bundled corpus (Python's help topics, pydoc_data.topics; no download)",
    )
    p.add_argument("--output", required=True, metavar="DIR", help="dataset directory to write")
    p.add_argument(
        "--text-field",
        default=DEFAULT_TEXT_FIELD,
        metavar="NAME",
        help=f"JSON field / column holding the text (default {DEFAULT_TEXT_FIELD!r})",
    )
    p.add_argument(
        "--tokenizer",
        metavar="DIR|JSON|byte",
        help="a model or tokenizer directory (its own tokenizer, EOS between documents), a "
        f"tokenizer JSON, or `{BYTE_TOKENIZER}` for raw bytes; default: train a BPE on the input",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=DEFAULT_VOCAB_SIZE,
        metavar="N",
        help=f"vocab of the BPE trained on the input (default {DEFAULT_VOCAB_SIZE}; 256 = bytes)",
    )
    p.add_argument(
        "--val-fraction",
        type=float,
        default=DEFAULT_VAL_FRACTION,
        metavar="F",
        help=f"fraction of the tokens held out for validation (default {DEFAULT_VAL_FRACTION})",
    )
    p.add_argument(
        "--format",
        choices=FORMATS,
        default="auto",
        help="text, chat (messages), prompt_completion or preference (chosen/rejected); auto: "
        "detected per file (data.format)",
    )
    p.add_argument(
        "--loss-on",
        choices=LOSS_ON,
        default="auto",
        help="chat data's loss tokens: assistant, completion or all; auto: assistant for "
        "conversations, completion for prompt-completion (data.loss_on)",
    )
    p.add_argument(
        "--chat-template",
        metavar="FILE|JINJA",
        help="a Jinja chat template (file or string) for a tokenizer without one (data.chat_template)",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        metavar="N",
        help="chat data: also report the samples of N tokens it makes, padded and packed",
    )
    p.add_argument(
        "--max-prompt-len",
        type=int,
        metavar="M",
        help="preference data, with --seq-len: keep each prompt's last M tokens in the report "
        "(data.max_prompt_len)",
    )
    p.add_argument(
        "--force", action="store_true", help="rebuild even if an identical dataset is there"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    fmt = "text" if args.default else detect_inputs_format(args.input, args.format)
    if fmt == "preference":
        return _run_preference(args, fmt)
    if args.max_prompt_len is not None:
        raise CephaloError(
            f"--max-prompt-len truncates the prompts of preference pairs; the inputs hold {fmt}"
        )
    if fmt != "text":
        return _run_chat(args, fmt)
    corpus = Corpus.bundled() if args.default else Corpus.from_paths(args.input, args.text_field)
    tokenizer_dir = (
        Path(args.tokenizer) if args.tokenizer and Path(args.tokenizer).is_dir() else None
    )
    console = Console()
    result = prepare_dataset(
        corpus,
        args.output,
        vocab_size=args.vocab_size,
        tokenizer=args.tokenizer,
        val_fraction=args.val_fraction,
        progress=console.is_terminal,
        force=args.force,
        max_vocab_size=declared_vocab_size(tokenizer_dir) if tokenizer_dir else None,
        model=f"{tokenizer_dir}/config.json",
    )
    status = "up to date" if result.cached else f"written in {result.seconds:.1f}s"
    console.print(
        f"[bold]{result.path}[/bold] {status}: {result.train.num_documents:,} documents -> "
        f"{result.train.num_tokens:,} train + {result.val.num_tokens:,} val tokens "
        f"({result.train.dtype}, vocab {result.train.vocab_size}, tokenizer "
        f"{result.train.tokenizer_key})",
        highlight=False,
    )
    return 0


def _run_chat(args: argparse.Namespace, fmt: str) -> int:
    tokenizer_dir = Path(args.tokenizer) if args.tokenizer else None
    console = Console()
    result = prepare_chat_dataset(
        args.input,
        args.output,
        args.tokenizer or "",
        fmt,
        args.loss_on,
        args.chat_template,
        args.val_fraction,
        progress=console.is_terminal,
        force=args.force,
        max_vocab_size=declared_vocab_size(tokenizer_dir) if tokenizer_dir else None,
        model=f"{tokenizer_dir}/config.json",
    )
    s, m = result.meta.stats, result.meta
    status = "up to date" if result.cached else f"written in {result.seconds:.1f}s"
    console.print(
        f"[bold]{result.path}[/bold] {status}: {s.conversations:,} {fmt} records -> "
        f"{s.documents:,} documents ({s.dropped:,} dropped: no loss token), {s.tokens:,} tokens, "
        f"{s.loss_tokens:,} loss tokens (loss on {m.loss_on})",
        highlight=False,
    )
    if args.seq_len:
        for packing in (False, True):
            b = DocumentBatches(result.path, args.seq_len, 1, packing=packing)
            t = b.train.stats
            how = "packed windows" if packing else "padded samples "
            console.print(
                f"  seq_len {args.seq_len}, {how}: {t.samples:,} samples, {t.truncated:,} "
                f"truncated, {t.dropped:,} dropped, {t.loss_tokens:,} loss tokens, padding "
                f"{t.padding_fraction:.1%}",
                highlight=False,
            )
    return 0


def _run_preference(args: argparse.Namespace, fmt: str) -> int:
    check_preference_loss_on(args.loss_on)
    tokenizer_dir = Path(args.tokenizer) if args.tokenizer else None
    console = Console()
    result = prepare_preference_dataset(
        args.input,
        args.output,
        args.tokenizer or "",
        fmt,
        args.chat_template,
        args.val_fraction,
        progress=console.is_terminal,
        force=args.force,
        max_vocab_size=declared_vocab_size(tokenizer_dir) if tokenizer_dir else None,
        model=f"{tokenizer_dir}/config.json",
    )
    s, m = result.meta.stats, result.meta
    status = "up to date" if result.cached else f"written in {result.seconds:.1f}s"
    console.print(
        f"[bold]{result.path}[/bold] {status}: {s.pairs:,} {m.kind} preference pairs, "
        f"{s.tokens:,} tokens ({s.completion_tokens:,} in completions)",
        highlight=False,
    )
    if args.seq_len:
        b = PreferenceBatches(result.path, args.seq_len, 1, max_prompt_len=args.max_prompt_len)
        for split, stats in (("train", b.train.stats), ("val", b.val.stats)):
            console.print(
                f"  seq_len {args.seq_len}, {split}: {stats.pairs:,} pairs, {stats.truncated:,} "
                f"truncated, {stats.dropped:,} dropped (the prompt fills seq_len), "
                f"{stats.completion_tokens:,} completion tokens, padding "
                f"{stats.padding_fraction:.1%}",
                highlight=False,
            )
    return 0
