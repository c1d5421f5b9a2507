"""`peagle grow-data`: grow the self-distilled training data of a head, one resumable cycle at a time."""

from __future__ import annotations

import argparse

from ._common import dataclass_from_args, dataclass_parent


def add_parser(sub) -> argparse.ArgumentParser:
    from ..data.growth import GrowDataArguments

    return sub.add_parser(
        "grow-data",
        help="the default target writes prompts (Magpie, stdlib code) and answers them; rows appended per cycle",
        parents=[dataclass_parent(GrowDataArguments)],
    )


def run(args: argparse.Namespace) -> int:
    from ..data.growth import GrowDataArguments, grow_data

    grow_data(dataclass_from_args(GrowDataArguments, args))
    return 0
