"""Refuse tracked files over 1 MiB outside the shipped heads' folder.

The repository's history already holds most of its size in old weights; new large files belong elsewhere (a
release, the Hub). Weights enter git only under `heads/`, when a shipped head changes. The few training-data
shards over the limit that predate this check are listed in `KNOWN` by path: any other file over the limit,
or a known one grown further, fails.

Usage: python .ci/check_file_sizes.py [ROOT]   (ROOT: a git work tree, default the current folder; exit status 1
and one line per file when a file is too large)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

LIMIT = 1 << 20
"""Bytes a tracked file may have outside `EXEMPT`."""
EXEMPT = ("heads/",)
"""Folders whose files may be larger: the shipped heads' weights."""
KNOWN = {
    "training_data/smollm2-135m-instruct/train/shard-00014.safetensors": 2678738,
    "training_data/smollm2-135m-instruct/train/shard-00025.safetensors": 1950972,
    "training_data/smollm2-135m-instruct/train/shard-00031.safetensors": 2863142,
    "training_data/smollm2-135m-instruct/train/shard-00061.safetensors": 1169986,
}
"""Files over the limit that predate the check, with their sizes (bytes) then."""


def tracked_files(root: Path) -> list[str]:
    """The paths git tracks in `root`'s index, relative to `root`."""
    out = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z"], check=True, capture_output=True
    ).stdout.decode()
    return [p for p in out.split("\0") if p]


def too_large(root: Path) -> list[tuple[str, int]]:
    """`(path, bytes)` of every tracked file over `LIMIT` outside `EXEMPT` and beyond its `KNOWN` size."""
    found = []
    for path in tracked_files(root):
        file = root / path
        if path.startswith(EXEMPT) or not file.is_file() or file.is_symlink():
            continue
        size = file.stat().st_size
        if size > max(LIMIT, KNOWN.get(path, 0)):
            found.append((path, size))
    return found


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    root = Path(args[0] if args else ".")
    found = too_large(root)
    for path, size in found:
        print(f"{path}: {size:,} bytes, over the {LIMIT:,}-byte limit for files outside {', '.join(EXEMPT)}")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
