"""Checks of a checkpoint's tensors against its config, before anything is loaded into a model.

Every error names the file and the tensor (in the checkpoint's own spelling) and the config it contradicts,
so a broken or mislabelled checkpoint fails with a message instead of a silent mis-load.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..configuration_peagle import PEagleConfig
from ..modeling_peagle import PEagleDrafter
from .io import Checkpoint, TensorSource

IGNORED_TENSORS = re.compile(r"(^|\.)rotary_emb\.inv_freq$|^verifier_(lm_head|norm)\.weight$")
"""Tensors some layouts store that a head does not need (recomputed or the verifier's own)."""


def expected_shapes(cls: type, config: PEagleConfig) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    """Shapes of every persistent tensor of `cls(config)` (built on the meta device) and its ignorable keys."""
    shapes, _, ignorable = _expected(cls, config)
    return shapes, ignorable


def _expected(cls: type, config: PEagleConfig):
    with torch.device("meta"):
        model = cls(config)
    state = model.state_dict()
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    kinds = {k: dtype_kind(v.dtype) for k, v in state.items()}
    ignorable = list(getattr(model, "_keys_to_ignore_on_load_missing", None) or [])
    return shapes, kinds, ignorable


def dtype_kind(dtype: torch.dtype | str) -> str:
    """`"float"`, `"int"` or `"bool"` of a torch dtype or a safetensors dtype name (`"F32"`, `"I64"`, `"BOOL"`).

    >>> dtype_kind(torch.bfloat16), dtype_kind("I64"), dtype_kind(torch.bool)
    ('float', 'int', 'bool')
    """
    if isinstance(dtype, str):
        name = dtype.upper()
        return "bool" if name == "BOOL" else "float" if name.startswith(("F", "BF")) else "int"
    if dtype == torch.bool:
        return "bool"
    return "float" if dtype.is_floating_point else "int"


def _stored_kinds(files: list[Path]) -> dict[str, tuple[str, Path]]:
    """Tensor name -> (dtype kind, file) from safetensors headers (no tensor data is read)."""
    from safetensors import safe_open

    kinds: dict[str, tuple[str, Path]] = {}
    for file in files:
        if file.suffix == ".safetensors":
            with safe_open(file, framework="pt") as f:
                for k in f.keys():  # noqa: SIM118
                    kinds[k] = (dtype_kind(f.get_slice(k).get_dtype()), file)
    return kinds


def _check_kind(name: str, stored: str, expected: str, file: Any, where: str) -> None:
    if stored != expected:
        raise ValueError(
            f"{file}: tensor {name!r} holds {stored} values; {where} expects {expected} values (a {stored} tensor "
            "is not cast: the checkpoint is broken or mislabelled)."
        )


def describe(config: PEagleConfig) -> str:
    """The config fields that decide tensor shapes, for error messages."""
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
    cls = cls or PEagleDrafter
    if not isinstance(config, PEagleConfig):
        config = cls.config_class.from_pretrained(checkpoint.path)
    expected, kinds, ignorable = _expected(cls, config)
    cfg_file = checkpoint.path / "config.json"
    for name, (shape, file) in checkpoint.shapes.items():
        if name in expected and shape != expected[name]:
            raise ValueError(
                f"{file}: tensor {name!r} has shape {shape}; {cfg_file} ({describe(config)}) expects "
                f"{expected[name]}."
            )
    for name, (kind, file) in _stored_kinds(list(checkpoint.files)).items():
        if name in kinds:
            _check_kind(name, kind, kinds[name], file, f"a peagle head ({cfg_file})")
    unexpected = sorted(n for n in checkpoint.shapes if n not in expected and not IGNORED_TENSORS.search(n))
    if unexpected:
        files = sorted({str(checkpoint.shapes[n][1]) for n in unexpected})
        raise ValueError(
            f"{', '.join(files)}: unexpected tensors {unexpected} for a peagle head ({describe(config)})."
        )
    missing = [
        n for n in expected if n not in checkpoint.shapes and not any(re.search(p, n) for p in ignorable)
    ]
    if missing:
        files = ", ".join(str(f) for f in checkpoint.files)
        raise ValueError(f"{files}: missing tensors {missing} required by {cfg_file}.")
    _check_native_vocab_maps(checkpoint, config)


def _read_tensor(file: Path, name: str) -> torch.Tensor:
    if file.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(file, framework="pt") as f:
            return f.get_tensor(name)
    return torch.load(file, map_location="cpu", weights_only=True)[name]


def _check_native_vocab_maps(checkpoint: Checkpoint, config: PEagleConfig) -> None:
    """`d2t` / `t2d` of a peagle-layout checkpoint: the map `check_d2t` wants, `t2d` True exactly at its targets."""
    if "d2t" not in checkpoint.shapes:
        return
    file = checkpoint.shapes["d2t"][1]
    offsets = _read_tensor(file, "d2t").to(torch.long).flatten()
    targets = check_d2t(offsets, int(config.vocab_size), file)
    if "t2d" in checkpoint.shapes:
        t2d_file = checkpoint.shapes["t2d"][1]
        expected = torch.zeros(int(config.vocab_size), dtype=torch.bool)
        expected[targets] = True
        if not torch.equal(_read_tensor(t2d_file, "t2d").to(torch.bool).flatten(), expected):
            raise ValueError(
                f"{t2d_file}: tensor 't2d' disagrees with 'd2t' (t2d must be True exactly at i + d2t[i])."
            )


def check_d2t(offsets: torch.Tensor, vocab_size: int, file: Any) -> torch.Tensor:
    """The target ids `i + d2t[i]` of a draft-vocabulary map; raises `ValueError` naming `file` and the first bad
    entry when one falls outside `[0, vocab_size)` (a negative one would wrap round when indexing) or two draft ids
    map onto one target id.

    >>> check_d2t(torch.tensor([0, 1, 1]), 8, "model.safetensors").tolist()
    [0, 2, 3]
    >>> check_d2t(torch.tensor([0, -2, 1]), 8, "model.safetensors")
    Traceback (most recent call last):
    ...
    ValueError: model.safetensors: tensor 'd2t' maps draft id 1 to target id -1 (d2t[1] = -2), outside [0, 8).
    """
    offsets = offsets.to(torch.long).flatten()
    targets = torch.arange(offsets.numel()) + offsets
    outside = ((targets < 0) | (targets >= vocab_size)).nonzero().flatten()
    if outside.numel():
        i = int(outside[0])
        hint = ""
        if (
            int(offsets.min()) >= 0
            and int(offsets.max()) < vocab_size
            and offsets.unique().numel() == offsets.numel()
        ):
            hint = " It looks like absolute target ids; d2t must hold offsets (target id = i + d2t[i])."
        raise ValueError(
            f"{file}: tensor 'd2t' maps draft id {i} to target id {int(targets[i])} (d2t[{i}] = {int(offsets[i])}), "
            f"outside [0, {vocab_size}).{hint}"
        )
    unique, counts = targets.unique(return_counts=True)
    if bool((counts > 1).any()):
        twice = int(unique[counts > 1][0])
        ids = (targets == twice).nonzero().flatten().tolist()
        raise ValueError(
            f"{file}: tensor 'd2t' maps draft ids {ids} all to target id {twice}; each target id may appear once."
        )
    return targets


def check_converted(
    state: Mapping[str, TensorSource],
    cls: type,
    config: PEagleConfig,
    checkpoint: Checkpoint,
    tensor_name: Callable[[str], str],
    skip: set[str],
) -> None:
    """Check a converted state (peagle name -> source) against `cls(config)`: shapes, unexpected, missing.

    `tensor_name` spells a peagle tensor name the way the checkpoint's layout does; `skip` lists tensors
    that may be missing (the target's embeddings of an `embed_from_target` head).
    """
    layout = checkpoint.layout
    files = ", ".join(str(f) for f in checkpoint.files)
    expected, kinds, _ = _expected(cls, config)
    cfg_file = checkpoint.path / "config.json"
    for name, src in state.items():
        if name in kinds:
            _check_kind(
                src.name, dtype_kind(src.tensor.dtype), kinds[name], src.file, f"a {layout}-layout head"
            )
        if name in expected and tuple(src.tensor.shape) != expected[name]:
            raise ValueError(
                f"{src.file}: tensor {src.name!r} has shape {tuple(src.tensor.shape)}; {cfg_file} ({layout} layout: "
                f"{describe(config)}) expects {expected[name]} for {tensor_name(name)!r}."
            )
    unexpected = sorted(src.name for n, src in state.items() if n not in expected)
    if unexpected:
        raise ValueError(
            f"{files}: unexpected tensors {unexpected} for a {layout}-layout head ({describe(config)})."
        )
    missing = [tensor_name(n) for n in expected if n not in state and n not in skip]
    if missing:
        raise ValueError(f"{files}: missing tensors {missing} required by {cfg_file} ({layout} layout).")


def complete_vocab_maps(state: dict[str, TensorSource], config: Mapping[str, Any], files: str) -> None:
    """Check `d2t` (offsets, `(draft_vocab_size,)`) and `t2d` (`(vocab_size,)` bool) in `state`, in place.

    A missing `d2t` is the identity when the draft vocabulary is the full one; `t2d` is always recomputed
    from `d2t` (and must agree with a stored one).
    """
    vocab, draft = int(config["vocab_size"]), int(config["draft_vocab_size"])
    d2t = state.get("d2t")
    if d2t is None:
        if draft != vocab:
            raise ValueError(
                f"{files}: missing tensor 'd2t' although draft_vocab_size {draft} < vocab_size {vocab}."
            )
        offsets = torch.zeros(draft, dtype=torch.long)
        state["d2t"] = TensorSource("d2t", Path("<identity>"), offsets)
    else:
        offsets = d2t.tensor.to(torch.long).flatten()
        if offsets.numel() == draft:
            check_d2t(offsets, vocab, d2t.file)
        state["d2t"] = TensorSource(d2t.name, d2t.file, offsets)
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
    state["t2d"] = TensorSource(old.name if old else "t2d", old.file if old else Path("<from d2t>"), t2d)
