"""Import and export of drafter heads in the checkpoint layouts found in the wild (docs/formats.md).

A registry of layouts, one small module each, with `detect(config, tensor_names) -> bool`, `to_peagle`
(convert in) and `from_peagle` (convert out, where peagle writes the layout):

    layout         module          reads  writes  what
    "peagle"       peagle.py       yes    yes     this library's own (`model_type: "peagle"`)
    "speculators"  speculators.py  yes    yes     vllm-project/speculators (`speculators_model_type`)
    "vllm"         vllm.py         yes    yes     AWS P-EAGLE heads: vLLM's EAGLE-3 drafter + mask token
    "eagle3"       eagle3.py       yes    no      EAGLE-3 research heads (autoregressive)

`load_head(path_or_id, ...)` (also `PEagleDrafter.from_pretrained`, registered below) reads any of them:
`io` resolves the folder or Hub repo and applies the pickle policy (safetensors only unless
`allow_pickle=True`), the registry tells the layout, `checks` checks every tensor against the config, and
`convert` builds the head.  Users never pick a layout by hand.  `export(head, out_dir, layout=...)` writes
one.  Each layout module cites the upstream sources its names were checked against; `llama` holds the
Llama-style config fields the foreign layouts share.

Importing this package registers `load_head` with `PEagleDrafter.register_checkpoint_loader`, `io.replacing_folder`
with `PEagleDrafter.register_folder_writer` (`save_pretrained` then swaps a fully written folder in), and (`auto`) the
model types of the vLLM and speculators exports with `AutoConfig`/`AutoModel`, so that
`AutoModel.from_pretrained(<export>)` returns a `PEagleDrafter` too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from ..configuration_peagle import MAX_SPECULATIVE_TOKENS, PEagleConfig, refuse_shape_overrides
from ..modeling_peagle import PEagleDrafter
from . import eagle3, speculators, vllm
from . import peagle as native
from .auto import register_auto_classes
from .checks import check_native
from .convert import assemble_head
from .io import (
    Checkpoint,
    TensorSource,
    read_checkpoint,
    read_json,
    read_shapes,
    read_tensors,
    replacing_folder,
    resolve_folder,
    weight_files,
)
from .speculators import speculators_config
from .vllm import ARCHITECTURE as VLLM_ARCHITECTURE
from .vllm import EAGLE3_ARCHITECTURES as VLLM_EAGLE3_ARCHITECTURES
from .vllm import speculative_config, vllm_config


def _same_name(name: str) -> str:
    return name


@dataclasses.dataclass(frozen=True)
class Layout:
    """One checkpoint layout (see the module docstring).

    Attributes:
        name: the key in `LAYOUTS`, the `layout=` of `export`.
        detect: `(config dict, tensor names) -> bool`; may raise `ValueError` for a layout of its family
            that peagle cannot read.
        to_peagle: `(checkpoint, tensors) -> (PEagleConfig kwargs, peagle tensor name -> TensorSource)`;
            None for peagle's own layout, which transformers loads as is.
        from_peagle: `(head, out_dir, *, target_model, num_speculative_tokens, max_shard_size, verifier)`,
            writing the layout; None if peagle does not write it.
        tensor_name: a peagle tensor name as the layout spells it (for error messages).
    """

    name: str
    detect: Callable[[Mapping[str, Any], Collection[str]], bool]
    to_peagle: Callable[..., tuple[dict[str, Any], dict[str, TensorSource]]] | None = None
    from_peagle: Callable[..., None] | None = None
    tensor_name: Callable[[str], str] = _same_name


LAYOUTS: dict[str, Layout] = {}
"""The registered layouts by name, in detection order."""


def register_layout(module: ModuleType | Any) -> Layout:
    """Register a layout from a module (or any object) with `NAME`, `detect` and optionally `to_peagle`,
    `from_peagle` and `tensor_name`; a later registration under the same name replaces the earlier one."""
    layout = Layout(
        name=module.NAME,
        detect=module.detect,
        to_peagle=getattr(module, "to_peagle", None),
        from_peagle=getattr(module, "from_peagle", None),
        tensor_name=getattr(module, "tensor_name", _same_name),
    )
    LAYOUTS[layout.name] = layout
    return layout


for _module in (native, speculators, vllm, eagle3):
    register_layout(_module)
EXPORT_LAYOUTS = tuple(name for name, layout in LAYOUTS.items() if layout.from_peagle is not None)
"""The built-in layouts `export` writes."""


def detect_layout(config: Mapping[str, Any], tensor_names: Collection[str], where: str = "checkpoint") -> str:
    """Tell a checkpoint's layout (a key of `LAYOUTS`) from its `config.json` and tensor names."""
    for name, layout in LAYOUTS.items():
        try:
            if layout.detect(config, tensor_names):
                return name
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
    raise ValueError(
        f"{where}: cannot tell the layout. config.json has model_type {config.get('model_type')!r} and no "
        "speculators_model_type, and the tensors are not an EAGLE-3 layout (midlayer.* or layers.0.* "
        f"plus fc.weight). Known layouts: {', '.join(LAYOUTS)}."
    )


def holds_other_model(folder: str | Path) -> str | None:
    """What `folder` holds when it is a model other than a head (a target, say), in words; None when it holds no
    config.json or a head in a layout peagle reads (which a new head may replace).  Only safetensors headers are
    read, never a pickle."""
    config_file = Path(folder) / "config.json"
    if not config_file.is_file():
        return None
    try:
        config = read_json(config_file)
    except ValueError:
        return "a config.json that is not a head's"
    try:
        names = read_shapes(weight_files(Path(folder)))
    except (ValueError, OSError):
        names = {}
    try:
        detect_layout(config, names)
    except ValueError:
        return f"a model of model_type {config.get('model_type')!r}"
    return None


def refuse_other_model(folder: str | Path, overwrite: bool = False) -> None:
    """Raise unless writing a head into `folder` is safe: it holds no model, or a head (which a new head
    replaces), or the caller said `overwrite=True`."""
    found = None if overwrite else holds_other_model(folder)
    if found is not None:
        raise FileExistsError(
            f"{folder} holds {found}, not a head: writing a head there would replace its config "
            "and weights. Choose another folder, or pass overwrite=True (--overwrite) to replace it."
        )


@contextlib.contextmanager
def head_folder(folder: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """`io.replacing_folder`, refused first where `folder` holds a model other than a head
    ([`refuse_other_model`]): what `save_pretrained` and `export` write through."""
    refuse_other_model(folder, overwrite)
    with replacing_folder(folder) as tmp:
        yield tmp


def inspect_checkpoint(
    path_or_repo: str | Path, *, allow_pickle: bool = False, hub_kwargs: Mapping[str, Any] | None = None
) -> Checkpoint:
    """Resolve a folder or Hub repo, refuse pickles unless `allow_pickle`, read config.json and tensor
    shapes, and detect the layout."""
    checkpoint = read_checkpoint(path_or_repo, allow_pickle=allow_pickle, hub_kwargs=hub_kwargs)
    where = str(checkpoint.path / "config.json")
    return dataclasses.replace(checkpoint, layout=detect_layout(checkpoint.config, checkpoint.shapes, where))


def load_converted(
    checkpoint: Checkpoint,
    cls: type | None = None,
    target_model: Any = None,
    dtype: torch.dtype | str | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> PEagleDrafter:
    """Build a `cls` (default `PEagleDrafter`) from a foreign-layout checkpoint (see `convert.assemble_head`);
    `overrides` replace config values read from it (`from_pretrained` keywords, see [`config_overrides`])."""
    layout = LAYOUTS[checkpoint.layout]
    if layout.to_peagle is None:
        raise ValueError(
            f"{checkpoint.path}: the {layout.name} layout is loaded by transformers, not converted."
        )
    config_kwargs, state = layout.to_peagle(checkpoint, read_tensors(checkpoint.files))
    config_kwargs.update(overrides or {})
    qc = checkpoint.config.get("quantization_config")
    if qc is not None:  # an FP8 export: peagle's FP8 layers take the tensors (docs/fp8.md section 3)
        from ..fp8 import fp8_record

        renamed = {layout.tensor_name(n).removesuffix(".weight"): n.removesuffix(".weight") for n in state}
        config_kwargs["peagle_fp8"] = fp8_record(qc, renamed, str(checkpoint.path / "config.json"))
    model = assemble_head(
        checkpoint,
        config_kwargs,
        state,
        cls=cls,
        target_model=target_model,
        dtype=dtype,
        tensor_name=layout.tensor_name,
    )
    model.check_finite_weights(checkpoint.path, tensor_name=layout.tensor_name)
    return model


def config_overrides(kwargs: Mapping[str, Any], where: str | Path) -> dict[str, Any]:
    """The `from_pretrained` keywords among `kwargs` that set head config fields (`confidence_threshold=0.3`),
    which a converted layout applies as peagle's own layout does; the fields that size weights are refused."""
    fields = set(PEagleConfig.__dataclass_fields__) - {"dtype", "torch_dtype"}
    overrides = {k: v for k, v in kwargs.items() if k in fields}
    refuse_shape_overrides(overrides, where)
    return overrides


def load_head(
    path_or_id: str | Path,
    *model_args: Any,
    target: Any = None,
    allow_pickle: bool = False,
    cls: type | None = None,
    **kwargs: Any,
) -> PEagleDrafter:
    """Load a head in any registered layout from a folder or a Hub repo.

    Args:
        path_or_id: a local folder or a Hub repo id.
        target: the target model; the head is attached to it (`attach_target`), and it supplies
            `embed_tokens` / `lm_head` a foreign checkpoint lacks (e.g. EAGLE-3 heads sharing embeddings).
        allow_pickle: permit `.bin` / `.pt` checkpoints (unpickling can run code; off by default).
        cls: the model class (default `PEagleDrafter`; `from_pretrained` passes its own class).
        *model_args, **kwargs: `from_pretrained` arguments (`dtype`, `revision`, `token`, `config`, ...);
            foreign layouts use `dtype` and the Hub arguments.

    Returns:
        The head, in eval mode; errors name the file and tensor of any mismatch with the config, and the tensors
        that hold NaN or inf (`PEagleDrafter.check_finite_weights`: such a head would draft nothing useful).
    """
    cls = cls or PEagleDrafter
    checkpoint = inspect_checkpoint(path_or_id, allow_pickle=allow_pickle, hub_kwargs=kwargs)
    if checkpoint.layout != native.NAME:
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
        overrides = config_overrides(kwargs, checkpoint.path)
        return load_converted(checkpoint, cls=cls, target_model=target, dtype=dtype, overrides=overrides)
    config = native.prepare(checkpoint, cls, config=kwargs.get("config"))
    if config is not None:
        kwargs["config"] = config
    model = cls.from_pretrained_native(checkpoint.path, *model_args, **kwargs)
    model.check_finite_weights(checkpoint.path)  # shapes were checked; a NaN or inf weight passes them
    if target is not None:
        model.attach_target(target)
    return model


def export(
    head: PEagleDrafter,
    out_dir: str | Path,
    layout: str = "vllm",
    *,
    target_model: Any = None,
    num_speculative_tokens: int | None = None,
    max_shard_size: int | str = "5GB",
    verifier: str | Path | None = None,
    overwrite: bool = False,
) -> Path:
    """Write `head` in a serving layout.

    Args:
        head: a `PEagleDrafter`.
        out_dir: the folder to write (created).  The export is written beside it, reloaded and checked
            (`check_written`), then takes its place: old weights, shards and config never stay beside new ones
            (other files in the folder are kept), and a failed export leaves the folder as it was.
        layout: ``"vllm"`` (served by vLLM >= 0.16 with `{"method": "eagle3", "model": out_dir,
            "num_speculative_tokens": K, "parallel_drafting": true}`, see `vllm.speculative_config`),
            ``"speculators"`` or ``"peagle"``.
        target_model: checked against the head (hidden size, vocabulary, layers) and attached first; required
            for `embed_from_target` heads not yet attached (the vLLM and speculators layouts store the full
            embedding table, whose mask row holds the mask vector).
        num_speculative_tokens: K recorded in the config (default `config.num_speculative_tokens`), an integer in
            [1, `MAX_SPECULATIVE_TOKENS`]; every layout, peagle's own included, reloads with it.
        verifier: where the speculators layout says the target lives (`speculators_config.verifier.name_or_path`):
            a Hub id, or a local folder so that speculators loads the export offline (default: the head's
            `target_model_name`).  The other layouts do not record it.
        overwrite: write even where `out_dir` holds a model other than a head (a target's folder, say), replacing
            its config and weights; without it that is refused before anything is written.

    Returns:
        `out_dir` as a `Path`.  Loading it back with `PEagleDrafter.from_pretrained` gives identical logits.

    Raises:
        ValueError: before anything is written or created, when the head does not fit `target_model`
            (`check_target`: family, widths, layers) or, for the layouts vLLM serves through its EAGLE-3 path
            (`vllm`, `speculators`), when vLLM does not serve the target family (`peagle.sizing.check_export_target`),
            or when a weight holds NaN or inf (`check_finite_weights`).
    """
    writers = {name: lay.from_peagle for name, lay in LAYOUTS.items() if lay.from_peagle is not None}
    if layout not in writers:
        raise ValueError(f"layout is {layout!r}; expected one of {tuple(writers)}.")
    k = num_speculative_tokens
    if k is not None and (
        isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS
    ):
        raise ValueError(
            f"num_speculative_tokens is {k!r}; expected an integer in [1, {MAX_SPECULATIVE_TOKENS}] (or None: the "
            f"head's own, {head.config.num_speculative_tokens})."
        )
    if target_model is not None:  # a head written next to a target it was not built for is refused
        head.check_target(target_model)
    head.check_finite_weights("the head to export")  # loading the export would refuse it
    from ..sizing import check_export_target

    check_export_target(head, layout, target_model)  # vLLM's EAGLE-3 families; before anything is created
    quantization = None
    if layout != native.NAME and getattr(head.config, "peagle_fp8", None):
        # FP8 heads: the compressed-tensors `quantization_config` vLLM reads, under the layout's tensor names
        # (peagle's own layout gets it from save_pretrained); refused here, before writing, if the peers cannot
        # read its block scales (docs/fp8.md section 3)
        from ..fp8.checkpoint import checked_quantization_config

        dense = speculators.DENSE_LINEARS if layout == speculators.NAME else ()
        quantization = checked_quantization_config(head, LAYOUTS[layout].tensor_name, dense, strict=True)
    out = Path(out_dir)
    # old files never stay beside the new ones, and a failed write (or check) leaves `out` as it was
    with head_folder(out, overwrite) as tmp:
        writers[layout](
            head,
            tmp,
            target_model=target_model,
            num_speculative_tokens=num_speculative_tokens,
            max_shard_size=max_shard_size,
            verifier=str(verifier) if verifier is not None else None,
        )
        if quantization is not None:
            from ..fp8.checkpoint import write_quantization_config

            write_quantization_config(tmp, quantization)
        check_written(tmp, head, layout, num_speculative_tokens, where=out)
    return out


RELOADED_FIELDS = (
    "drafting_mode",
    "num_hidden_layers",
    "hidden_size",
    "vocab_size",
    "draft_vocab_size",
    "num_parallel_positions",
    "confidence_threshold",
    "draft_calibration",
    "drafter_window",
)
"""The config fields an exported head must reload with (besides K, the mask token and the vocabulary map)."""


def check_written(
    folder: Path,
    head: PEagleDrafter,
    layout: str,
    num_speculative_tokens: int | None,
    where: Path | None = None,
) -> None:
    """Reload what `export` wrote into `folder` and raise `ValueError` unless it is the head with the values it was
    given: K (`num_speculative_tokens`, default the head's), the fields of `RELOADED_FIELDS`, the mask token of a
    parallel head and the draft vocabulary.  `where` is the folder named in the error (the export's destination)."""
    where = where or folder
    try:
        loaded = load_head(folder)
    except (ValueError, OSError) as err:
        raise ValueError(
            f"the {layout} export for {where} does not reload ({err}); nothing was written."
        ) from err
    want = {key: getattr(head.config, key) for key in RELOADED_FIELDS}
    want["num_speculative_tokens"] = num_speculative_tokens or head.config.num_speculative_tokens
    if head.config.drafting_mode == "parallel":
        want["mask_token_id"] = head.config.mask_token_id
    wrong = {k: (v, getattr(loaded.config, k)) for k, v in want.items() if getattr(loaded.config, k) != v}
    if not torch.equal(loaded.d2t.cpu(), head.d2t.cpu()):
        wrong["d2t"] = ("the head's", "another map")
    if wrong:
        said = ", ".join(f"{k} {got!r} instead of {v!r}" for k, (v, got) in wrong.items())
        raise ValueError(f"the {layout} export for {where} reloads with {said}; nothing was written.")


PEagleDrafter.register_checkpoint_loader(load_head)
PEagleDrafter.register_folder_writer(head_folder)
register_auto_classes()

__all__ = [
    "Checkpoint",
    "TensorSource",
    "Layout",
    "LAYOUTS",
    "EXPORT_LAYOUTS",
    "VLLM_ARCHITECTURE",
    "VLLM_EAGLE3_ARCHITECTURES",
    "register_layout",
    "detect_layout",
    "inspect_checkpoint",
    "check_native",
    "load_converted",
    "load_head",
    "resolve_folder",
    "replacing_folder",
    "weight_files",
    "export",
    "check_written",
    "vllm_config",
    "speculators_config",
    "speculative_config",
]
