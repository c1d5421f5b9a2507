"""Reading heads in every layout peagle knows: detection, shape checks, conversion (see `peagle.formats`)."""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..configuration_peagle import PEagleConfig, default_aux_layer_ids

logger = logging.getLogger(__name__)

LAYOUTS = ("peagle", "vllm", "speculators", "eagle3")
EXPORT_LAYOUTS = ("vllm", "speculators", "peagle")
VLLM_ARCHITECTURE = "LlamaForCausalLMEagle3"
VLLM_EAGLE3_ARCHITECTURES = (
    "LlamaForCausalLMEagle3",
    "Eagle3LlamaForCausalLM",
    "PEagleDraftModel",
    "PeagleLlamaForCausalLM",
)
MASK_TOKEN_KEYS = ("mask_token_id", "pard_token", "ptd_token_id")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
METADATA_KEY = "peagle"  # extra config.json block that carries peagle-only fields through foreign layouts
_NOT_WEIGHTS = re.compile(r"^(training_args|optimizer|scheduler|rng_state.*|scaler)\.(bin|pt|pth)$")
_IGNORED_TENSORS = re.compile(r"(^|\.)rotary_emb\.inv_freq$|^verifier_(lm_head|norm)\.weight$")
_UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")
_HUB_KWARGS = ("revision", "token", "cache_dir", "local_files_only", "force_download")


@dataclass
class Checkpoint:
    """A head checkpoint on local disk.

    Attributes:
        path: the folder (a Hub repo is first downloaded to the local cache).
        layout: one of `LAYOUTS`.
        config: the parsed `config.json`.
        files: the weight files, safetensors unless pickles were explicitly allowed.
        shapes: tensor name -> (shape, file), read from the file headers.
    """

    path: Path
    layout: str
    config: dict[str, Any]
    files: list[Path]
    shapes: dict[str, tuple[tuple[int, ...], Path]]


@dataclass
class _Source:
    name: str  # the tensor's name in its own file
    file: Path
    tensor: torch.Tensor


# ---------------------------------------------------------------------------------------------- reading
def resolve_folder(path_or_repo: str | Path, hub_kwargs: Mapping[str, Any] | None = None) -> Path:
    """A local folder as is; otherwise a Hub repo id, downloaded with `huggingface_hub.snapshot_download`."""
    path = Path(path_or_repo)
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(
            f"{path} is a file; expected a folder (or Hub repo id) holding config.json and weights."
        )
    from huggingface_hub import snapshot_download

    kwargs = {k: hub_kwargs[k] for k in _HUB_KWARGS if hub_kwargs and hub_kwargs.get(k) is not None}
    patterns = ["*.json", "*.safetensors", "*.py", "*.md", "*.txt"]
    return Path(snapshot_download(str(path_or_repo), allow_patterns=patterns, **kwargs))


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


def _open_pickle(file: Path) -> dict[str, torch.Tensor]:
    state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    if isinstance(state, Mapping) and "state_dict" in state and isinstance(state["state_dict"], Mapping):
        state = state["state_dict"]
    if not isinstance(state, Mapping):
        raise ValueError(f"{file} holds a {type(state).__name__}; expected a dict of tensors.")
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def _read_shapes(files: Iterable[Path]) -> dict[str, tuple[tuple[int, ...], Path]]:
    shapes: dict[str, tuple[tuple[int, ...], Path]] = {}
    for file in files:
        if file.suffix == ".safetensors":
            with safe_open(file, framework="pt") as f:
                items = [(k, tuple(f.get_slice(k).get_shape())) for k in f.keys()]  # noqa: SIM118
        else:
            items = [(k, tuple(v.shape)) for k, v in _open_pickle(file).items()]
        for name, shape in items:
            if name in shapes:
                raise ValueError(f"tensor {name!r} appears in both {shapes[name][1]} and {file}.")
            shapes[name] = (shape, file)
    return shapes


def _read_tensors(files: Iterable[Path]) -> dict[str, _Source]:
    out: dict[str, _Source] = {}
    for file in files:
        if file.suffix == ".safetensors":
            with safe_open(file, framework="pt") as f:
                items = [(k, f.get_tensor(k)) for k in f.keys()]  # noqa: SIM118
        else:
            items = list(_open_pickle(file).items())
        for name, tensor in items:
            if name in out:
                raise ValueError(f"tensor {name!r} appears in both {out[name].file} and {file}.")
            out[name] = _Source(name, file, tensor)
    return out


def _strip_model_prefix(name: str) -> str:
    return name[len("model.") :] if name.startswith("model.") else name


def detect_layout(config: Mapping[str, Any], tensor_names: Iterable[str], where: str = "checkpoint") -> str:
    """Tell a checkpoint's layout (one of `LAYOUTS`) from its `config.json` and tensor names."""
    if config.get("model_type") == PEagleConfig.model_type:
        return "peagle"
    kind = config.get("speculators_model_type")
    if kind is not None:
        if kind not in ("peagle", "eagle3"):
            raise ValueError(
                f"{where}: speculators_model_type is {kind!r}; peagle reads 'peagle' and 'eagle3'."
            )
        return "speculators"
    names = {_strip_model_prefix(n) for n in tensor_names}
    fused = any(n.startswith(("midlayer.", "layers.0.")) for n in names)
    if not fused or "fc.weight" not in names:
        raise ValueError(
            f"{where}: cannot tell the layout. config.json has model_type {config.get('model_type')!r} and no "
            "speculators_model_type, and the tensors are not an EAGLE-3 layout (midlayer.* or layers.0.* "
            f"plus fc.weight). Known layouts: {', '.join(LAYOUTS)}."
        )
    if any(config.get(k) is not None for k in MASK_TOKEN_KEYS) or "mask_hidden" in names:
        return "vllm"
    return "eagle3"


def inspect_checkpoint(
    path_or_repo: str | Path, *, allow_pickle: bool = False, hub_kwargs: Mapping[str, Any] | None = None
) -> Checkpoint:
    """Resolve a folder or Hub repo, refuse pickles unless `allow_pickle`, read config.json and tensor shapes."""
    folder = resolve_folder(path_or_repo, hub_kwargs)
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{folder} has no config.json; expected a drafter head checkpoint folder.")
    config = json.loads(cfg_file.read_text())
    has_safetensors = any(folder.glob("*.safetensors")) or (folder / "model.safetensors.index.json").is_file()
    if not has_safetensors and not Path(path_or_repo).is_dir():  # a Hub repo without safetensors weights
        if allow_pickle:
            folder = _download_pickles(path_or_repo, hub_kwargs)
        else:
            _raise_if_remote_pickles(path_or_repo, hub_kwargs)
    files = weight_files(folder, allow_pickle=allow_pickle)
    shapes = _read_shapes(files)
    layout = detect_layout(config, shapes, where=str(cfg_file))
    return Checkpoint(path=folder, layout=layout, config=config, files=files, shapes=shapes)


def _raise_if_remote_pickles(repo: str | Path, hub_kwargs: Mapping[str, Any] | None) -> None:
    from huggingface_hub import list_repo_files

    kwargs = {k: hub_kwargs[k] for k in ("revision", "token") if hub_kwargs and hub_kwargs.get(k) is not None}
    try:
        pickles = [f for f in list_repo_files(str(repo), **kwargs) if f.endswith(PICKLE_SUFFIXES)]
    except Exception:  # offline or private: weight_files() reports the missing weights
        return
    if pickles:
        raise ValueError(
            f"Hub repo {repo} holds only pickle checkpoints ({', '.join(pickles)}); peagle refuses them by "
            "default because unpickling can run arbitrary code. Pass allow_pickle=True if you trust it."
        )


def _download_pickles(repo: str | Path, hub_kwargs: Mapping[str, Any] | None) -> Path:
    from huggingface_hub import snapshot_download

    kwargs = {k: hub_kwargs[k] for k in _HUB_KWARGS if hub_kwargs and hub_kwargs.get(k) is not None}
    patterns = ["*.json", *[f"*{s}" for s in PICKLE_SUFFIXES]]
    return Path(snapshot_download(str(repo), allow_patterns=patterns, **kwargs))


# ---------------------------------------------------------------------------------------------- checks
def _expected_shapes(cls: type, config: PEagleConfig) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    """Shapes of every persistent tensor of `cls(config)` (built on the meta device) and its ignorable keys."""
    with torch.device("meta"):
        model = cls(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    ignorable = list(getattr(model, "_keys_to_ignore_on_load_missing", None) or [])
    return shapes, ignorable


def _describe(config: PEagleConfig) -> str:
    c = config
    return (
        f"hidden_size={c.hidden_size}, target_hidden_size={c.target_hidden_size}, num_hidden_layers="
        f"{c.num_hidden_layers}, heads={c.num_attention_heads}/{c.num_key_value_heads} x head_dim={c.head_dim}, "
        f"intermediate_size={c.intermediate_size}, vocab_size={c.vocab_size}, draft_vocab_size={c.draft_vocab_size}"
    )


def check_native(checkpoint: Checkpoint, cls: type | None = None, config: PEagleConfig | None = None) -> None:
    """Check a peagle-layout checkpoint against its config before transformers loads it.

    Raises `ValueError` naming the file and tensor for any shape mismatch, missing or unexpected tensor.
    """
    if cls is None:
        from ..modeling_peagle import PEagleDrafter as cls
    if not isinstance(config, PEagleConfig):
        config = cls.config_class.from_pretrained(checkpoint.path)
    expected, ignorable = _expected_shapes(cls, config)
    cfg_file = checkpoint.path / "config.json"
    for name, (shape, file) in checkpoint.shapes.items():
        if name in expected and shape != expected[name]:
            raise ValueError(
                f"{file}: tensor {name!r} has shape {shape}; {cfg_file} ({_describe(config)}) expects "
                f"{expected[name]}."
            )
    unexpected = sorted(n for n in checkpoint.shapes if n not in expected and not _IGNORED_TENSORS.search(n))
    if unexpected:
        files = sorted({str(checkpoint.shapes[n][1]) for n in unexpected})
        raise ValueError(
            f"{', '.join(files)}: unexpected tensors {unexpected} for a peagle head ({_describe(config)})."
        )
    missing = [
        n for n in expected if n not in checkpoint.shapes and not any(re.search(p, n) for p in ignorable)
    ]
    if missing:
        files = ", ".join(str(f) for f in checkpoint.files)
        raise ValueError(f"{files}: missing tensors {missing} required by {cfg_file}.")


# ---------------------------------------------------------------------------------------------- conversion
def _rope_parameters(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """transformers >= 5 `rope_parameters` from either that key or legacy `rope_theta` + `rope_scaling`."""
    params = cfg.get("rope_parameters")
    if isinstance(params, Mapping) and params:
        rope = dict(params)
    else:
        rope = dict(cfg.get("rope_scaling") or {})
    if "type" in rope:
        rope.setdefault("rope_type", rope["type"])
        del rope["type"]
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", float(cfg.get("rope_theta") or 10000.0))
    return rope


def _llama_fields(cfg: Mapping[str, Any], where: str) -> dict[str, Any]:
    missing = [k for k in ("hidden_size", "num_attention_heads", "vocab_size") if cfg.get(k) is None]
    if missing:
        raise ValueError(f"{where} lacks {missing}; expected a Llama-style drafter config.")
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    fields: dict[str, Any] = {
        "hidden_size": hidden,
        "intermediate_size": int(cfg.get("intermediate_size") or 4 * hidden),
        "num_attention_heads": heads,
        "num_key_value_heads": int(cfg.get("num_key_value_heads") or heads),
        "head_dim": int(cfg.get("head_dim") or hidden // heads),
        "hidden_act": cfg.get("hidden_act") or "silu",
        "max_position_embeddings": int(cfg.get("max_position_embeddings") or 2048),
        "rms_norm_eps": float(cfg.get("rms_norm_eps") or 1e-6),
        "rope_parameters": _rope_parameters(cfg),
        "attention_bias": bool(cfg.get("attention_bias", False)),
        "mlp_bias": bool(cfg.get("mlp_bias", False)),
        "vocab_size": int(cfg["vocab_size"]),
        "tie_word_embeddings": False,
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "initializer_range"):
        if cfg.get(key) is not None:
            fields[key] = cfg[key]
    return fields


def _mask_token(cfg: Mapping[str, Any], where: str) -> int | None:
    values = {k: int(cfg[k]) for k in MASK_TOKEN_KEYS if cfg.get(k) is not None}
    if len(set(values.values())) > 1:
        raise ValueError(f"{where} names different mask tokens {values}; expected one id.")
    return next(iter(values.values()), None)


def _layout_name(layout: str, name: str) -> str:
    """A peagle tensor name as the given layout spells it (for error messages and export)."""
    if layout in ("vllm", "eagle3") and name.startswith("layers.0."):
        return "midlayer." + name[len("layers.0.") :]
    return name


def _num_layers(state: Mapping[str, _Source], declared: Any, layout: str, where: str) -> int:
    found = {int(m.group(1)) for n in state if (m := re.match(r"layers\.(\d+)\.", n))}
    if 0 not in found:
        raise ValueError(
            f"{where}: no fused first layer ({_layout_name(layout, 'layers.0.')}*) in the weights."
        )
    count = max(found) + 1
    gaps = sorted(set(range(count)) - found)
    if gaps:
        raise ValueError(
            f"{where}: decoder layers {gaps} are missing from the weights (found {sorted(found)})."
        )
    if declared is not None and int(declared) != count:
        raise ValueError(
            f"{where} declares num_hidden_layers={declared}, but the weights hold {count} decoder layers "
            f"({_layout_name(layout, 'layers.0.')}* and layers.1..{count - 1}.*); num_hidden_layers counts the fused layer."
        )
    return count


def _aux_ids(cfg: Mapping[str, Any]) -> list[int] | None:
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if not ids and isinstance(cfg.get("eagle_config"), Mapping):
        ids = cfg["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
    return [int(i) for i in ids] if ids else None


def _convert(
    checkpoint: Checkpoint, tensors: Mapping[str, _Source]
) -> tuple[dict[str, Any], dict[str, _Source]]:
    """Map a foreign checkpoint to (PEagleConfig kwargs, peagle tensor name -> source tensor)."""
    cfg, layout = checkpoint.config, checkpoint.layout
    where = str(checkpoint.path / "config.json")
    meta = dict(cfg.get(METADATA_KEY) or {})
    if layout == "speculators":
        llama_cfg = cfg.get("transformer_layer_config")
        if not isinstance(llama_cfg, Mapping):
            raise ValueError(f"{where}: speculators config without a transformer_layer_config dict.")
        if llama_cfg.get("model_type", "llama") != "llama":
            raise ValueError(
                f"{where}: transformer_layer_config.model_type is {llama_cfg['model_type']!r}; peagle's drafter "
                "is Llama-style (expected 'llama')."
            )
        kind = cfg["speculators_model_type"]
        parallel = kind == "peagle"
        norm_default = not parallel  # vLLM: eagle3 defaults norm_before_residual to True, peagle to False
        spec = cfg.get("speculators_config") or {}
        methods = spec.get("proposal_methods") or [{}]
        meta.setdefault("num_speculative_tokens", methods[0].get("speculative_tokens"))
        meta.setdefault("target_model_name", (spec.get("verifier") or {}).get("name_or_path"))
        if cfg.get("para_depths") is not None:
            meta.setdefault("num_parallel_positions", cfg["para_depths"])
        rename = {n: n for n in tensors}
    else:
        llama_cfg = cfg
        parallel = layout == "vllm"
        norm_default = False
        eagle_cfg = cfg.get("eagle_config")
        if isinstance(eagle_cfg, Mapping) and eagle_cfg.get("use_aux_hidden_state", True) is False:
            raise ValueError(
                f"{where}: eagle_config.use_aux_hidden_state is false; peagle needs the 3-layer fc."
            )
        rename = {}
        for name in tensors:
            new = _strip_model_prefix(name)
            if new.startswith("midlayer."):
                new = "layers.0." + new[len("midlayer.") :]
            rename[name] = new
    for key in _UNSUPPORTED_FLAGS:
        if cfg.get(key):
            raise ValueError(
                f"{where}: {key}=true adds a norm peagle's drafter does not have; expected false or absent."
            )

    state: dict[str, _Source] = {}
    for name, new in rename.items():
        if _IGNORED_TENSORS.search(name):
            continue
        if new in state:
            raise ValueError(
                f"{tensors[name].file}: tensors {state[new].name!r} and {name!r} both map to {new!r}."
            )
        state[new] = tensors[name]

    fields = _llama_fields(llama_cfg, where)
    fields["num_hidden_layers"] = _num_layers(state, llama_cfg.get("num_hidden_layers"), layout, where)
    mask_id = _mask_token(cfg, where)
    if parallel and mask_id is None:
        keys = " / ".join(MASK_TOKEN_KEYS)
        raise ValueError(f"{where}: parallel-drafting head without a mask token id; expected one of {keys}.")
    if parallel and "mask_hidden" not in state:
        files = ", ".join(str(f) for f in checkpoint.files)
        raise ValueError(
            f"{files}: mask_hidden not found in the weights, but {where} sets mask token {mask_id} (parallel "
            f"drafting); expected a tensor of 3 x {fields['hidden_size']} elements."
        )
    fc = state.get("fc.weight")
    if fc is None:
        raise ValueError(f"{', '.join(str(f) for f in checkpoint.files)}: missing tensor 'fc.weight'.")
    lm_head = state.get("lm_head.weight")
    draft_vocab = cfg.get("draft_vocab_size") or cfg.get("truncated_vocab_size")
    if draft_vocab is None:
        draft_vocab = lm_head.tensor.shape[0] if lm_head is not None else fields["vocab_size"]
    target_hidden = (
        cfg.get("target_hidden_size") or llama_cfg.get("target_hidden_size") or fc.tensor.shape[-1] // 3
    )
    config = {
        **fields,
        "draft_vocab_size": int(draft_vocab),
        "target_hidden_size": int(target_hidden),
        "eagle_aux_hidden_state_layer_ids": _aux_ids(cfg),
        "norm_before_residual": bool(cfg.get("norm_before_residual", norm_default)),
        "drafting_mode": "parallel" if parallel else "autoregressive",
        "mask_token_id": mask_id if mask_id is not None else int(fields["vocab_size"]) - 1,
    }
    for key in (
        "num_parallel_positions",
        "num_speculative_tokens",
        "target_model_name",
        "target_num_hidden_layers",
    ):
        if meta.get(key) is not None:
            config[key] = meta[key]
    return config, state


def _vocab_maps(state: dict[str, _Source], config: Mapping[str, Any], files: str) -> None:
    """Check/complete `d2t` (offsets) and `t2d` in `state` in place."""
    vocab, draft = int(config["vocab_size"]), int(config["draft_vocab_size"])
    d2t = state.get("d2t")
    if d2t is None:
        if draft != vocab:
            raise ValueError(
                f"{files}: missing tensor 'd2t' although draft_vocab_size {draft} < vocab_size {vocab}."
            )
        offsets = torch.zeros(draft, dtype=torch.long)
        state["d2t"] = _Source("d2t", Path("<identity>"), offsets)
    else:
        offsets = d2t.tensor.to(torch.long).flatten()
        if offsets.numel() == draft:
            target = torch.arange(draft) + offsets
            if int(target.min()) < 0 or int(target.max()) >= vocab or target.unique().numel() != draft:
                hint = ""
                if (
                    int(offsets.min()) >= 0
                    and int(offsets.max()) < vocab
                    and offsets.unique().numel() == draft
                ):
                    hint = (
                        " It looks like absolute target ids; d2t must hold offsets (target id = i + d2t[i])."
                    )
                raise ValueError(
                    f"{d2t.file}: tensor 'd2t' maps draft ids outside [0, {vocab}) or twice onto one target id.{hint}"
                )
        state["d2t"] = _Source(d2t.name, d2t.file, offsets)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    if state["d2t"].tensor.numel() == draft:
        t2d[torch.arange(draft) + state["d2t"].tensor] = True
    old = state.get("t2d")
    if (
        old is not None
        and old.tensor.numel() == vocab
        and not torch.equal(old.tensor.to(torch.bool).flatten(), t2d)
    ):
        raise ValueError(
            f"{old.file}: tensor 't2d' disagrees with 'd2t' (t2d must be True exactly at i + d2t[i])."
        )
    state["t2d"] = _Source(old.name if old else "t2d", old.file if old else Path("<from d2t>"), t2d)


def _resolve_dtype(dtype: Any, fallback: torch.dtype) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return fallback if fallback.is_floating_point else torch.float32
    if isinstance(dtype, str):
        return getattr(torch, dtype)
    return dtype


def load_converted(
    checkpoint: Checkpoint,
    cls: type | None = None,
    target_model: Any = None,
    dtype: torch.dtype | str | None = None,
) -> Any:
    """Build a `cls` (default `PEagleDrafter`) from a foreign-layout checkpoint.

    Missing `embed_tokens.weight` / `lm_head.weight` are taken from `target_model` when given (the lm_head
    rows of the draft vocabulary, `i + d2t[i]`); otherwise the error names the missing tensor.  Every
    tensor's shape is checked against the converted config; errors name the file and the tensor.
    """
    if cls is None:
        from ..modeling_peagle import PEagleDrafter as cls
    files = ", ".join(str(f) for f in checkpoint.files)
    tensors = _read_tensors(checkpoint.files)
    config_kwargs, state = _convert(checkpoint, tensors)
    layout = checkpoint.layout

    tc = None
    if target_model is not None:
        tc = (
            target_model.config.get_text_config()
            if hasattr(target_model.config, "get_text_config")
            else target_model.config
        )
        if config_kwargs["eagle_aux_hidden_state_layer_ids"] is None:
            config_kwargs["eagle_aux_hidden_state_layer_ids"] = default_aux_layer_ids(
                int(tc.num_hidden_layers)
            )
        config_kwargs.setdefault("target_num_hidden_layers", int(tc.num_hidden_layers))
        config_kwargs.setdefault("target_model_name", getattr(tc, "_name_or_path", None) or None)
    if "embed_tokens.weight" not in state:
        if target_model is None:
            raise ValueError(
                f"{files}: missing tensor 'embed_tokens.weight' (the head shares its target's embeddings); pass "
                "target_model= to take them from the target."
            )
        config_kwargs["embed_from_target"] = True
    config = cls.config_class(**config_kwargs)
    _vocab_maps(state, config_kwargs, files)
    if config.embed_from_target:
        emb = target_model.get_input_embeddings().weight.detach()
        if tuple(emb.shape) != (config.vocab_size, config.hidden_size):
            raise ValueError(
                f"target input embeddings have shape {tuple(emb.shape)}; the head ({files}) expects "
                f"({config.vocab_size}, {config.hidden_size})."
            )
        state["mask_embedding"] = _Source(
            "embed_tokens.weight", Path("<target>"), emb[config.mask_token_id][None].clone()
        )
    if "lm_head.weight" not in state:
        out_emb = target_model.get_output_embeddings() if target_model is not None else None
        if out_emb is None:
            raise ValueError(
                f"{files}: missing tensor 'lm_head.weight'; pass target_model= to take the draft-vocabulary rows "
                "of the target's lm_head."
            )
        weight = out_emb.weight.detach()
        if tuple(weight.shape) != (config.vocab_size, config.hidden_size):
            raise ValueError(
                f"target lm_head has shape {tuple(weight.shape)}; the head ({files}) expects "
                f"({config.vocab_size}, {config.hidden_size}) to take its rows."
            )
        ids = torch.arange(config.draft_vocab_size) + state["d2t"].tensor
        state["lm_head.weight"] = _Source(
            "lm_head.weight", Path("<target>"), weight[ids.to(weight.device)].clone()
        )
    if config.drafting_mode == "parallel":
        mh = state["mask_hidden"]
        if mh.tensor.numel() != 3 * config.target_hidden_size:
            raise ValueError(
                f"{mh.file}: tensor {mh.name!r} has {mh.tensor.numel()} elements (shape {tuple(mh.tensor.shape)}); "
                f"expected 3 x target_hidden_size = {3 * config.target_hidden_size}."
            )
        state["mask_hidden"] = _Source(mh.name, mh.file, mh.tensor.reshape(1, 1, -1))
    else:
        state["mask_hidden"] = _Source(
            "mask_hidden", Path("<unused>"), torch.zeros(1, 1, 3 * config.target_hidden_size)
        )

    expected, _ = _expected_shapes(cls, config)
    cfg_file = checkpoint.path / "config.json"
    for name, src in state.items():
        if name in expected and tuple(src.tensor.shape) != expected[name]:
            raise ValueError(
                f"{src.file}: tensor {src.name!r} has shape {tuple(src.tensor.shape)}; {cfg_file} ({layout} layout: "
                f"{_describe(config)}) expects {expected[name]} for {_layout_name(layout, name)!r}."
            )
    unexpected = sorted(src.name for n, src in state.items() if n not in expected)
    if unexpected:
        raise ValueError(
            f"{files}: unexpected tensors {unexpected} for a {layout}-layout head ({_describe(config)})."
        )
    skip = {"embed_tokens.weight"} if config.embed_from_target else set()
    missing = [_layout_name(layout, n) for n in expected if n not in state and n not in skip]
    if missing:
        raise ValueError(f"{files}: missing tensors {missing} required by {cfg_file} ({layout} layout).")

    dtype = _resolve_dtype(dtype, state["fc.weight"].tensor.dtype)
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        no_init_weights = contextlib.nullcontext
    with no_init_weights():
        model = cls._from_config(config, dtype=dtype)
    result = model.load_state_dict({n: s.tensor for n, s in state.items()}, strict=False)
    left = [k for k in result.missing_keys if k not in skip]
    if left or result.unexpected_keys:
        raise ValueError(
            f"{files}: state dict mismatch after conversion: missing {left}, unexpected {result.unexpected_keys}."
        )
    model.config._name_or_path = str(checkpoint.path)
    model.eval()
    if target_model is not None:
        model.attach_target(target_model)
    logger.info("loaded a %s-layout head from %s (%s)", layout, checkpoint.path, config.drafting_mode)
    return model
