"""`peagle train`: target + prompts -> self-distilled data -> trained head (`peagle.training.recipe.train_head`).

The flags are the fields of `peagle.training.arguments` (`PEagleTrainingArguments`, `DataArguments`,
`HeadArguments`, `LoraArguments`), parsed by transformers' `HfArgumentParser`: `--cod_ratio` fills `cod_ratio`,
with its one default.  `--output_dir` is the head's folder; checkpoints go to its `checkpoints/`.
"""

from __future__ import annotations

import argparse
import os

from ._common import dataclass_from_args, dataclass_parent

_ARGUMENTS = ("PEagleTrainingArguments", "DataArguments", "HeadArguments", "LoraArguments")


def _argument_types() -> list[type]:
    from ..training import arguments

    return [getattr(arguments, name) for name in _ARGUMENTS]


def add_parser(sub) -> argparse.ArgumentParser:
    from ..training.arguments import RECIPE_DEFAULTS

    p = sub.add_parser(
        "train",
        help="train a P-EAGLE (or EAGLE-3) head for a target on self-distilled data",
        parents=[dataclass_parent(*_argument_types())],
        conflict_handler="resolve",  # peagle's --debug (one-line errors or the traceback) over TrainingArguments'
    )
    p.set_defaults(**RECIPE_DEFAULTS)
    return p


def _is_default(spec: str | None) -> bool:
    return spec is None or spec == "default"


def _read_chat_template(path: str) -> str:
    """The text of a `--chat_template` file (a Jinja template, as `tokenizer.chat_template` holds)."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"--chat_template file {path!r} does not exist.") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"--chat_template file {path!r} is not UTF-8 text (byte {err.start}).") from err
    if not text.strip():
        raise ValueError(f"--chat_template file {path!r} is empty; expected a Jinja chat template.")
    return text


def parse_settings(args: argparse.Namespace):
    """The four settings objects of a parsed `peagle train` command line, checked against each other."""
    import torch

    from ..training.arguments import DataArguments, HeadArguments, LoraArguments, PEagleTrainingArguments

    if not args.output_dir:
        raise ValueError("--output_dir is required: the folder the trained head is saved to.")
    data, head, lora = (dataclass_from_args(k, args) for k in (DataArguments, HeadArguments, LoraArguments))
    check_lora(data, head, lora, args)
    use_cpu = bool(args.use_cpu) or not torch.cuda.is_available()
    training = dataclass_from_args(
        PEagleTrainingArguments,
        args,
        output_dir=os.path.join(args.output_dir, "checkpoints"),
        use_cpu=use_cpu,
    )
    return data, head, lora, training


def check_lora(data, head, lora, args) -> None:
    if data.plain_prompts and data.chat_template:
        raise ValueError(
            "--plain_prompts encodes prompts without a template; --chat_template gives one: pass one."
        )
    if not lora.lora:
        return
    if head.base_head is None and not _is_default(data.target):
        raise ValueError("--lora with --target needs --base_head (the head to adapt).")
    if head.draft_vocab_size is not None:
        raise ValueError("--lora adapts the base head's own draft vocabulary; --draft_vocab_size resizes it.")
    if head.num_hidden_layers is not None:
        raise ValueError("--lora adapts the base head's own layers; --num_hidden_layers grows it.")
    if args.trainable_parameters is not None:
        raise ValueError(
            "--lora trains only its adapters; --trainable_parameters chooses among the head's own weights."
        )


def show_sizing_log() -> None:
    """The head-size decisions (peagle.sizing) and the draft-vocabulary choice are logged at INFO: show them."""
    import logging

    log = logging.getLogger("peagle")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


def load_data(data):
    """Prompts, ready examples and chat template, checked before the target model loads; then the target."""

    from ..data.prompts import check_chat_template, load_prompts
    from ..data.shards import load_examples
    from ..targets import load_target_tokenizer

    spec = "default" if _is_default(data.target) else data.target
    prompts = [p for path in data.prompts for p in load_prompts(path, limit=data.limit)]
    examples = load_examples(data.examples) if data.examples else None
    template = _read_chat_template(data.chat_template) if data.chat_template else None
    if examples is None and (prompts or data.num_magpie_prompts or data.num_code_prompts):
        tokenizer = load_target_tokenizer(spec)
        if tokenizer is not None and template is not None:
            tokenizer.chat_template = template
        magpie = bool(data.num_magpie_prompts)
        check_chat_template(tokenizer, plain_prompts=data.plain_prompts, magpie=magpie, what=f"target {spec}")
    return spec, prompts, examples, template


def warn_slow_bf16(training, data) -> None:
    import logging

    from ..runtime import native_bf16

    device = "cpu" if training.use_cpu else "cuda"
    if (training.bf16 or data.dtype == "bfloat16") and not native_bf16(device):
        logging.getLogger("peagle").warning(
            f"warning: this {device} has no native bfloat16 (e.g. an AVX2-only CPU); bf16 runs through slow "
            "fallback kernels here, often many times slower than float32: drop --bf16 / --dtype bfloat16."
        )


def run(args: argparse.Namespace) -> int:
    import torch

    from ..targets import load_target
    from ..training.recipe import end_distributed, format_summary, train_head

    data, head_args, lora, training = parse_settings(args)
    show_sizing_log()
    warn_slow_bf16(training, data)
    spec, prompts, examples, template = load_data(data)
    device = "cpu" if training.use_cpu else "cuda"
    target, tokenizer = load_target(spec, dtype=getattr(torch, data.dtype), device=device)
    if examples is not None:
        from ..data.shards import check_token_ids

        check_token_ids(
            examples, int(target.config.get_text_config().vocab_size), f"--examples {data.examples}"
        )
    if tokenizer is not None and template is not None:
        tokenizer.chat_template = template
    if lora.lora and head_args.base_head is None:  # the shipped head of the default target
        from ..targets import default_drafter_path

        head_args.base_head = str(default_drafter_path("peagle"))
    head, summary = train_head(
        target,
        tokenizer,
        output_dir=args.output_dir,
        training_args=training,
        data_args=data,
        head_args=head_args,
        lora_args=lora,
        prompts=prompts,
        examples=examples,
    )
    print(format_summary(summary))
    if lora.lora and training.should_save:
        from ..integrations.peft import merge_lora

        merged_dir = os.path.join(args.output_dir, "merged")
        merge_lora(head).save_pretrained(merged_dir)
        print(f"LoRA adapter: {args.output_dir}\nmerged head:  {merged_dir}")
    end_distributed()
    return 0
