"""Write docs/config.md from the config dataclasses (their field docstrings are the source).

python scripts/gen_config_docs.py           # rewrite docs/config.md
python scripts/gen_config_docs.py --check   # exit 1 if docs/config.md is stale (CI, tests)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cephalo.train.config_manager import config_markdown

DOC_PATH = Path(__file__).resolve().parent.parent / "docs" / "config.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--check", action="store_true", help="only check that the file is up to date"
    )
    args = parser.parse_args(argv)
    text = config_markdown()
    if args.check:
        if not DOC_PATH.is_file() or DOC_PATH.read_text() != text:
            print(f"{DOC_PATH} is stale: run python scripts/gen_config_docs.py", file=sys.stderr)
            return 1
        return 0
    DOC_PATH.write_text(text)
    print(f"wrote {DOC_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
