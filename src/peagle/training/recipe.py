"""The standard recipe: a target and prompts -> self-distilled examples -> a trained, saved head.

[`training_arguments`] builds the recipe's `PEagleTrainingArguments`, [`build_head`] a new head for a target
(config, draft vocabulary, mask token), [`load_head_for_training`] an existing head (optionally with a LoRA
adapter), and [`train_head`] runs the whole recipe (`peagle train` calls it).  Scripts and the command line
build heads and arguments through these functions only.

Importing this module is cheap; torch, transformers and the trainer are imported inside the functions.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ..modeling_peagle import PEagleDrafter
    from .arguments import PEagleTrainingArguments

logger = logging.getLogger(__name__)


def training_arguments(
    output_dir: str | os.PathLike, *, use_cpu: bool | None = None, progress: bool = True, **fields: Any
) -> PEagleTrainingArguments:
    """The recipe's `PEagleTrainingArguments`: `RECIPE_DEFAULTS` over transformers' defaults, then `fields`.

    Args:
        output_dir: checkpoints and logs.
        use_cpu: default: True unless CUDA is available.
        progress: show the trainer's progress bar.
        fields: any `PEagleTrainingArguments` / `TrainingArguments` field (`num_parallel_positions`, `cod_ratio`,
            `sequence_partitions`, `learning_rate`, `save_strategy="no"`, ...); each default is the field's own.
    """
    import torch

    from .arguments import RECIPE_DEFAULTS, PEagleTrainingArguments

    values: dict[str, Any] = {
        **RECIPE_DEFAULTS,
        "output_dir": os.fspath(output_dir),
        "use_cpu": (not torch.cuda.is_available()) if use_cpu is None else use_cpu,
        "disable_tqdm": not progress,
        **fields,
    }
    return PEagleTrainingArguments(**values)


def build_head(
    target,
    examples: Sequence[dict[str, Any]] | None = None,
    *,
    drafting_mode: str = "parallel",
    num_hidden_layers: int | None = None,
    draft_vocab_size: int | None = None,
    num_parallel_positions: int | None = None,
    num_speculative_tokens: int | None = None,
    embed_from_target: bool = True,
    mask_token_id: int | None = None,
    target_model_name: str | None = None,
    lm_head_init: str = "target",
    layers_init: str = "random",
    dtype: torch.dtype | None = None,
    **config_overrides: Any,
) -> PEagleDrafter:
    """A new head for `target`: `PEagleConfig.for_target` (the size rule of `peagle.sizing`) plus a draft
    vocabulary chosen from `examples`.

    Args:
        target: the target model.
        examples: training examples.  The draft vocabulary is their most frequent response tokens plus the EOS ids
            ([`select_draft_vocab`]); its size, unless given, is the smallest in the range the size rule allows that
            covers 99.5% of their response tokens ([`choose_draft_vocab_size`]).  Needed whenever the draft
            vocabulary is smaller than the target's.
        drafting_mode: `"parallel"` (P-EAGLE) or `"autoregressive"` (EAGLE-3 baseline).
        num_hidden_layers: drafter decoder layers (default: the size rule's, 2 or 1).
        draft_vocab_size: rows of the LM head (default: chosen from `examples` as above).
        num_parallel_positions: K_train (default 8).
        num_speculative_tokens: the head's default inference K (default: min(7, K_train)).
        embed_from_target: share the target's frozen embeddings (only the mask embedding is learned); the default.
        mask_token_id: a reserved token of the tokenizer (default: the config's, the last id).
        target_model_name: recorded in the config (default: the target config's name).
        lm_head_init: `"target"` (the default): the LM head starts as the target's output-embedding rows of the
            draft vocabulary ([`init_lm_head_from_target`]); `"random"`: transformers' initialisation.
        layers_init: `"random"` (the default): transformers' initialisation of the decoder layers; `"target"`: the
            drafter's layers start as the target's last layers ([`init_layers_from_target`]).
        dtype: parameter dtype (default float32, the training dtype).
        config_overrides: any other `PEagleConfig` field (e.g. `attn_implementation="sdpa"`).
    """
    import torch

    from ..configuration_peagle import PEagleConfig
    from ..modeling_peagle import PEagleDrafter
    from ..sizing import plan_head
    from .vocab import coverage_vocab_size, select_draft_vocab

    for name, value in (("lm_head_init", lm_head_init), ("layers_init", layers_init)):
        if value not in ("target", "random"):
            raise ValueError(f"{name} is {value!r}; expected 'target' or 'random'.")
    values: dict[str, Any] = {"drafting_mode": drafting_mode, "embed_from_target": embed_from_target}
    optional = {
        "num_hidden_layers": num_hidden_layers,
        "num_parallel_positions": num_parallel_positions,
        "num_speculative_tokens": num_speculative_tokens,
        "mask_token_id": mask_token_id,
        "target_model_name": target_model_name,
    }
    values.update({k: v for k, v in optional.items() if v is not None})
    values.update(config_overrides)
    vocab_size = int(target.config.get_text_config().vocab_size)
    why_vocab = "given"
    if draft_vocab_size is None:
        why_vocab = "the size rule's"
        needed = coverage_vocab_size(examples, vocab_size) if examples is not None else None
        plan = plan_head(target, values, needed_vocab=needed)  # keeps `needed` ids before a second layer
        smallest, largest = plan.vocab_range
        if needed is not None and largest < vocab_size:
            draft_vocab_size = max(smallest, min(largest, needed))
            why_vocab = f"chosen from the training data: {needed} ids cover 99.5% of its response tokens"
            logger.info(
                "draft vocabulary: %d ids (the examples need %d to cover 99.5%% of their response tokens; the size "
                "rule allows [%d, %d] with %d layers)",
                draft_vocab_size,
                needed,
                smallest,
                largest,
                plan.values["num_hidden_layers"],
            )
        else:
            draft_vocab_size = largest
    if draft_vocab_size < vocab_size and examples is None:
        raise ValueError(
            f"a draft vocabulary of {draft_vocab_size} of the target's {vocab_size} ids is chosen from training "
            f"examples; pass them (or draft_vocab_size={vocab_size} for the whole vocabulary)."
        )
    # PEagleConfig.for_target, with the draft vocabulary's reason logged as it is (not "given" when peagle chose it)
    plan = plan_head(target, {**values, "draft_vocab_size": draft_vocab_size})
    plan.notes[:] = [
        f"draft_vocab_size: {draft_vocab_size} ({why_vocab})"
        if n == f"draft_vocab_size: {draft_vocab_size} (given)"
        else n
        for n in plan.notes
    ]
    chosen = not {"num_hidden_layers", "embed_from_target"} & set(values) and why_vocab != "given"
    over = plan.head_parameters > plan.budget and chosen
    logging.getLogger("peagle.sizing").log(logging.WARNING if over else logging.INFO, plan.describe())
    config = PEagleConfig(**plan.values)
    head = PEagleDrafter(config).to(dtype or torch.float32)
    if draft_vocab_size < vocab_size:
        head.set_draft_vocab(select_draft_vocab(examples, draft_vocab_size, vocab_size, _eos_ids(target)))
    if lm_head_init == "target":
        init_lm_head_from_target(head, target)
    if layers_init == "target":
        init_layers_from_target(head, target)
    return head


def _eos_ids(target) -> list[int]:
    eos = target.config.get_text_config().eos_token_id
    return [int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None]


def grow_draft_vocab(
    head: PEagleDrafter, target, examples: Sequence[dict[str, Any]], draft_vocab_size: int
) -> PEagleDrafter:
    """[`resize_draft_vocab`] to `draft_vocab_size` ids chosen from `examples`: a larger vocabulary keeps every id
    the head has and adds the examples' most frequent response tokens it lacks; a smaller one is the examples' most
    frequent (plus EOS), as a new head's would be.  Logs the share of the examples' response tokens each covers.

    A head continued on data unlike the data its vocabulary was chosen from can miss many of the tokens its target
    writes: the shipped SmolLM2 head's 8,192 ids, chosen from its first 549k response tokens, cover 93.7% of its
    held-out greedy continuations, and the most frequent 16,384 of its 10M training tokens 99.4%
    (docs/training.md, section 3).
    """

    from .vocab import select_draft_vocab, token_counts

    vocab_size = head.config.vocab_size
    own = head.draft_vocab_ids.cpu()
    extra = _eos_ids(target) + (own.tolist() if draft_vocab_size >= own.numel() else [])
    ids = select_draft_vocab(examples, draft_vocab_size, vocab_size, extra)
    counts = token_counts(examples, vocab_size)[0]
    total = max(int(counts.sum()), 1)
    logger.info(
        "draft vocabulary: %d -> %d ids, covering %.1f%% -> %.1f%% of the examples' response tokens",
        own.numel(),
        ids.numel(),
        100 * int(counts[own].sum()) / total,
        100 * int(counts[ids].sum()) / total,
    )
    return resize_draft_vocab(head, target, ids)


def init_layers_from_target(head: PEagleDrafter, target) -> None:
    """Start the drafter's n decoder layers as the target's last n layers (drafter layer i from target layer
    `L - n + i`), copying every weight whose name and shape match.

    Layer 0 is the fused layer: its q/k/v projections read `[input_layernorm(embeds), hidden_norm(h)]`, so the
    target's projection goes into the columns that read the hidden state (the embedding columns keep their
    initialisation), and `hidden_norm` takes the target layer's `input_layernorm`.  Attention output, MLP and
    post-attention norm copy as they are.  Layers 1.. are plain Llama layers and copy whole.

    Raises:
        ValueError: the target has fewer layers than the head, or a layer shares no weight of the head's Llama
            layout (another layer family, or other widths).
    """
    import torch

    decoder = target.get_decoder() if hasattr(target, "get_decoder") else target.model
    source = list(getattr(decoder, "layers", []))
    n = len(head.layers)
    if len(source) < n:
        raise ValueError(f"the target has {len(source)} decoder layers; the head needs {n} to start from.")
    hidden = head.config.hidden_size
    with torch.no_grad():
        for i, (mine, theirs) in enumerate(zip(head.layers, source[len(source) - n :])):
            params = dict(mine.named_parameters())
            copied = 0
            for name, weight in theirs.state_dict().items():
                if i == 0 and name == "input_layernorm.weight":
                    name = "hidden_norm.weight"
                ours = params.get(name)
                if ours is None:
                    continue
                weight = weight.to(ours.device, ours.dtype)
                fused = i == 0 and name.split(".")[-2] in ("q_proj", "k_proj", "v_proj") and ours.dim() == 2
                if fused and tuple(weight.shape) == (ours.shape[0], hidden) and ours.shape[1] == 2 * hidden:
                    ours[:, hidden:].copy_(weight)
                    copied += 1
                elif tuple(weight.shape) == tuple(ours.shape):
                    ours.copy_(weight)
                    copied += 1
            if not copied:
                raise ValueError(
                    f"target layer {len(source) - n + i} shares no weight with drafter layer {i} (names and "
                    f"shapes of a Llama layer of hidden size {hidden}); use layers_init='random'."
                )


def init_lm_head_from_target(head: PEagleDrafter, target) -> None:
    """Start the head's LM head as the target's output-embedding rows of the draft vocabulary (`i + d2t[i]`),
    rescaled to the standard deviation of a fresh layer (`config.initializer_range`).

    The rows give the head the target's geometry of the output space; the rescaling keeps its first predictions
    soft.  Measured on SmolLM2-135M (2 layers, draft vocabulary 8,192, 12 steps of 4 examples, the same data and
    seed): KL loss 8.00 -> 5.74 with rescaled rows, 7.89 -> 6.68 from a random LM head, and 13.4 -> 7.17 with the
    rows at the target's own scale (confident random logits at first; docs/families.md).
    """
    import torch

    weight = target.get_output_embeddings().weight
    if tuple(weight.shape) != (head.config.vocab_size, head.config.hidden_size):
        raise ValueError(
            f"the target's output embeddings have shape {tuple(weight.shape)}; the head's LM head takes rows of "
            f"({head.config.vocab_size}, {head.config.hidden_size})."
        )
    ids = head.draft_vocab_ids
    with torch.no_grad():
        rows = weight.detach()[ids.to(weight.device)].float()
        rows = rows * (head.config.initializer_range / rows.std().clamp_min(1e-12))
        head.lm_head.weight.copy_(rows.to(head.lm_head.weight.device, head.lm_head.weight.dtype))


def _require_plain_head(head, caller: str) -> None:
    from ..modeling_peagle import PEagleDrafter

    if not isinstance(head, PEagleDrafter):
        raise TypeError(
            f"{caller} takes a PEagleDrafter (a LoRA-wrapped head merges first), got {type(head).__name__}."
        )


def _rebuilt_head(
    head: PEagleDrafter, fresh: Callable[[str], bool], *, skip=(), **config_changes
) -> PEagleDrafter:
    """A new head of `head`'s config with `config_changes`, on its device and dtype, holding every weight of `head`
    but those named in `skip`.  Only the weights `fresh(name)` accepts (and the target's shared embeddings) may
    stay unloaded; any other mismatch is a ValueError."""
    from ..modeling_peagle import PEagleDrafter

    config = head.config.__class__.from_dict({**head.config.to_dict(), **config_changes})
    new = PEagleDrafter(config).to(head.lm_head.weight.device, head.lm_head.weight.dtype)
    state = {k: v for k, v in head.state_dict().items() if k not in skip}
    missing, unexpected = new.load_state_dict(state, strict=False)
    if unexpected or any(not fresh(k) and k != "embed_tokens.weight" for k in missing):
        raise ValueError(
            f"the head's weights do not fit its own config: missing {missing}, unexpected {unexpected}."
        )
    return new


def resize_draft_vocab(head: PEagleDrafter, target, draft_ids: torch.Tensor) -> PEagleDrafter:
    """A copy of a trained `head` whose draft vocabulary is `draft_ids` (target ids, any size).

    Everything but the LM head is copied as it is.  Ids the head already had keep their trained LM-head rows; the
    others start from the target's output-embedding rows mapped through the least-squares linear fit of the
    trained rows on the target's rows of the kept ids, which gives them the trained rows' scale and as much of
    their geometry as the fit explains (when fewer ids are kept than twice the hidden size, the fit is a single
    scale).  Train the result before using it: untrained, the new rows do not win drafts (docs/training.md,
    section 3).  [`grow_draft_vocab`] chooses the ids from training examples.
    """
    import torch

    _require_plain_head(head, "resize_draft_vocab")
    ids = torch.as_tensor(draft_ids, dtype=torch.long).flatten().unique()  # sorted, as set_draft_vocab wants
    lm = ("lm_head.weight", "d2t", "t2d")
    new = _rebuilt_head(head, lambda name: name in lm, skip=lm, draft_vocab_size=int(ids.numel()))
    config = new.config
    new.set_draft_vocab(ids)
    old_ids = head.draft_vocab_ids
    with torch.no_grad():
        trained = head.lm_head.weight.detach().float().cpu()
        rows_of = target.get_output_embeddings().weight.detach().float().cpu()
        where = torch.full((config.vocab_size,), -1, dtype=torch.long)
        where[old_ids.cpu()] = torch.arange(old_ids.numel())
        old_row = where[ids]
        kept = old_row >= 0
        x, y = rows_of[ids[kept]], trained[old_row[kept]]
        if int(kept.sum()) >= 2 * config.hidden_size:
            rows = rows_of[ids] @ torch.linalg.lstsq(x, y, driver="gelsd").solution
        else:  # too few kept rows for a linear map: one scale (or a fresh layer's when none is kept)
            scale = float((x * y).sum() / (x * x).sum().clamp_min(1e-12)) if bool(kept.any()) else None
            src = rows_of[ids]
            rows = src * scale if scale else src * (config.initializer_range / src.std().clamp_min(1e-12))
        rows[kept] = y
        new.lm_head.weight.copy_(rows.to(new.lm_head.weight.device, new.lm_head.weight.dtype))
    new.train(head.training)
    return new


def grow_layers(head: PEagleDrafter, num_hidden_layers: int) -> PEagleDrafter:
    """A copy of a trained `head` with `num_hidden_layers` decoder layers: new layers appended after its last.

    Every weight the head has is copied.  Each new layer starts as a copy of the head's last plain layer (a fresh
    one when the head has only its fused first layer) with the two projections that write into the residual stream,
    `self_attn.o_proj` and `mlp.down_proj`, set to zero, so it adds nothing: the grown head drafts exactly as the
    head did, and training opens the new layers from there (block expansion, as LLaMA Pro grows a trained model).
    The gradient reaches the zeroed projections first and the rest of the layer once they move.

    Raises:
        TypeError: `head` is not a plain `PEagleDrafter` (merge a LoRA-wrapped head first).
        ValueError: `num_hidden_layers` is not larger than the head's.
    """
    import torch

    _require_plain_head(head, "grow_layers")
    have = head.config.num_hidden_layers
    if num_hidden_layers <= have:
        raise ValueError(
            f"grow_layers adds layers: the head has {have}, asked for {num_hidden_layers} (a head does not shrink)."
        )
    added = tuple(f"layers.{i}." for i in range(have, num_hidden_layers))
    new = _rebuilt_head(head, lambda name: name.startswith(added), num_hidden_layers=num_hidden_layers)
    with torch.no_grad():
        for layer in new.layers[have:]:
            if have > 1:  # the fused first layer has another shape; a head of one layer grows fresh layers
                layer.load_state_dict(head.layers[have - 1].state_dict())
            for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                proj.weight.zero_()
                if proj.bias is not None:
                    proj.bias.zero_()
    new.train(head.training)
    return new


def load_head_for_training(path: str | os.PathLike, target, *, lora=None):
    """An existing head to continue training, in float32 and attached to `target`; with `lora` (a
    `peft.LoraConfig`, see `peagle.adapters.lora_config`) a LoRA adapter on the frozen head instead."""
    import torch

    if lora is not None:
        from ..adapters import lora_for_training

        return lora_for_training(path, target, lora)
    from ..modeling_peagle import PEagleDrafter

    return PEagleDrafter.from_pretrained(path, dtype=torch.float32, target_model=target)


def train_head(
    target,
    tokenizer=None,
    *,
    output_dir: str | os.PathLike,
    prompts: Sequence[Any] = (),
    examples: Sequence[dict[str, Any]] | None = None,
    num_magpie_prompts: int = 0,
    num_code_prompts: int = 0,
    max_new_tokens: int = 256,
    generation_batch_size: int = 8,
    do_sample: bool = False,
    temperature: float = 1.0,
    head=None,
    num_hidden_layers: int | None = None,
    draft_vocab_size: int | None = None,
    drafting_mode: str = "parallel",
    embed_from_target: bool = True,
    mask_token_id: int | None = None,
    lm_head_init: str = "target",
    layers_init: str = "random",
    feature_cache: str | os.PathLike | None = None,
    calibration_examples: int | str = 0,
    training_args: PEagleTrainingArguments | Mapping[str, Any] | None = None,
    resume_from_checkpoint: str | bool | None = None,
    progress: bool = True,
    plain_prompts: bool = False,
) -> tuple[Any, dict[str, Any]]:
    """Self-distill data from `prompts`, train a head on it with [`PEagleTrainer`] and save it to `output_dir`.

    Args:
        target: the target causal LM (frozen).
        tokenizer: its tokenizer (needed for text prompts and Magpie prompts; not for pre-tokenized ones).  When
            given, the prompts of ready `examples` are checked against the evaluation sets too.
        output_dir: where the head (`config.json`, `model.safetensors`), `examples.jsonl`, checkpoints
            (`checkpoints/`) and `train_summary.json` go.
        prompts: user strings, chat message lists or pre-tokenized prompt ids.
        examples: ready examples (`input_ids`, `loss_mask`); skips generation.
        num_magpie_prompts: prompts the target writes itself (Magpie), added to `prompts`.
        num_code_prompts: coding prompts from Python's standard library, added to `prompts`.
        max_new_tokens, generation_batch_size, do_sample, temperature: self-distillation decoding.
        plain_prompts: encode text prompts as plain text, without the tokenizer's chat template (for a target that
            has none; Magpie prompts need one). Checked before any generation: a tokenizer without a chat
            template and text prompts raise `ValueError` unless this is set.
        head: a head to continue training; default [`build_head`] on the examples with `num_hidden_layers`,
            `drafting_mode`, `embed_from_target`, `mask_token_id`, `draft_vocab_size`, `lm_head_init`, `layers_init` (each
            defaulting to the size rule of `peagle.sizing`: the draft vocabulary is chosen from the examples) and
            the arguments' K_train. A draft calibration it carries was fitted to its old weights: the trained
            head drops it (with a warning) unless `calibration_examples` fits a new one.  With `draft_vocab_size`
            too, a head whose vocabulary has another size is first given one of that size ([`grow_draft_vocab`]:
            a larger one keeps its ids and trained rows and adds the examples' most frequent other tokens).
            With `num_hidden_layers` too, a head with fewer layers first gets that many ([`grow_layers`]: the new
            layers are appended and start adding nothing, so the grown head drafts as the head did).
        feature_cache: directory of a [`FeatureCache`] (built or reused) instead of online feature capture.
        calibration_examples: hold out the last N examples from training and, after it, fit the head's per-depth
            draft calibration (`config.draft_calibration`, used by cost-aware drafting) on their prompts with
            greedy `generate()` rounds, with its held-out calibration error in `report` (0: no calibration; run
            `peagle calibrate` later; `"auto"`: min(32, 10% of the examples), none below 40 examples).
        training_args: `PEagleTrainingArguments` (e.g. from [`training_arguments`]), or a dict of its fields
            (`output_dir` defaults to `<output_dir>/checkpoints`, the rest to `PEagleTrainingArguments`' own
            defaults).

    Returns:
        `(head, summary)`: the trained head and a dict of what happened (also written to `train_summary.json`).

    Raises:
        ValueError: no prompts or examples, or a prompt is an MT-Bench/HumanEval prompt.
    """
    import torch

    from ..sizing import head_parameters, target_parameters
    from .arguments import PEagleTrainingArguments
    from .distill import self_distill, synthesize_prompts
    from .features import FeatureCache
    from .prompts import check_chat_template, check_not_evaluation, is_token_ids, stdlib_code_prompts
    from .shards import check_example, save_examples
    from .trainer import PEagleTrainer

    start = time.time()
    if (
        isinstance(generation_batch_size, bool)
        or not isinstance(generation_batch_size, int)
        or generation_batch_size < 1
    ):
        raise ValueError(
            f"generation_batch_size (--gen-batch-size) is {generation_batch_size!r}; expected an integer >= 1."
        )
    generated = examples is None
    if examples is None:
        prompts = list(prompts)
        text_prompts = num_code_prompts or any(not is_token_ids(p) for p in prompts)
        if num_magpie_prompts or text_prompts:
            check_chat_template(tokenizer, plain_prompts=plain_prompts, magpie=bool(num_magpie_prompts))
    output_dir = os.fspath(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    if isinstance(training_args, PEagleTrainingArguments):
        args = training_args
    else:
        targs = dict(training_args or {})
        targs.setdefault("output_dir", os.path.join(output_dir, "checkpoints"))
        targs.setdefault("report_to", "none")
        targs.setdefault("disable_tqdm", not progress)
        args = PEagleTrainingArguments(**targs)
    generated = examples is None
    if examples is None:
        prompts = list(prompts)
        if num_magpie_prompts:
            prompts += synthesize_prompts(
                target, num_magpie_prompts, tokenizer=tokenizer, seed=args.seed, progress=progress
            )
        if num_code_prompts:
            prompts += stdlib_code_prompts(num_code_prompts, seed=args.seed)
        if not prompts:
            raise ValueError("train_head needs prompts, examples, num_magpie_prompts or num_code_prompts.")
        examples = self_distill(
            target,
            prompts,
            tokenizer=tokenizer,
            max_new_tokens=max_new_tokens,
            batch_size=generation_batch_size,
            do_sample=do_sample,
            temperature=temperature,
            seed=args.seed,
            progress=progress,
            plain_prompts=plain_prompts,
        )
        if args.should_save:
            save_examples(examples, os.path.join(output_dir, "examples.jsonl"))
    else:
        examples = [check_example(ex, f"train_head examples, row {i}") for i, ex in enumerate(examples)]
    if tokenizer is not None and not generated:
        check_not_evaluation(
            ([t for t, m in zip(ex["input_ids"], ex["loss_mask"]) if not m] for ex in examples),
            tokenizer,
            source="train_head examples",
        )
    examples = list(examples)
    held_out: list[dict[str, Any]] = []
    if calibration_examples == "auto":
        calibration_examples = min(32, len(examples) // 10) if len(examples) >= 40 else 0
    calibration_examples = int(calibration_examples)
    if calibration_examples > 0:
        if calibration_examples >= len(examples):
            raise ValueError(
                f"calibration_examples={calibration_examples} leaves nothing to train on ({len(examples)} examples)."
            )
        examples, held_out = examples[:-calibration_examples], examples[-calibration_examples:]
    if not examples:
        raise ValueError("no training examples (every response was empty).")

    if head is None:
        name = getattr(tokenizer, "name_or_path", None) if tokenizer is not None else None
        head = build_head(
            target,
            examples,
            drafting_mode=drafting_mode,
            num_hidden_layers=num_hidden_layers,
            draft_vocab_size=draft_vocab_size,
            num_parallel_positions=args.num_parallel_positions or None,
            embed_from_target=embed_from_target,
            mask_token_id=mask_token_id,
            target_model_name=name or None,
            lm_head_init=lm_head_init,
            layers_init=layers_init,
        )
    else:
        if num_hidden_layers is not None and num_hidden_layers != head.config.num_hidden_layers:
            head = grow_layers(head, num_hidden_layers)
            logger.info(
                "grew the head to %d decoder layers (the new ones add nothing until trained)",
                num_hidden_layers,
            )
        if draft_vocab_size is not None and draft_vocab_size != head.config.draft_vocab_size:
            head = grow_draft_vocab(head, target, examples, draft_vocab_size)

    dataset: Any = examples
    cache_info = None
    if feature_cache is not None:
        dataset = FeatureCache.build(
            target, examples, feature_cache, head.config.eagle_aux_hidden_state_layer_ids, progress=progress
        )
        cache_info = {
            "path": os.fspath(feature_cache),
            "bytes": dataset.size_bytes,
            "dtype": dataset.index["dtype"].removeprefix("torch."),
        }

    trainer = PEagleTrainer(model=head, target_model=target, args=args, train_dataset=dataset)
    result = trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    calibration_report = None
    if getattr(head.config, "draft_calibration", None) is not None and trainer.state.global_step > 0:
        # a head continued from a calibrated one: the map was fitted to the weights before this training
        logger.warning(
            "The head's draft_calibration was fitted before this training and is dropped; "
            "run `peagle calibrate` on the trained head (or pass calibration_examples=N)."
        )
        head.config.draft_calibration = None
    if held_out:
        calibration_report = calibrate_trained_head(head, target, held_out, progress=progress)

    history = [h for h in trainer.state.log_history if "loss" in h]
    last_acc = {k: v for k, v in (history[-1] if history else {}).items() if k.startswith("acc_d")}
    summary = {
        "output_dir": output_dir,
        "drafting_mode": head.config.drafting_mode,
        "num_hidden_layers": head.config.num_hidden_layers,
        "num_parallel_positions": head.config.num_parallel_positions,
        "draft_vocab_size": head.config.draft_vocab_size,
        "head_parameters": head_parameters(head.config.to_dict()),
        **(
            {"trainable_parameters": args.trainable_parameters}
            if args.trainable_parameters is not None
            else {}
        ),
        **({"lr_scales": list(args.lr_scales)} if args.lr_scales else {}),
        "target_parameters": target_parameters(target)[0],
        "examples": len(examples),
        "tokens": sum(len(e["input_ids"]) for e in examples),
        "response_tokens": int(sum(sum(e["loss_mask"]) for e in examples)),
        "optimizer_steps": trainer.state.global_step,
        "response_tokens_trained": trainer.response_tokens_trained(),
        **({"response_tokens_trained_estimated": True} if trainer.budget_estimated else {}),
        "threads": torch.get_num_threads() if args.device.type == "cpu" else None,
        "first_loss": history[0]["loss"] if history else None,
        "train_loss": result.training_loss,
        "last_logged_accuracy": last_acc,
        "feature_cache": cache_info,
        "seconds": round(time.time() - start + trainer.resumed_seconds, 1),  # a resumed run counts its past
        "calibration": calibration_report,
    }
    if args.should_save:  # one writer when several processes train (accelerate launch / torchrun)
        head.save_pretrained(output_dir)
        check_saved_head(output_dir, head)
        with open(os.path.join(output_dir, "train_summary.json"), "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=2)
    return head, summary


SAVED_FIELDS = (
    "drafting_mode",
    "num_hidden_layers",
    "num_parallel_positions",
    "num_speculative_tokens",
    "draft_vocab_size",
    "mask_token_id",
    "embed_from_target",
)
"""The config fields a trained head's folder must reload with."""


def check_saved_head(folder: str | os.PathLike, head: Any) -> None:
    """Raise `ValueError` unless the peagle head saved in `folder` reloads with `head`'s sizes (`SAVED_FIELDS`) and
    tensors of the shapes its config declares (`peagle.formats.check_native`); adapters (peft) are not checked."""
    from ..configuration_peagle import PEagleConfig
    from ..formats import check_native, inspect_checkpoint
    from ..modeling_peagle import PEagleDrafter

    if not isinstance(head, PEagleDrafter):
        return
    checkpoint = inspect_checkpoint(folder)
    config = PEagleConfig.from_pretrained(folder)
    check_native(checkpoint, type(head), config=config)
    wrong = {
        k: (getattr(head.config, k), getattr(config, k))
        for k in SAVED_FIELDS
        if getattr(head.config, k) != getattr(config, k)
    }
    if wrong:
        said = ", ".join(f"{k} {got!r} instead of {want!r}" for k, (want, got) in wrong.items())
        raise ValueError(f"the head saved in {folder} reloads with {said}.")


def end_distributed() -> None:
    """Wait for every training process and close the process group, as a launched script does before it exits.

    A no-op in a single process. Without it, a process of a multi-process CPU (gloo) run can abort at interpreter
    exit while the group's threads are still alive. `peagle train` calls it last; call it at the end of your own
    script after [`train_head`] or `PEagleTrainer.train` under `accelerate launch` or `torchrun`.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def calibrate_trained_head(head, target, examples: Sequence[dict[str, Any]], progress: bool = True) -> dict:
    """Fit `head.config.draft_calibration` on the prompts of held-out `examples` (never trained on) and return
    its report (held-out expected calibration error before / after, per depth)."""
    from ..generation.calibration import fit_draft_calibration, prompts_of_examples

    was_training = head.training
    head.eval()
    try:
        result = fit_draft_calibration(head, target, prompts_of_examples(examples), progress=progress)
    finally:
        head.train(was_training)
    data = {
        "examples": len(examples),
        "target_dtype": str(next(target.parameters()).dtype).replace("torch.", ""),
    }
    head.config.draft_calibration = dict(result["calibration"], report=result["report"], data=data)
    return result["report"]


def format_summary(summary: dict[str, Any]) -> str:
    """A small human-readable table of a [`train_head`] summary."""
    rows = [
        ("head", summary["output_dir"]),
        (
            "mode / layers / K_train",
            f"{summary['drafting_mode']} / {summary['num_hidden_layers']} / {summary['num_parallel_positions']}",
        ),
        ("draft vocab", summary["draft_vocab_size"]),
    ]
    if summary.get("head_parameters") and summary.get("target_parameters"):
        own, tgt = summary["head_parameters"], summary["target_parameters"]
        rows.append(
            ("head / target parameters", f"{own / 1e6:.2f}M / {tgt / 1e6:.1f}M ({100 * own / tgt:.1f}%)")
        )
    rows += [
        (
            "examples / tokens / response tokens",
            f"{summary['examples']} / {summary['tokens']} / {summary['response_tokens']}",
        ),
        ("optimizer steps", summary["optimizer_steps"]),
        ("loss first log -> mean", f"{summary['first_loss']} -> {summary['train_loss']:.4f}"),
        (
            "top-1 by depth (last log)",
            " ".join(f"{v:.2f}" for v in summary["last_logged_accuracy"].values()) or "-",
        ),
    ]
    if summary.get("feature_cache"):
        cache = summary["feature_cache"]
        rows.append(("feature cache", f"{cache['path']} ({cache['bytes'] / 2**20:.1f} MiB)"))
    rows.append(("time", f"{summary['seconds']} s"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


__all__ = [
    "training_arguments",
    "build_head",
    "init_layers_from_target",
    "init_lm_head_from_target",
    "resize_draft_vocab",
    "grow_draft_vocab",
    "load_head_for_training",
    "train_head",
    "format_summary",
]
