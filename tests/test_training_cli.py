"""`peagle train` end to end on a tiny target saved to disk (with a tiny word-level tokenizer)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from helpers import make_target, tiny_tokenizer
from peagle import PEagleDrafter
from peagle.cli import main


def test_peagle_train_command(tmp_path, capsys, caplog, monkeypatch):
    target_dir = tmp_path / "target"
    make_target().save_pretrained(target_dir)
    tiny_tokenizer().save_pretrained(target_dir)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello world\nwrite code please\nthe bot\n")
    out = tmp_path / "head"
    common = [
        "--target",
        str(target_dir),
        "--use_cpu",
        "--num_parallel_positions",
        "3",
        "--gradient_accumulation_steps",
        "1",
        "--logging_steps",
        "1",
    ]
    rc = main(
        [
            "train",
            *common,
            "--prompts",
            str(prompts),
            "--output_dir",
            str(out),
            "--max_steps",
            "3",
            "--max_new_tokens",
            "6",
            "--draft_vocab_size",
            "64",
            "--sequence_partitions",
            "2",
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "optimizer steps" in printed and "top-1 by depth" in printed
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["examples"] == 3 and summary["optimizer_steps"] == 3 and summary["draft_vocab_size"] == 64
    assert os.path.exists(out / "examples.jsonl") and os.path.exists(out / "model.safetensors")
    head = PEagleDrafter.from_pretrained(out)
    assert head.config.draft_vocab_size == 64 and head.config.num_parallel_positions == 3
    assert int(head.t2d.sum()) == 64

    # reuse the examples, train the EAGLE-3 baseline on them from a feature cache; --bf16 on a CPU without
    # native bf16 is allowed but warned about (it runs many times slower there)
    import peagle.runtime

    monkeypatch.setattr(peagle.runtime, "_cpu_native_bf16", lambda: False)
    out2 = tmp_path / "eagle3"
    rc = main(
        [
            "train",
            *common,
            "--bf16",
            "--examples",
            str(out / "examples.jsonl"),
            "--output_dir",
            str(out2),
            "--max_steps",
            "2",
            "--drafting_mode",
            "autoregressive",
            "--feature_cache",
            str(tmp_path / "cache"),
        ]
    )
    assert rc == 0
    summary = json.loads((out2 / "train_summary.json").read_text())
    assert summary["drafting_mode"] == "autoregressive" and summary["feature_cache"]["bytes"] > 0
    assert "no native bfloat16" in caplog.text
    assert PEagleDrafter.from_pretrained(out2).config.drafting_mode == "autoregressive"

    # continue the first head with a larger draft vocabulary (its 64 ids stay, 16 more come from the examples)
    # and one more layer; --trainable_parameters lm_head trains the new LM head only and leaves every other weight
    # as it was
    out3 = tmp_path / "grown"
    grow = ["train", *common, "--examples", str(out / "examples.jsonl"), "--base_head", str(out)]
    only_lm_head = ["--trainable_parameters", "lm_head", "--learning_rate", "1e-2", "--warmup_steps", "0"]
    assert (
        main(
            [*grow, "--output_dir", str(out3), "--max_steps", "1", "--draft_vocab_size", "80", *only_lm_head]
            + ["--lr_scales", "lm_head=0.5", "--num_hidden_layers", str(head.config.num_hidden_layers + 1)]
        )
        == 0
    )
    grown = PEagleDrafter.from_pretrained(out3)
    assert grown.config.draft_vocab_size == 80 and bool(grown.t2d[head.t2d].all())
    assert grown.config.num_hidden_layers == head.config.num_hidden_layers + 1  # --num_hidden_layers grew it
    summary3 = json.loads((out3 / "train_summary.json").read_text())
    assert summary3["trainable_parameters"] == "lm_head" and summary3["lr_scales"] == ["lm_head=0.5"]
    before, after = head.state_dict(), grown.state_dict()
    frozen = [k for k in before if k not in ("lm_head.weight", "d2t", "t2d", "embed_tokens.weight")]
    assert frozen and all(torch.equal(before[k], after[k]) for k in frozen)
    where = {t: i for i, t in enumerate(grown.draft_vocab_ids.tolist())}
    rows = [where[t] for t in head.draft_vocab_ids.tolist()]  # the 64 kept ids' rows in the grown head
    assert not torch.allclose(before["lm_head.weight"], after["lm_head.weight"][rows])  # the LM head trained
    with pytest.raises(SystemExit, match="--draft_vocab_size resizes"):
        main([*grow, "--output_dir", str(tmp_path / "x"), "--lora", "--draft_vocab_size", "80"])
    with pytest.raises(SystemExit, match="--num_hidden_layers grows"):
        main([*grow, "--output_dir", str(tmp_path / "x"), "--lora", "--num_hidden_layers", "3"])
    with pytest.raises(SystemExit, match="--trainable_parameters"):
        main([*grow, "--output_dir", str(tmp_path / "x"), "--lora", *only_lm_head])


def test_train_spells_k_train_one_way():
    from peagle.cli import build_parser

    args = build_parser().parse_args(["train", "--output_dir", "x", "--num_parallel_positions", "5"])
    assert args.num_parallel_positions == 5
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--output_dir", "x", "--k", "5"])


def test_cli_errors_are_one_line_and_the_traceback_is_behind_debug(tmp_path, monkeypatch):
    """A library error ends the command with one line naming the problem and exit status 1; `--debug` or
    `PEAGLE_DEBUG=1` lets the exception through."""
    monkeypatch.delenv("PEAGLE_DEBUG", raising=False)
    argv = ["train", "--target", str(tmp_path / "nowhere"), "--output_dir", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    line = str(exit_info.value.code)
    assert line.startswith("peagle train: error: target folder") and str(tmp_path / "nowhere") in line
    assert "\n" not in line and "--debug" in line
    with pytest.raises(FileNotFoundError):
        main([*argv, "--debug"])
    monkeypatch.setenv("PEAGLE_DEBUG", "1")
    with pytest.raises(FileNotFoundError):
        main(argv)
    # `sys.exit(main())`, the console script, prints SystemExit's line to stderr and exits 1, no traceback
    assert isinstance(exit_info.value.__cause__, FileNotFoundError)


def test_train_help_shows_defaults_and_refuses_non_positive_counts(capsys):
    from peagle.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("(default: 256)", "(default: 8)", "(default: 0.0003)", "(default: float32)"):
        assert shown in text, shown
    assert "(default: None)" not in text and "(default: [])" not in text
    fields = ("generation_batch_size", "per_device_train_batch_size", "gradient_accumulation_steps")
    for field in (*fields, "max_new_tokens", "num_hidden_layers"):
        with pytest.raises(SystemExit) as exit_:
            main(["train", "--output_dir", "x", f"--{field}", "0"])
        assert f"{field} is 0; expected an integer >= 1" in str(exit_.value.code)


def test_a_target_without_a_chat_template_is_refused_before_loading_it(tmp_path, monkeypatch):
    """Checked before the target model loads, with the two ways on: --chat_template FILE and --plain_prompts."""
    import peagle.targets

    target_dir = tmp_path / "target"
    make_target().save_pretrained(target_dir)
    tok = tiny_tokenizer()
    template, tok.chat_template = tok.chat_template, None
    tok.save_pretrained(target_dir)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello world\nthe bot\n")
    base = [
        "train",
        "--target",
        str(target_dir),
        "--prompts",
        str(prompts),
        "--use_cpu",
        "--gradient_accumulation_steps",
        "1",
    ]
    base += ["--max_steps", "1", "--max_new_tokens", "3", "--num_parallel_positions", "2"]
    real_load = peagle.targets.load_target

    def no_model(*a, **k):
        raise AssertionError("the target model was loaded before the chat template was checked")

    monkeypatch.setattr(peagle.targets, "load_target", no_model)
    with pytest.raises(
        SystemExit, match=r"the tokenizer of .*target has no chat template.*--chat_template FILE"
    ):
        main([*base, "--output_dir", str(tmp_path / "a")])
    with pytest.raises(SystemExit, match=r"Magpie prompts need a chat template"):
        main([*base, "--output_dir", str(tmp_path / "a"), "--num_magpie_prompts", "2", "--plain_prompts"])
    monkeypatch.setattr(peagle.targets, "load_target", real_load)
    assert main([*base, "--output_dir", str(tmp_path / "plain"), "--plain_prompts"]) == 0
    plain = [json.loads(line) for line in (tmp_path / "plain" / "examples.jsonl").read_text().splitlines()]
    assert plain[0]["input_ids"][: len(tok("hello world")["input_ids"])] == tok("hello world")["input_ids"]
    (tmp_path / "chat.jinja").write_text(template)
    assert (
        main([*base, "--output_dir", str(tmp_path / "chat"), "--chat_template", str(tmp_path / "chat.jinja")])
        == 0
    )
    chat = [json.loads(line) for line in (tmp_path / "chat" / "examples.jsonl").read_text().splitlines()]
    assert tok.convert_tokens_to_ids("<|im_start|>") in chat[0]["input_ids"]


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--num_hidden_layers", "0"], "num_hidden_layers is 0; expected an integer >= 1"),
        (["--num_hidden_layers", "-2"], "num_hidden_layers is -2; expected an integer >= 1"),
        (["--draft_vocab_size", "0"], "draft_vocab_size is 0; expected an integer >= 1"),
        (["--num_parallel_positions", "0"], "num_parallel_positions is 0; expected an integer in [1, 64]"),
        (
            ["--num_parallel_positions", "100000"],
            "num_parallel_positions is 100000; expected an integer in [1, 64]",
        ),
    ],
)
def test_train_refuses_sizes_a_head_cannot_have(tmp_path, capsys, flags, words):
    """`--num_hidden_layers 0` exited 0 with a config saying 0 layers while the head had 1."""
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--output_dir", str(tmp_path / "head"), *flags])
    assert exit_.value.code != 0
    assert words in str(exit_.value.code), exit_.value.code
    assert not (tmp_path / "head").exists()


def test_each_training_default_is_defined_once(tmp_path, monkeypatch):
    """`peagle train` with no setting flags, the dataclasses' own defaults and what `train_head` uses when given no
    settings are one set of values: no default lives in the command or in `train_head`."""
    import dataclasses
    import inspect

    from peagle.cli import build_parser
    from peagle.cli.train import parse_settings
    from peagle.training import recipe
    from peagle.training.arguments import DataArguments, HeadArguments, LoraArguments
    from peagle.training.recipe import train_head, training_arguments

    data, head, lora, training = parse_settings(
        build_parser().parse_args(["train", "--output_dir", str(tmp_path)])
    )
    assert (data, head, lora) == (DataArguments(), HeadArguments(), LoraArguments())
    recipe_args = training_arguments(tmp_path / "checkpoints", use_cpu=training.use_cpu)
    derived = {
        "disable_tqdm",
        "logging_dir",
    }  # computed in __post_init__ (the progress bar, a timestamped folder)
    for f in dataclasses.fields(training):
        if f.init and f.name not in derived:
            assert getattr(training, f.name) == getattr(recipe_args, f.name), f.name
    # train_head's keywords carry no setting of their own: each default is None or empty
    for name, parameter in inspect.signature(train_head).parameters.items():
        assert parameter.default in (inspect.Parameter.empty, None, ()), name
    seen = {}

    def stop(examples, calibration_examples):
        seen["calibration_examples"] = calibration_examples
        raise InterruptedError

    monkeypatch.setattr(recipe, "split_calibration", stop)
    with pytest.raises(InterruptedError):
        train_head(
            make_target(), output_dir=tmp_path / "h", examples=[{"input_ids": [1, 5], "loss_mask": [0, 1]}]
        )
    assert seen["calibration_examples"] == DataArguments().calibration_examples == "auto"


OLD_SPELLINGS = {
    "bench": ([], [
        ("--max-new-tokens 5", "--max_new_tokens 5"), ("--vllm-python py", "--vllm_python py"),
        ("--ar-head h", "--ar_head h"), ("--head-dtype float32", "--head_dtype float32"),
        ("--confidence-threshold 0.5", "--confidence_threshold 0.5"), ("--batch-sizes 1,2", "--batch_sizes 1,2"),
        ("--tree-sizes 0,8", "--tree_sizes 0,8"), ("--no-speed", "--no_speed"),
        ("--no-default-rule", "--no_default_rule"),
    ]),
    "calibrate": (["head"], [
        ("--batch-sizes 1,2", "--batch_sizes 1,2"), ("--max-new-tokens 5", "--max_new_tokens 5"),
        ("-k 3", "--num_speculative_tokens 3"), ("--num-speculative-tokens 3", "--num_speculative_tokens 3"),
        ("--head-dtype float32", "--head_dtype float32"),
    ]),
    "export": (["head", "--out", "o"], [
        ("-k 3", "--num_speculative_tokens 3"), ("--num-speculative-tokens 3", "--num_speculative_tokens 3"),
        ("--allow-pickle", "--allow_pickle"), ("--max-shard-size 1GB", "--max_shard_size 1GB"),
    ]),
    "push": (["head", "me/repo"], [
        ("--base-model m", "--base_model m"), ("--allow-pickle", "--allow_pickle"),
        ("--prepare-only d", "--prepare_only d"),
    ]),
    "pack": (["rows.jsonl", "shards"], [("--max-tokens-per-shard 7", "--max_tokens_per_shard 7")]),
    "demo": ([], [
        ("--max-new-tokens 5", "--max_new_tokens 5"), ("-k 3", "--num_speculative_tokens 3"),
        ("--num-speculative-tokens 3", "--num_speculative_tokens 3"),
        ("--confidence-threshold 0.5", "--confidence_threshold 0.5"), ("--head-dtype float32", "--head_dtype float32"),
    ]),
    "train": (["--output_dir", "x"], [
        ("--cod-ratio 0.5", "--cod_ratio 0.5"), ("--no-embed-from-target", "--no_embed_from_target"),
    ]),
}  # fmt: skip


@pytest.mark.parametrize("command", sorted(OLD_SPELLINGS))
def test_old_flag_spellings_still_work_hidden_and_deprecated(command, capsys):
    """Every flag is spelled as its field (`--max_new_tokens`); the old dash spellings (and `-k`) parse to the same
    settings for one more release, say on stderr which flag replaces them, and are not in `--help`."""
    import re

    from peagle.cli import build_parser

    base, pairs = OLD_SPELLINGS[command]
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    help_text = capsys.readouterr().out
    for old, new in pairs:
        want = vars(build_parser().parse_args([command, *base, *new.split()]))
        assert capsys.readouterr().err == ""
        got = vars(build_parser().parse_args([command, *base, *old.split()]))
        assert {k: v for k, v in got.items() if k != "func"} == {k: v for k, v in want.items() if k != "func"}
        flag, new_flag = old.split()[0], new.split()[0]
        err = capsys.readouterr().err
        assert f"peagle {command}: {flag} is deprecated" in err and f"use {new_flag}" in err, err
        assert new_flag in help_text and not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text), (
            flag
        )


def test_every_parser_refuses_abbreviated_flags(capsys):
    """`allow_abbrev` is off on `peagle` and on every sub-command: a prefix of a flag is an error, not the flag."""
    from peagle.cli import COMMANDS, build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    assert not parser.allow_abbrev and set(commands) == set(COMMANDS)
    for name, sub in commands.items():
        assert not sub.allow_abbrev, name
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--max_new", "5"])
    assert "--max_new" in capsys.readouterr().err


def test_python_dash_m_runs_the_command_line():
    """`python -m peagle.cli` is the `peagle` command (benchmarks/gpu_check.py runs it where no script is installed)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "peagle.cli", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "train" in out.stdout and "bench" in out.stdout
