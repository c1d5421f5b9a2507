"""Average the weights of heads trained side by side from one starting head (peagle.training.average_heads).

    python scripts/average_heads.py runs/stage16A runs/stage16B --out runs/stage16-avg
    python scripts/average_heads.py --chain STAGE21 STAGE22 STAGE23 --out runs/stage23-chain3

The result's train_summary.json counts every arm's token-passes and CPU time; with `--chain` the heads are
successive stages of one chain, oldest first, and the result's budget is the newest stage's.  Calibrate it before
shipping.
"""

from __future__ import annotations

import argparse

from peagle.training import average_heads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("heads", nargs="+", help="peagle-layout head folders from one starting head")
    ap.add_argument("--out", required=True)
    ap.add_argument("--weights", default=None, help="comma-separated weights, one per head (default: equal)")
    ap.add_argument(
        "--chain",
        action="store_true",
        help="the heads are successive stages of one chain, oldest first (the budget is the newest's)",
    )
    args = ap.parse_args()
    weights = [float(w) for w in args.weights.split(",")] if args.weights else None
    print(f"wrote {average_heads(args.heads, args.out, weights, chain=args.chain)}")


if __name__ == "__main__":
    main()
