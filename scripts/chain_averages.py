"""Collect a stage's chain averages and their walks into one record (docs/results/stageNN/chain_averages.json).

A stage ends with a few weight averages of its arms and earlier stages (scripts/average_heads.py --chain), walked
by scripts/scaling_curve.py --measure decoded, often split over the two cores into two result files.  This
script reads those result files and each average's train_summary.json (which records the members and their
weights), checks that every walk point was measured on the weights its folder holds now, and writes one record:
each average's members, weights, budget, walk and per-set walks, next to the heads it is compared with.

    python scripts/chain_averages.py --walks runs/scaling-27.json runs/probe27.json \
        --averages runs/stage27-chain2 runs/stage27-chain2w runs/stage27-chain3 \
        --compare heads/smollm2-135m-peagle-stage24 runs/stage27-avg \
        --label runs/old/stage23=git:9d5b860:heads/smollm2-135m-peagle-stage23 \
        --kept "none: no average beat stage 24's walk" --out docs/results/stage27/chain_averages.json

`--label FOLDER=LABEL` names a member or compared folder by the label under which it is kept (e.g. a stage that
left heads/ for a local copy, named by its commit); `--relabel OLD=NEW` renames an average itself (e.g. the one
kept as the stage's head under heads/).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from scaling_curve import MEASURES, relabel_points, split_spec, weights_fingerprint

from peagle.training.merge import SUMMARY

WALK = MEASURES["decoded"]
SHARED_SETTINGS = ("heldout", "num_speculative_tokens", "max_new_tokens", "head_dtype", "measure")


def load_walks(paths: list[str]) -> tuple[dict, dict[str, dict]]:
    """The shared settings of several walk results and their points by head label.  Raises ValueError when
    the results were measured differently (other held-out sets, K, length, dtype or measure) or when two of
    them hold a point of the same head with different numbers."""
    settings: dict | None = None
    points: dict[str, dict] = {}
    for path in paths:
        result = json.loads(Path(path).read_text())
        own = {k: result["settings"].get(k) for k in SHARED_SETTINGS}
        if own["measure"] != "decoded":
            raise ValueError(f"{path}: not a decoding walk (--measure decoded), measure {own['measure']}")
        if settings is None:
            settings = own
        elif own != settings:
            differ = [k for k in SHARED_SETTINGS if own[k] != settings[k]]
            raise ValueError(f"{path} was measured with other settings than {paths[0]}: {', '.join(differ)}")
        for point in result["points"]:
            seen = points.get(point["head"])
            if seen is not None and seen[WALK] != point[WALK]:
                raise ValueError(f"{point['head']} has two different walks in the results given")
            points[point["head"]] = point
    if settings is None:
        raise ValueError("no walk results given")
    return settings, points


def member_name(folder: str, labels: dict[str, str]) -> str:
    """A chain member as the record names it: its --label, else its folder, with the arms it averages where it
    is an average of arms trained side by side."""
    if folder in labels:
        return labels[folder]
    path = Path(folder) / SUMMARY
    arms = json.loads(path.read_text()).get("merged_from") if path.is_file() else None
    return f"{folder} (average of {', '.join(arms)})" if arms else folder


def measured_point(head: str, points: dict[str, dict]) -> dict:
    """The walk point of `head`, refused with ValueError if there is none or if the folder now holds other
    weights than the ones the point measured."""
    if head not in points:
        raise ValueError(f"{head}: no walk of it in the results given")
    point = points[head]
    now = weights_fingerprint(head)
    if now is not None and point.get("weights_sha256") not in (None, now):
        raise ValueError(f"{head} holds other weights than its walk point measured")
    return point


def chain_record(
    walks: list[str],
    averages: list[str],
    compare: list[str],
    labels: list[str],
    relabels: list[str],
    kept: str,
) -> dict:
    """The chain_averages.json record (see the module docstring)."""
    settings, points = load_walks(walks)
    label_of = dict(split_spec("--label", spec, "FOLDER=LABEL") for spec in labels)
    rows = []
    for head in averages:
        summary = json.loads((Path(head) / SUMMARY).read_text())
        chain = summary.get("chain_average")
        if not chain or "from" not in chain:
            raise ValueError(
                f"{head}: its {SUMMARY} records no chain average (scripts/average_heads.py --chain)"
            )
        point = measured_point(head, points)
        row = {"head": head, "chain_of": [member_name(m, label_of) for m in chain["from"]]}
        if chain.get("weights"):
            row["weights"] = chain["weights"]
        row.update(
            token_passes=point["token_passes"],
            walk=point[WALK],
            per_set={k: v[WALK] for k, v in point["per_set"].items()},
            weights_sha256=point.get("weights_sha256"),
        )
        rows.append(row)
    rows = relabel_points(rows, relabels)
    return {
        "what": "decoding walk of chain averages (scripts/average_heads.py --chain), equal weights unless a point "
        "lists its own; the newest member's budget",
        "settings": settings,
        "compare": {label_of.get(h, h): round(measured_point(h, points)[WALK], 4) for h in compare},
        "points": rows,
        "kept": kept,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--walks", nargs="+", required=True, help="scaling_curve.py --measure decoded results")
    ap.add_argument("--averages", nargs="+", required=True, help="chain-average head folders, as walked")
    ap.add_argument("--compare", nargs="*", default=[], help="heads (walked) to list beside the averages")
    ap.add_argument(
        "--label",
        action="append",
        default=[],
        help="FOLDER=LABEL: a member's or compared head's name in the record",
    )
    ap.add_argument("--relabel", action="append", default=[], help="OLD=NEW: an average's name in the record")
    ap.add_argument("--kept", required=True, help="which average the stage kept, and why (or none, and why)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    try:
        record = chain_record(args.walks, args.averages, args.compare, args.label, args.relabel, args.kept)
    except (ValueError, OSError) as err:  # a wrong folder, label or result: one line, not a traceback
        ap.error(str(err))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    for row in record["points"]:
        print(f"{row['head']}: walk {row['walk']:.4f} ({' + '.join(row['chain_of'])})")
    for head, walk in record["compare"].items():
        print(f"{head}: walk {walk:.4f}")


if __name__ == "__main__":
    main()
