"""`peagle train`: target + prompts -> self-distilled data -> trained head."""

from __future__ import annotations

import argparse


def add_parser(sub) -> argparse.ArgumentParser:
    from ..training.recipe import add_train_arguments  # argparse only; heavy imports happen in run_train

    p = sub.add_parser("train", help="train a P-EAGLE (or EAGLE-3) head for a target on self-distilled data")
    add_train_arguments(p)
    return p


def run(args: argparse.Namespace) -> int:
    from ..training.recipe import run_train

    return run_train(args)
