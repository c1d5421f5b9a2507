"""Training prompts for the default SmolLM2 head (none from MT-Bench or HumanEval).

Two offline sources:
- code: public functions of Python's own standard library, asked for by signature and docstring;
- chat: instruction templates crossed with everyday topics.
Magpie-style prompts (the target writes user turns itself) are added by `make_default_head.py` through
`peagle.training.data`.  Every prompt is checked with `peagle.evalsets.is_evaluation_prompt`.

Usage: `python scripts/default_prompts.py --out prompts.jsonl` (prints counts).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import random
import warnings

from peagle.evalsets import is_evaluation_prompt

STDLIB_MODULES = [
    "string",
    "textwrap",
    "difflib",
    "re",
    "json",
    "csv",
    "math",
    "statistics",
    "fractions",
    "decimal",
    "random",
    "itertools",
    "functools",
    "operator",
    "collections",
    "heapq",
    "bisect",
    "copy",
    "pprint",
    "datetime",
    "calendar",
    "os.path",
    "posixpath",
    "shutil",
    "glob",
    "fnmatch",
    "tempfile",
    "pathlib",
    "base64",
    "binascii",
    "hashlib",
    "hmac",
    "secrets",
    "zlib",
    "gzip",
    "html",
    "urllib.parse",
    "ipaddress",
    "email.utils",
    "shlex",
    "argparse",
    "logging",
    "typing",
    "dataclasses",
    "enum",
    "contextlib",
    "inspect",
    "ast",
    "tokenize",
    "keyword",
    "colorsys",
    "uuid",
    "struct",
    "array",
    "graphlib",
    "zipfile",
    "tarfile",
    "configparser",
    "sched",
    "queue",
    "threading",
    "timeit",
    "unicodedata",
]

CODE_TEMPLATES = [
    "Write a Python function `{name}{sig}` that does the following: {doc}",
    "Implement `{name}{sig}` in Python from scratch (do not import {module}). Specification: {doc}",
    "Explain what `{module}.{name}` does in Python and show a short usage example.",
    "Write unit tests with pytest for a function `{name}{sig}` described as: {doc}",
]

CHAT_TEMPLATES = [
    "Explain {topic} to a beginner in a few paragraphs.",
    "Give me five practical tips about {topic}.",
    "Write a short, friendly email to a colleague about {topic}.",
    "What are the pros and cons of {topic}?",
    "Summarize the key ideas of {topic} in a bulleted list.",
    "Write a short poem about {topic}.",
    "I am preparing a presentation on {topic}. Suggest an outline with section titles.",
    "What are common misconceptions about {topic}?",
    "Describe a typical day of someone who works with {topic}.",
    "Write a short dialogue between two friends discussing {topic}.",
    "How would you explain {topic} to a ten-year-old?",
    "List three questions an interviewer might ask about {topic}, with good answers.",
]

TOPICS = [
    "renewable energy",
    "saving money",
    "learning a new language",
    "the water cycle",
    "healthy sleep",
    "machine learning",
    "remote work",
    "composting",
    "public transport",
    "the history of the printing press",
    "time management",
    "photosynthesis",
    "volcanoes",
    "writing a resume",
    "meditation",
    "cloud computing",
    "baking bread",
    "climate change",
    "the stock market",
    "running a marathon",
    "version control with git",
    "databases",
    "the solar system",
    "first aid",
    "gardening on a balcony",
    "electric cars",
    "recycling",
    "team meetings",
    "learning to play the guitar",
    "online privacy",
    "the Roman Empire",
    "vaccines",
    "container ships",
    "coffee",
    "bees and pollination",
    "password security",
    "budget travel",
    "chess",
    "the human heart",
    "3D printing",
    "sorting algorithms",
    "writing clean code",
    "recursion",
    "HTTP and web servers",
    "unit testing",
    "regular expressions",
    "spreadsheets",
    "city planning",
    "dinosaurs",
    "ocean tides",
    "job interviews",
    "public speaking",
    "cooking pasta",
    "starting a podcast",
    "the immune system",
    "bicycles",
    "libraries",
    "rainforests",
    "electricity at home",
    "friendship",
]


def code_prompts(rng: random.Random) -> list[str]:
    prompts = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for modname in STDLIB_MODULES:
            try:
                mod = importlib.import_module(modname)
            except ImportError:
                continue
            for name, obj in sorted(vars(mod).items()):
                if name.startswith("_") or not inspect.isfunction(obj) or not obj.__doc__:
                    continue
                doc = " ".join(obj.__doc__.strip().split("\n\n")[0].split())
                if len(doc) < 20:
                    continue
                try:
                    sig = str(inspect.signature(obj))
                except (TypeError, ValueError):
                    continue
                tmpl = rng.choice(CODE_TEMPLATES)
                prompts.append(tmpl.format(name=name, sig=sig, doc=doc[:400], module=modname))
    return prompts


def chat_prompts() -> list[str]:
    return [t.format(topic=topic) for topic in TOPICS for t in CHAT_TEMPLATES]


def build_prompts(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    prompts = code_prompts(rng) + chat_prompts()
    prompts = [p for p in dict.fromkeys(prompts) if not is_evaluation_prompt(p)]
    rng.shuffle(prompts)
    return prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    prompts = build_prompts(args.seed)
    with open(args.out, "w") as fh:
        for p in prompts:
            fh.write(json.dumps({"prompt": p}) + "\n")
    print(f"{len(prompts)} prompts -> {args.out}")


if __name__ == "__main__":
    main()
