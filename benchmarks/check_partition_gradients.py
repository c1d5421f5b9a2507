"""Exactness of partitioned training at length: the gradient of one step with S segments against another S.

One example of `--length` tokens (random tokens, cached random features, as in bench_partition.py), the shipped
head's shape (width 576, 4 layers, K_train 8, draft vocabulary 8,192), fp32.  For each S in `--partitions` the
same head takes one `PEagleTrainer.training_step`; the script prints the relative difference
``||g_S - g_ref|| / ||g_ref||`` over all trainable parameters against the first S, and the step's seconds, and
writes `<out>/partition_gradients.json`.

    python benchmarks/check_partition_gradients.py --length 4096 --partitions 1,8
    python benchmarks/check_partition_gradients.py --length 8192 --partitions 8,32
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--partitions", default="1,8")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", default="bench_results/partition_gradients")
    args = ap.parse_args(argv)

    import torch
    from transformers import LlamaConfig

    from peagle.evaluation.timing import machine_description
    from peagle.training import PEagleDataCollator, PEagleTrainer, build_head, training_arguments

    class LMHeadOnly(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config = config
            self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.embed_tokens = torch.nn.Embedding(config.vocab_size, config.hidden_size)

        def get_input_embeddings(self):
            return self.embed_tokens

        def get_output_embeddings(self):
            return self.lm_head

    n = args.length
    positions = max(32768, 2 * n)
    tcfg = LlamaConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        max_position_embeddings=positions,
    )
    torch.manual_seed(0)
    target = LMHeadOnly(tcfg)
    g = torch.Generator().manual_seed(n)
    example = {
        "input_ids": torch.randint(0, 8192, (n,), generator=g).tolist(),
        "loss_mask": [0] * 64 + [1] * (n - 64),
        "target_hidden_states": torch.randn(n, 3 * 576, generator=g),
        "target_last_hidden": torch.randn(n, 576, generator=g),
    }
    head = build_head(
        target,
        [example],
        num_hidden_layers=args.layers,
        draft_vocab_size=8192,
        num_parallel_positions=8,
        max_position_embeddings=positions,
        embed_from_target=True,
        attn_implementation="sdpa",
    )
    batch = PEagleDataCollator()([example])
    grads, rows = {}, []
    for s in [int(x) for x in args.partitions.split(",")]:
        targs = training_arguments(
            os.path.join(args.out, "tmp"),
            use_cpu=True,
            sequence_partitions=s,
            num_parallel_positions=8,
            max_length=n,
            optim="sgd",
        )
        trainer = PEagleTrainer(model=head, target_model=target, args=targs, train_dataset=[example])
        head.zero_grad(set_to_none=True)
        plans = trainer.plan_batch(batch, step=0)
        t0 = time.perf_counter()
        trainer.training_step(
            trainer.model, dict(batch, peagle_plans=plans), sum(p.num_supervised for p in plans)
        )
        seconds = time.perf_counter() - t0
        grads[s] = {k: p.grad.detach().clone() for k, p in head.named_parameters() if p.grad is not None}
        ref_s = next(iter(grads))
        ref = grads[ref_s]
        num = sum(float(((grads[s][k] - ref[k]) ** 2).sum()) for k in ref) ** 0.5
        den = sum(float((ref[k] ** 2).sum()) for k in ref) ** 0.5
        row = {"partitions": s, "reference": ref_s, "relative_difference": num / den, "step_s": seconds}
        rows.append(row)
        print(
            f"length {n}  S={s:<3} vs S={ref_s:<3} relative difference {num / den:.3e}  step {seconds:.1f} s"
        )
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"partition_gradients_{n}.json")
    meta = {"length": n, "layers": args.layers, "machine": machine_description()}
    with open(path, "w") as fh:
        json.dump({**meta, "rows": rows}, fh, indent=2)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
