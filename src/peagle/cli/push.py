"""`peagle push`: upload a head with its model card, remote code and custom_generate/."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from ._common import dataclass_parent, hub_repo_id, positional, upload_folder


@dataclass
class PushArguments:
    """The settings of `peagle push` (`head` and `repo_id` are positional; each other field is a flag of the same
    name)."""

    head: str = positional("head folder or Hub repo id, in any layout peagle reads")
    repo_id: str = positional(
        "destination Hub repo, e.g. you/SmolLM2-135M-Instruct-peagle", parse=hub_repo_id
    )
    target: str | None = field(
        default=None, metadata={"help": "target path, Hub id or 'default' (checked against the head)"}
    )
    bench: str | None = field(
        default=None, metadata={"help": "benchmark JSON (peagle bench) for the acceptance/speedup table"}
    )
    training: str | None = field(
        default=None, metadata={"help": "JSON file describing training data and budget"}
    )
    license: str | None = field(
        default=None,
        metadata={
            "help": "the card's license (default: the target's: its folder's card, its family's (Gemma: gemma), "
            "apache-2.0 for the default target, else 'other')"
        },
    )
    base_model: str | None = field(
        default=None,
        metadata={
            "help": "the target's Hub id for the card's base_model (default: the name the head or the target "
            "folder records)"
        },
    )
    private: bool = field(default=False, metadata={"switch": True})
    token: str | None = None
    allow_pickle: bool = field(
        default=False, metadata={"switch": True, "help": "permit .bin/.pt checkpoints (unpickling runs code)"}
    )
    prepare_only: str | None = field(
        default=None,
        metadata={
            "metavar": "DIR",
            "parse": upload_folder,
            "help": "write the upload folder to DIR, do not upload",
        },
    )


def add_parser(sub) -> argparse.ArgumentParser:
    return sub.add_parser(
        "push",
        help="upload a head to the Hub with a model card, remote code and custom_generate/",
        parents=[dataclass_parent(PushArguments)],
    )


def run(args: argparse.Namespace) -> int:
    from ..formats import load_head
    from ..integrations.hub import prepare_upload_folder, push_to_hub
    from ..targets import load_target

    target = load_target(args.target)[0] if args.target else None
    head = load_head(args.head, target=target, allow_pickle=args.allow_pickle)
    if args.prepare_only is not None:
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
