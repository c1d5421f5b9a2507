"""Multi-turn chat that passes its cache back: plain `generate()` against peagle, per turn and overall (issue #77).

Each conversation has `--turns` user turns.  Turns 1, 3, 5, ... open with `--doc-tokens` tokens of a licence text
(`--documents`, default Debian's /usr/share/common-licenses: a kind of text absent from the head's training data),
and every turn asks a held-out question (the user turns of `--examples`, by default the repository's held-out set
after `--skip` 48; never MT-Bench or HumanEval).  Both sides run each turn with the cache the previous turn
filled (`target.generate(ids, cache=cache, ...)`), greedy, `--max-new-tokens` per answer, interleaved turn by
turn; every peagle output is compared with plain's.  peagle runs with the shipped head's default rule; an untimed
warm-up first times the cost curve and its context point at the conversations' longest length (what
`peagle calibrate --costs` does ahead of time; its seconds are reported), so no timed turn includes that timing
(each turn's own `cost_timing_seconds` says so).

Writes `<out>/multi_turn.json` (every turn: input and cached tokens, new tokens, seconds, speedup, tokens per
target pass, the head's catch-up seconds) and `<out>/multi_turn.png` (seconds per turn).  Exit status 1 when an
output differed from plain.

Examples:
    # the measurement (CPU, an otherwise idle machine, a fresh cost cache): about 10 minutes on 2 cores
    PEAGLE_COST_CACHE=$(mktemp -d) python benchmarks/bench_multi_turn.py --conversations 3 --turns 5 \\
        --out docs/results/multi_turn
    # a quick end-to-end check
    python benchmarks/bench_multi_turn.py --conversations 1 --turns 2 --doc-tokens 200 --max-new-tokens 16 \\
        --out /tmp/multi_turn
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

import peagle
from peagle.data.documents import read_documents
from peagle.data.shards import load_examples
from peagle.evaluation import multi_turn
from peagle.evaluation.long_inputs import prompt_part
from peagle.evaluation.timing import machine_description
from peagle.generation.cost import prepare_cost_model
from peagle.generation.settings import AUTO_TREE_NODES


def user_question(tokenizer, example) -> str:
    """The user turn's text of a held-out example's prompt."""
    text = tokenizer.decode(prompt_part(example))
    start = text.rfind("<|im_start|>user\n")
    body = text[start + len("<|im_start|>user\n") :] if start >= 0 else text
    return body.split("<|im_end|>")[0].strip()


def document_chunks(tokenizer, source: str, count: int, tokens: int, seed: int) -> list[str]:
    """`count` chunks of `tokens` tokens from the documents of `source`, taken in a seeded order of documents, one
    chunk from each before a second from any (a long licence gives several)."""
    docs = [text for _, text in read_documents(source)]
    order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(seed)).tolist()
    ids = [tokenizer(docs[i], add_special_tokens=False)["input_ids"] for i in order]
    chunks = []
    for part in range(max(len(d) for d in ids) // tokens):
        for doc in ids:
            if len(doc) >= (part + 1) * tokens:
                chunks.append(tokenizer.decode(doc[part * tokens : (part + 1) * tokens]))
            if len(chunks) == count:
                return chunks
    raise ValueError(f"{source}: {len(chunks)} chunks of {tokens} tokens in all; {count} needed.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--doc-tokens", type=int, default=1400)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--documents", default="/usr/share/common-licenses")
    parser.add_argument("--examples", default="training_data/smollm2-135m-instruct/heldout")
    parser.add_argument("--skip", type=int, default=48)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", default="bench_results/multi_turn")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    target, tok = peagle.load_default_target()
    head = peagle.load_default_drafter(target)
    examples = load_examples(args.examples)[args.skip :]
    need = args.conversations * args.turns
    questions = [user_question(tok, e) for e in examples[:need]]
    per_conv_docs = (args.turns + 1) // 2
    docs = document_chunks(tok, args.documents, args.conversations * per_conv_docs, args.doc_tokens, seed=7)

    # warm-up (untimed): one call with the head, then everything the cost rule times at these lengths, ahead
    longest = args.turns * (args.max_new_tokens + 60) + per_conv_docs * args.doc_tokens
    tic = time.perf_counter()
    target.generate(torch.tensor([[1, 2, 3, 4]]), assistant_model=head, max_new_tokens=8, do_sample=False)
    prepare_cost_model(target, head, AUTO_TREE_NODES + 1, contexts=[longest])
    warm_seconds = time.perf_counter() - tic

    conversations = []
    for c in range(args.conversations):
        turns = multi_turn.conversation_turns(
            questions[c * args.turns : (c + 1) * args.turns],
            docs[c * per_conv_docs : (c + 1) * per_conv_docs],
            args.turns,
        )
        records = multi_turn.run_conversation(target, tok, head, turns, args.max_new_tokens)
        conversations.append(records)
        speedups = ", ".join(f"{t['speedup']:.2f}x" for t in records)
        print(f"conversation {c + 1}: {speedups}", flush=True)
    summary = multi_turn.summarize(conversations)
    print(multi_turn.format_table(conversations, summary))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {
        "benchmark": "multi_turn",
        "date": datetime.date.today().isoformat(),
        "machine": machine_description(),
        "head": "shipped P-EAGLE head (peagle-heads), default rule",
        "head_dtype": str(head.dtype).removeprefix("torch."),
        "target": "HuggingFaceTB/SmolLM2-135M-Instruct, float32",
        "settings": vars(args),
        "warm_up_seconds": warm_seconds,
        "summary": summary,
        "conversations": conversations,
    }
    (out / "multi_turn.json").write_text(json.dumps(results, indent=2))
    multi_turn.plot(conversations, out / "multi_turn.png")
    print(f"wrote {out / 'multi_turn.json'} and {out / 'multi_turn.png'}")
    return 0 if summary["all_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
