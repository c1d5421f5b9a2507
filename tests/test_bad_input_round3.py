"""Bad input, third round (issue #70): values that enter by a second door (`from_pretrained(**kwargs)`, a
`GenerationConfig`), state shared between threads or calls, and folders that hold another model."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, RepetitionPenaltyLogitsProcessor

import peagle
from helpers import make_head, make_target, prompt_ids
from peagle import PEagleConfig, PEagleDrafter


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    target = make_target()
    head = make_head(target)
    folder = tmp_path_factory.mktemp("head")
    head.save_pretrained(folder)
    return folder, target


# ------------------------------------------------------------------------------ from_pretrained keywords
@pytest.mark.parametrize(
    "override, named",
    [
        ({"confidence_threshold": 2.0}, "confidence_threshold"),
        ({"confidence_threshold": -1.0}, "confidence_threshold"),
        ({"num_speculative_tokens": "5"}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 100}, "num_speculative_tokens"),
        ({"mask_token_id": 999}, "mask_token_id"),
        ({"eagle_aux_hidden_state_layer_ids": [0, 0, 9]}, "eagle_aux_hidden_state_layer_ids"),
        ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
        ({"drafter_window": 0}, "drafter_window"),
        ({"rope_parameters": {"rope_type": None, "rope_theta": 1e4}}, "rope_type"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": "1e4"}}, "rope_theta"),
    ],
)
def test_from_pretrained_keywords_pass_the_config_checks(saved, override, named):
    folder, _ = saved
    with pytest.raises(ValueError, match=named) as err:
        PEagleDrafter.from_pretrained(folder, **override)
    assert "from_pretrained keyword" in str(err.value) and str(folder) in str(err.value)


def test_from_pretrained_keywords_that_resize_weights_are_refused(saved):
    folder, _ = saved
    with pytest.raises(ValueError, match="draft_vocab_size cannot be overridden"):
        PEagleDrafter.from_pretrained(folder, draft_vocab_size=64)


def test_valid_keywords_still_override(saved):
    folder, _ = saved
    head = PEagleDrafter.from_pretrained(folder, confidence_threshold=0.25, drafter_window=64)
    assert head.config.confidence_threshold == 0.25 and head.config.drafter_window == 64


@pytest.mark.parametrize(
    "field, value",
    [
        ("rms_norm_eps", 0.0),
        ("rms_norm_eps", float("nan")),
        ("attention_dropout", 1.5),
        ("rope_parameters", {"rope_type": "default", "rope_theta": -5.0}),
    ],
)
def test_numeric_config_fields_have_checked_ranges(field, value):
    with pytest.raises(ValueError, match=field.split("_")[0]):
        PEagleConfig(
            vocab_size=128, hidden_size=64, num_attention_heads=4, intermediate_size=128, **{field: value}
        )


# ------------------------------------------------------------------------------ statistics per call
def test_stats_belong_to_the_thread_and_call_that_made_them():
    """A long B = 1 call is held mid-decoding while another thread makes a short B = 3 call with the same head."""
    target = make_target(eos_token_id=None)
    head = make_head(target)
    seen: dict[str, object] = {}
    started, short_done = threading.Event(), threading.Event()

    class Pause(LogitsProcessor):
        peagle_stateless = True

        def __call__(self, input_ids, scores):
            if not started.is_set():
                started.set()
                assert short_done.wait(timeout=60)
            return scores

    def long_call():
        out = target.generate(
            prompt_ids(1, 8),
            max_new_tokens=40,
            assistant_model=head,
            do_sample=False,
            logits_processor=LogitsProcessorList([Pause()]),
        )
        seen["long"] = (head.last_generation_stats, out.shape[1] - 8)

    worker = threading.Thread(target=long_call)
    worker.start()
    assert started.wait(timeout=60)
    rows = torch.cat([prompt_ids(2, 5)] * 3)
    short = target.generate(
        rows, max_new_tokens=8, assistant_model=head, do_sample=False, return_dict_in_generate=True
    )
    mine = head.last_generation_stats
    short_done.set()
    worker.join(timeout=120)
    long_stats, long_new = seen["long"]
    assert mine is short.peagle_stats and mine.batch_size == 3 and mine.generated_tokens == 24
    assert long_stats.batch_size == 1 and long_stats.generated_tokens == long_new == 40
    assert head.last_generation_stats is mine  # the other thread's call did not replace this thread's


# ------------------------------------------------------------------------------ logits processors
class CountingProcessor(LogitsProcessor):
    def __init__(self):
        self.calls = 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        return scores


def _warnings(target, head, processor, **kw) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        target.generate(
            prompt_ids(3, 6),
            max_new_tokens=4,
            assistant_model=head,
            do_sample=False,
            logits_processor=LogitsProcessorList([processor]),
            **kw,
        )
    return [str(w.message) for w in caught if "stateless" in str(w.message)]


def test_unknown_processors_are_warned_about_until_declared_stateless(tiny_target, tiny_head):
    found = _warnings(tiny_target, tiny_head, CountingProcessor())
    assert len(found) == 1 and "CountingProcessor" in found[0] and "declare_stateless_processor" in found[0]
    assert not _warnings(tiny_target, tiny_head, RepetitionPenaltyLogitsProcessor(1.3))  # transformers' own

    class Declared(CountingProcessor):
        peagle_stateless = True

    assert not _warnings(tiny_target, tiny_head, Declared())

    class Registered(CountingProcessor):
        pass

    assert peagle.declare_stateless_processor(Registered) is Registered
    assert not _warnings(tiny_target, tiny_head, Registered())
    with pytest.raises(TypeError, match="takes a class"):
        peagle.declare_stateless_processor(Registered())


# ------------------------------------------------------------------------------ prompts a head cannot read
def test_empty_prompts_and_all_masked_rows_are_refused_by_name(tiny_target, tiny_head):
    with pytest.raises(ValueError, match=r"empty prompt \(input_ids of shape \(2, 0\)\)"):
        tiny_target.generate(torch.zeros(2, 0, dtype=torch.long), max_new_tokens=3, assistant_model=tiny_head)
    mask = torch.tensor([[1, 1, 1], [0, 0, 0], [0, 1, 1]])
    with pytest.raises(ValueError, match=r"attention_mask rows \[1\] are all zeros"):
        tiny_target.generate(
            torch.full((3, 3), 5), attention_mask=mask, max_new_tokens=3, assistant_model=tiny_head
        )


# ------------------------------------------------------------------------------ folders of other models
def test_writing_a_head_over_another_model_is_refused(tmp_path, tiny_target, tiny_head):
    folder = tmp_path / "target"
    tiny_target.save_pretrained(folder)
    before = (folder / "config.json").read_text()
    with pytest.raises(FileExistsError, match="model_type 'llama'.*overwrite=True"):
        tiny_head.save_pretrained(folder)
    with pytest.raises(FileExistsError, match="not a head"):
        peagle.export(tiny_head, folder, layout="vllm", target_model=tiny_target)
    assert (folder / "config.json").read_text() == before  # nothing written
    head_folder = tmp_path / "head"
    tiny_head.save_pretrained(head_folder)
    tiny_head.save_pretrained(head_folder)  # a head replaces a head
    peagle.export(tiny_head, head_folder, layout="vllm", target_model=tiny_target)  # in another layout too
    tiny_head.save_pretrained(folder, overwrite=True)  # said explicitly
    assert PEagleDrafter.from_pretrained(folder).config.model_type == "peagle"


# ------------------------------------------------------------------------------ training settings
@pytest.mark.parametrize(
    "override, message",
    [
        ({"ttt_decay": -1.0}, r"ttt_decay is -1.0; expected a finite number in \(0.0, 1.0\]"),
        ({"ttt_decay": float("nan")}, "ttt_decay is nan"),
        ({"num_train_epochs": 0}, "nothing would be trained"),
        ({"flex_block_size": 0}, "flex_block_size is 0"),
        ({"cod_ratio": 1.5}, "cod_ratio is 1.5"),
        ({"learning_rate": float("nan")}, "learning_rate is nan"),
    ],
)
def test_training_settings_are_range_checked_before_any_work(tmp_path, override, message):
    from peagle.training.arguments import PEagleTrainingArguments

    with pytest.raises(ValueError, match=message):
        PEagleTrainingArguments(output_dir=str(tmp_path / "out"), **override)
    PEagleTrainingArguments(
        output_dir=str(tmp_path / "out"), num_train_epochs=0, max_steps=2
    )  # steps suffice


def test_folder_settings_naming_a_file_are_refused(tmp_path):
    from peagle.training.arguments import DataArguments, PEagleTrainingArguments

    file = tmp_path / "a_file"
    file.write_text("x")
    with pytest.raises(ValueError, match="output_dir is .*a file; expected a folder"):
        PEagleTrainingArguments(output_dir=str(file))
    with pytest.raises(ValueError, match="feature_cache is .*a file; expected a folder"):
        DataArguments(feature_cache=str(file))


def test_cli_flags_are_never_abbreviated(capsys):
    from peagle.cli import build_parser

    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--output_dir", "x", "--num_parallel", "2"])
    assert "--num_parallel" in capsys.readouterr().err
    args = parser.parse_args(["train", "--output_dir", "x", "--num_parallel_positions", "2"])
    assert args.num_parallel_positions == 2


def test_more_partitions_than_anchors_train_like_one(tmp_path):
    """Segments that own no anchor are skipped: S = 40 or 1000 on 18-40-token examples gives S = 1's update."""
    from helpers import make_args, random_examples
    from peagle.training import PEagleTrainer

    target = make_target()
    updates = []
    for parts, budget in ((1, None), (40, None), (1000, "1GB")):
        head = make_head(target).float()
        before = {k: p.detach().clone() for k, p in head.named_parameters()}
        args = make_args(tmp_path / str(parts), sequence_partitions=parts, partition_memory_budget=budget)
        PEagleTrainer(model=head, target_model=target, args=args, train_dataset=random_examples(2)).train()
        updates.append(torch.cat([(p.detach() - before[k]).flatten() for k, p in head.named_parameters()]))
    for other in updates[1:]:
        torch.testing.assert_close(other, updates[0], rtol=1e-5, atol=1e-7)


def test_token_ids_outside_the_vocabulary_name_the_file_and_row():
    from peagle.data.shards import check_token_ids

    rows = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 500]}]
    with pytest.raises(ValueError, match=r"--examples data.jsonl, example 1 \(0-based row\): token id 500"):
        check_token_ids(rows, 128, "--examples data.jsonl")


def test_keywords_reach_heads_in_every_layout(tmp_path, tiny_target, tiny_head):
    """A converted layout (vLLM's) takes the same config keywords as peagle's own, with the same checks."""
    folder = peagle.export(tiny_head, tmp_path / "vllm", layout="vllm", target_model=tiny_target)
    head = PEagleDrafter.from_pretrained(folder, confidence_threshold=0.3, drafter_window=16)
    assert head.config.confidence_threshold == 0.3 and head.config.drafter_window == 16
    with pytest.raises(ValueError, match="confidence_threshold is 2.0"):
        PEagleDrafter.from_pretrained(folder, confidence_threshold=2.0)
    with pytest.raises(ValueError, match="draft_vocab_size cannot be overridden"):
        PEagleDrafter.from_pretrained(folder, draft_vocab_size=64)
