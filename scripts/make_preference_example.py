"""Write a small preference dataset and a tiny chat model directory (no download), for the
README's "Preference tuning (DPO)":

    python scripts/make_preference_example.py data/preference-example        # 2000 pairs
    -> data/preference-example/preference.jsonl (TRL's conversational prompt/chosen/rejected),
       data/preference-example/qwen-tiny/ (config, tokenizer, chat template)

The pairs are the chat example's conversations: chosen = the real last answer, rejected = an
unhelpful reply or another conversation's answer (cephalo.preference.example).
"""

from __future__ import annotations

import argparse

from cephalo.preference.example import write_preference_example


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out_dir", help="directory to write")
    parser.add_argument("--pairs", type=int, default=2000, help="how many (default 2000)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    example = write_preference_example(args.out_dir, args.pairs, args.seed)
    print(f"wrote {example.jsonl} ({args.pairs} pairs) and {example.model}/")


if __name__ == "__main__":
    main()
