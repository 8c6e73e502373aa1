"""Write a small chat dataset and a tiny chat model directory (no download), for the README's
"Fine-tune on chat data":

    python scripts/make_chat_example.py examples/chat          # 2000 conversations
    -> examples/chat/chat.jsonl, examples/chat/qwen-tiny/ (config, tokenizer, chat template)
"""

from __future__ import annotations

import argparse

from cephalo.data.chat_example import write_chat_example


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out_dir", help="directory to write")
    parser.add_argument("--conversations", type=int, default=2000, help="how many (default 2000)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    example = write_chat_example(args.out_dir, args.conversations, args.seed)
    print(f"wrote {example.jsonl} ({args.conversations} conversations) and {example.model}/")


if __name__ == "__main__":
    main()
