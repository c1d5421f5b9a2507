"""`peagle export`: any published head layout -> vLLM / speculators / peagle."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from ._common import dataclass_parent, num_speculative_tokens_field, positional

VERIFIER_CHOICES = ("local", "hub")


def shard_size(value: str) -> str:
    """argparse type of `--max_shard_size`: a positive size with a unit (`500MB`, `5GB`; KB, MB, GB, TB)."""
    from huggingface_hub.serialization._base import parse_size_to_int

    try:
        size = parse_size_to_int(value)
    except ValueError:
        size = 0
    if size <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive size such as 500MB or 5GB, got {value!r}")
    return value


@dataclass
class ExportArguments:
    """The settings of `peagle export` (`head` is positional; each other field is a flag of the same name)."""

    head: str = positional("head folder or Hub repo id, in any layout peagle reads")
    out: str = field(metadata={"help": "output folder"})
    layout: str = field(default="vllm", metadata={"choices": ["vllm", "speculators", "peagle"]})
    target: str | None = field(
        default=None,
        metadata={
            "help": "target path, Hub id or 'default'; needed when the head shares the target's embeddings or lacks "
            "embed_tokens / lm_head"
        },
    )
    verifier: str | None = field(
        default=None,
        metadata={
            "metavar": "local|hub|NAME_OR_PATH",
            "help": "where the speculators layout says the target lives (speculators_config.verifier.name_or_path): "
            "'local' (the default with --target: the target's folder, so speculators loads the export offline), "
            "'hub' (its Hub id, for publishing), or a folder / Hub id given as is",
        },
    )
    num_speculative_tokens: int | None = num_speculative_tokens_field("K to record (default: the head's)")
    allow_pickle: bool = field(
        default=False, metadata={"switch": True, "help": "permit .bin/.pt checkpoints (unpickling runs code)"}
    )
    overwrite: bool = field(
        default=False,
        metadata={
            "switch": True,
            "help": "write even where --out holds a model other than a head (e.g. the target's folder), replacing it",
        },
    )
    max_shard_size: str = field(
        default="5GB", metadata={"parse": shard_size, "help": "largest weight file, e.g. 500MB (default 5GB)"}
    )


def add_parser(sub) -> argparse.ArgumentParser:
    return sub.add_parser(
        "export",
        help="convert a head (any known layout) to the vllm, speculators or peagle layout",
        parents=[dataclass_parent(ExportArguments)],
    )


def target_locations(spec: str, target=None) -> tuple[str | None, str | None]:
    """(Hub id, local folder) of a `--target` value: `default`, a folder, or a Hub id (its local folder: the Hub
    cache's snapshot, when one is there).  Either may be None when unknown."""
    if spec == "default":
        from ..targets import DEFAULT_TARGET_NAME, default_target_path

        return DEFAULT_TARGET_NAME, str(default_target_path().resolve())
    path = Path(spec).expanduser()
    if path.is_dir():
        name = getattr(getattr(target, "config", None), "_name_or_path", None)
        hub = name if name and not Path(name).expanduser().is_dir() else None
        return hub, str(path.resolve())
    from huggingface_hub import snapshot_download

    try:
        local = snapshot_download(spec, local_files_only=True, allow_patterns=["*.json"])
    except Exception:  # not in the Hub cache (or not a valid id): only the id is known
        local = None
    return spec, local


def resolve_verifier(choice: str | None, target_spec: str | None, target=None) -> str | None:
    """`--verifier` as recorded: `local` / `hub` resolved through `--target`, anything else as given; None (the
    head's own target name) without either flag."""
    if choice is not None and choice not in VERIFIER_CHOICES:
        return choice
    if target_spec is None:
        if choice is not None:
            raise SystemExit(f"peagle export: --verifier {choice} needs --target (the target to locate)")
        return None
    hub, local = target_locations(target_spec, target)
    if (choice or "local") == "local":
        if local is None:
            raise SystemExit(
                f"peagle export: no local folder known for --target {target_spec} (not in the Hub cache); "
                "give --verifier hub, or --verifier with a folder"
            )
        return local
    if hub is None:
        raise SystemExit(
            f"peagle export: no Hub id known for --target {target_spec}; give --verifier local or a Hub id"
        )
    return hub


def run(args: argparse.Namespace) -> int:
    import json

    from ..formats import export, load_head
    from ..formats.vllm import speculative_config
    from ..targets import load_target

    target = load_target(args.target)[0] if args.target else None
    verifier = resolve_verifier(args.verifier, args.target, target)
    head = load_head(args.head, target=target, allow_pickle=args.allow_pickle)
    served = served_target(head, args.target, target)
    head.config.target_model_name = (
        served  # a Hub id, never a folder of this machine (--verifier may name one)
    )
    out = export(
        head,
        args.out,
        layout=args.layout,
        target_model=target,
        num_speculative_tokens=args.num_speculative_tokens,
        max_shard_size=args.max_shard_size,
        verifier=verifier,
        overwrite=args.overwrite,
    )
    print(f"wrote the {args.layout} layout of {args.head} to {out}")
    if args.layout == "speculators":
        where = verifier or head.config.target_model_name
        print(f"verifier (speculators_config.verifier.name_or_path): {where}")
    if args.layout == "vllm":
        spec = speculative_config(head, Path(out).resolve(), args.num_speculative_tokens)
        print(f"serve with: vllm serve {served or '<target>'} --speculative-config '{json.dumps(spec)}'")
        if served is None:
            print("(no Hub id is known for the target: put its Hub id or folder in place of <target>)")
    return 0


def served_target(head, target_spec: str | None, target=None) -> str | None:
    """The target an export names: its Hub id when known (from `--target`, else the head's recorded name), never
    a folder of this machine; None when no Hub id is known."""
    from ..sizing import recorded_target_name

    hub = target_locations(target_spec, target)[0] if target_spec else None
    folder = target_spec if target_spec and Path(target_spec).expanduser().is_dir() else None
    names = (recorded_target_name(n) for n in (hub, folder, head.config.target_model_name))
    return next((n for n in names if n), None)
