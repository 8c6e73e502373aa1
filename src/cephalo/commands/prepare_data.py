"""`cephalo prepare-data`: tokenize text files into a token dataset (train / val splits)."""

from __future__ import annotations

import argparse

from rich.console import Console

from cephalo.train.data import (
    DEFAULT_VAL_FRACTION,
    DEFAULT_VOCAB_SIZE,
    default_corpus,
    prepare_dataset,
    read_documents,
)
from cephalo.train.tokenizer import BYTE_TOKENIZER

EPILOG = """\
examples:
  cephalo prepare-data --input notes/ book.txt --output data/mine
  cephalo prepare-data --input corpus/ --output data/bytes --tokenizer byte
  cephalo prepare-data --default --output data/pydoc --vocab-size 512

The output directory holds train.bin/.json, val.bin/.json and tokenizer.json; point a
config's data path at it. Format: docs/data.md.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "prepare-data",
        help="tokenize text files into a token dataset",
        description=__doc__.split(":", 1)[1].strip(),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--input",
        nargs="+",
        metavar="PATH",
        help="text files, or directories searched for *.txt and *.md (recursively, sorted)",
    )
    src.add_argument(
        "--default",
        action="store_true",
        help="the bundled corpus (Python's help topics, pydoc_data.topics; no download)",
    )
    p.add_argument("--output", required=True, metavar="DIR", help="dataset directory to write")
    p.add_argument(
        "--vocab-size",
        type=int,
        default=DEFAULT_VOCAB_SIZE,
        metavar="N",
        help=f"vocab of the BPE trained on the input (default {DEFAULT_VOCAB_SIZE}; 256 = bytes)",
    )
    p.add_argument(
        "--tokenizer",
        metavar="PATH|byte",
        help=f"reuse a tokenizer JSON instead of training one, or `{BYTE_TOKENIZER}` for raw bytes",
    )
    p.add_argument(
        "--val-fraction",
        type=float,
        default=DEFAULT_VAL_FRACTION,
        metavar="F",
        help=f"fraction of the tokens held out for validation (default {DEFAULT_VAL_FRACTION})",
    )
    p.add_argument(
        "--force", action="store_true", help="rebuild even if an identical dataset is there"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    documents = default_corpus() if args.default else read_documents(args.input)
    console = Console()
    result = prepare_dataset(
        documents,
        args.output,
        vocab_size=args.vocab_size,
        tokenizer=args.tokenizer,
        val_fraction=args.val_fraction,
        progress=console.is_terminal,
        force=args.force,
    )
    status = "up to date" if result.cached else f"written in {result.seconds:.1f}s"
    console.print(
        f"[bold]{result.path}[/bold] {status}: {len(documents)} documents -> "
        f"{result.train.num_tokens:,} train + {result.val.num_tokens:,} val tokens "
        f"({result.train.dtype}, vocab {result.train.vocab_size}, tokenizer "
        f"{result.train.tokenizer_key})",
        highlight=False,
    )
    return 0
