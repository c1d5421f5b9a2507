"""Scaling curve of the heads: held-out tokens per target pass at K vs the training budget, with a plot and a fit.

Evaluates head folders (their `train_summary.json` chains give the budget: response tokens trained, all stages,
`peagle.training.recipe.training_budget`) and the checkpoints of a run (budget of the stage it continued plus
the run's token-passes up to the checkpoint's step), teacher-forced on held-out examples
(`PEagleTrainer.evaluate_acceptance`, see docs/training.md section 4), and optionally adds the from-scratch
curves of `scripts/ablate_heads.py` (P-EAGLE and EAGLE-3 at small budgets).  Fits tokens-per-pass = a + b log10(
token-passes) to the P-EAGLE points and states the budget the fit predicts for given targets.  Writes JSON and a
PNG.  Acceptance does not depend on the machine; this needs no idle machine.

Usage:
    python scripts/scaling_curve.py --heldout training_data/smollm2-135m-instruct/heldout \
        --heads src/peagle/default_heads/smollm2-135m-peagle heads/smollm2-135m-peagle-stage4 runs/stage5-peagle \
        --checkpoints runs/stage5-peagle-run/checkpoints=runs/stage5-peagle \
        --ablations docs/results/ablations.json --out docs/results/scaling.json
    # a stage's folder left heads/: its point keeps its number under a git label, nothing is measured
    python scripts/scaling_curve.py --heldout training_data/smollm2-135m-instruct/heldout \
        --reuse docs/results/scaling.json --relabel heads/NAME=git:COMMIT:heads/NAME --out docs/results/scaling.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from peagle.runtime import DTYPE_CHOICES, resolve_dtype_name
from peagle.targets import load_default_target
from peagle.training.recipe import training_budget
from peagle.training.shards import file_sha256

sys.path.insert(0, str(Path(__file__).parent))
from eval_acceptance import heldout_spec, teacher_forced  # noqa: E402


def checkpoint_budget(step: int, final_summary: dict) -> int:
    """Token-passes of a checkpoint at `step` of the run that produced `final_summary`."""
    before = (
        training_budget(final_summary["previous_stage"])["response_tokens_trained"]
        if (final_summary.get("previous_stage"))
        else 0
    )
    per_step = final_summary["response_tokens_trained"] / max(final_summary["optimizer_steps"], 1)
    return int(before + step * per_step)


MEASURES = {
    "every-anchor": "every_anchor_tokens_per_target_pass",
    "decoded": "decoded_tokens_per_target_pass",
}
"""`--measure` -> the point's field that is fitted and plotted (and copied to `tokens_per_target_pass`)."""

SET_FIELDS = {
    "every_anchor_tokens_per_target_pass": "tokens_per_target_pass",
    "decoded_tokens_per_target_pass": "decoded_tokens_per_target_pass",
}
"""What a point keeps of each held-out set (`per_set`), next to the pooled measures."""


def pooled(results: list[dict]) -> dict:
    """One head's `evaluate_acceptance` results on several held-out sets, pooled: the every-anchor measures
    weighted by anchors, the decoding walk as its summed tokens over its summed passes."""
    anchors = sum(r["anchors"] for r in results)
    k = len(results[0]["acceptance_by_depth"])
    passes = sum(r["decoded_target_passes"] for r in results)
    return {
        "every_anchor_tokens_per_target_pass": sum(
            r["tokens_per_target_pass"] * r["anchors"] for r in results
        )
        / anchors,
        "acceptance_by_depth": [
            sum(r["acceptance_by_depth"][d] * r["anchors"] for r in results) / anchors for d in range(k)
        ],
        "decoded_tokens_per_target_pass": sum(r["decoded_tokens"] for r in results) / passes
        if passes
        else 0.0,
        "anchors": anchors,
    }


def fit_log_linear(points: list[dict], goals: list[float]) -> tuple[dict | None, dict[str, float | None]]:
    """Least-squares fit of tokens_per_target_pass = a + b log10(token_passes) over the points with a budget, and
    the budget it predicts for each goal (None where the fit does not rise, or rises so slowly that the budget is
    beyond any float, as with heads of nearly one budget).  (None, {}) with fewer than two points."""
    used = [p for p in points if p["token_passes"] > 0]
    if len(used) < 2:
        return None, {}
    xs = [math.log10(p["token_passes"]) for p in used]
    ys = [p["tokens_per_target_pass"] for p in used]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(sum((x - mx) ** 2 for x in xs), 1e-12)
    a = my - b * mx
    fit = {"a": a, "b": b, "form": "tokens_per_target_pass = a + b * log10(token_passes)"}
    return fit, {str(goal): _budget_for(goal, a, b) for goal in goals}


def _budget_for(goal: float, a: float, b: float) -> float | None:
    """10 ** ((goal - a) / b), the fit's budget for `goal`; None where the fit does not rise or overflows."""
    if b <= 0:
        return None
    try:
        return 10 ** ((goal - a) / b)
    except OverflowError:
        return None


def split_spec(option: str, spec: str, form: str) -> tuple[str, str]:
    """The two sides of a command-line LEFT=RIGHT spec (split at the first `=`), both non-empty; ValueError
    naming the option, the spec and the expected form otherwise."""
    left, sep, right = spec.partition("=")
    if not sep or not left or not right:
        raise ValueError(f"{option} {spec}: expected {form}")
    return left, right


def head_budgets(heads: list[str], specs: list[str]) -> tuple[dict[str, int], set[str]]:
    """Each head's training budget in token-passes: the one a HEAD=TOKEN_PASSES spec states (a checkpoint, or a
    head from before the token-pass count; these come back in the second value, as estimates), else its
    train_summary.json's, earlier stages included."""
    given = {}
    for spec in specs:
        head, value = split_spec("--budget", spec, "HEAD=TOKEN_PASSES")
        if head not in heads:
            raise ValueError(f"--budget {spec}: {head} is not one of --heads")
        given[head] = int(float(value))
    budgets = {}
    for head in heads:
        if head in given:
            budgets[head] = given[head]
        else:
            summary = json.loads((Path(head) / "train_summary.json").read_text())
            budgets[head] = training_budget(summary)["response_tokens_trained"]
    return budgets, set(given)


def weights_fingerprint(folder: str) -> str | None:
    """sha256 of a head folder's model.safetensors, or None where the folder holds none (gone, or a label such
    as `git:<commit>:<path>`)."""
    path = Path(folder) / "model.safetensors"
    return file_sha256(path) if path.is_file() else None


def merge_points(new: list[dict], kept: list[dict]) -> tuple[list[dict], list[str]]:
    """The points just measured plus those of a --reuse result, matched by weights rather than by folder path.

    A kept point is replaced by a new point of the same folder when it was measured on the same weights (its
    recorded `weights_sha256`).  A kept point whose folder now holds other weights keeps its measurement under
    the label `FOLDER@sha256:<first 12 hex digits>` (returned as a note), so that neither its number nor the new
    one is lost or misattributed.  A kept point that recorded no fingerprint (measured before they were kept)
    cannot be matched: measuring its folder again is refused with ValueError instead of guessed at."""
    now = {p["head"] for p in new}
    merged, notes = list(new), []
    for point in kept:
        point = dict(point)
        recorded = point.get("weights_sha256")
        current = weights_fingerprint(point["head"])
        if recorded and current and recorded != current:
            label = f"{point['head']}@sha256:{recorded[:12]}"
            notes.append(
                f"{point['head']} holds other weights than the point measured on it: kept as {label}"
            )
            point["head"] = label
        elif point["head"] in now:
            if not recorded:
                raise ValueError(
                    f"the --reuse point of {point['head']} records no weights fingerprint, so whether the folder "
                    "still holds the weights it measured is unknown: relabel or remove that point first"
                )
            continue  # measured again on the same weights: the new point replaces it
        merged.append(point)
    return merged, notes


def relabel_points(points: list[dict], specs: list[str]) -> list[dict]:
    """The points with --relabel OLD=NEW applied: the point labelled OLD takes the label NEW, e.g. a stage's
    folder that left heads/ becomes `git:<commit>:<path>`, or a head walked under runs/ and kept under heads/
    takes its heads/ path.  Raises ValueError for a spec without `=`, an OLD given twice or labelling no
    point, or a NEW that would label two points."""
    mapping = {}
    for spec in specs:
        old, new = split_spec("--relabel", spec, "OLD=NEW")
        if old in mapping:
            raise ValueError(f"--relabel: {old} is relabelled twice")
        mapping[old] = new
    labels = [p["head"] for p in points]
    missing = [old for old in mapping if old not in labels]
    if missing:
        raise ValueError(f"--relabel: no point is labelled {', '.join(missing)}")
    relabelled = [dict(p, head=mapping.get(p["head"], p["head"])) for p in points]
    seen: set[str] = set()
    for p in relabelled:
        if p["head"] in seen:
            raise ValueError(f"--relabel: two points would be labelled {p['head']}")
        seen.add(p["head"])
    return relabelled


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--heldout",
        required=True,
        nargs="+",
        help="held-out example folders, each FOLDER or FOLDER:SKIP:LIMIT (default --skip and --limit); the "
        "measure pools them",
    )
    ap.add_argument("--skip", type=int, default=48)
    ap.add_argument("--limit", type=int, default=48)
    ap.add_argument(
        "--measure",
        choices=list(MEASURES),
        default="every-anchor",
        help="every-anchor: 1 + the mean accepted run over every round start; decoded: the decoding walk, what "
        "generate() reports drafting K every round (docs/training.md section 4)",
    )
    ap.add_argument(
        "--max-new-tokens", type=int, default=128, help="--measure decoded: tokens decoded per response"
    )
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=7)
    ap.add_argument("--heads", nargs="*", default=[], help="head folders with train_summary.json")
    ap.add_argument(
        "--checkpoints", nargs="*", default=[], help="CHECKPOINTS_DIR=FINAL_HEAD: a run's checkpoints"
    )
    ap.add_argument(
        "--budget",
        nargs="*",
        default=[],
        metavar="HEAD=TOKEN_PASSES",
        help="the budget of a --heads folder that has no train_summary.json (a checkpoint) or one that predates the "
        "token-pass count",
    )
    ap.add_argument("--ablations", default=None, help="ablate_heads.py JSON (from-scratch curves)")
    ap.add_argument("--targets", default="2.0,2.5,3.0", help="tokens per pass to predict budgets for")
    ap.add_argument(
        "--head-dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="the heads' dtype (auto: bfloat16 where this machine computes it natively, else float32)",
    )
    ap.add_argument("--feature-cache", default="runs/cache-heldout-scaling")
    ap.add_argument("--out", default="docs/results/scaling.json")
    ap.add_argument(
        "--reuse",
        default=None,
        help="an earlier result JSON measured with the same settings: its points are kept, not evaluated again "
        "(a folder measured again replaces its point only if it still holds the same weights, by sha256)",
    )
    ap.add_argument(
        "--relabel",
        nargs="*",
        default=[],
        metavar="OLD=NEW",
        help="label a point anew once measured or reused: a folder that left the tree as git:<commit>:<path>, or a "
        "head walked under runs/ by the path it is kept under",
    )
    args = ap.parse_args()
    args.head_dtype = resolve_dtype_name(args.head_dtype)  # recorded resolved
    kept: list[dict] = []
    if args.reuse:
        earlier = json.loads(Path(args.reuse).read_text())
        same = (
            "heldout",
            "skip",
            "limit",
            "num_speculative_tokens",
            "head_dtype",
            "measure",
            "max_new_tokens",
        )
        defaults = {"measure": "every-anchor", "max_new_tokens": 128}  # results written before these existed
        heldout = earlier["settings"].get("heldout")
        earlier["settings"]["heldout"] = [heldout] if isinstance(heldout, str) else heldout
        differ = [k for k in same if earlier["settings"].get(k, defaults.get(k)) != getattr(args, k)]
        if differ:
            ap.error(f"--reuse {args.reuse} was measured with other settings: {', '.join(differ)}")
        kept = earlier["points"]

    try:
        budgets, given = head_budgets(args.heads, args.budget)
        runs = [split_spec("--checkpoints", spec, "CHECKPOINTS_DIR=FINAL_HEAD") for spec in args.checkpoints]
    except ValueError as err:
        ap.error(str(err))
    folders = list(args.heads)
    for ckpt_dir, final in runs:
        summary = json.loads((Path(final) / "train_summary.json").read_text())
        for ckpt in sorted(Path(ckpt_dir).glob("checkpoint-*"), key=lambda p: int(p.name.rsplit("-", 1)[1])):
            step = int(ckpt.name.rsplit("-", 1)[1])
            if step >= summary["optimizer_steps"]:
                continue  # the final head is listed under --heads
            folders.append(str(ckpt))
            budgets[str(ckpt)] = checkpoint_budget(step, summary)
    # hashed before the evaluation loads them: a point records the weights it measured
    fingerprints = {folder: weights_fingerprint(folder) for folder in folders}
    try:  # refuse an unmatchable --reuse point or --relabel before the evaluation, not after it
        dry_run, _ = merge_points([{"head": f, "weights_sha256": fp} for f, fp in fingerprints.items()], kept)
        relabel_points(dry_run, args.relabel)
    except ValueError as err:
        ap.error(str(err))
    per_set = []
    if folders:  # with only --reuse (and --relabel) there is nothing to evaluate
        target, _ = load_default_target()
        for i, spec in enumerate(args.heldout):
            folder, skip, limit = heldout_spec(spec, args.skip, args.limit)
            per_set.append(
                teacher_forced(
                    target,
                    argparse.Namespace(
                        heads=folders,
                        examples=folder,
                        skip=skip,
                        limit=limit,
                        num_speculative_tokens=args.num_speculative_tokens,
                        head_dtype=args.head_dtype,
                        feature_cache=f"{args.feature_cache}-{i}"
                        if len(args.heldout) > 1
                        else args.feature_cache,
                        max_new_tokens=args.max_new_tokens,
                        truncate=args.measure == "decoded",
                    ),
                )
            )
    points = [
        {
            "head": folder,
            "kind": "peagle",
            "token_passes": budgets[folder],
            **pooled([r[folder] for r in per_set]),
            "per_set": {
                spec: {key: r[folder][field] for key, field in SET_FIELDS.items()}
                for spec, r in zip(args.heldout, per_set)
            },
        }
        for folder in folders
    ]
    for p in points:
        p["tokens_per_target_pass"] = p[MEASURES[args.measure]]
        p["weights_sha256"] = fingerprints[p["head"]]
        if p["head"] in given:
            p["token_passes_estimated"] = True  # stated with --budget, not counted by the trainer
    points, notes = merge_points(points, kept)
    for note in notes:
        print(note)
    points = relabel_points(points, args.relabel)
    points.sort(key=lambda p: p["token_passes"])
    scratch = {}
    if args.ablations and Path(args.ablations).exists():
        results = json.loads(Path(args.ablations).read_text())["results"]
        for name in ("base", "eagle3"):
            if name in results and results[name].get("curve"):
                total = results[name]["response_tokens_trained"] or 0
                steps = len(results[name]["curve"])
                scratch[name] = [
                    {
                        "token_passes": total * (i + 1) / steps,
                        "tokens_per_target_pass": c["tokens_per_target_pass_k7"],
                    }
                    for i, c in enumerate(results[name]["curve"])
                ]
    fit, predictions = fit_log_linear(points, [float(t) for t in args.targets.split(",")])
    for p in points:
        sets = "  ".join(f"{v[MEASURES[args.measure]]:.3f}" for v in (p.get("per_set") or {}).values())
        print(f"{p['token_passes']:>12,}  {p['tokens_per_target_pass']:.3f}  {p['head']}  (per set: {sets})")
    if fit:
        print(f"fit: {fit['a']:.3f} + {fit['b']:.3f} log10(token-passes)")
        for goal, budget in predictions.items():
            print(
                f"  {goal} tokens/pass at about {budget:,.0f} token-passes"
                if budget
                else f"  {goal}: no trend"
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "settings": vars(args),
        "points": points,
        "from_scratch": scratch,
        "fit": fit,
        "predictions": predictions,
    }
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"), args.num_speculative_tokens)
    print(f"wrote {out} and {out.with_suffix('.png')}")


def plot(result: dict, path: Path, k: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    pts = result["points"]
    ax.plot(
        [p["token_passes"] for p in pts],
        [p["tokens_per_target_pass"] for p in pts],
        "o-",
        label="P-EAGLE (stages)",
    )
    styles = {"base": ("s--", "P-EAGLE from scratch"), "eagle3": ("^--", "EAGLE-3-style from scratch")}
    for name, curve in result["from_scratch"].items():
        style, label = styles[name]
        ax.plot(
            [c["token_passes"] for c in curve],
            [c["tokens_per_target_pass"] for c in curve],
            style,
            label=label,
        )
    fit = result["fit"]
    if fit:
        lo = min(p["token_passes"] for p in pts if p["token_passes"] > 0)
        hi = max([lo * 10] + [v for v in result["predictions"].values() if v])
        xs = [lo * (hi / lo) ** (i / 50) for i in range(51)]
        ax.plot(
            xs, [fit["a"] + fit["b"] * math.log10(x) for x in xs], ":", color="gray", label="log-linear fit"
        )
    ax.set_xscale("log")
    ax.set_xlabel("training budget (response-token passes, all stages)")
    ax.set_ylabel(f"held-out new tokens per target pass, K={k}")
    how = (
        "decoding walk" if result["settings"].get("measure") == "decoded" else "teacher-forced, every anchor"
    )
    ax.set_title(f"Head quality vs training budget (SmolLM2-135M target, {how})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
