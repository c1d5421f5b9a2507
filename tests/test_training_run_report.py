"""peagle.training.run_report: a run says before it starts how much it will train (and what to change when that is
too little to learn), and its summary logs a loss for every run that made a step."""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import pytest

from helpers import make_target, tiny_tokenizer
from peagle.training import train_head, training_arguments
from peagle.training.run_report import (
    MIN_OPTIMIZER_STEPS,
    format_summary,
    run_size,
    too_small_warning,
)


def _args(per_device=8, accumulation=8, epochs=1.0, max_steps=-1, world_size=1):
    return SimpleNamespace(
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        num_train_epochs=epochs,
        max_steps=max_steps,
        world_size=world_size,
    )


@pytest.mark.parametrize(
    ("examples", "args", "steps"),
    [
        (16, _args(), 1),  # the issue's first run: 8 + 8 prompts, the recipe's 64 examples per step
        (300, _args(epochs=3.0), 15),  # 38 batches -> 5 updates per epoch (the last one partial)
        (100, _args(accumulation=1), 13),
        (100, _args(world_size=2, epochs=4.0), 4),  # 7 batches per process -> 1 update per epoch
        (10, _args(max_steps=3), 3),
    ],
)
def test_run_size_counts_steps_as_the_trainer_will(examples, args, steps):
    assert run_size(examples, args).steps == steps


def test_the_issues_first_run_is_told_what_to_change():
    size = run_size(16, _args())
    assert size.examples_per_step == 64
    text = too_small_warning(size)
    assert text.startswith("This run will make 1 optimizer step: 16 examples, 64 per optimizer step")
    assert "per_device_train_batch_size 8 x gradient_accumulation_steps 8 x 1 process" in text
    # every fix it names reaches the minimum
    assert "--gradient_accumulation_steps 1 --per_device_train_batch_size 1" in text
    assert run_size(16, _args(per_device=1, accumulation=1)).steps >= MIN_OPTIMIZER_STEPS
    assert f"--num_train_epochs {MIN_OPTIMIZER_STEPS}" in text
    assert f"about {MIN_OPTIMIZER_STEPS * 64} examples" in text and "--num_magpie_prompts" in text


def test_the_fewest_changes_are_named():
    text = too_small_warning(run_size(100, _args()))  # 13 batches: 2 steps at accumulation 8
    assert "--gradient_accumulation_steps 1;" in text and "--per_device_train_batch_size" not in text
    assert "--num_train_epochs 5" in text
    assert run_size(100, _args(accumulation=1)).steps >= MIN_OPTIMIZER_STEPS


def test_large_runs_and_chosen_step_counts_are_not_warned():
    assert too_small_warning(run_size(640, _args())) is None
    assert too_small_warning(run_size(16, _args(max_steps=2))) is None  # the user chose the steps


def test_train_head_warns_before_training(tmp_path, caplog):
    target, tok = make_target(), tiny_tokenizer()
    examples = [
        {"input_ids": tok("write code please the bot of the", add_special_tokens=False)["input_ids"],
         "loss_mask": [0, 0, 0, 1, 1, 1, 1]},
    ] * 3  # fmt: skip
    args = training_arguments(
        tmp_path / "ckpt", num_parallel_positions=3, use_cpu=True, save_strategy="no", progress=False
    )
    trained = []
    with caplog.at_level(logging.INFO):
        logging.getLogger("peagle.training.recipe").addFilter(
            lambda r: trained.append(r.getMessage()) or True
        )
        _, summary = train_head(
            target, tok, output_dir=tmp_path / "head", examples=examples, training_args=args
        )
    warning = next(r for r in caplog.records if r.name == "peagle.training.run_report")
    assert (
        warning.levelno == logging.WARNING
        and "This run will make 1 optimizer step: 3 examples" in warning.message
    )
    assert summary["optimizer_steps"] == 1
    # a loss for the one step: logged at the first step by the recipe's defaults, then printed
    assert summary["first_loss"] is not None
    loss = f"{summary['first_loss']:.4f} -> {summary['train_loss']:.4f}"
    assert re.search(rf"\nloss first log -> run mean +{loss}\n", format_summary(summary))


def _summary(**kw):
    base = dict(
        output_dir="runs/x", drafting_mode="parallel", num_hidden_layers=1, num_parallel_positions=8,
        draft_vocab_size=64, examples=3, tokens=30, response_tokens=20, optimizer_steps=1, first_loss=None,
        train_loss=7.9074, last_logged_accuracy={}, seconds=1.0,
    )  # fmt: skip
    return {**base, **kw}


def test_the_summary_logs_a_loss_for_every_run_that_made_a_step():
    assert re.search(
        r"\nloss \(run mean\) +7\.9074\n", format_summary(_summary())
    )  # none logged before the end
    assert "None" not in format_summary(_summary())
    assert re.search(
        r"\nloss first log -> run mean +8\.1000 -> 7\.9074\n", format_summary(_summary(first_loss=8.1))
    )
    assert re.search(r"\nloss +- \(no optimizer step\)\n", format_summary(_summary(optimizer_steps=0)))
