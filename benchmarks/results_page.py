"""docs/results.md, the page that says what peagle does today, from the benchmark JSONs under docs/results/.

    python benchmarks/results_page.py            # rewrites docs/results.md
    python benchmarks/results_page.py --check    # exits 1 when docs/results.md is not what the JSONs give

The README's results table comes from the same run: `--readme` prints it. Which runs the page reports, with their
dates and heads: `peagle.evaluation.results_page.SOURCES`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from peagle.evaluation.results_page import readme_table, render

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--results", default=str(ROOT / "docs" / "results"), help="folder of the benchmark JSONs"
    )
    parser.add_argument("--out", default=str(ROOT / "docs" / "results.md"), help="the page to write")
    parser.add_argument("--check", action="store_true", help="compare with the page instead of writing it")
    parser.add_argument("--readme", action="store_true", help="print the README's results table")
    args = parser.parse_args(argv)
    if args.readme:
        print(readme_table(args.results), end="")
        return 0
    text = render(args.results)
    out = Path(args.out)
    if args.check:
        same = out.is_file() and out.read_text(encoding="utf-8") == text
        print(f"{out.name} is {'up to date' if same else 'stale: run python benchmarks/results_page.py'}")
        return 0 if same else 1
    out.write_text(text, encoding="utf-8")
    print(f"wrote {out.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
