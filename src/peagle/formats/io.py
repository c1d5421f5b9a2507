"""Reading and writing head checkpoints: folders and Hub repos, weight files, the pickle policy.

The pickle policy: weights are read from safetensors only.  Pickle checkpoints (`.bin`, `.pt`, ...) are
refused with an error naming the files unless the caller passes `allow_pickle=True`, because unpickling can
run arbitrary code; even then they are read with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
HUB_KWARGS = ("revision", "token", "cache_dir", "local_files_only", "force_download")
"""The `from_pretrained` keyword arguments passed on to `huggingface_hub.snapshot_download`."""
_NOT_WEIGHTS = re.compile(r"^(training_args|optimizer|scheduler|rng_state.*|scaler)\.(bin|pt|pth)$")


@dataclass
class Checkpoint:
    """A head checkpoint on local disk.

    Attributes:
        path: the folder (a Hub repo is first downloaded to the local cache).
        layout: the name of its layout in `peagle.formats.LAYOUTS` (None until detected).
        config: the parsed `config.json`.
        files: the weight files, safetensors unless pickles were explicitly allowed.
        shapes: tensor name -> (shape, file), read from the file headers.
    """

    path: Path
    layout: str | None
    config: dict[str, Any]
    files: list[Path]
    shapes: dict[str, tuple[tuple[int, ...], Path]]


@dataclass
class TensorSource:
    """A tensor with where it came from, so that errors can name the file and the tensor's own name."""

    name: str  # the tensor's name in its own file (or a description such as "<target>")
    file: Path
    tensor: torch.Tensor


def _hub_kwargs(hub_kwargs: Mapping[str, Any] | None, keys: Iterable[str] = HUB_KWARGS) -> dict[str, Any]:
    return {k: hub_kwargs[k] for k in keys if hub_kwargs and hub_kwargs.get(k) is not None}


def looks_like_path(spec: str | Path) -> bool:
    """Whether `spec` can only be a local path: a `Path`, absolute, `~`-, `.`- or `..`-relative, or more than one
    `/` (a Hub id is `name` or `org/name`)."""
    if isinstance(spec, Path):
        return True
    text = str(spec)
    return text.startswith(("/", "~", ".")) or text.count("/") > 1 or "\\" in text


def resolve_folder(path_or_repo: str | Path, hub_kwargs: Mapping[str, Any] | None = None) -> Path:
    """A local folder as is; otherwise a Hub repo id, downloaded with `huggingface_hub.snapshot_download`.

    A path-shaped argument that does not exist fails at once, naming it (no Hub lookup, no network retries).
    """
    path = Path(path_or_repo).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(
            f"{path} is a file; expected a folder (or Hub repo id) holding config.json and weights."
        )
    if looks_like_path(path_or_repo):
        raise FileNotFoundError(
            f"no such folder: {path} (a local path; a Hub repo id looks like 'org/name')."
        )
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.py", "*.md", "*.txt"]
    return Path(snapshot_download(str(path_or_repo), allow_patterns=patterns, **_hub_kwargs(hub_kwargs)))


def _pickle_files(folder: Path) -> list[Path]:
    index = folder / "pytorch_model.bin.index.json"
    if index.is_file():
        return [folder / n for n in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return sorted(
        f
        for f in folder.iterdir()
        if f.is_file() and f.suffix in PICKLE_SUFFIXES and not _NOT_WEIGHTS.match(f.name)
    )


def weight_files(folder: Path, allow_pickle: bool = False) -> list[Path]:
    """The weight files of a checkpoint folder: safetensors (sharded or not); pickles only if allowed."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = [folder / n for n in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if files:
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists weight files that do not exist: {missing}.")
        return files
    pickles = _pickle_files(folder)
    if not pickles:
        raise FileNotFoundError(f"no weights in {folder}: expected *.safetensors files.")
    if not allow_pickle:
        names = ", ".join(str(p) for p in pickles)
        raise ValueError(
            f"{folder} holds only pickle checkpoints ({names}); peagle refuses them by default because "
            "unpickling can run arbitrary code. Convert them to safetensors, or pass allow_pickle=True if "
            "you trust the source."
        )
    return pickles


def _raise_if_remote_pickles(repo: str | Path, hub_kwargs: Mapping[str, Any] | None) -> None:
    from huggingface_hub import list_repo_files

    try:
        files = list_repo_files(str(repo), **_hub_kwargs(hub_kwargs, ("revision", "token")))
    except Exception:  # offline or private: weight_files() reports the missing weights
        return
    pickles = [f for f in files if f.endswith(PICKLE_SUFFIXES)]
    if pickles:
        raise ValueError(
            f"Hub repo {repo} holds only pickle checkpoints ({', '.join(pickles)}); peagle refuses them by "
            "default because unpickling can run arbitrary code. Pass allow_pickle=True if you trust it."
        )


def _download_pickles(repo: str | Path, hub_kwargs: Mapping[str, Any] | None) -> Path:
    from huggingface_hub import snapshot_download

    patterns = ["*.json", *[f"*{s}" for s in PICKLE_SUFFIXES]]
    return Path(snapshot_download(str(repo), allow_patterns=patterns, **_hub_kwargs(hub_kwargs)))


def _open_pickle(file: Path) -> dict[str, torch.Tensor]:
    state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    if isinstance(state, Mapping) and "state_dict" in state and isinstance(state["state_dict"], Mapping):
        state = state["state_dict"]
    if not isinstance(state, Mapping):
        raise ValueError(f"{file} holds a {type(state).__name__}; expected a dict of tensors.")
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def _open_safetensors(file: Path):
    """`safe_open(file)`, with the file named in the error when it is truncated or not a safetensors file."""
    try:
        return safe_open(file, framework="pt")
    except Exception as err:  # safetensors raises its own SafetensorError (and OSError) without the path
        raise ValueError(
            f"cannot read {file}: {err} (a truncated download or not a safetensors file?)"
        ) from err


def read_json(file: Path) -> dict[str, Any]:
    """A JSON object from `file`; a malformed or non-UTF-8 file is an error naming it (and the line and column, or
    the offending byte)."""
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{file} is not UTF-8 text: byte {err.object[err.start]:#04x} at offset {err.start} (JSON files are UTF-8)."
        ) from err
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{file} is not valid JSON: {err.msg} at line {err.lineno}, column {err.colno}."
        ) from err
    if not isinstance(value, dict):
        raise ValueError(f"{file} holds a JSON {type(value).__name__}; expected an object.")
    return value


def read_shapes(files: Iterable[Path]) -> dict[str, tuple[tuple[int, ...], Path]]:
    """Tensor name -> (shape, file), from safetensors headers (pickles are loaded); names must be unique."""
    shapes: dict[str, tuple[tuple[int, ...], Path]] = {}
    for file in files:
        if file.suffix == ".safetensors":
            with _open_safetensors(file) as f:
                items = [(k, tuple(f.get_slice(k).get_shape())) for k in f.keys()]  # noqa: SIM118
        else:
            items = [(k, tuple(v.shape)) for k, v in _open_pickle(file).items()]
        for name, shape in items:
            if name in shapes:
                raise ValueError(f"tensor {name!r} appears in both {shapes[name][1]} and {file}.")
            shapes[name] = (shape, file)
    return shapes


def read_tensors(files: Iterable[Path]) -> dict[str, TensorSource]:
    """Every tensor of the files, by its name; names must be unique across files."""
    out: dict[str, TensorSource] = {}
    for file in files:
        if file.suffix == ".safetensors":
            with _open_safetensors(file) as f:
                items = [(k, f.get_tensor(k)) for k in f.keys()]  # noqa: SIM118
        else:
            items = list(_open_pickle(file).items())
        for name, tensor in items:
            if name in out:
                raise ValueError(f"tensor {name!r} appears in both {out[name].file} and {file}.")
            out[name] = TensorSource(name, file, tensor)
    return out


def read_checkpoint(
    path_or_repo: str | Path, *, allow_pickle: bool = False, hub_kwargs: Mapping[str, Any] | None = None
) -> Checkpoint:
    """Resolve a folder or Hub repo, refuse pickles unless `allow_pickle`, read config.json and tensor shapes.

    The returned `Checkpoint` has `layout=None`; `peagle.formats.inspect_checkpoint` fills it in.
    """
    folder = resolve_folder(path_or_repo, hub_kwargs)
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{folder} has no config.json; expected a drafter head checkpoint folder.")
    config = read_json(cfg_file)
    has_safetensors = any(folder.glob("*.safetensors")) or (folder / "model.safetensors.index.json").is_file()
    if not has_safetensors and not Path(path_or_repo).is_dir():  # a Hub repo without safetensors weights
        if allow_pickle:
            folder = _download_pickles(path_or_repo, hub_kwargs)
        else:
            _raise_if_remote_pickles(path_or_repo, hub_kwargs)
    files = weight_files(folder, allow_pickle=allow_pickle)
    return Checkpoint(path=folder, layout=None, config=config, files=files, shapes=read_shapes(files))


def write_checkpoint(
    out: Path, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], max_shard_size: int | str
) -> None:
    """Write `config.json` and safetensors shards into `out`, removing old `model*.safetensors` there first."""
    from huggingface_hub import save_torch_state_dict

    for old in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    save_torch_state_dict(dict(tensors), out, max_shard_size=max_shard_size, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


HEAD_FILES = re.compile(
    r"^(config\.json|generation_config\.json|.*\.safetensors|.*\.index\.json|pytorch_model.*\.bin|[^/]*\.py)$"
)
"""Names of the files a head folder's writer owns (config, weights and their index, remote code): `replacing_folder`
drops the old ones; anything else in the folder (examples, checkpoints, a README) is kept."""


@contextlib.contextmanager
def replacing_folder(folder: str | os.PathLike) -> Iterator[Path]:
    """Write a head into `folder` without ever leaving a mix of old and new files.

    Yields a new, empty sibling folder to write into.  When the block ends without an error, the old folder's
    entries that are not head files (`HEAD_FILES`: config, weights, weight index, remote code) and that the new
    write did not produce move over, and the new folder takes `folder`'s place: readers see the old head or the new
    one, never old shards beside a new index.  On an error the sibling is removed and `folder` stays as it was.
    """
    folder = Path(folder).expanduser().absolute()
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"{folder} is a file; expected a folder to write the head into.")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".writing", dir=folder.parent))
    try:
        yield tmp
        _swap_in(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful swap


def _swap_in(new: Path, folder: Path) -> None:
    """Make `new` the content of `folder` (see `replacing_folder`)."""
    umask = os.umask(0)
    os.umask(umask)
    mode = folder.stat().st_mode & 0o7777 if folder.is_dir() else 0o777 & ~umask
    os.chmod(new, mode)  # mkdtemp's folder is private (0o700); the head folder keeps its usual mode
    if not folder.exists():
        os.rename(new, folder)
        return
    for entry in list(folder.iterdir()):
        if not (entry.is_file() and HEAD_FILES.match(entry.name)) and not (new / entry.name).exists():
            os.rename(entry, new / entry.name)
    old = folder.with_name(f".{folder.name}.old-{uuid.uuid4().hex[:12]}")
    cwd = Path.cwd()
    try:
        if folder == cwd or folder in cwd.parents:  # renaming it would leave this process in a deleted folder
            raise OSError("the working folder")
        os.rename(folder, old)
    except OSError:  # e.g. the working folder or a mount point: replace entry by entry instead
        for entry in list(folder.iterdir()):
            if entry.is_file() and HEAD_FILES.match(entry.name):
                entry.unlink()
        for entry in list(new.iterdir()):
            target = folder / entry.name
            if target.is_dir():  # the new write's folder of that name replaces the old one
                shutil.rmtree(target)
            os.replace(entry, target)
        return
    os.rename(new, folder)
    shutil.rmtree(old, ignore_errors=True)
