"""Pack self-distilled JSONL rows into compact token-id shards (`peagle.data.shards`), resumably.

Reads rows `{"input_ids", "loss_mask", "source", ...}` (as `peagle grow-data` appends them to
data/grow/rows.jsonl) and appends one shard per source to the shard folder.  Each shard's manifest entry records
the JSONL file (name and a fingerprint of its first line) and the row range it holds (`rows: [start, stop]`),
so a re-run on the same file packs only the rows appended since; `peagle grow-data` rows carry their cycle, and a
cycle the folder already holds from another rows file (another run or machine) is skipped.  An unfinished
last line (a writer still appending) is left for the next run.  Old shards are never
rewritten.

Usage:
    peagle pack data/grow/rows.jsonl data/shards/grow
    peagle pack data/grow/rows.jsonl data/shards/grow --dtype bfloat16 --target default
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import defaultdict

from ..targets import DEFAULT_TARGET_NAME
from .shards import MANIFEST, dataset_folders, packed_cycles, read_manifest, write_shard


def _same_file(shard: dict, rows_file: str, head: str) -> bool:
    """Whether a manifest entry was packed from this very rows file: same name and same first line."""
    return shard.get("rows_file") == rows_file and shard.get("rows_head") == head


def packed_rows(folder: str, rows_file: str, head: str) -> int:
    """How many lines of this rows file (name + first-line fingerprint) earlier runs packed into `folder`."""
    if not os.path.exists(os.path.join(folder, MANIFEST)):
        return 0
    shards = read_manifest(folder)["shards"]
    return max((s["rows"][1] for s in shards if _same_file(s, rows_file, head)), default=0)


def first_line_fingerprint(path: str) -> str:
    with open(path, encoding="utf-8") as fh:
        return hashlib.sha256(fh.readline().encode()).hexdigest()[:16]


def complete_lines(path: str, start: int) -> list[str]:
    """Lines `start..` of `path` that end with a newline (a line still being written is left out)."""
    out = []
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh):
            if i >= start and line.endswith("\n"):
                out.append(line)
    return out


def sibling_cycles(folder: str) -> set[int]:
    """Cycles held by the other shard folders of the same dataset (e.g. `heldout/` beside `train/`): a rows file
    holds every cycle grow_data.py generated, and a held-out cycle must never be packed into training data."""
    cycles: set[int] = set()
    for other in dataset_folders(os.path.dirname(os.path.abspath(folder)), exclude=folder):
        cycles |= packed_cycles(other)
    return cycles


RECORDED_FIELDS = {"engine": "transformers", "prompt_set": "1"}
"""Row fields copied into each shard's manifest entry (all values of the shard's rows, joined by `+`), with the
value a row without the field had (rows of older runs); a shard none of whose rows has the field records none."""


def pack(
    rows_path: str,
    folder: str,
    *,
    target_name: str = DEFAULT_TARGET_NAME,
    dtype: str | None = "bfloat16",
    default_source: str = "unknown",
    max_tokens_per_shard: int = 4_000_000,
) -> list[dict]:
    """Append the rows of `rows_path` not yet in `folder` as shards (one or more per source); returns the new
    manifest entries."""
    rows_file = os.path.basename(rows_path)
    head = first_line_fingerprint(rows_path)
    # this file resumes after the rows packed from it before; rows of `peagle grow-data` carry their cycle, and a cycle
    # the folder holds from another file (another run or machine) is never packed twice
    start = packed_rows(folder, rows_file, head)
    has_manifest = os.path.exists(os.path.join(folder, MANIFEST))
    done = packed_cycles(folder, ignore=lambda s: _same_file(s, rows_file, head)) if has_manifest else set()
    done |= sibling_cycles(folder)
    lines = complete_lines(rows_path, start)
    stop = start + len(lines)
    by_source: dict[str, list[dict]] = defaultdict(list)
    cycles: dict[str, list[int]] = defaultdict(list)
    # how the rows were made (`peagle grow-data --engine, --prompt_set`), recorded per shard for the fields its rows name
    recorded: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    named: dict[str, set[str]] = defaultdict(set)
    dtypes: dict[str, set[str]] = defaultdict(set)  # rows that name their generation dtype win over `dtype`
    for line in lines:
        if not line.strip():
            continue
        row = json.loads(line)
        if "cycle" in row and int(row["cycle"]) in done:
            continue
        source = str(row.get("source") or default_source)
        by_source[source].append({"input_ids": row["input_ids"], "loss_mask": row["loss_mask"]})
        if "cycle" in row:
            cycles[source].append(int(row["cycle"]))
        if row.get("dtype"):
            dtypes[source].add(str(row["dtype"]))
        for field, default in RECORDED_FIELDS.items():
            value = row.get(field)
            if value is not None:
                named[source].add(field)
            recorded[source][field].add(str(default if value is None else value))
    entries = []
    for source, examples in sorted(by_source.items()):
        chunk: list[dict] = []
        tokens = 0
        for i, ex in enumerate(examples):
            chunk.append(ex)
            tokens += len(ex["input_ids"])
            if tokens >= max_tokens_per_shard or i == len(examples) - 1:
                extra = {"rows_file": rows_file, "rows_head": head, "rows": [start, stop]}
                if cycles[source]:
                    extra["cycles"] = [min(cycles[source]), max(cycles[source])]
                for field in sorted(named[source]):
                    extra[field] = "+".join(sorted(recorded[source][field]))
                entries.append(
                    write_shard(
                        chunk,
                        folder,
                        source=source,
                        target_name=target_name,
                        dtype="+".join(sorted(dtypes[source])) if dtypes[source] else dtype,
                        extra=extra,
                    )
                )
                chunk, tokens = [], 0
    return entries


__all__ = ["pack", "packed_rows", "first_line_fingerprint", "complete_lines", "sibling_cycles"]
