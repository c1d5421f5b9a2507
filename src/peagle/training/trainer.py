"""`PEagleTrainer`: P-EAGLE (and EAGLE-3) head training on `transformers.Trainer`, with exact sequence partitioning.

One training step per micro-batch:

1. plan (CPU, in `get_batch_samples`, before the step): per example, [`plan_example`] COD-samples the elements
   ``(a, d)``, marks the supervised ones (label ``x_{a+d+2}`` in the response and in the draft vocabulary) and
   splits them into `sequence_partitions` segments ([`peagle.training.plan`]); the supervised elements of the
   whole accumulated batch across all processes are counted (the loss normaliser);
2. capture the frozen target's features once (one target forward per micro-batch, or a [`FeatureCache`]);
3. a [`PartitionedStep`] ([`peagle.training.step`]) stores the prefix keys and values, then for each segment (in
   reverse order) builds the drafter inputs of its elements, forwards them and scores them against the target;
   the trainer divides each segment's loss by the global count and runs `accelerator.backward` (under `no_sync`
   for all but the last segment).

Element inputs (docs/DESIGN.md section 4): element ``(a, 0)`` = token ``x_{a+1}``, features ``f_a``, position ``a``,
label ``x_{a+2}``; element ``(a, d >= 1)`` = parallel slot (mask embedding, ``fc(mask_hidden)``), position
``a + d``, label ``x_{a+d+2}``.  The target's logits for label ``x_p`` are its logits at position ``p - 1``.

EAGLE-3 heads (`drafting_mode == "autoregressive"`) train with the same plan by training-time test: depth d is
step d of an unroll whose slot ``(a, d)`` reads token ``x_{a+d+1}`` and the drafter's own output hidden state of
``(a, d - 1)``, attends like a P-EAGLE element, and is weighted ``ttt_decay ** d``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
from typing import Any

import torch
from transformers import Trainer
from transformers.trainer_utils import get_last_checkpoint
from transformers.utils import logging

from ..data.features import PEagleDataCollator, capture_features
from ..data.shards import check_token_ids
from .arguments import PEagleTrainingArguments, parse_lr_scales
from .callbacks import COUNTS_FILE, TrainingCountsCallback
from .masks import PEagleMaskTemplate
from .memory import StepMemoryModel, choose_num_segments, resolve_memory_budget
from .optimizer import freeze_except, split_lr_groups
from .plan import ExamplePlan, cod_seed, plan_example
from .step import AcceptanceRecorder, PartitionedStep, SegmentPass, StepSettings

logger = logging.get_logger(__name__)


# ------------------------------------------------------------------------------------------------ the trainer
def epoch_order(num_examples: int, seed: int, epoch: int = 0) -> list[int]:
    """The order in which a single-process [`PEagleTrainer`] run with `seed` visits the examples in `epoch`.

    The trainer keeps transformers' random sampler, which accelerate seeds with `seed + epoch`; a run that
    stopped after `s` optimiser steps of batch `b` and gradient accumulation `g` has trained on the first `s*b*g`
    indices of epoch 0.  Continuing on the others gives a later stage only examples it has not seen.
    """
    generator = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(num_examples, generator=generator).tolist()


def check_examples(dataset: Any, vocab_size: int) -> None:
    """Refuse training data that cannot teach anything, before the first step: an empty dataset, token ids outside
    the target's vocabulary (naming the example), or no supervised token at all; warn with the count of examples
    without one.  In-memory lists of examples are checked in full; other datasets only for emptiness."""
    try:
        size = len(dataset)
    except TypeError:
        return
    if size == 0:
        raise ValueError("the training dataset is empty; pass examples with input_ids and loss_mask.")
    if not isinstance(dataset, (list, tuple)):
        return
    check_token_ids(dataset, vocab_size, "the training dataset")
    unsupervised = 0
    for ex in dataset:
        mask = ex.get("loss_mask")
        if mask is not None and not bool(torch.as_tensor(mask).bool().any()):
            unsupervised += 1
    if unsupervised == size:
        raise ValueError(
            f"none of the {size} examples has a supervised token (every loss_mask is all zero): nothing to learn."
        )
    if unsupervised:
        logger.warning(f"{unsupervised} of {size} examples have no supervised token (loss_mask all zero).")


class PEagleTrainer(Trainer):
    """Train a [`PEagleDrafter`] against a frozen target with the P-EAGLE method (or EAGLE-3's, for
    autoregressive heads).

    Args:
        model: the head to train (the only optimised, wrapped and saved model).
        target_model: the frozen target; kept outside the optimised model (eval mode, no grads, never wrapped by
            DDP/FSDP), moved to the training device.  With `head.config.embed_from_target` the head takes its
            (frozen) embeddings, so only the mask embedding is learned.
        args: [`PEagleTrainingArguments`].
        data_collator: default [`PEagleDataCollator`] truncating to `args.max_length`.
        train_dataset, eval_dataset: examples with `input_ids` and `loss_mask` (or a [`FeatureCache`]).

    Logged besides the loss: `acc_d{i}`, the drafter's top-1 agreement with the target at depth i (eval: with the
    `eval_` prefix), and `supervised_elements` per optimiser step.
    """

    loss_is_scaled_for_ga = True

    def __init__(
        self,
        model=None,
        target_model=None,
        args: PEagleTrainingArguments | None = None,
        data_collator=None,
        **kwargs,
    ):
        if model is None or target_model is None:
            raise ValueError("PEagleTrainer needs model= (the head) and target_model= (the frozen target).")
        if args is None:
            args = PEagleTrainingArguments(output_dir="peagle_trainer_output")
        if not isinstance(args, PEagleTrainingArguments):
            raise TypeError(f"args is a {type(args).__name__}; expected PEagleTrainingArguments.")
        cfg = model.config
        if not cfg.eagle_aux_hidden_state_layer_ids:
            raise ValueError(
                "head.config.eagle_aux_hidden_state_layer_ids is empty; build the head with for_target()."
            )
        target_model.eval()
        target_model.requires_grad_(False)
        model.attach_target(target_model)
        if args.num_parallel_positions is not None:
            cfg.num_parallel_positions = int(args.num_parallel_positions)
        if cfg.drafting_mode == "parallel" and cfg.num_speculative_tokens > cfg.num_parallel_positions:
            logger.info(
                f"num_speculative_tokens {cfg.num_speculative_tokens} -> K_train {cfg.num_parallel_positions}"
            )
            cfg.num_speculative_tokens = int(
                cfg.num_parallel_positions
            )  # a head never drafts deeper than trained
        self.num_parallel_positions = int(cfg.num_parallel_positions)
        self.autoregressive = cfg.drafting_mode == "autoregressive"
        if self.autoregressive:  # EAGLE-3 heads never use the parallel-slot placeholders
            model.mask_hidden.requires_grad_(False)
            if model.mask_embedding is not None:
                model.mask_embedding.requires_grad_(False)
        if args.trainable_parameters is not None:
            freeze_except(model, args.trainable_parameters)
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        for entry, (regex, _) in zip(args.lr_scales, parse_lr_scales(args.lr_scales)):
            if not any(regex.search(n) for n in trainable):
                raise ValueError(f"lr_scales entry {entry!r} matches no trainable parameter of the head.")
        if data_collator is None:
            data_collator = PEagleDataCollator(pad_token_id=cfg.pad_token_id or 0, max_length=args.max_length)
        super().__init__(model=model, args=args, data_collator=data_collator, **kwargs)
        if self.args.n_gpu > 1:
            raise ValueError(
                f"PEagleTrainer does not support DataParallel over {self.args.n_gpu} GPUs; launch one process per "
                "GPU with `accelerate launch` or `torchrun` (DDP)."
            )
        # the target goes to the device first: an "auto" budget measures the memory left beside it
        self.target_model = target_model.to(self.args.device)
        budget = args.partition_memory_budget
        self.memory_budget = resolve_memory_budget(budget, args.device, args.gradient_checkpointing)
        partitioned = args.sequence_partitions > 1 or self.memory_budget is not None
        if args.gradient_checkpointing and (partitioned or self.autoregressive):
            raise ValueError(
                "gradient_checkpointing drops the drafter's KV cache, which "
                + ("EAGLE-3 training-time test" if self.autoregressive else "sequence partitioning")
                + " reads (earlier segments' keys and values); train without it (partitioning is the memory lever:"
                " sequence_partitions or partition_memory_budget)."
            )
        if model.config._attn_implementation == "flex_attention" and self.args.device.type == "cpu":
            raise ValueError(
                "the head uses flex_attention, which has no backward pass on the CPU in torch "
                f"{torch.__version__}; build it with attn_implementation='sdpa' for CPU training."
            )
        if self.train_dataset is not None:
            check_examples(self.train_dataset, int(target_model.config.get_text_config().vocab_size))
        self._template = PEagleMaskTemplate(args.max_length, self.num_parallel_positions)
        self._last_partition_choice: tuple[int, int] | None = None
        self._draft_weight: torch.Tensor | None = None
        self._stats = {k: self._zero_stats() for k in ("train", "eval")}
        self._response_tokens = 0  # response tokens of the micro-batches trained by this process
        self._count_estimated = False  # resumed from a checkpoint that did not record the count
        self._seconds_before = 0.0  # training seconds recorded by the checkpoint this run resumed from
        self._train_started: float | None = None
        self.add_callback(TrainingCountsCallback(self))

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        """transformers' optimizer, with the parameters `args.lr_scales` names in groups at their own rates."""
        built_here = self.optimizer is None  # an optimizer passed in (`optimizers=`) keeps its own groups
        optimizer = super().create_optimizer(model)
        if self.args.lr_scales and built_here:
            opt_model = self.model if model is None else model
            split_lr_groups(optimizer, opt_model.named_parameters(), self.args.lr_scales)
        elif self.args.lr_scales:
            logger.warning(
                "lr_scales are ignored: the optimizer passed in (optimizers=) keeps its own groups."
            )
        return optimizer

    # ----------------------------------------------------------------------------------------- helpers
    def _head(self):
        return self.accelerator.unwrap_model(self.model)

    def _zero_stats(self) -> dict[str, torch.Tensor]:
        k = self.num_parallel_positions
        return {
            "correct": torch.zeros(k, dtype=torch.long),
            "total": torch.zeros(k, dtype=torch.long),
            "items": torch.zeros(1),
        }

    def plan_batch(
        self, batch: dict[str, torch.Tensor], step: int | None = None, keep_all: bool = False
    ) -> list[ExamplePlan]:
        """[`ExamplePlan`]s of a collated batch; COD draws depend on (seed, `step`, tokens) only.  `keep_all`:
        every depth of every anchor (no COD dropping; used to measure acceptance)."""
        ratio, min_ratio = (1.0, 1.0) if keep_all else (self.args.cod_ratio, self.args.cod_min_ratio)
        step = self.state.global_step if step is None else step
        ids = batch["input_ids"].cpu()
        att = batch["attention_mask"].cpu().bool()
        loss_mask = batch["loss_mask"].cpu()
        t2d = self._head().t2d.cpu()
        plans = []
        for b in range(ids.shape[0]):
            length = int(att[b].sum())
            if not bool(att[b, :length].all()):
                raise ValueError("PEagleTrainer expects right-padded batches (attention_mask = 1...1 0...0).")
            row = ids[b, :length]
            gen = torch.Generator().manual_seed(cod_seed(self.args.seed, step, row))
            if self._template.max_anchors < length:
                self._template = PEagleMaskTemplate(length, self.num_parallel_positions)
            plans.append(
                plan_example(
                    row,
                    loss_mask[b, :length],
                    t2d,
                    self.num_parallel_positions,
                    ratio,
                    min_ratio,
                    self.args.sequence_partitions,
                    generator=gen,
                    template=self._template,
                    balance=self.args.balance_partitions,
                )
            )
        if self.memory_budget is not None:
            self._fit_partitions(plans, online="target_hidden_states" not in batch)
        return plans

    def _fit_partitions(self, plans: list[ExamplePlan], online: bool) -> None:
        """Re-partition `plans` into the fewest segments whose step fits `partition_memory_budget`."""
        budget = self.memory_budget
        model = StepMemoryModel(
            self._head().config, self.target_model.config.get_text_config(), online=online
        )
        count, need = choose_num_segments(
            plans, model, budget, self.args.sequence_partitions, self.args.balance_partitions
        )
        key = (max(p.length for p in plans), count)
        if self._last_partition_choice is None or count != self._last_partition_choice[1]:
            logger.info(
                f"partition_memory_budget {budget / 2**30:.2f} GiB: {len(plans)} x {key[0]} tokens in {count} "
                f"segment(s), about {need / 2**30:.2f} GiB"
            )
        self._last_partition_choice = key

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        """Fetch the micro-batches of one optimiser step, plan them, and count their supervised elements over
        all processes (the loss normaliser, `num_items_in_batch`)."""
        batch_samples = []
        for _ in range(num_batches):
            try:
                batch_samples.append(next(epoch_iterator))
            except StopIteration:
                break
        count = 0
        for batch in batch_samples:
            batch["peagle_plans"] = self.plan_batch(batch)
            count += sum(p.num_supervised for p in batch["peagle_plans"])
        total = torch.tensor(count, dtype=torch.long, device=device)
        if self.accelerator.num_processes > 1:
            total = self.accelerator.gather(total).sum()
        return batch_samples, total

    def _draft_lm_weight(self) -> torch.Tensor:
        """Rows of the target's `lm_head` for the draft vocabulary, `(V_draft, H_t)` (cached)."""
        head = self._head()
        if self._draft_weight is None:
            ids = head.draft_vocab_ids
            weight = self.target_model.get_output_embeddings().weight
            self._draft_weight = weight.detach()[ids.to(weight.device)]
        return self._draft_weight

    def _features(self, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        if "target_hidden_states" in inputs and "target_last_hidden" in inputs:
            return inputs["target_hidden_states"], inputs["target_last_hidden"]
        return capture_features(
            self.target_model,
            inputs["input_ids"],
            inputs["attention_mask"],
            self._head().config.eagle_aux_hidden_state_layer_ids,
        )

    def _checked_features(self, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's features of a micro-batch; cached ones must be finite."""
        aux, last = self._features(inputs)
        if "target_hidden_states" in inputs and not bool(
            torch.isfinite(aux).all() and torch.isfinite(last).all()
        ):
            directory = getattr(self.train_dataset, "directory", None) or "(the dataset's target features)"
            raise FloatingPointError(
                f"the feature cache {directory} holds non-finite target features (at global step "
                f"{self.state.global_step}): its dtype cannot hold this target's activations. Delete it and build it "
                "again (FeatureCache.build picks bfloat16 when float16 overflows), or train without --feature-cache."
            )
        return aux, last

    def _partitioned_step(
        self,
        model,
        inputs: dict,
        plans: list[ExamplePlan],
        backward: bool = False,
        acceptance: AcceptanceRecorder | None = None,
    ) -> PartitionedStep:
        """The [`PartitionedStep`] of one micro-batch: its segment passes, their prefix store and their order."""
        settings = StepSettings(
            config=self._head().config,
            num_parallel_positions=self.num_parallel_positions,
            draft_lm_weight=self._draft_lm_weight(),
            softcap=getattr(self.target_model.config, "final_logit_softcapping", None),
            loss_type=self.args.loss_type,
            ttt_decay=self.args.ttt_decay,
            flex_block_size=self.args.flex_block_size,
            global_step=self.state.global_step,
            no_sync=functools.partial(self.accelerator.no_sync, model),
        )
        features = self._checked_features(inputs)
        return PartitionedStep(
            model, inputs, plans, features, settings, backward=backward, acceptance=acceptance
        )

    def _record(self, split: str, result: SegmentPass) -> None:
        if result.correct is not None:
            self._stats[split]["correct"] += result.correct
            self._stats[split]["total"] += result.total

    # ----------------------------------------------------------------------------------------- Trainer API
    def training_step(
        self, model, inputs: dict, num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """Forward + backward of every partition segment of one micro-batch; returns the (detached) loss.

        Each segment's summed loss is divided by `num_items_in_batch` (the supervised elements of the whole
        accumulated batch on all processes) and multiplied by the process count (DDP averages gradients), so the
        accumulated gradient is that of the global mean loss, whatever the partitioning.
        """
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        plans = inputs.pop("peagle_plans", None)
        inputs = self._prepare_inputs(inputs)
        if plans is None:
            plans = self.plan_batch(inputs)
            local = sum(p.num_supervised for p in plans)
            num_items_in_batch = num_items_in_batch if num_items_in_batch is not None else local
        denom = float(num_items_in_batch) if num_items_in_batch is not None else 1.0
        scale = self.accelerator.num_processes / max(denom, 1.0)
        total = torch.zeros((), device=self.args.device)
        scaler = getattr(self.accelerator, "scaler", None)
        step = self._partitioned_step(model, inputs, plans, backward=True)
        with self.compute_loss_context_manager():
            step.store_prefix()
        order = step.order
        for s in order:
            sync = contextlib.nullcontext() if s == order[-1] else self.accelerator.no_sync(model)
            with sync:
                with self.compute_loss_context_manager():
                    result = step.run(s)
                loss = result.loss * scale
                self.accelerator.backward(loss if result.surrogate is None else loss + result.surrogate)
            # the prefix this segment read: its gradient goes to the segments before
            step.collect(result, scaler)
            total += loss.detach()
            self._record("train", result)
        self._stats["train"]["items"] += sum(p.num_supervised for p in plans)
        self._response_tokens += int(inputs["loss_mask"].sum())
        if not bool(torch.isfinite(total)):
            lengths = [p.length for p in plans]
            raise FloatingPointError(
                f"non-finite training loss {total.item()} at global step {self.state.global_step} (example lengths "
                f"{lengths}, learning rate {self._get_learning_rate() if self.lr_scheduler else 'n/a'}); lower the "
                "learning rate, check the data, or train in float32/bfloat16 instead of float16."
            )
        return total

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """`Trainer.train`, with denormal floats flushed to zero on the CPU for its duration when
        `args.flush_denormal` (restored afterwards).  Resuming from a checkpoint also resumes its token-pass count
        (`response_tokens_trained`)."""
        if resume_from_checkpoint:
            folder = (
                get_last_checkpoint(self.args.output_dir)
                if resume_from_checkpoint is True
                else os.fspath(resume_from_checkpoint)
            )
            if folder is not None and os.path.isdir(folder):
                from .checkpoints import check_checkpoint_fits

                check_checkpoint_fits(self.model, folder)
            self._resume_counts(resume_from_checkpoint)
        self._train_started = time.time()
        if not self.args.flush_denormal:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        flushed = torch.set_flush_denormal(True)
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            if flushed:
                torch.set_flush_denormal(False)

    def compute_loss(self, model, inputs: dict, return_outputs: bool = False, num_items_in_batch=None):
        """Loss of a batch without backward (evaluation): summed over segments, divided by `num_items_in_batch`
        or, by default, by this batch's supervised count."""
        plans = inputs.pop("peagle_plans", None) or self.plan_batch(inputs, step=0)
        denom = num_items_in_batch if num_items_in_batch is not None else sum(p.num_supervised for p in plans)
        loss = torch.zeros((), device=self.args.device)
        split = "train" if model.training else "eval"
        step = self._partitioned_step(model, inputs, plans)
        for s in step.order:
            result = step.run(s)
            loss = loss + result.loss
            if split == "eval":
                self._record(split, result)
        loss = loss / max(float(denom), 1.0)
        return (loss, None) if return_outputs else loss

    def _resume_counts(self, checkpoint: str | bool) -> None:
        """Set the token-pass count from the checkpoint's record (`COUNTS_FILE`, this process's count), or estimate it
        from the epochs trained and the dataset's response tokens when the checkpoint has none (flagged)."""
        folder = get_last_checkpoint(self.args.output_dir) if checkpoint is True else os.fspath(checkpoint)
        if folder is None:
            return  # Trainer.train raises its own error
        path = os.path.join(folder, COUNTS_FILE.format(self.accelerator.process_index))
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as fh:
                record = json.load(fh)
            self._response_tokens = int(record["response_tokens_trained"])
            self._seconds_before = float(record.get("training_seconds") or 0.0)
            return
        with open(os.path.join(folder, "trainer_state.json"), encoding="utf-8") as fh:
            epoch = float(json.load(fh).get("epoch") or 0.0)
        per_epoch = (
            sum(int(sum(ex["loss_mask"])) for ex in self.train_dataset.examples)
            if hasattr(self.train_dataset, "examples")
            else sum(int(sum(self.train_dataset[i]["loss_mask"])) for i in range(len(self.train_dataset)))
        )
        self._response_tokens = round(epoch * per_epoch / self.accelerator.num_processes)
        self._count_estimated = True
        logger.warning(
            "%s records no token-pass count (an older peagle saved it); estimated %d response tokens trained from its "
            "epoch %.3f",
            folder,
            self._response_tokens,
            epoch,
        )

    @property
    def count_estimated(self) -> bool:
        """Whether `response_tokens_trained` includes an estimate (resumed from a checkpoint without a count)."""
        return self._count_estimated

    @property
    def resumed_seconds(self) -> float:
        """Training seconds the run had spent before the checkpoint it resumed from (0 for a fresh run, or when
        the checkpoint predates the record)."""
        return self._seconds_before

    def training_seconds(self) -> float:
        """Wall-clock seconds of `train()` so far, across resumes: this call's time since `train()` began plus
        what the resumed checkpoint recorded."""
        now = 0.0 if self._train_started is None else time.time() - self._train_started
        return self._seconds_before + now

    def response_tokens_trained(self) -> int:
        """Response tokens of every micro-batch trained so far, over all processes (a token seen in two epochs
        counts twice): token-passes."""
        count = torch.tensor(self._response_tokens, device=self.args.device)
        if self.accelerator.num_processes > 1:
            count = self.accelerator.reduce(count, reduction="sum")
        return int(count)

    @torch.no_grad()
    def acceptance_records(self, batch: dict) -> torch.Tensor:
        """Run one evaluation batch with every depth kept (no COD) and return one row per supervised element:
        `(row, anchor, depth, accepted)`, accepted meaning the draft equals the target's argmax over its whole
        vocabulary (what greedy verification accepts). `peagle.evaluation.teacher_forced` builds on it."""
        batch = self._prepare_inputs(batch)
        plans = self.plan_batch(batch, step=0, keep_all=True)
        head = self._head()
        recorder = AcceptanceRecorder(
            self.target_model.get_output_embeddings().weight.detach(), head.draft_vocab_ids
        )
        step = self._partitioned_step(self.model, batch, plans, acceptance=recorder)
        for s in step.order:
            step.run(s)
        return recorder.records()

    def prediction_step(self, model, inputs, prediction_loss_only: bool, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add per-depth top-1 accuracy (`acc_d{i}` / `eval_acc_d{i}`) to the loss logs."""
        for split, key, prefix in (("train", "loss", ""), ("eval", "eval_loss", "eval_")):
            if key not in logs:
                continue
            stats = self._stats[split]
            correct, total, items = stats["correct"], stats["total"], stats["items"]
            if self.accelerator.num_processes > 1:
                packed = torch.cat([correct.float(), total.float(), items]).to(self.args.device)
                packed = self.accelerator.reduce(packed, reduction="sum").cpu()
                k = self.num_parallel_positions
                correct, total, items = packed[:k], packed[k : 2 * k], packed[2 * k :]
            for d in range(self.num_parallel_positions):
                if total[d] > 0:
                    logs[f"{prefix}acc_d{d}"] = round(float(correct[d]) / float(total[d]), 4)
            if split == "train":
                logs["supervised_elements"] = float(items[0])
                if self._last_partition_choice is not None:  # S chosen from partition_memory_budget
                    logs["sequence_partitions"] = float(self._last_partition_choice[1])
            self._stats[split] = self._zero_stats()
        super().log(logs, start_time)

    def per_depth_accuracy(self, split: str = "train") -> list[float | None]:
        """Top-1 agreement per depth since the last log (None where nothing was supervised)."""
        s = self._stats[split]
        return [float(c) / float(t) if t > 0 else None for c, t in zip(s["correct"], s["total"])]


__all__ = ["PEagleTrainer"]
