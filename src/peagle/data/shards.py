"""Examples on disk: JSON lines, and compact token-id shards with a manifest (kept in git, extended, never rewritten).

A shard folder holds `shard-00000.safetensors`, `shard-00001.safetensors`, ... and `manifest.json`.  Each shard
(safetensors, never pickle) stores n examples as flat tensors:

- `input_ids`: all tokens concatenated, uint16 when every id fits (< 65,536), else int32;
- `offsets`: int64 `(n + 1,)`, example i is ``input_ids[offsets[i]:offsets[i + 1]]``;
- `prompt_lengths`: int32 `(n,)`, the response is everything after the prompt (`loss_mask` 1 there); or, when some
  example's `loss_mask` is not of that prompt/response form, `loss_mask`: uint8, flat like `input_ids`.

`manifest.json` lists every shard with its source, example, token and response-token counts, the target that
generated it, the dtype it ran in, the creation date, the peagle version and the file's sha256.  [`write_shard`]
appends one shard (old shards are never rewritten); [`read_shards`] checks every shard against the manifest and
raises naming the file on a mismatch.  About 2 bytes per token: 1M tokens take 2 MB.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

MANIFEST = "manifest.json"
FORMAT = "peagle-token-shards"
FORMAT_VERSION = 1


# ------------------------------------------------------------------------------------------------ JSON lines
def save_examples(examples: Sequence[dict[str, Any]], path: str | os.PathLike) -> None:
    """Write examples as JSON lines (`input_ids`, `loss_mask`)."""
    with open(path, "w", encoding="utf-8") as fh:
        for ex in examples:
            row = {k: _as_list(ex[k]) for k in ("input_ids", "loss_mask")}
            fh.write(json.dumps(row) + "\n")


def load_examples(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Read examples: a JSON-lines file (as written by [`save_examples`]; extra keys are kept) or a shard folder
    ([`read_shards`])."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return read_shards(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"examples {path!r}: no such file or shard folder.")
    with open(path, "rb") as fh:
        lines = fh.read().split(b"\n")
    examples = []
    last = max((i for i, line in enumerate(lines, 1) if line.strip()), default=0)
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        where = f"examples file {path!r}, line {number}"
        try:
            row = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as err:
            raise ValueError(f"{where}: not UTF-8 text (byte {err.start} of the line).") from err
        except json.JSONDecodeError as err:
            cut = " (the file looks truncated)" if number == last else ""
            raise ValueError(f"{where}: not valid JSON{cut} ({err.msg}, column {err.colno}).") from err
        examples.append(check_example(row, where))
    if not examples:
        raise ValueError(f"examples file {path!r} holds no examples (it is empty).")
    return examples


def check_example(row: Any, where: str) -> dict[str, Any]:
    """`row` if it is a training example (`input_ids`: token ids >= 0; `loss_mask`: as many 0s and 1s), else a
    `ValueError` that starts with `where` (the file and the row) and names the field."""
    if not isinstance(row, dict):
        raise ValueError(
            f"{where}: expected a JSON object with input_ids and loss_mask, got a {type(row).__name__}."
        )
    for key in ("input_ids", "loss_mask"):
        if key not in row:
            raise ValueError(
                f"{where}: no {key!r} field (found {sorted(row)}); expected input_ids and loss_mask."
            )
        values = row[key]
        if hasattr(values, "tolist"):  # a tensor or an array
            values = values.tolist()
        if isinstance(values, tuple):
            values = list(values)
        if not isinstance(values, list) or not values:
            raise ValueError(f"{where}: {key} is {_short(values)}; expected a non-empty list of integers.")
        # JSON true/false are 1/0 in a loss mask, never token ids
        allowed = (int, bool) if key == "loss_mask" else (int,)
        for v in values:
            if type(v) not in allowed:
                raise ValueError(f"{where}: {key} holds {v!r} ({type(v).__name__}); expected integers.")
    ids, mask = _as_list(row["input_ids"]), _as_list(row["loss_mask"])
    if len(mask) != len(ids):
        raise ValueError(
            f"{where}: loss_mask has {len(mask)} entries, input_ids {len(ids)}; expected one per token."
        )
    if min(ids) < 0:
        raise ValueError(f"{where}: input_ids holds {min(ids)}; token ids are >= 0.")
    other = next((v for v in mask if v not in (0, 1)), None)
    if other is not None:
        raise ValueError(f"{where}: loss_mask holds {other}; expected only 0 (prompt) and 1 (response).")
    return row


def check_token_ids(examples: Sequence[dict[str, Any]], vocab_size: int, source: str) -> None:
    """Raise `ValueError` naming `source` (a file or folder), the row and the id when an example holds a token id
    outside the target's vocabulary `[0, vocab_size)`."""
    for i, ex in enumerate(examples):
        ids = torch.as_tensor(ex["input_ids"])
        if not ids.numel():
            continue
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab_size:
            bad = high if high >= vocab_size else low
            raise ValueError(
                f"{source}, example {i} (0-based row): token id {bad} is outside the target's vocabulary "
                f"[0, {vocab_size}). Were these examples made with another target's tokenizer?"
            )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _as_list(x: Any) -> list[int]:
    return x.tolist() if isinstance(x, torch.Tensor) else [int(v) for v in x]


# ---------------------------------------------------------------------------------------------------- shards
def read_manifest(folder: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a shard folder (`{"format", "version", "shards": [...]}`)."""
    path = os.path.join(os.fspath(folder), MANIFEST)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: {os.fspath(folder)!r} is not a shard folder.")
    with open(path, encoding="utf-8") as fh:
        manifest = json.load(fh)
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: format is {manifest.get('format')!r}; expected {FORMAT!r}.")
    return manifest


def packed_cycles(
    folder: str | os.PathLike, ignore: Callable[[dict[str, Any]], bool] | None = None
) -> set[int]:
    """The generation cycles (`peagle grow-data`) the shards of `folder` hold, from the manifest's `cycles`
    ranges (shards for which `ignore(entry)` is true left out): a later run skips them instead of generating or
    packing the same data again."""
    done: set[int] = set()
    for shard in read_manifest(folder)["shards"]:
        if "cycles" in shard and not (ignore and ignore(shard)):
            done.update(range(int(shard["cycles"][0]), int(shard["cycles"][1]) + 1))
    return done


def dataset_folders(parent: str | os.PathLike, exclude: str | os.PathLike | None = None) -> list[str]:
    """The shard folders directly under `parent` (those with a manifest), sorted, `exclude` left out: the folders of
    one dataset (e.g. `train/`, `heldout/` and the other held-out sets), whose cycles no other folder may hold."""
    parent = os.fspath(parent)
    skip = os.path.abspath(exclude) if exclude is not None else None
    names = sorted(os.listdir(parent)) if os.path.isdir(parent) else []
    return [
        os.path.join(parent, name)
        for name in names
        if os.path.isfile(os.path.join(parent, name, MANIFEST))
        and os.path.abspath(os.path.join(parent, name)) != skip
    ]


def write_shard(
    examples: Sequence[dict[str, Any]],
    folder: str | os.PathLike,
    *,
    source: str,
    target_name: str,
    dtype: str | torch.dtype | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Append one shard of `examples` to `folder` (created if needed) and list it in the manifest.

    Args:
        examples: dicts with `input_ids` and `loss_mask` (`(T_i,)` each; loss_mask 0/1).
        folder: the shard folder.
        source: where the examples come from (e.g. `"magpie"`, `"stdlib-code"`).
        target_name: the model that generated the responses.
        dtype: the dtype the target ran in while generating.
        extra: more fields for the manifest entry (e.g. which input rows the shard holds).

    Returns:
        The manifest entry of the new shard.
    """
    from safetensors.numpy import save_file

    if not examples:
        raise ValueError("write_shard got no examples.")
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    manifest_path = os.path.join(folder, MANIFEST)
    if os.path.exists(manifest_path):
        manifest = read_manifest(folder)
    else:
        manifest = {"format": FORMAT, "version": FORMAT_VERSION, "shards": []}
    listed = {s["file"] for s in manifest["shards"]}
    index = len(manifest["shards"])
    while f"shard-{index:05d}.safetensors" in listed:
        index += 1
    name = f"shard-{index:05d}.safetensors"

    tensors = pack_examples(examples)
    response_tokens = int(_response_tokens(tensors))
    entry: dict[str, Any] = {
        "file": name,
        "source": source,
        "examples": len(examples),
        "tokens": int(tensors["input_ids"].size),
        "response_tokens": response_tokens,
        "target": target_name,
        "dtype": None if dtype is None else str(dtype).removeprefix("torch."),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "peagle_version": _peagle_version(),
        "input_ids_dtype": str(tensors["input_ids"].dtype),
    }
    entry.update(extra or {})
    metadata = {k: str(v) for k, v in entry.items() if k != "file"}
    tmp = os.path.join(folder, f".{name}.tmp")
    save_file(tensors, tmp, metadata=metadata)
    os.chmod(tmp, 0o644)
    entry["sha256"] = file_sha256(tmp)
    os.replace(tmp, os.path.join(folder, name))
    manifest["shards"].append(entry)
    _write_manifest(manifest_path, manifest)
    return entry


def read_shards(
    folder: str | os.PathLike,
    *,
    sources: Iterable[str] | None = None,
    cycles: Iterable[tuple[int, int | None]] | None = None,
) -> list[dict[str, list[int]]]:
    """Examples of every shard listed in the manifest (manifest order), each checked against its entry.

    Args:
        folder: the shard folder.
        sources: only the shards of these sources (default: all).
        cycles: only the shards whose rows all come from `grow_data.py` cycles inside one of these inclusive
            `(first, last)` ranges (`last=None`: no upper end), by the manifest entry's `cycles`; e.g. the data
            added since a head last trained. Shards without cycles are left out. See `parse_cycle_ranges`.

    Returns:
        Examples `{"input_ids": [...], "loss_mask": [...]}` (lists of `T_i` ints).

    Raises:
        FileNotFoundError: the manifest or a listed shard is missing.
        ValueError: a shard does not match its manifest entry (checksum, example, token or response-token
            counts) or cannot be read; the message names the file.
    """
    from safetensors.numpy import load_file

    folder = os.fspath(folder)
    wanted = None if sources is None else set(sources)
    ranges = None if cycles is None else list(cycles)
    examples: list[dict[str, list[int]]] = []
    for entry in read_manifest(folder)["shards"]:
        if wanted is not None and entry["source"] not in wanted:
            continue
        if ranges is not None and not _cycles_within(entry.get("cycles"), ranges):
            continue
        path = os.path.join(folder, entry["file"])
        if not os.path.isfile(path):
            raise FileNotFoundError(f"shard {path} is listed in {MANIFEST} but missing.")
        if "sha256" in entry and file_sha256(path) != entry["sha256"]:
            raise ValueError(f"shard {path} is corrupted: its sha256 differs from the one in {MANIFEST}.")
        try:
            tensors = load_file(path)
        except Exception as exc:
            raise ValueError(f"shard {path} cannot be read: {exc}") from exc
        examples += _unpack_checked(tensors, entry, path)
    return examples


def parse_cycle_ranges(spec: str) -> list[tuple[int, int | None]]:
    """The cycle ranges of a spec such as `"78-93,513-"`: comma-separated `N` (one cycle), `N-M` or `N-` (no end).

    Example:

        >>> parse_cycle_ranges("78-93,513-,7")
        [(78, 93), (513, None), (7, 7)]
    """
    ranges: list[tuple[int, int | None]] = []
    for part in spec.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            lo = int(first)
            hi = None if dash and not last.strip() else int(last if dash else first)
        except ValueError:
            raise ValueError(f"cycle range {part!r} in {spec!r} is not N, N-M or N-") from None
        if hi is not None and hi < lo:
            raise ValueError(f"cycle range {part!r} in {spec!r} ends before it starts")
        ranges.append((lo, hi))
    return ranges


def _cycles_within(span: Sequence[int] | None, ranges: Sequence[tuple[int, int | None]]) -> bool:
    """Whether a shard's cycle span `[first, last]` lies inside one of `ranges` (no span: never)."""
    if not span:
        return False
    return any(lo <= span[0] and (hi is None or span[1] <= hi) for lo, hi in ranges)


def pack_examples(examples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The shard tensors (numpy arrays) of `examples`: `input_ids`, `offsets` and `prompt_lengths` or `loss_mask`.

    Example:

        >>> t = pack_examples([{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [8, 9], "loss_mask": [0, 1]}])
        >>> {k: v.tolist() for k, v in t.items()}
        {'input_ids': [5, 6, 7, 8, 9], 'offsets': [0, 3, 5], 'prompt_lengths': [1, 1]}
        >>> str(t["input_ids"].dtype)
        'uint16'
    """
    import numpy as np

    ids = [np.asarray(_as_list(ex["input_ids"]), dtype=np.int64) for ex in examples]
    masks = [np.asarray(_as_list(ex["loss_mask"]), dtype=np.int64) for ex in examples]
    prompt_lengths = []
    for i, (x, m) in enumerate(zip(ids, masks)):
        if x.shape != m.shape:
            raise ValueError(f"example {i}: loss_mask has {m.size} entries, input_ids {x.size}.")
        if x.size and (x.min() < 0 or x.max() >= 2**31):
            raise ValueError(f"example {i}: token ids must lie in [0, 2**31).")
        if not np.isin(m, (0, 1)).all():
            raise ValueError(f"example {i}: loss_mask must hold only 0 and 1.")
        p = int(np.argmax(m)) if m.any() else m.size
        prompt_lengths.append(p if bool((m[:p] == 0).all() and (m[p:] == 1).all()) else -1)
    flat = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
    small = flat.size == 0 or int(flat.max()) < 2**16
    out = {
        "input_ids": flat.astype(np.uint16 if small else np.int32),
        "offsets": np.concatenate([[0], np.cumsum([x.size for x in ids])]).astype(np.int64),
    }
    if all(p >= 0 for p in prompt_lengths):
        out["prompt_lengths"] = np.asarray(prompt_lengths, dtype=np.int32)
    else:
        out["loss_mask"] = np.concatenate(masks).astype(np.uint8)
    return out


def unpack_examples(tensors: dict[str, Any]) -> list[dict[str, list[int]]]:
    """The inverse of [`pack_examples`]."""
    ids, offsets = tensors["input_ids"], tensors["offsets"].tolist()
    examples = []
    for i in range(len(offsets) - 1):
        a, b = offsets[i], offsets[i + 1]
        if "prompt_lengths" in tensors:
            p = int(tensors["prompt_lengths"][i])
            mask = [0] * p + [1] * (b - a - p)
        else:
            mask = tensors["loss_mask"][a:b].tolist()
        examples.append({"input_ids": ids[a:b].tolist(), "loss_mask": mask})
    return examples


def _unpack_checked(tensors: dict[str, Any], entry: dict[str, Any], path: str) -> list[dict[str, list[int]]]:
    offsets = tensors.get("offsets")
    if offsets is None or "input_ids" not in tensors or not ({"prompt_lengths", "loss_mask"} & set(tensors)):
        raise ValueError(f"shard {path} lacks input_ids, offsets, or prompt_lengths/loss_mask.")
    found = {
        "examples": int(offsets.size - 1),
        "tokens": int(tensors["input_ids"].size),
        "response_tokens": int(_response_tokens(tensors)),
    }
    bad = {k: (entry.get(k), v) for k, v in found.items() if entry.get(k) != v}
    if (
        int(offsets[0]) != 0
        or int(offsets[-1]) != found["tokens"]
        or bool((offsets[1:] < offsets[:-1]).any())
    ):
        bad["offsets"] = ("0 .. tokens, increasing", f"{int(offsets[0])} .. {int(offsets[-1])}")
    if bad:
        detail = ", ".join(f"{k}: manifest {m}, file {f}" for k, (m, f) in bad.items())
        raise ValueError(f"shard {path} does not match {MANIFEST} ({detail}).")
    examples = unpack_examples(tensors)
    if "loss_mask" in tensors and bool((tensors["loss_mask"] > 1).any()):
        for i, ex in enumerate(examples):
            check_example(ex, f"shard {path} example {i}")
    return examples


def _response_tokens(tensors: dict[str, Any]) -> int:
    if "prompt_lengths" in tensors:
        lengths = tensors["offsets"][1:] - tensors["offsets"][:-1]
        return int((lengths - tensors["prompt_lengths"]).sum())
    return int(tensors["loss_mask"].sum())


def file_sha256(path: str | os.PathLike[str]) -> str:
    """sha256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_manifest(path: str, manifest: dict[str, Any]) -> None:
    """Write the manifest atomically, one line per shard (appending a shard adds one line to a git diff)."""
    head = {k: v for k, v in manifest.items() if k != "shards"}
    lines = [json.dumps(s) for s in manifest["shards"]]
    text = json.dumps(head)[:-1] + ', "shards": [\n' + ",\n".join(lines) + "\n]}\n"
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)


def _peagle_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("peagle")
    except PackageNotFoundError:
        return "unknown"


__all__ = [
    "save_examples",
    "load_examples",
    "check_example",
    "write_shard",
    "read_shards",
    "read_manifest",
    "packed_cycles",
    "pack_examples",
    "unpack_examples",
    "file_sha256",
    "MANIFEST",
]
