"""`peagle push`: upload a head with its model card, remote code and custom_generate/."""

from __future__ import annotations

import argparse


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "push", help="upload a head to the Hub with a model card, remote code and custom_generate/"
    )
    p.add_argument("head", help="head folder or Hub repo id, in any layout peagle reads")
    p.add_argument("repo_id", help="destination Hub repo, e.g. you/SmolLM2-135M-Instruct-peagle")
    p.add_argument(
        "--target", default=None, help="target path, Hub id or 'default' (checked against the head)"
    )
    p.add_argument(
        "--bench", default=None, help="benchmark JSON (peagle bench) for the acceptance/speedup table"
    )
    p.add_argument("--training", default=None, help="JSON file describing training data and budget")
    p.add_argument("--license", default="apache-2.0")
    p.add_argument("--private", action="store_true")
    p.add_argument("--token", default=None)
    p.add_argument(
        "--allow-pickle", action="store_true", help="permit .bin/.pt checkpoints (unpickling runs code)"
    )
    p.add_argument(
        "--prepare-only", default=None, metavar="DIR", help="write the upload folder to DIR, do not upload"
    )
    return p


def run(args: argparse.Namespace) -> int:
    from ..hub import cli_push

    return cli_push(args)
