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
    p.add_argument(
        "--license",
        default=None,
        help="the card's license (default: the target's: its folder's card, its family's (Gemma: gemma), "
        "apache-2.0 for the default target, else 'other')",
    )
    p.add_argument(
        "--base-model",
        default=None,
        help="the target's Hub id for the card's base_model (default: the name the head or the target folder "
        "records)",
    )
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
    from ..formats import load_head
    from ..integrations.hub import prepare_upload_folder, push_to_hub
    from ..targets import load_target

    target = load_target(args.target)[0] if args.target else None
    head = load_head(args.head, target=target, allow_pickle=args.allow_pickle)
    if args.prepare_only:
        out = prepare_upload_folder(
            head,
            args.prepare_only,
            repo_id=args.repo_id,
            bench=args.bench,
            training=args.training,
            license=args.license,
            base_model=args.base_model,
            target_model=target,
        )
        print(f"wrote the upload folder for {args.repo_id} to {out} (not uploaded)")
        return 0
    info = push_to_hub(
        head,
        args.repo_id,
        token=args.token,
        private=args.private or None,
        bench=args.bench,
        training=args.training,
        license=args.license,
        base_model=args.base_model,
        target_model=target,
    )
    print(f"uploaded {args.head} to {getattr(info, 'commit_url', args.repo_id)}")
    return 0
