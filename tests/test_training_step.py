"""PartitionedStep: the segments' order, the prefix store's gradient hand-off, and acceptance recording."""

from __future__ import annotations

import pytest
import torch

from helpers import make_args, make_head, make_target, random_examples
from peagle.training import PEagleDataCollator, PEagleTrainer
from peagle.training.step import AcceptanceRecorder


def trainer_and_batch(tmp_path, mode: str, parts: int):
    target = make_target()
    head = make_head(target, drafting_mode=mode).float()
    data = random_examples(2, lo=24, hi=30)
    args = make_args(tmp_path, sequence_partitions=parts, cod_ratio=1.0, cod_min_ratio=1.0)
    trainer = PEagleTrainer(model=head, target_model=target, args=args, train_dataset=data)
    return trainer, head, PEagleDataCollator()(data)


@pytest.mark.parametrize("mode", ["parallel", "autoregressive"])
def test_training_runs_the_segments_in_reverse_and_scores_them_like_evaluation(tmp_path, mode):
    trainer, head, batch = trainer_and_batch(tmp_path, mode, parts=3)
    plans = trainer.plan_batch(batch, step=0)
    evaluation = trainer._partitioned_step(head, batch, plans)
    assert evaluation.order == [0, 1, 2]
    with torch.no_grad():
        scored = {s: evaluation.run(s) for s in evaluation.order}
    assert all(r.surrogate is None and not r.prefix_leaves for r in scored.values())

    training = trainer._partitioned_step(head, batch, plans, backward=True)
    assert training.order == [2, 1, 0]
    training.store_prefix()
    layers = head.config.num_hidden_layers
    for s in training.order:
        result = training.run(s)
        # the last segment runs first: nothing has sent its keys and values a gradient yet
        assert (result.surrogate is None) == (s == 2)
        assert len(result.prefix_leaves) == (0 if s == 0 else 2 * layers)
        (result.loss if result.surrogate is None else result.loss + result.surrogate).backward()
        training.collect(result)
        if s > 0:
            assert all(leaf.grad is not None for leaf in result.prefix_leaves)
        torch.testing.assert_close(result.loss.detach(), scored[s].loss, rtol=1e-5, atol=1e-6)
        assert torch.equal(result.correct, scored[s].correct) and torch.equal(result.total, scored[s].total)
    assert training.prefix.grads is not None


def test_acceptance_is_recorded_into_the_recorder_given_to_the_step(tmp_path):
    trainer, head, batch = trainer_and_batch(tmp_path, "parallel", parts=2)
    plans = trainer.plan_batch(batch, step=0, keep_all=True)
    k = head.config.num_parallel_positions
    with torch.no_grad():
        plain = trainer._partitioned_step(head, batch, plans)
        unrecorded = [plain.run(s) for s in plain.order]
        recorder = AcceptanceRecorder(
            trainer.target_model.get_output_embeddings().weight, head.draft_vocab_ids
        )
        step = trainer._partitioned_step(head, batch, plans, acceptance=recorder)
        results = [step.run(s) for s in step.order]
    assert plain.acceptance is None and AcceptanceRecorder(None, None).records().shape == (0, 4)
    records = recorder.records()
    assert records.shape == (sum(p.num_supervised for p in plans), 4)
    total = sum(r.total for r in results)
    correct = sum(r.correct for r in results)
    assert torch.equal(total, sum(r.total for r in unrecorded))
    assert torch.equal(torch.bincount(records[:, 2], minlength=k)[:k], total)
    accepted = torch.bincount(records[records[:, 3] == 1, 2], minlength=k)[:k]
    assert bool((accepted <= correct).all())  # accepted: correct and the target's global argmax
    assert torch.equal(records, trainer.acceptance_records(batch))
