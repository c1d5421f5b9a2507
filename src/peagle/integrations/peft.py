"""Adapting a trained head with LoRA through peft, instead of retraining it.

A published head drifts when the traffic differs from its training data (domain, language, longer contexts).
LoRA adds a low-rank update ``W + (alpha / r) * B @ A`` to chosen linear layers and trains only ``A`` and ``B``;
the head itself stays frozen.  `PEagleDrafter` is a plain transformers `PreTrainedModel`, so peft wraps it
directly (no task type: a [`peft.PeftModel`] whose forward passes every keyword through to the head):

```python
from peagle import load_default_drafter, load_default_target
from peagle.integrations.peft import apply_lora, lora_config, merge_lora
from peagle.training import PEagleTrainer, PEagleTrainingArguments

target, tok = load_default_target()
head = load_default_drafter(target, dtype=torch.float32)
model = apply_lora(head, lora_config(r=16))  # a peft.PeftModel; head.config, d2t, draft() stay reachable
PEagleTrainer(model=model, target_model=target, args=PEagleTrainingArguments(...), train_dataset=ex).train()
model.save_pretrained("my-adapter")  # adapter_config.json + adapter_model.safetensors (a few MB)
merged = merge_lora(model)  # a plain PEagleDrafter again: generate(), peagle.export(), save_pretrained()
target.generate(ids, assistant_model=merged)
```

Default target modules ([`DEFAULT_LORA_TARGET_MODULES`]): the attention projections ``q/k/v/o_proj`` and the
MLP projections ``gate/up/down_proj`` of every drafter layer (the fused layer 0 included, whose ``q/k/v`` read
``2 * hidden_size``), plus ``fc`` (the projection of the target's three feature layers, which is also applied to
the learned ``mask_hidden``).  Left out on purpose: ``lm_head`` (its rows are the draft vocabulary, fixed by
``d2t``), ``embed_tokens`` (often the target's own frozen table) and the learned placeholders ``mask_hidden`` /
``mask_embedding`` (parameters, not modules).  A LoRA adapter cannot add tokens to the draft vocabulary: tokens of
the new domain outside it can never be drafted (see [`head_vocab_coverage`]).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ..modeling_peagle import PEagleDrafter

DEFAULT_LORA_TARGET_MODULES: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "fc",
)
"""Module-name suffixes LoRA adapts by default: attention and MLP projections of all layers, and `fc`."""

_EXCLUDED_MODULES = ("lm_head", "embed_tokens")


def lora_config(
    r: int = 16,
    lora_alpha: int | float | None = None,
    lora_dropout: float = 0.0,
    target_modules: Sequence[str] | str | None = None,
    layers_to_transform: Sequence[int] | int | None = None,
    **kwargs: Any,
):
    """A `peft.LoraConfig` for a [`PEagleDrafter`].

    Args:
        r: LoRA rank.
        lora_alpha: scaling numerator (the update is scaled by `lora_alpha / r`); default `2 * r`.
        lora_dropout: dropout on the LoRA branch's input during training.
        target_modules: module-name suffixes (or a regex over full names) to adapt; default
            [`DEFAULT_LORA_TARGET_MODULES`].
        layers_to_transform: adapt only these drafter layers (`layers.{i}`); `fc` is then left out, since it
            belongs to no layer.
        **kwargs: any other `LoraConfig` field (`init_lora_weights`, `use_rslora`, `use_dora`, ...).

    Returns:
        `peft.LoraConfig` with `task_type=None` (peft then builds a plain `PeftModel`, whose forward passes all
        keyword arguments through to `PEagleDrafter.forward`).
    """
    from peft import LoraConfig

    if r < 1:
        raise ValueError(f"LoRA rank r is {r}; expected an integer >= 1.")
    if not 0.0 <= lora_dropout < 1.0:
        raise ValueError(f"lora_dropout is {lora_dropout}; expected a value in [0, 1).")
    if target_modules is None:
        target_modules = list(DEFAULT_LORA_TARGET_MODULES)
        if layers_to_transform is not None:
            target_modules.remove("fc")
    elif not isinstance(target_modules, str):
        target_modules = list(target_modules)
    if layers_to_transform is not None:
        kwargs.setdefault("layers_pattern", "layers")
    if isinstance(layers_to_transform, Iterable):
        layers_to_transform = [int(i) for i in layers_to_transform]
    return LoraConfig(
        r=int(r),
        lora_alpha=2 * r if lora_alpha is None else lora_alpha,
        lora_dropout=float(lora_dropout),
        target_modules=target_modules,
        layers_to_transform=layers_to_transform,
        task_type=None,
        bias="none",
        **kwargs,
    )


def lora_target_module_names(head: PEagleDrafter, config=None) -> list[str]:
    """Full names of the modules of `head` that `config` (default [`lora_config`]`()`) would adapt."""
    from peft.tuners.tuners_utils import check_target_module_exists

    config = lora_config() if config is None else config
    return [name for name, _ in head.named_modules() if name and check_target_module_exists(config, name)]


@contextlib.contextmanager
def _quiet_peft() -> Iterator[None]:
    """Silence the one FutureWarning peft triggers on every transformers 5 model (it reads the deprecated
    `is_gradient_checkpointing`); every other warning still shows."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def apply_lora(head: PEagleDrafter, config=None, adapter_name: str = "default"):
    """Wrap `head` with LoRA adapters (in place: its linear layers gain LoRA branches); only those train.

    Args:
        head: the head to adapt (any dtype; LoRA weights are kept in float32 for stable training).
        config: a `peft.LoraConfig` (default [`lora_config`]`()`).
        adapter_name: peft's adapter name.

    Returns:
        `peft.PeftModel` around `head`.  Attribute access falls through to the head (`model.config`, `model.d2t`,
        `model.draft(...)`, `model.attach_target(...)`), so [`PEagleTrainer`] trains it unchanged.  For
        `target.generate(..., assistant_model=...)` pass [`merge_lora`]`(model)` (or, unmerged and a little
        slower, `model.get_base_model()`, the head with its LoRA branches active).
    """
    from peft import get_peft_model

    if not isinstance(head, PEagleDrafter):
        raise TypeError(f"apply_lora expects a PEagleDrafter; got {type(head).__name__}.")
    config = lora_config() if config is None else config
    if getattr(config, "peft_type", None) is None or str(config.peft_type.value) != "LORA":
        raise TypeError(f"config is a {type(config).__name__}; expected a peft.LoraConfig.")
    names = lora_target_module_names(head, config)
    if not names:
        raise ValueError(
            f"target_modules {config.target_modules!r} match no module of the head; expected names such as "
            f"{list(DEFAULT_LORA_TARGET_MODULES)} (see peagle.integrations.peft.DEFAULT_LORA_TARGET_MODULES)."
        )
    excluded = [n for n in names if n.split(".")[-1] in _EXCLUDED_MODULES]
    if excluded:
        raise ValueError(
            f"target_modules select {excluded}; LoRA on lm_head/embed_tokens is not supported (lm_head rows are "
            "the draft vocabulary fixed by d2t, embed_tokens is often the target's frozen table)."
        )
    modules = dict(head.named_modules())
    not_linear = {n: type(modules[n]).__name__ for n in names if type(modules[n]) is not nn.Linear}
    if not_linear:
        raise TypeError(
            f"LoRA needs plain torch.nn.Linear layers; {not_linear} are not (an FP8 head? adapt the bf16/fp32 "
            "head and quantize after merging, see peagle.dequantize_head)."
        )
    with _quiet_peft():
        return get_peft_model(head, config, adapter_name=adapter_name)


def _trainable_after_unload(head: PEagleDrafter) -> PEagleDrafter:
    """peft froze every base weight; a merged head is trainable again, except embeddings taken from the target."""
    head.requires_grad_(True)
    if head.config.embed_from_target:
        head.embed_tokens.weight.requires_grad_(False)
    if head.config.drafting_mode == "autoregressive":  # EAGLE-3 heads never use the parallel placeholders
        head.mask_hidden.requires_grad_(False)
        if head.mask_embedding is not None:
            head.mask_embedding.requires_grad_(False)
    return head


def merge_lora(model, safe_merge: bool = True) -> PEagleDrafter:
    """Fold the LoRA updates into the head's weights and drop the adapters (`merge_and_unload`).

    Args:
        model: a `peft.PeftModel` from [`apply_lora`] or [`load_adapter`].
        safe_merge: check the merged weights for NaN/inf before committing them.

    Returns:
        The plain [`PEagleDrafter`] (same object the adapter was applied to), ready for
        `target.generate(..., assistant_model=head)`, `peagle.export(head, ...)` and `save_pretrained`.  Its
        outputs equal the adapted model's up to float rounding.
    """
    from peft import PeftModel

    if isinstance(model, PEagleDrafter):
        raise TypeError("merge_lora got a PEagleDrafter without adapters; expected a peft.PeftModel.")
    if not isinstance(model, PeftModel):
        raise TypeError(f"merge_lora expects a peft.PeftModel; got {type(model).__name__}.")
    head = model.merge_and_unload(safe_merge=safe_merge)
    if not isinstance(head, PEagleDrafter):
        raise TypeError(f"the adapted model wraps a {type(head).__name__}; expected a PEagleDrafter.")
    return _trainable_after_unload(head)


def load_adapter(
    head: PEagleDrafter,
    adapter_path: str | os.PathLike,
    is_trainable: bool = False,
    adapter_name: str = "default",
):
    """Put a saved LoRA adapter (`model.save_pretrained(path)`) on top of a loaded head.

    Args:
        head: the base head the adapter was trained on (e.g. `PEagleDrafter.from_pretrained(...)`).
        adapter_path: folder with `adapter_config.json` and `adapter_model.safetensors`.
        is_trainable: keep the LoRA weights trainable (to continue training); default inference mode.

    Returns:
        `peft.PeftModel` (merge it with [`merge_lora`] for generation and export).
    """
    from peft import PeftModel

    if not isinstance(head, PEagleDrafter):
        raise TypeError(f"load_adapter expects a PEagleDrafter; got {type(head).__name__}.")
    path = os.fspath(adapter_path)
    if not os.path.isfile(os.path.join(path, "adapter_config.json")):
        raise FileNotFoundError(
            f"no adapter_config.json in {path}; expected a folder written by PeftModel.save_pretrained."
        )
    with _quiet_peft():
        return PeftModel.from_pretrained(head, path, adapter_name=adapter_name, is_trainable=is_trainable)


def load_adapted_head(
    base_head: PEagleDrafter | str | os.PathLike,
    adapter_path: str | os.PathLike,
    target_model=None,
    dtype: torch.dtype | None = None,
) -> PEagleDrafter:
    """Base head + saved adapter -> one merged [`PEagleDrafter`] (eval mode), attached to `target_model`.

    Args:
        base_head: a loaded head or its folder (any layout `PEagleDrafter.from_pretrained` reads).
        adapter_path: the adapter folder.
        target_model: attached to the head (needed for `embed_from_target` heads).
        dtype: load dtype of a head given as a folder.
    """
    if not isinstance(base_head, PEagleDrafter):
        kwargs: dict[str, Any] = {"target_model": target_model}
        if dtype is not None:
            kwargs["dtype"] = dtype
        base_head = PEagleDrafter.from_pretrained(base_head, **kwargs)
    elif target_model is not None:
        base_head.attach_target(target_model)
    return merge_lora(load_adapter(base_head, adapter_path)).eval()


def lora_for_training(
    base_head: PEagleDrafter | str | os.PathLike,
    target_model,
    config=None,
    dtype: torch.dtype = torch.float32,
):
    """A base head (object or folder) attached to `target_model` and wrapped with LoRA, ready for
    [`PEagleTrainer`] (`peagle train --lora`).

    Args:
        base_head: the head to adapt, or its folder (loaded in `dtype`; float32 trains best on the CPU).
        target_model: the frozen target the head drafts for.
        config: a `peft.LoraConfig` (default [`lora_config`]`()`).

    Returns:
        `peft.PeftModel` in training mode; only its LoRA weights require gradients.
    """
    if not isinstance(base_head, PEagleDrafter):
        base_head = PEagleDrafter.from_pretrained(base_head, dtype=dtype, target_model=target_model)
    else:
        base_head.attach_target(target_model)
    return apply_lora(base_head, config).train()


def head_vocab_coverage(head: PEagleDrafter, examples: Iterable[dict[str, Any]]) -> float:
    """Fraction of the response tokens (`loss_mask == 1`) of `examples` inside the head's draft vocabulary.

    An upper bound on what any adapter can reach on that data: a token outside the draft vocabulary is never
    drafted.  1.0 when the draft vocabulary is the whole vocabulary.
    """
    t2d = head.t2d.cpu()
    inside = total = 0
    for ex in examples:
        ids = torch.as_tensor(ex["input_ids"], dtype=torch.long)
        mask = torch.as_tensor(ex["loss_mask"], dtype=torch.bool)
        resp = ids[mask]
        inside += int(t2d[resp].sum())
        total += int(resp.numel())
    if total == 0:
        raise ValueError("head_vocab_coverage got no response tokens (loss_mask is 0 everywhere).")
    return inside / total


__all__ = [
    "DEFAULT_LORA_TARGET_MODULES",
    "lora_config",
    "lora_target_module_names",
    "apply_lora",
    "merge_lora",
    "load_adapter",
    "load_adapted_head",
    "lora_for_training",
    "head_vocab_coverage",
]
