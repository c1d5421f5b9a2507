"""docs/results.md, the one page that says what peagle does today, rendered from the benchmark JSONs committed
under docs/results/ (`python benchmarks/results_page.py` writes it; a test checks the committed page equals it).

[`SOURCES`] names the runs the page reports: each with its JSON, the date it ran and the head it measured (the
JSONs record the machine, not the date). [`readme_table`] is the README's results table, from the same run as the
page's first table. docs/benchmarks.md keeps every earlier run as history.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Source:
    """One benchmark run the page reports.

    Args:
        path: its JSON, relative to docs/results/.
        date: the day it ran (ISO).
        head: the head (or heads) it measured.
        command: the command that reproduces it, from the repository root.
        archive: the heading of the docs/benchmarks.md section that discusses it.
        cpu: the processor, where the JSON predates recording it.
    """

    path: str
    date: str
    head: str
    command: str
    archive: str
    cpu: str | None = None


SHIPPED = "the shipped heads (`peagle-heads`: `smollm2-135m-peagle`, `smollm2-135m-eagle3`)"
HELD_OUT = "training_data/smollm2-135m-instruct/heldout"

SOURCES: dict[str, Source] = {
    "speed": Source(
        path="trees/speed/bench_tree.json",
        date="2026-12-03",
        head=SHIPPED,
        command="make bench-tree",
        archive="15.3 Speed with default settings",
        cpu="AMD EPYC, AVX-512 BF16",
    ),
    "batch": Source(
        path="cost_rule/batch/bench_batch.json",
        date="2026-12-04",
        head="the shipped P-EAGLE head (`smollm2-135m-peagle`)",
        command=f"peagle bench --batch_sizes 1,2,4,8 --examples {HELD_OUT} --skip 48 --limit 16 --datasets '' "
        "--methods greedy,peagle --max_new_tokens 64",
        archive="16.1 Batch sizes",
    ),
    "conversations": Source(
        path="long_context_catchup/conversations/long_context.json",
        date="2026-12-05",
        head="the shipped P-EAGLE head (`smollm2-135m-peagle`, its 256-slot drafter window)",
        command=f"peagle bench --contexts 0,2048,4096,7936 --examples {HELD_OUT} --skip 48 --limit 3 "
        "--max_new_tokens 128 --methods greedy,peagle",
        archive="20. Long contexts: the windowed catch-up priced right (#67)",
    ),
    "licences": Source(
        path="long_context_catchup/licences/long_context.json",
        date="2026-12-05",
        head="the shipped P-EAGLE head (`smollm2-135m-peagle`, its 256-slot drafter window)",
        command=f"peagle bench --contexts 0,2048,4096,7936 --examples {HELD_OUT} --skip 48 --limit 3 "
        "--max_new_tokens 128 --methods greedy,peagle --context_source /usr/share/common-licenses",
        archive="20. Long contexts: the windowed catch-up priced right (#67)",
    ),
    "multi_turn": Source(
        path="multi_turn/multi_turn.json",
        date="2026-12-06",
        head="the shipped P-EAGLE head (`smollm2-135m-peagle`)",
        command="PEAGLE_COST_CACHE=$(mktemp -d) python benchmarks/bench_multi_turn.py --conversations 3 --turns 5 "
        "--out docs/results/multi_turn",
        archive="22. A chat that passes its cache back (#77)",
    ),
    "no_hidden_cost": Source(
        path="no_hidden_cost/no_hidden_cost.json",
        date="2026-12-06",
        head="the shipped P-EAGLE head (`smollm2-135m-peagle`)",
        command="OMP_NUM_THREADS=1 python benchmarks/bench_no_hidden_cost.py --batch_sizes 1,2,4,8 "
        "--max_new_tokens 64 --out docs/results/no_hidden_cost",
        archive="26. Lean rounds and a shorter first call (#78)",
    ),
    "compiled": Source(
        path="compiled/compiled.json",
        date="2026-12-06",
        head="the shipped P-EAGLE head (`smollm2-135m-peagle`), chains, K = 7, threshold 0",
        command="python benchmarks/bench_compiled.py --batch_sizes 1,8 --max_new_tokens 32 --prompts 2 --warmup 1 "
        "--repeats 1 --device cpu --out docs/results/compiled",
        archive="25. The rule's own costs, by batch size (#78)",
    ),
    "gemma": Source(
        path="gemma3_270m_batches/bench_batch.json",
        date="2026-12-05",
        head="a first head for Gemma-3-270M (base model) from `peagle train --target gemma-3-270m-q4_k_m.gguf "
        "--num_code_prompts 300 --plain_prompts --sequence_partitions 4 --num_train_epochs 3`",
        command="peagle bench --target gemma-3-270m-q4_k_m.gguf --head <head> --batch_sizes 1,4,8 --examples "
        "<head>/examples.jsonl --skip 270 --limit 16 --datasets '' --methods greedy,peagle --max_new_tokens 64",
        archive="19. A real sliding-window target: Gemma-3-270M in batches and trees (#69)",
    ),
}

SETS = {"heldout": "held-out", "mtbench": "MT-Bench", "humaneval": "HumanEval"}
SPEED_ROWS = {
    "peagle default": "P-EAGLE, default (trees)",
    "peagle default chains": "P-EAGLE, chains only",
    "eagle3 default": "EAGLE-3-style, default (trees)",
}


def load(results_dir: str | Path) -> dict[str, dict]:
    """The JSON of every source, by key."""
    return {key: json.loads((Path(results_dir) / s.path).read_text()) for key, s in SOURCES.items()}


def anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces as hyphens.

    >>> anchor("15.3 Speed with default settings")
    '153-speed-with-default-settings'
    """
    kept = "".join(c for c in heading.strip().lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def _x(value: float) -> str:
    return f"{value:.2f}x"


def _yes(flag: bool) -> str:
    return "yes" if flag else "**no**"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def machine_line(machine: dict, cpu: str | None = None) -> str:
    """`machine` of a benchmark JSON in words: processor, threads, torch, and the GPU if any."""
    model = machine.get("cpu_model") or cpu or machine.get("processor", "unknown CPU")
    vector = machine.get("cpu_vector_extension")
    if vector and not cpu:
        model += f", {vector.upper().replace('AVX512_', 'AVX-512 ')}"
    gpu = machine.get("cuda")
    where = f"GPU {gpu}" if gpu else "no GPU"
    threads = machine["threads"]
    return f"{model}, {threads} thread{'' if threads == 1 else 's'}, {where}, torch {machine['torch']}"


def _about(key: str, data: dict, folder: str | None = None, command: str | None = None) -> list[str]:
    """Machine, date, head, raw results and the command of one source (`folder`: its JSONs' folder instead)."""
    source = SOURCES[key]
    where = folder or source.path
    return [
        f"- machine: {machine_line(data['machine'], source.cpu)}; date: {source.date}",
        f"- head: {source.head}, drafting in {data.get('head_dtype', 'float32')} under a float32 target",
        f"- raw results: [`results/{where}`](results/{where}); discussion: "
        f"[benchmarks.md section {source.archive.split()[0].rstrip('.')}](benchmarks.md#{anchor(source.archive)})",
        "",
        "```bash",
        command or source.command,
        "```",
        "",
    ]


def _speed_rows(data: dict) -> list[dict]:
    return [r for r in data["summary"] if r["label"] in SPEED_ROWS]


def readme_table(results_dir: str | Path) -> str:
    """The README's results table (at most 8 rows): the default rule against plain greedy on each evaluation set,
    from the page's first source."""
    data = load(results_dir)["speed"]
    greedy = {r["dataset"]: r for r in data["summary"] if r["label"] == "greedy"}
    rows = [
        [
            SETS[r["dataset"]],
            SPEED_ROWS[r["label"]],
            f"{r['tokens_per_target_pass']:.2f}",
            f"{greedy[r['dataset']]['tokens_per_s']:.1f} -> {r['tokens_per_s']:.1f}",
            _x(r["speedup"]),
            _yes(r["lossless"]),
        ]
        for r in _speed_rows(data)
        if r["label"] != "peagle default chains"
        and (r["label"] == "peagle default" or r["dataset"] == "heldout")
    ]
    header = ["set", "head, rule", "tokens/target pass", "tok/s (greedy -> head)", "speedup", "= greedy"]
    return "\n".join(_table(header, rows)) + "\n"


def _speed_section(data: dict) -> list[str]:
    greedy = {r["dataset"]: r for r in data["summary"] if r["label"] == "greedy"}
    rows = []
    for r in _speed_rows(data):
        base = greedy[r["dataset"]]
        rows.append(
            [
                SETS[r["dataset"]],
                SPEED_ROWS[r["label"]],
                f"{r['tokens_per_target_pass']:.2f}",
                f"{base['tokens_per_s']:.1f}",
                f"{r['tokens_per_s']:.1f}",
                _x(r["speedup"]),
                _x(r["slowest_prompt"]),
                _yes(r["lossless"] and base["lossless"]),
            ]
        )
    prompts = data["config"]["prompts"]
    header = ["set", "head, rule", "tokens/target pass", "greedy tok/s", "tok/s", "speedup", "slowest prompt"]
    return [
        "## 1. One prompt at a time, default settings",
        "",
        f"{prompts['heldout']} held-out prompts (never trained or tuned on) and the first {prompts['mtbench']} of "
        f"MT-Bench and {prompts['humaneval']} of HumanEval, {data['config']['max_new_tokens']} new tokens, "
        'fp32 target. "default" is `generate(ids, assistant_model=head)` with nothing else set: the cost rule '
        'verifies draft trees where they pay; "chains only" is the same rule with `draft_tree_size=0`.',
        "",
        *_about("speed", data),
        *_table([*header, "= greedy"], rows),
        "",
    ]


def _batch_rows(data: dict, methods: dict[str, str]) -> list[list[str]]:
    rows = []
    for r in data["summary"]:
        if r["method"] not in methods:
            continue
        rows.append(
            [
                str(r["batch_size"]),
                methods[r["method"]],
                f"{r['tokens_per_target_pass']:.2f}",
                f"{r['tokens_per_s']:.1f}",
                _x(r["speedup"]),
                _x(r["slowest_batch_speedup"]),
                _yes(r["lossless"]),
                r["rows_equal_to_batch1"],
            ]
        )
    return rows


BATCH_HEADER = [
    "B",
    "method",
    "tokens/target pass per row",
    "tok/s",
    "speedup",
    "slowest batch",
    "= plain batched greedy",
    "rows = batch-1 greedy",
]
BATCH_METHODS = {"greedy": "plain batched greedy", "peagle-auto": "default"}


def _batch_section(data: dict) -> list[str]:
    return [
        "## 2. Left-padded batches",
        "",
        f"{data['config']['prompts']} held-out prompts of mixed lengths, {data['config']['max_new_tokens']} new "
        "tokens, each batch against plain batched greedy on the same batch.",
        "",
        *_about("batch", data),
        *_table(BATCH_HEADER, _batch_rows(data, BATCH_METHODS)),
        "",
    ]


def _context_rows(data: dict, kind: str) -> list[list[str]]:
    return [
        [
            f"{round(r['context_tokens_mean']):,} tokens of {kind}" if r["context"] else "none",
            f"{r['tokens_per_target_pass']:.2f}",
            _x(r["speedup"]),
            _x(r["slowest_prompt_speedup"]),
            _x(r["decode_speedup"]),
            _yes(r["identical"]),
        ]
        for r in data["summary"]
    ]


def _context_section(conversations: dict, licences: dict) -> list[str]:
    header = [
        "context before the prompt",
        "tokens/target pass",
        "speedup",
        "slowest prompt",
        "decode",
        "= greedy",
    ]
    return [
        "## 3. After long contexts",
        "",
        "3 held-out prompts after other held-out conversations, or after licence texts (a kind absent from "
        'training), 128 new tokens, default settings. "decode" leaves out the prefill, which both sides share.',
        "",
        *_about(
            "licences",
            licences,
            folder="long_context_catchup/",
            command=SOURCES["licences"].command + "   # without --context_source: after conversations",
        ),
        *_table(
            header,
            _context_rows(conversations, "conversations") + _context_rows(licences, "licence texts")[1:],
        ),
        "",
    ]


def _multi_turn_section(data: dict) -> list[str]:
    summary = data["summary"]
    rows = []
    for c, conversation in enumerate(data["conversations"]):
        plain = sum(t["plain_seconds"] for t in conversation)
        spec = sum(t["peagle_seconds"] for t in conversation)
        last = conversation[-1]
        rows.append(
            [
                str(c + 1),
                f"{last['input_tokens'] + last['new_tokens']:,}",
                _x(plain / spec),
                _x(min(t["speedup"] for t in conversation)),
                _x(max(t["speedup"] for t in conversation)),
                _yes(all(t["identical"] for t in conversation)),
            ]
        )
    header = ["conversation", "tokens at the end", "speedup", "slowest turn", "fastest turn", "= greedy"]
    return [
        "## 4. A chat that passes its cache back",
        "",
        f"Conversations of {len(data['conversations'][0])} turns, both sides passing their own cache back every turn "
        "(`generate(ids, cache=cache)`); every other turn opens with 1,400 tokens of a licence text, every turn asks a "
        f"held-out question, 96 new tokens at most. Overall {_x(summary['speedup'])}; the head's state travels with "
        "the cache, so no turn re-reads the conversation.",
        "",
        *_about("multi_turn", data),
        *_table(header, rows),
        "",
    ]


def _gemma_section(data: dict) -> list[str]:
    return [
        "## 5. Another target: Gemma-3-270M (sliding window, base model)",
        "",
        f"{data['config']['prompts']} code prompts held out from the head's calibration, "
        f"{data['config']['max_new_tokens']} new tokens. The head is a first one (15 optimizer steps): most of "
        "what the trees accept comes from their prompt-lookup branches, and at B = 1 the rule declines to draft.",
        "",
        *_about("gemma", data),
        *_table(BATCH_HEADER, _batch_rows(data, BATCH_METHODS)),
        "",
    ]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def _no_hidden_cost_section(data: dict) -> list[str]:
    rows = []
    for r in data["summary"]:
        spec, plain = r["peagle"], r["plain"]
        reads = spec["host_syncs_per_drafting_round"]
        rows.append(
            [
                str(r["batch_size"]),
                _x(r["speedup"]),
                f"{spec['first_over_repeated']:.2f}",
                f"{spec['first_call_cost_timing_seconds']:.2f} s",
                f"{spec['drafting_rounds']} / {spec['target_passes']}",
                _ms(spec["ms_outside_forwards_per_drafting_round"]),
                f"{_ms(spec['ms_outside_forwards_per_plain_step'])} ({_ms(plain['ms_outside_forwards_per_plain_step'])})",
                "-" if reads is None else f"{reads:.1f}",
                _yes(r["lossless"]),
            ]
        )
    header = [
        "B", "speedup", "first call / repeated", "timing in the first call", "drafting rounds / target passes",
        "outside the forwards, drafting round", "outside, plain step (plain)", "host reads, drafting round",
        "= greedy",
    ]  # fmt: skip
    return [
        "## 6. First calls and the rule's own costs, by batch size",
        "",
        f"One batch of held-out prompts per batch size, {data['config']['max_new_tokens']} new tokens, one thread, "
        "the default rule on a fresh cost cache: the first call (which times a quick cost curve inside it) against the "
        "same call repeated, and the repeated call against plain batched greedy. Per round, the time outside the "
        "target's and the drafter's forwards and the host reads (a stall each on a GPU).",
        "",
        *_about("no_hidden_cost", data),
        *_table(header, rows),
        "",
    ]


def _compiled_section(data: dict) -> list[str]:
    kinds = ["eager_plain", "compiled_plain", "eager_peagle", "compiled_peagle"]
    rows = []
    for r in data["summary"]:
        base = r["eager_plain"]["tokens_per_second"]
        cells = [f"{base:.1f} tok/s"] + [_x(r[k]["speedup_over_eager_plain"]) for k in kinds[1:]]
        recompiled = sum(r[k]["graphs_compiled_while_timed"] for k in kinds)
        same = all(r[k]["same_as_eager_plain"] for k in kinds)
        rows.append([str(r["batch_size"]), *cells, str(recompiled), _yes(same)])
    header = ["B", "eager plain", "compiled plain", "eager peagle", "compiled peagle", "graphs compiled while timed",
              "= greedy"]  # fmt: skip
    settings = data["settings"]
    return [
        "## 7. Eager and compiled, on a static cache",
        "",
        'The target\'s forward compiled with `torch.compile(dynamic=False)` on `cache_implementation="static"`, '
        f"plain greedy and peagle side by side, {settings['prompts']} batches of held-out prompts, "
        f'{settings["max_new_tokens"]} new tokens per row; peagle verifies in fixed widths (`verify_widths="fixed"`) '
        "so that nothing recompiles after the warm-up.",
        "",
        *_about("compiled", data),
        *_table(header, rows),
        "",
    ]


def render(results_dir: str | Path) -> str:
    """The text of docs/results.md from the JSONs under `results_dir` (docs/results/)."""
    data = load(results_dir)
    lines = [
        "# Results",
        "",
        "What peagle does today, on the machines it was measured on. Generated from the JSONs under "
        "[`results/`](results/) by `python benchmarks/results_page.py`; edit that, not this page. Every output "
        "was checked against plain greedy decoding of the same target. The history of every measurement, with "
        "the reasoning behind each change, is [benchmarks.md](benchmarks.md).",
        "",
        "Timings on a shared 2-core CPU vary from run to run and between machines of the same kind: read speedups "
        "within about ±0.1x. On a GPU, where verifying 33 tokens costs about one plain step (on this CPU 2.4-3.5), "
        "the tokens per target pass are what counts.",
        "",
        *_speed_section(data["speed"]),
        *_batch_section(data["batch"]),
        *_context_section(data["conversations"], data["licences"]),
        *_multi_turn_section(data["multi_turn"]),
        *_gemma_section(data["gemma"]),
        *_no_hidden_cost_section(data["no_hidden_cost"]),
        *_compiled_section(data["compiled"]),
    ]
    return "\n".join(lines).rstrip("\n") + "\n"


__all__ = ["SOURCES", "Source", "anchor", "load", "machine_line", "readme_table", "render"]
