"""`peagle export`: any published head layout -> vLLM / speculators / peagle."""

from __future__ import annotations

import argparse


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "export", help="convert a head (any known layout) to the vllm, speculators or peagle layout"
    )
    p.add_argument("head", help="head folder or Hub repo id, in any layout peagle reads")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--layout", choices=["vllm", "speculators", "peagle"], default="vllm")
    p.add_argument(
        "--target",
        default=None,
        help="target path, Hub id or 'default'; needed when the head "
        "shares the target's embeddings or lacks embed_tokens / lm_head",
    )
    p.add_argument(
        "--num-speculative-tokens", type=int, default=None, help="K to record (default: the head's)"
    )
    p.add_argument(
        "--allow-pickle", action="store_true", help="permit .bin/.pt checkpoints (unpickling runs code)"
    )
    p.add_argument("--max-shard-size", default="5GB")
    return p


def run(args: argparse.Namespace) -> int:
    import json

    from ..formats import export, load_head
    from ..formats.vllm import speculative_config
    from ..targets import load_target

    target = load_target(args.target)[0] if args.target else None
    head = load_head(args.head, target=target, allow_pickle=args.allow_pickle)
    out = export(
        head,
        args.out,
        layout=args.layout,
        target_model=target,
        num_speculative_tokens=args.num_speculative_tokens,
        max_shard_size=args.max_shard_size,
    )
    print(f"wrote the {args.layout} layout of {args.head} to {out}")
    if args.layout == "vllm":
        spec = speculative_config(head, out, args.num_speculative_tokens)
        print(f"serve with: vllm serve <target> --speculative-config '{json.dumps(spec)}'")
    return 0
