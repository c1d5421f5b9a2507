"""Ablations of the head recipe at one small fixed budget, measured on held-out examples, with a plot.

Each variant trains a new head from scratch with `make_default_heads.py` for the same number of optimizer steps
(the same examples seen; the target's features come from one shared `--feature-cache`), then
`eval_acceptance.py --teacher-forced` measures new tokens per target pass on held-out examples (drafts accepted
by greedy verification in a round at every anchor; tokens per pass at K is ``1 + sum of the first K leading
acceptance rates``, so one evaluation at K=7 gives every smaller K).  Checkpoints every `--save-steps` give the
base recipes' early curve.  Resumable: a variant whose `eval.json` exists is not run again.

Usage:
    OMP_NUM_THREADS=1 python scripts/ablate_heads.py --examples training_data/smollm2-135m-instruct/train \
        --feature-cache runs/cache-train --heldout training_data/smollm2-135m-instruct/heldout \
        --steps 150 --out docs/results/ablations.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

BASE = [
    "--layers",
    "2",
    "--draft-vocab",
    "8192",
    "--num-parallel-positions",
    "8",
    "--lr",
    "1e-3",
    "--lm-head-init",
    "random",
]

# name: (kind, arguments replacing the base's, what it tests), most informative first (a session runs a prefix)
VARIANTS: dict[str, tuple[str, list[str], str]] = {
    "base": ("peagle", [], "2 layers, 8k draft vocabulary, K_train 8, KL, COD 0.7, linear lr 1e-3"),
    "eagle3": ("eagle3", [], "the EAGLE-3-style autoregressive head, same recipe"),
    "layers-1": ("peagle", ["--layers", "1"], "1 drafter layer"),
    "layers-4": ("peagle", ["--layers", "4"], "4 drafter layers"),
    "vocab-16k": ("peagle", ["--draft-vocab", "16384"], "draft vocabulary 16k"),
    "vocab-4k": ("peagle", ["--draft-vocab", "4096"], "draft vocabulary 4k"),
    "loss-ce": ("peagle", ["--loss-type", "ce"], "cross-entropy on the target's argmax instead of KL"),
    "ktrain-4": ("peagle", ["--num-parallel-positions", "4"], "K_train 4 (measured up to K=4)"),
    "cod-1.0": ("peagle", ["--cod-ratio", "1.0"], "no COD dropping (every depth of every anchor)"),
    "lr-cosine": ("peagle", ["--lr-scheduler", "cosine"], "cosine learning-rate schedule"),
    "vocab-32k": ("peagle", ["--draft-vocab", "32768"], "draft vocabulary 32k"),
    "cod-0.5": ("peagle", ["--cod-ratio", "0.5"], "COD keep ratio 0.5 (fewer deep elements)"),
    "ktrain-12": ("peagle", ["--num-parallel-positions", "12"], "K_train 12"),
    "lr-constant": ("peagle", ["--lr-scheduler", "constant"], "constant learning rate"),
    "lr-3e-4": ("peagle", ["--lr", "3e-4"], "learning rate 3e-4"),
    "lmhead-target": ("peagle", ["--lm-head-init", "target"], "LM head initialised from the target's rows"),
    "layers-target": (
        "peagle",
        ["--layers-init", "target"],
        "drafter layers from the target's last 2 layers",
    ),
}


def merged(overrides: list[str]) -> list[str]:
    args = list(BASE)
    for flag, value in zip(overrides[::2], overrides[1::2]):
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    return args


def tokens_per_pass(acceptance_by_depth: list[float], k: int) -> float:
    return 1.0 + sum(acceptance_by_depth[:k])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", required=True)
    ap.add_argument("--feature-cache", required=True)
    ap.add_argument("--heldout", required=True)
    ap.add_argument(
        "--skip", type=int, default=48, help="held-out examples skipped (calibration / rule comparison)"
    )
    ap.add_argument("--limit", type=int, default=72)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--grad-accum", type=int, default=4)
    ap.add_argument("--save-steps", type=int, default=50)
    ap.add_argument("--only", default=None, help="comma-separated variant names")
    ap.add_argument("--run-root", default="runs/ablations")
    ap.add_argument("--out", default="docs/results/ablations.json")
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(VARIANTS)
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {sorted(VARIANTS)}")
    root = Path(args.run_root)
    heldout_cache = str(root / "cache-heldout")
    evaluate = [
        "--examples",
        args.heldout,
        "--skip",
        str(args.skip),
        "--limit",
        str(args.limit),
        "--teacher-forced",
        "--feature-cache",
        heldout_cache,
    ]
    for name in names:
        kind, overrides, _ = VARIANTS[name]
        arguments = merged(overrides)
        folder = root / name
        report = folder / "eval.json"
        if report.exists():
            continue
        cmd = [
            sys.executable,
            "scripts/make_default_heads.py",
            "--examples",
            args.examples,
            "--feature-cache",
            args.feature_cache,
            "--kind",
            kind,
            "--out",
            str(folder / "head"),
            "--run-dir",
            str(folder / "run"),
            "--max-steps",
            str(args.steps),
            "--grad-accum",
            str(args.grad_accum),
            "--save-steps",
            str(args.save_steps),
            "--save-total-limit",
            "100",
            "--threads",
            "1",
            *arguments,
        ]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        heads = [str(folder / "head")]
        if name in ("base", "eagle3"):  # the early curve of the two head kinds
            heads = sorted(
                (str(p) for p in (folder / "run" / "checkpoints").glob("checkpoint-*")),
                key=lambda p: int(p.rsplit("-", 1)[1]),
            )
            heads = [h for h in heads if not h.endswith(f"-{args.steps}")] + [str(folder / "head")]
        k = min(7, int(arguments[arguments.index("--num-parallel-positions") + 1]))
        subprocess.run(
            [
                sys.executable,
                "scripts/eval_acceptance.py",
                *heads,
                *evaluate,
                "-k",
                str(k),
                "--out",
                str(report),
            ],
            check=True,
        )
    collect(names, root, args)


def collect(names: list[str], root: Path, args) -> None:
    results = {}
    for name in names:
        report = root / name / "eval.json"
        if not report.exists():
            continue
        evaluated = json.loads(report.read_text())["results"]
        kind, overrides, what = VARIANTS[name]
        final = evaluated[str(root / name / "head")]
        summary = final.get("train_summary", {})
        curve = [
            {
                "checkpoint": h,
                "tokens_per_target_pass_k7": tokens_per_pass(r["acceptance_by_depth"], 7),
                "acceptance_by_depth": r["acceptance_by_depth"],
                "decoded_tokens_per_target_pass": r.get("decoded_tokens_per_target_pass"),
            }
            for h, r in evaluated.items()
        ]
        results[name] = {
            "kind": kind,
            "what": what,
            "arguments": merged(overrides),
            "response_tokens_trained": summary.get("response_tokens_trained"),
            "seconds": summary.get("seconds"),
            "head_parameters": summary.get("head_parameters"),
            "tokens_per_target_pass_k4": tokens_per_pass(final["acceptance_by_depth"], 4),
            "tokens_per_target_pass_k7": (
                tokens_per_pass(final["acceptance_by_depth"], 7)
                if len(final["acceptance_by_depth"]) >= 7
                else None
            ),
            "acceptance_by_depth": final["acceptance_by_depth"],
            # the decoding walk at the evaluated K (min(7, K_train)); absent from evaluations made before it
            "decoded_tokens_per_target_pass": final.get("decoded_tokens_per_target_pass"),
            "decoded_k": len(final["acceptance_by_depth"]),
            "anchors": final["anchors"],
            "curve": curve if len(curve) > 1 else None,
        }
        walk = results[name]["decoded_tokens_per_target_pass"]
        print(
            f"{name:14s} K=4 {results[name]['tokens_per_target_pass_k4']:.3f}  K=7 "
            f"{results[name]['tokens_per_target_pass_k7'] or float('nan'):.3f}  walk K={len(final['acceptance_by_depth'])} "
            f"{walk if walk is not None else float('nan'):.3f}  ({what})"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items()}
    out.write_text(json.dumps({"settings": settings, "results": results}, indent=2))
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    k4 = [results[n]["tokens_per_target_pass_k4"] for n in names]
    seconds = [results[n]["seconds"] or 0.0 for n in names]
    fig, (ax, cost) = plt.subplots(
        1, 2, figsize=(11, 0.35 * len(names) + 1.4), sharey=True, gridspec_kw={"width_ratios": [3, 1.3]}
    )
    colors = ["tab:gray" if n == "base" else "tab:blue" for n in names]
    ax.barh(names[::-1], k4[::-1], color=colors[::-1])
    if "base" in results:
        ax.axvline(results["base"]["tokens_per_target_pass_k4"], color="k", lw=0.8, ls="--")
        curve = [c["tokens_per_target_pass_k7"] for c in results["base"].get("curve") or []]
        if len(curve) > 1:  # how much the base recipe moves between its last checkpoints: the noise floor
            spread = abs(curve[-1] - curve[-2])
            base = results["base"]["tokens_per_target_pass_k4"]
            ax.axvspan(
                base - spread, base + spread, color="0.85", zorder=0, label="base: last checkpoints' spread"
            )
            ax.legend(loc="lower right", fontsize=8)
    ax.set_xlim(1.0, max(k4) * 1.03)
    ax.set_xlabel("held-out new tokens per target pass at K=4 (teacher-forced)")
    ax.set_title("Head recipe ablations at one fixed budget")
    cost.barh(names[::-1], seconds[::-1], color=colors[::-1])
    cost.set_xlabel("training seconds (one thread)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
