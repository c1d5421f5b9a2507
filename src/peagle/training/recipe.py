"""The standard recipe: a target and prompts -> self-distilled examples -> a trained, saved head.

[`training_arguments`] builds the recipe's `PEagleTrainingArguments`, [`build_head`] a new head for a target
(config, draft vocabulary, mask token), [`load_head_for_training`] an existing head (optionally with a LoRA
adapter), and [`train_head`] runs the whole recipe (`peagle train` calls it).  Every setting is a field of the
argument dataclasses of `peagle.training.arguments` (`PEagleTrainingArguments`, `DataArguments`, `HeadArguments`,
`LoraArguments`), its default defined there once: scripts build them, the command line parses them, and both
hand them to these functions.

Importing this module is cheap; torch, transformers and the trainer are imported inside the functions.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from transformers import set_seed

from .run_report import format_summary, warn_if_too_small

if TYPE_CHECKING:
    import torch

    from ..modeling_peagle import PEagleDrafter
    from .arguments import DataArguments, HeadArguments, LoraArguments, PEagleTrainingArguments

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


def draft_vocab_choice(
    target, values: dict[str, Any], draft_vocab_size: int | None, examples: Sequence[dict[str, Any]] | None
) -> tuple[int, str]:
    """The draft vocabulary's size for a head with config `values`, and why: `draft_vocab_size` when given, else
    the smallest size the size rule allows that covers 99.5% of the examples' response tokens (the rule's largest
    without examples)."""
    from ..data.vocab import coverage_vocab_size
    from ..sizing import plan_head

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
    return draft_vocab_size, why_vocab


def logged_plan(
    target, values: dict[str, Any], head_args: HeadArguments, draft_vocab_size: int, why_vocab: str
):
    """`PEagleConfig.for_target`'s plan for [`build_head`], logged with what peagle chose said as chosen: the draft
    vocabulary's reason (not "given" when peagle chose it) and its ids taken from the training examples."""
    from ..sizing import plan_head

    given = ["num_hidden_layers"] if "num_hidden_layers" in values else []
    given += ["draft_vocab_size"] if why_vocab == "given" else []
    given += [] if head_args.embed_from_target else ["embed_from_target"]
    plan = plan_head(target, {**values, "draft_vocab_size": draft_vocab_size}, given=given)
    plan.notes[:] = [
        f"draft_vocab_size: {draft_vocab_size} ({why_vocab})"
        if n == f"draft_vocab_size: {draft_vocab_size} (given)"
        else f"draft ids: the training examples' {draft_vocab_size} most frequent response tokens and the EOS ids "
        "(the head drafts only these)"
        if n.startswith("draft ids: ")
        else n
        for n in plan.notes
    ]
    chosen = not {"num_hidden_layers", "embed_from_target"} & set(values) and why_vocab != "given"
    over = plan.head_parameters > plan.budget and chosen
    logging.getLogger("peagle.sizing").log(logging.WARNING if over else logging.INFO, plan.describe())
    return plan


def build_head(
    target,
    examples: Sequence[dict[str, Any]] | None = None,
    head_args: HeadArguments | None = None,
    *,
    num_parallel_positions: int | None = None,
    num_speculative_tokens: int | None = None,
    target_model_name: str | None = None,
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
        head_args: [`HeadArguments`]: drafting mode, layers and draft vocabulary size (None: the size rule's),
            embeddings, mask token and how the LM head and the layers start (default: `HeadArguments()`;
            `base_head` is not read here).
        num_parallel_positions: K_train (default 8).
        num_speculative_tokens: the head's default inference K (default: min(7, K_train)).
        target_model_name: recorded in the config (default: the target config's name).
        dtype: parameter dtype (default float32, the training dtype).
        config_overrides: any other `PEagleConfig` field (e.g. `attn_implementation="sdpa"`).
    """
    import dataclasses

    import torch

    from ..configuration_peagle import PEagleConfig
    from ..data.vocab import select_draft_vocab
    from ..modeling_peagle import PEagleDrafter
    from .arguments import HeadArguments
    from .head_surgery import eos_ids, init_layers_from_target, init_lm_head_from_target

    misplaced = sorted({f.name for f in dataclasses.fields(HeadArguments)} & set(config_overrides))
    if misplaced:
        raise TypeError(f"build_head takes {misplaced} in head_args (HeadArguments), not as keywords.")
    head_args = HeadArguments() if head_args is None else head_args  # its fields are checked when it is made
    values: dict[str, Any] = {
        "drafting_mode": head_args.drafting_mode,
        "embed_from_target": head_args.embed_from_target,
    }
    optional = {
        "num_hidden_layers": head_args.num_hidden_layers,
        "num_parallel_positions": num_parallel_positions,
        "num_speculative_tokens": num_speculative_tokens,
        "mask_token_id": head_args.mask_token_id,
        "target_model_name": target_model_name,
    }
    values.update({k: v for k, v in optional.items() if v is not None})
    values.update(config_overrides)
    vocab_size = int(target.config.get_text_config().vocab_size)
    draft_vocab_size, why_vocab = draft_vocab_choice(target, values, head_args.draft_vocab_size, examples)
    plan = logged_plan(target, values, head_args, draft_vocab_size, why_vocab)
    config = PEagleConfig(**plan.values)
    head = PEagleDrafter(config).to(dtype or torch.float32)
    if draft_vocab_size < vocab_size:
        head.set_draft_vocab(select_draft_vocab(examples, draft_vocab_size, vocab_size, eos_ids(target)))
    if head_args.lm_head_init == "target":
        init_lm_head_from_target(head, target)
    if head_args.layers_init == "target":
        init_layers_from_target(head, target)
    return head


def load_head_for_training(path: str | os.PathLike, target, *, lora=None):
    """An existing head to continue training, in float32 and attached to `target`; with `lora` (a
    `peft.LoraConfig`, see `peagle.integrations.peft.lora_config`) a LoRA adapter on the frozen head instead."""
    import torch

    if lora is not None:
        from ..integrations.peft import lora_for_training

        return lora_for_training(path, target, lora)
    from ..modeling_peagle import PEagleDrafter

    return PEagleDrafter.from_pretrained(path, dtype=torch.float32, target_model=target)


def train_head(
    target,
    tokenizer=None,
    *,
    output_dir: str | os.PathLike,
    training_args: PEagleTrainingArguments | None = None,
    data_args: DataArguments | None = None,
    head_args: HeadArguments | None = None,
    lora_args: LoraArguments | None = None,
    prompts: Sequence[Any] = (),
    examples: Sequence[dict[str, Any]] | None = None,
    head=None,
) -> tuple[Any, dict[str, Any]]:
    """Self-distill data from `prompts`, train a head on it with [`PEagleTrainer`] and save it to `output_dir`.

    The settings are the argument dataclasses of `peagle.training.arguments`, the ones `peagle train` parses: each
    left None is its class's defaults.

    Args:
        target: the target causal LM (frozen).
        tokenizer: its tokenizer (needed for text prompts and Magpie prompts; not for pre-tokenized ones).  When
            given, the prompts of ready `examples` are checked against the evaluation sets too.
        output_dir: where the head (`config.json`, `model.safetensors`), `examples.jsonl` and `train_summary.json`
            go.
        training_args: [`PEagleTrainingArguments`] (e.g. from [`training_arguments`]); default
            `training_arguments(<output_dir>/checkpoints)`.  `resume_from_checkpoint` (a checkpoint folder, or
            `"last"`: the newest under its `output_dir`) continues an interrupted run; `disable_tqdm` hides the
            progress bars of data generation and training alike.
        data_args: [`DataArguments`]: Magpie and standard-library coding prompts added to `prompts`, the
            self-distillation decoding (`max_new_tokens`, `generation_batch_size`, `do_sample`, `temperature`,
            `plain_prompts`), `feature_cache`, long `documents` and `calibration_examples`.  Its file fields
            (`target`, `dtype`, `prompts`, `limit`, `examples`, `chat_template`) are read by `peagle train`, which
            passes their contents here as `target`, `tokenizer`, `prompts` and `examples`.
        head_args: [`HeadArguments`]: the new head [`build_head`] makes (sizes left None follow the size rule of
            `peagle.sizing`: the draft vocabulary is chosen from the examples), or with `head` (or `base_head`) the
            layers and draft vocabulary it is grown to first ([`grow_layers`]: appended layers start adding
            nothing; [`grow_draft_vocab`]: a larger vocabulary keeps its ids and trained rows and adds the
            examples' most frequent other tokens).  `base_head`, when `head` is None: the head folder to continue.
        lora_args: [`LoraArguments`]: with `lora`, train a LoRA adapter on the frozen `base_head` instead.
        prompts: user strings, chat message lists or pre-tokenized prompt ids.
        examples: ready examples (`input_ids`, `loss_mask`); skips generation.
        head: a head to continue training (default: `head_args.base_head`, else a new one).  A draft calibration
            it carries was fitted to its old weights: the trained head drops it (with a warning) unless
            `calibration_examples` fits a new one.

    Returns:
        `(head, summary)`: the trained head and a dict of what happened (also written to `train_summary.json`).
        Raises `ValueError` for no prompts or examples, or a prompt from MT-Bench or HumanEval.
    """
    from .arguments import DataArguments, HeadArguments, explicit_documents

    start = time.time()
    data_args = DataArguments() if data_args is None else data_args
    head_args = HeadArguments() if head_args is None else head_args
    output_dir = os.fspath(output_dir)
    if training_args is None:
        training_args = training_arguments(os.path.join(output_dir, "checkpoints"))
    args, progress = training_args, not training_args.disable_tqdm
    generated = data_args.num_magpie_prompts or data_args.num_code_prompts
    if examples is None and explicit_documents(data_args.documents) and not (prompts or generated):
        examples = []  # long document examples alone
    if examples is None:
        check_prompts(tokenizer, prompts, data_args)
    if head is None and (head_args.base_head is not None or (lora_args is not None and lora_args.lora)):
        head = base_head(target, head_args, lora_args)
    os.makedirs(output_dir, exist_ok=True)
    examples = gather_examples(target, tokenizer, output_dir, args, data_args, prompts, examples)
    examples, held_out = split_calibration(examples, data_args.calibration_examples)
    set_seed(args.seed)  # the head's initial weights depend on the seed alone, not on how the data came
    head = prepare_head(head, target, tokenizer, examples, args, head_args)
    dataset, cache_info = training_dataset(target, examples, head, data_args.feature_cache, progress)
    resume = args.resume_from_checkpoint
    trainer, result = run_training(head, target, args, dataset, True if resume == "last" else resume)
    calibration_report = recalibrate(head, target, trainer, held_out, progress)
    summary = training_summary(
        head, target, args, trainer, result, examples, output_dir, cache_info, calibration_report, start
    )
    if args.should_save:  # one writer when several processes train (accelerate launch / torchrun)
        save_trained_head(head, output_dir, summary)
    return head, summary


def gather_examples(
    target,
    tokenizer,
    output_dir: str,
    args: PEagleTrainingArguments,
    data_args: DataArguments,
    prompts: Sequence[Any],
    examples: Sequence[dict[str, Any]] | None,
) -> list[dict[str, Any]]:
    """The training examples of a run: `examples` checked, or the target's answers to `prompts` (saved to
    `output_dir/examples.jsonl`), with the long examples of `data_args.documents` first."""
    set_seed(args.seed)  # sampled answers, like the new head's weights, follow the run's seed
    if examples is None:
        examples = distill_examples(target, tokenizer, args, data_args, prompts)
        if args.should_save:
            from ..data.shards import save_examples

            save_examples(examples, os.path.join(output_dir, "examples.jsonl"))
    else:
        examples = checked_examples(examples, tokenizer)
    documents = resolved_documents(data_args.documents, target, tokenizer, args.max_length)
    if documents is None:
        return list(examples)
    return long_examples(target, tokenizer, documents, args, data_args) + list(examples)


def base_head(target, head_args: HeadArguments, lora_args: LoraArguments | None = None):
    """The head `head_args.base_head` names, to continue training; with `lora_args.lora`, wrapped in a LoRA adapter
    ([`load_head_for_training`])."""
    config = None
    if lora_args is not None and lora_args.lora:
        from ..integrations.peft import lora_config

        modules = lora_args.lora_target_modules.split(",") if lora_args.lora_target_modules else None
        config = lora_config(
            r=lora_args.lora_r,
            lora_alpha=lora_args.lora_alpha,
            lora_dropout=lora_args.lora_dropout,
            target_modules=modules,
        )
    if head_args.base_head is None:
        raise ValueError("a LoRA adapter needs head_args.base_head, the head it adapts.")
    return load_head_for_training(head_args.base_head, target, lora=config)


def check_prompts(tokenizer, prompts, data_args: DataArguments) -> None:
    """Text and Magpie prompts need a chat template (or `plain_prompts`): checked before anything is generated."""
    from ..data.prompts import check_chat_template, is_token_ids

    text_prompts = data_args.num_code_prompts or any(not is_token_ids(p) for p in prompts)
    if data_args.num_magpie_prompts or text_prompts:
        magpie = bool(data_args.num_magpie_prompts)
        check_chat_template(tokenizer, plain_prompts=data_args.plain_prompts, magpie=magpie)


def distill_examples(
    target, tokenizer, args: PEagleTrainingArguments, data_args: DataArguments, prompts: Sequence[Any] = ()
) -> list[dict[str, Any]]:
    """The target answers `prompts` (plus `data_args`' Magpie and standard-library coding prompts) itself: the
    examples, decoded as `data_args` says."""
    from ..data.distill import synthesize_prompts
    from ..data.prompts import stdlib_code_prompts

    progress = not args.disable_tqdm
    prompts = list(prompts)
    if data_args.num_magpie_prompts:
        prompts += synthesize_prompts(
            target, data_args.num_magpie_prompts, tokenizer=tokenizer, seed=args.seed, progress=progress
        )
    if data_args.num_code_prompts:
        prompts += stdlib_code_prompts(data_args.num_code_prompts, seed=args.seed)
    if not prompts:
        raise ValueError("train_head needs prompts, examples, num_magpie_prompts or num_code_prompts.")
    return answered(target, tokenizer, args, data_args, prompts)


def answered(
    target, tokenizer, args: PEagleTrainingArguments, data_args: DataArguments, prompts: Sequence[Any]
) -> list[dict[str, Any]]:
    """The target's own answers to `prompts`, decoded as `data_args` says."""
    from ..data.distill import self_distill

    return self_distill(
        target,
        prompts,
        tokenizer=tokenizer,
        max_new_tokens=data_args.max_new_tokens,
        batch_size=data_args.generation_batch_size,
        do_sample=data_args.do_sample,
        temperature=data_args.temperature,
        seed=args.seed,
        progress=not args.disable_tqdm,
        plain_prompts=data_args.plain_prompts,
    )


def target_positions(target, default: int) -> int:
    """The target's position range (`max_position_embeddings`), or `default` where its config gives none."""
    return int(getattr(target.config.get_text_config(), "max_position_embeddings", default))


def document_lengths(target, max_length: int) -> list[int]:
    """The long examples' lengths: 2K tokens doubling up to the target's range and `max_length`."""
    from ..data.documents import default_document_lengths

    return default_document_lengths(target_positions(target, max_length), max_length)


def resolved_documents(documents: str | None, target, tokenizer, max_length: int) -> str | None:
    """The documents a run reads: `documents` as given; for `"auto"` (the default), Python's standard library where
    the target's range and `max_length` allow 2K-token examples and a tokenizer can encode them; None for `"none"`
    or where `"auto"` finds no room."""
    from .arguments import explicit_documents

    if explicit_documents(documents):
        return documents
    if (
        str(documents).strip().lower() != "auto"
        or tokenizer is None
        or not document_lengths(target, max_length)
    ):
        return None
    logger.info("documents: auto, long examples from Python's standard library (documents='none' for none)")
    return "stdlib"


def long_examples(
    target, tokenizer, documents: str, args: PEagleTrainingArguments, data_args: DataArguments
) -> list[dict[str, Any]]:
    """Teacher-forced examples from `documents` at every length the target's range and `args.max_length` allow
    (none, with a warning, where that is under 2K tokens), and the target's answers to
    `data_args.document_questions` questions about them."""
    from ..data.documents import document_examples, document_questions, read_documents
    from ..data.prompts import has_chat_template

    if tokenizer is None:
        raise ValueError("documents need the target's tokenizer to encode their text.")
    lengths = document_lengths(target, args.max_length)
    if not lengths:
        logger.warning(
            f"documents: no long examples (max_length {args.max_length} and the target's "
            f"{target_positions(target, args.max_length)} positions leave no room for 2K tokens); raise max_length "
            "to train on long text."
        )
        return []
    texts = read_documents(documents)
    per_length, progress = data_args.document_examples_per_length, not args.disable_tqdm
    rows = document_examples(tokenizer, texts, lengths, per_length, args.seed, progress)
    logger.info(f"documents: {len(rows)} examples of {lengths} tokens from {documents}")
    count = data_args.document_questions
    if count and not (data_args.plain_prompts or has_chat_template(tokenizer)):
        logger.warning(
            "documents: no questions about the documents (the tokenizer has no chat template; plain_prompts "
            "or chat_template to ask them)."
        )
        count = 0
    if count:
        questions = document_questions(tokenizer, texts, lengths, count, data_args.max_new_tokens, args.seed)
        rows += [
            dict(ex, source="document questions")
            for ex in answered(target, tokenizer, args, data_args, questions)
        ]
        logger.info(f"documents: {count} questions about them answered by the target")
    return rows


def checked_examples(examples: Sequence[dict[str, Any]], tokenizer) -> list[dict[str, Any]]:
    """Ready examples checked row by row, and (with a tokenizer) their prompts against the evaluation sets."""
    from ..data.prompts import check_not_evaluation
    from ..data.shards import check_example

    examples = [check_example(ex, f"train_head examples, row {i}") for i, ex in enumerate(examples)]
    if tokenizer is not None:
        check_not_evaluation(
            ([t for t, m in zip(ex["input_ids"], ex["loss_mask"]) if not m] for ex in examples),
            tokenizer,
            source="train_head examples",
        )
    return examples


def split_calibration(
    examples: Sequence[dict[str, Any]], calibration_examples: int | str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`(train, held_out)`: the last `calibration_examples` held out for the draft calibration (`"auto"`:
    min(32, 10%), none below 40 examples)."""
    examples = list(examples)
    if calibration_examples == "auto":
        calibration_examples = min(32, len(examples) // 10) if len(examples) >= 40 else 0
    count = int(calibration_examples)
    held_out: list[dict[str, Any]] = []
    if count > 0:
        if count >= len(examples):
            raise ValueError(
                f"calibration_examples={count} leaves nothing to train on ({len(examples)} examples)."
            )
        examples, held_out = examples[:-count], examples[-count:]
    if not examples:
        raise ValueError("no training examples (every response was empty).")
    return examples, held_out


def prepare_head(head, target, tokenizer, examples: Sequence[dict[str, Any]], args, head_args: HeadArguments):
    """A new head sized for the target and the examples ([`build_head`] with `head_args` and the arguments'
    K_train), or `head` grown to the layers and draft vocabulary `head_args` asks for."""
    from .head_surgery import grow_draft_vocab, grow_layers

    if head is None:
        from ..sizing import recorded_target_name

        name = recorded_target_name(
            getattr(tokenizer, "name_or_path", None) if tokenizer is not None else None
        )
        return build_head(
            target,
            examples,
            head_args,
            num_parallel_positions=args.num_parallel_positions or None,
            target_model_name=name or None,
        )
    num_hidden_layers, draft_vocab_size = head_args.num_hidden_layers, head_args.draft_vocab_size
    if num_hidden_layers is not None and num_hidden_layers != head.config.num_hidden_layers:
        head = grow_layers(head, num_hidden_layers)
        logger.info(
            "grew the head to %d decoder layers (the new ones add nothing until trained)", num_hidden_layers
        )
    if draft_vocab_size is not None and draft_vocab_size != head.config.draft_vocab_size:
        head = grow_draft_vocab(head, target, examples, draft_vocab_size)
    return head


def training_dataset(
    target, examples, head, feature_cache, progress: bool
) -> tuple[Any, dict[str, Any] | None]:
    """The examples, or a [`FeatureCache`] of their target features (built or reused) with its description."""
    from ..data.features import FeatureCache

    if feature_cache is None:
        return examples, None
    cache = FeatureCache.build(
        target, examples, feature_cache, head.config.eagle_aux_hidden_state_layer_ids, progress=progress
    )
    info = {
        "path": os.fspath(feature_cache),
        "bytes": cache.size_bytes,
        "dtype": cache.index["dtype"].removeprefix("torch."),
    }
    return cache, info


def run_training(head, target, args: PEagleTrainingArguments, dataset, resume_from_checkpoint):
    """`PEagleTrainer.train`, after saying how many optimizer steps it will make (and what to change when that is
    too few to learn); returns `(trainer, result)`."""
    from .trainer import PEagleTrainer

    warn_if_too_small(len(dataset), args)
    trainer = PEagleTrainer(model=head, target_model=target, args=args, train_dataset=dataset)
    return trainer, trainer.train(resume_from_checkpoint=resume_from_checkpoint)


def recalibrate(head, target, trainer, held_out: Sequence[dict[str, Any]], progress: bool) -> dict | None:
    """Drop a draft calibration fitted before this training; fit a new one on `held_out` when there is any."""
    if getattr(head.config, "draft_calibration", None) is not None and trainer.state.global_step > 0:
        # a head continued from a calibrated one: the map was fitted to the weights before this training
        logger.warning(
            "The head's draft_calibration was fitted before this training and is dropped; "
            "run `peagle calibrate` on the trained head (or pass calibration_examples=N)."
        )
        head.config.draft_calibration = None
    return calibrate_trained_head(head, target, held_out, progress=progress) if held_out else None


def training_summary(
    head, target, args, trainer, result, examples, output_dir, cache_info, calibration_report, start: float
) -> dict[str, Any]:
    """What happened, as `train_summary.json` records it."""
    import torch

    from ..sizing import head_parameters, target_parameters

    history = [h for h in trainer.state.log_history if "loss" in h]
    last_acc = {k: v for k, v in (history[-1] if history else {}).items() if k.startswith("acc_d")}
    return {
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
        **({"response_tokens_trained_estimated": True} if trainer.count_estimated else {}),
        "threads": torch.get_num_threads() if args.device.type == "cpu" else None,
        "first_loss": history[0]["loss"] if history else None,
        "train_loss": result.training_loss,
        "last_logged_accuracy": last_acc,
        "feature_cache": cache_info,
        "seconds": round(time.time() - start + trainer.resumed_seconds, 1),  # a resumed run counts its past
        "calibration": calibration_report,
    }


def save_trained_head(head, output_dir: str, summary: dict[str, Any]) -> None:
    """The head and its `train_summary.json`, checked to reload with the head's sizes."""
    head.save_pretrained(output_dir)
    check_saved_head(output_dir, head)
    with open(os.path.join(output_dir, "train_summary.json"), "w", encoding="utf-8") as fh:
        json.dump(summary, fh, indent=2)


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


__all__ = [
    "training_arguments",
    "build_head",
    "load_head_for_training",
    "train_head",
    "format_summary",
]
