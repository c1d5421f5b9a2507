"""`peagle pack`: append self-distilled JSONL rows to a folder of token-id shards, resumably."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from ._common import dataclass_parent, positional, positive_int


@dataclass
class PackArguments:
    """The settings of `peagle pack` (`rows` and `folder` are positional; each other field is a flag of the same
    name)."""

    rows: str = positional("JSONL of rows with input_ids, loss_mask and source")
    folder: str = positional("shard folder (created if needed)")
    target: str = field(
        default="default",
        metadata={"help": "name of the model that generated the rows ('default': SmolLM2)"},
    )
    dtype: str = field(
        default="bfloat16",
        metadata={"help": "dtype the target generated in, for rows that do not name theirs"},
    )
    source: str = field(default="unknown", metadata={"help": "source of rows without a 'source' field"})
    max_tokens_per_shard: int = field(default=4_000_000, metadata={"parse": positive_int})


def add_parser(sub) -> argparse.ArgumentParser:
    return sub.add_parser(
        "pack",
        help="pack self-distilled JSONL rows (peagle grow-data) into token-id shards, resumably",
        parents=[dataclass_parent(PackArguments)],
    )


def run(args: argparse.Namespace) -> int:
    from ..data.packing import pack
    from ..data.shards import MANIFEST, read_manifest
    from ..targets import DEFAULT_TARGET_NAME

    entries = pack(
        args.rows,
        args.folder,
        target_name=DEFAULT_TARGET_NAME if args.target == "default" else args.target,
        dtype=args.dtype,
        default_source=args.source,
        max_tokens_per_shard=args.max_tokens_per_shard,
    )
    for e in entries:
        print(f"{e['file']}: {e['source']}, {e['examples']} examples, {e['response_tokens']} response tokens")
    has_manifest = os.path.exists(os.path.join(args.folder, MANIFEST))
    total = read_manifest(args.folder)["shards"] if has_manifest else []
    print(
        f"{len(entries)} new shard(s); {args.folder} holds {sum(s['examples'] for s in total)} examples, "
        f"{sum(s['response_tokens'] for s in total)} response tokens in {len(total)} shard(s)"
    )
    return 0
