"""Prompts for self-distillation: chat formatting, the evaluation-set guard, and the offline prompt sources.

A *prompt* is a user string, a list of chat messages, or token ids already formatted for the target (e.g. ending
with the assistant prefix).  Sources here need no model: prompt files ([`load_prompts`]), coding prompts built
from Python's standard library ([`stdlib_code_prompts`], and stubs to complete: [`stdlib_stub_prompts`]) and
the default heads' templated set ([`default_prompt_set`]).  Prompts the target writes itself (Magpie) come from
[`peagle.data.distill.synthesize_prompts`].

No source yields MT-Bench or HumanEval prompts: [`check_not_evaluation`] refuses user-given ones with a
`ValueError` naming the prompt, [`drop_evaluation_prompts`] drops generated ones with a logged count
(both through `peagle.data.evalsets.is_evaluation_prompt`).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import io
import json
import os
import random
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from transformers.utils import logging

from . import evalsets

logger = logging.get_logger(__name__)

Prompt = str | list[dict[str, str]] | Sequence[int]

_SENTINEL = "\u2063PEAGLE_SENTINEL\u2063"


# ------------------------------------------------------------------------------------------- chat formatting
def is_token_ids(prompt: Any) -> bool:
    """Whether `prompt` is already token ids (a tensor or a non-empty sequence of ints)."""
    if isinstance(prompt, torch.Tensor):
        return True
    return not isinstance(prompt, str) and len(prompt) > 0 and isinstance(prompt[0], int)


def has_chat_template(tokenizer) -> bool:
    """Whether `tokenizer` formats chat turns (has a `chat_template`)."""
    return bool(getattr(tokenizer, "chat_template", None))


def check_chat_template(
    tokenizer, *, plain_prompts: bool = False, magpie: bool = False, what: str = "the target"
) -> None:
    """Raise `ValueError` before any slow work when text prompts cannot be formatted: `tokenizer` is None, or has no
    chat template and `plain_prompts` is off, or Magpie prompts are asked for without a template (Magpie lets the
    target write a user turn: it needs the template's turn markers)."""
    if tokenizer is None:
        raise ValueError(
            f"{what} has no tokenizer: text prompts need one (or pass ready examples / token ids)."
        )
    name = getattr(tokenizer, "name_or_path", None) or what
    if magpie and (plain_prompts or not has_chat_template(tokenizer)):
        raise ValueError(
            f"Magpie prompts need a chat template and the tokenizer of {name} "
            + ("is used without one (plain_prompts / --plain_prompts)" if plain_prompts else "has none")
            + "; give it one (chat_template / --chat_template FILE) or drop them (num_magpie_prompts / --num_magpie_prompts)."
        )
    if not plain_prompts and not has_chat_template(tokenizer):
        raise ValueError(
            f"the tokenizer of {name} has no chat template, so chat prompts cannot be formatted: give it one "
            "(tokenizer.chat_template = a Jinja template; peagle train --chat_template FILE) or train on plain "
            "text prompts (plain_prompts=True; peagle train --plain_prompts: each prompt is encoded as is and the "
            "target continues it). See docs/training.md."
        )


def chat_prompt_ids(tokenizer, prompt: Prompt, system: str | None = None, plain: bool = False) -> list[int]:
    """Token ids of `prompt` formatted with the tokenizer's chat template, ending with the assistant prefix.

    `prompt` is a user string, a list of chat messages, or already token ids (returned as a list unchanged).
    `system` is prepended as a system message unless the messages start with one.  `plain`: no template, the
    messages' contents joined by newlines and encoded as text (with the tokenizer's special tokens, e.g. BOS), for
    targets without a chat template; a tokenizer without a template raises `ValueError` unless `plain`.
    """
    if isinstance(prompt, torch.Tensor):
        return prompt.flatten().tolist()
    if is_token_ids(prompt):
        return list(prompt)
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system is not None and (not messages or messages[0].get("role") != "system"):
        messages = [{"role": "system", "content": system}] + messages
    if plain:
        text = "\n".join(m["content"] for m in messages)
        return tokenizer(text)["input_ids"]
    check_chat_template(tokenizer)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def user_turn_template(tokenizer, system: str | None = None) -> tuple[list[int], list[int]]:
    """`(prefix_ids, suffix_ids)` around a user turn in the tokenizer's chat template.

    The prefix is everything before the user's text, *including* the system prompt: `system` when given, else
    any default one the template inserts (SmolLM2's does); the suffix is everything after it up to the assistant
    prefix.  Magpie-style synthesis lets the target continue the prefix, which makes it write a user turn.
    """
    check_chat_template(tokenizer, magpie=True)
    messages = [{"role": "user", "content": _SENTINEL}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if text.count(_SENTINEL) != 1:
        raise ValueError("could not locate the user turn in the chat template's output.")
    before, after = text.split(_SENTINEL)
    return _encode(tokenizer, before), _encode(tokenizer, after)


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


# ------------------------------------------------------------------------------------ evaluation-set guard
def prompt_text(prompt: Prompt, tokenizer=None) -> str | None:
    """The text of `prompt` that the guard checks: the string, the chat messages' contents, or the decoded
    token ids (None for token ids without a tokenizer)."""
    if is_token_ids(prompt):
        if tokenizer is None:
            return None
        ids = prompt.flatten().tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
        return tokenizer.decode(ids, skip_special_tokens=True)
    if isinstance(prompt, str):
        return prompt
    return "\n".join(str(m.get("content", "")) for m in prompt)


def check_not_evaluation(prompts: Iterable[Prompt], tokenizer=None, *, source: str = "prompts") -> None:
    """Refuse MT-Bench / HumanEval prompts: raise `ValueError` naming the first one found.

    Token-id prompts are decoded with `tokenizer`; without one they cannot be checked and are let through.
    """
    for i, prompt in enumerate(prompts):
        text = prompt_text(prompt, tokenizer)
        if text is not None and evalsets.is_evaluation_prompt(text):
            shown = " ".join(text.split())
            shown = shown if len(shown) <= 200 else shown[:200] + "..."
            raise ValueError(
                f"{source}: prompt {i} is an MT-Bench/HumanEval evaluation prompt, which peagle never trains "
                f"on: {shown!r}. Remove it from the training prompts."
            )


def drop_evaluation_prompts(
    prompts: Iterable[Prompt], tokenizer=None, *, source: str = "generated prompts"
) -> list[Prompt]:
    """`prompts` without MT-Bench / HumanEval prompts (order kept; the number dropped is logged)."""
    kept, dropped = [], 0
    for prompt in prompts:
        text = prompt_text(prompt, tokenizer)
        if text is not None and evalsets.is_evaluation_prompt(text):
            dropped += 1
        else:
            kept.append(prompt)
    if dropped:
        logger.warning("%s: dropped %d MT-Bench/HumanEval evaluation prompt(s)", source, dropped)
    return kept


# -------------------------------------------------------------------------------------------- prompt files
def load_prompts(path: str | os.PathLike, limit: int | None = None) -> list[Prompt]:
    """Read prompts from a file: `.txt` (one per line), `.json`/`.jsonl` (strings, or objects with `messages`,
    `conversations`, `prompt`, `instruction`, `question` or `text`; for conversations only the turns up to the
    first user turn are kept, since responses are regenerated by the target).

    Raises `ValueError` naming the prompt when the file holds an MT-Bench or HumanEval prompt.
    """
    path = os.fspath(path)
    if not path.endswith((".txt", ".json", ".jsonl")):
        raise ValueError(f"prompt file {path!r}: expected a .txt, .json or .jsonl file.")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"prompt file {path!r} does not exist.")
    prompts: list[Prompt] = []
    skipped: list[int] = []  # line (JSONL) or item numbers, 1-based, of rows that hold no prompt
    with open(path, "rb") as raw:
        data = raw.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise ValueError(
            f"prompt file {path!r}, line {line}: not UTF-8 text (byte {err.start}); save the file as UTF-8."
        ) from err
    if not text.strip():
        raise ValueError(
            f"prompt file {path!r} is empty; expected one prompt per line (.txt) or a JSON list."
        )
    with io.StringIO(text) as fh:
        if path.endswith(".txt"):
            rows: Iterable[tuple[int, Any]] = ((i, line.rstrip("\n")) for i, line in enumerate(fh, 1))
        elif path.endswith(".jsonl"):
            rows = ((i, _json_line(path, i, line)) for i, line in enumerate(fh, 1) if line.strip())
        else:
            try:
                data = json.load(fh)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"prompt file {path!r} is not valid JSON: {err.msg} at line {err.lineno}."
                ) from err
            if not isinstance(data, list):
                raise ValueError(
                    f"prompt file {path!r}: expected a JSON list of prompts, got a {type(data).__name__}."
                )
            rows = enumerate(data, 1)
        for i, row in rows:
            p = _prompt_from_row(row)
            if p:
                prompts.append(p)
            elif not (isinstance(row, str) and not row.strip()):
                skipped.append(i)
            if limit is not None and len(prompts) >= limit:
                break
    if skipped:
        where = "line" if path.endswith((".jsonl", ".txt")) else "item"
        logger.warning(
            f"prompt file {path!r}: {len(skipped)} rows hold no prompt (no messages/conversations/prompt/"
            f"instruction/question/text field), skipped: {where}s {skipped[:10]}{' ...' if len(skipped) > 10 else ''}"
        )
    if not prompts and limit != 0:
        raise ValueError(
            f"prompt file {path!r} holds no prompts ({len(skipped)} rows without a messages/conversations/prompt/"
            "instruction/question/text field)."
        )
    check_not_evaluation(prompts, source=f"prompt file {path!r}")
    return prompts


def _json_line(path: str, number: int, line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"prompt file {path!r}, line {number}: not valid JSON ({err.msg}).") from err


def _prompt_from_row(row: Any) -> Prompt | None:
    if isinstance(row, str):
        return row.strip() or None
    if not isinstance(row, dict):
        return None
    for key in ("messages", "conversations", "conversation"):
        if isinstance(row.get(key), list):
            msgs = []
            for m in row[key]:
                role = m.get("role", m.get("from", "user"))
                role = {"human": "user", "gpt": "assistant"}.get(role, role)
                msgs.append({"role": role, "content": m.get("content", m.get("value", ""))})
                if role == "user":
                    return msgs
            return None
    for key in ("prompt", "instruction", "question", "text"):
        if isinstance(row.get(key), str) and row[key].strip():
            return row[key].strip()
    return None


# ------------------------------------------------------------------------------ standard-library prompts
STDLIB_MODULES = (  # noqa: SIM905 - one compact string, not one line per item
    "argparse ast base64 bisect calendar collections colorsys csv dataclasses datetime difflib email.utils "
    "fnmatch fractions functools glob gzip heapq html http.cookies inspect ipaddress json keyword logging "
    "mimetypes ntpath os os.path pathlib pickle platform posixpath pprint quopri random re shlex shutil "
    "statistics string tarfile tempfile textwrap tokenize typing urllib.parse uuid warnings zipfile"
).split()
"""Modules of [`stdlib_code_prompts`]."""


def stdlib_functions(
    modules: Iterable[str], *, defined_here: bool = True
) -> Iterator[tuple[str, str, Any, str]]:
    """`(module, name, function, signature)` of the public, documented functions of importable `modules`.

    Names are visited in sorted order per module; `defined_here` skips functions a module only re-exports.
    """
    for modname in modules:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                module = importlib.import_module(modname)
            except ImportError:
                continue
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or not inspect.isfunction(obj) or not obj.__doc__:
                continue
            if defined_here and obj.__module__ != module.__name__:
                continue
            try:
                sig = str(inspect.signature(obj))
            except (TypeError, ValueError):
                continue
            yield modname, name, obj, sig


def stdlib_code_prompts(num_prompts: int, seed: int = 0) -> list[str]:
    """Coding prompts built from Python's own standard library: "write `name(signature)`: <docstring summary>".

    These complement Magpie prompts (which small chat models rarely make about code) and are not evaluation data.
    Returns at most `num_prompts` prompts (about 400 exist), shuffled by `seed`.
    """
    found: list[str] = []
    for _, name, obj, sig in stdlib_functions(STDLIB_MODULES):
        doc = inspect.getdoc(obj)
        if not doc:
            continue
        summary = doc.strip().split("\n\n")[0].replace("\n", " ")
        if 20 <= len(summary) <= 400:
            found.append(f"Write a Python function `{name}{sig}`. {summary} Explain your code briefly.")
    random.Random(seed).shuffle(found)
    return drop_evaluation_prompts(found, source="stdlib_code_prompts")[:num_prompts]


STUB_INSTRUCTIONS = (
    "Complete the following Python function. Reply with code only.\n\n```python\n{stub}```",
    "Complete this Python function:\n\n```python\n{stub}```",
    "Implement the body of this function in Python.\n\n```python\n{stub}```",
    "Fill in the function below so that it does what its docstring says.\n\n```python\n{stub}```",
)
"""Instructions of [`stdlib_stub_prompts`]; `{stub}` is a signature with its docstring."""


def stdlib_stub_prompts(
    num_prompts: int, seed: int = 0, modules: Iterable[str] = STDLIB_MODULES
) -> list[str]:
    """Code-completion prompts of HumanEval's *kind* built from the standard library: a function stub.

    Each prompt gives a stub (`def name(signature):` and its docstring, examples included) under one of
    [`STUB_INSTRUCTIONS`] and asks for the body, the way HumanEval asks; the functions are the standard
    library's, never HumanEval's, and the evaluation-set guard drops any prompt that matches one.  Returns at
    most `num_prompts` prompts (every function whose stub parses, in every phrasing: about 1,500 for the default
    modules), shuffled by `seed`.
    """
    found: list[str] = []
    for _, name, obj, sig in stdlib_functions(modules):
        doc = inspect.getdoc(obj)
        if not doc or not 20 <= len(doc) <= 800 or '"""' in doc:
            continue
        body = "\n".join(("    " + line).rstrip() for line in doc.splitlines())
        stub = f'def {name}{sig}:\n    """\n{body}\n    """\n'
        if not _parses(stub):  # e.g. a default shown as `<object at 0x...>`, which also varies per process
            continue
        found += [instruction.format(stub=stub) for instruction in STUB_INSTRUCTIONS]
    random.Random(seed).shuffle(found)
    return drop_evaluation_prompts(found, source="stdlib_stub_prompts")[:num_prompts]


def _parses(code: str) -> bool:
    try:
        ast.parse(code)
    except SyntaxError:
        return False
    return True


# ---------------------------------------------------------------------------- the default heads' prompts
DEFAULT_SET_MODULES = (  # noqa: SIM905 - one compact string, not one line per item
    "string textwrap difflib re json csv math statistics fractions decimal random itertools functools operator "
    "collections heapq bisect copy pprint datetime calendar os.path posixpath shutil glob fnmatch tempfile "
    "pathlib base64 binascii hashlib hmac secrets zlib gzip html urllib.parse ipaddress email.utils shlex "
    "argparse logging typing dataclasses enum contextlib inspect ast tokenize keyword colorsys uuid struct array "
    "graphlib zipfile tarfile configparser sched queue threading timeit unicodedata"
).split()
"""Modules of the coding half of [`default_prompt_set`]."""

CODE_TEMPLATES = (
    "Write a Python function `{name}{sig}` that does the following: {doc}",
    "Implement `{name}{sig}` in Python from scratch (do not import {module}). Specification: {doc}",
    "Explain what `{module}.{name}` does in Python and show a short usage example.",
    "Write unit tests with pytest for a function `{name}{sig}` described as: {doc}",
)

CHAT_TEMPLATES = (
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
)

TOPICS = (  # noqa: SIM905 - one compact string, not one line per item
    "renewable energy; saving money; learning a new language; the water cycle; healthy sleep; machine learning; "
    "remote work; composting; public transport; the history of the printing press; time management; "
    "photosynthesis; volcanoes; writing a resume; meditation; cloud computing; baking bread; climate change; "
    "the stock market; running a marathon; version control with git; databases; the solar system; first aid; "
    "gardening on a balcony; electric cars; recycling; team meetings; learning to play the guitar; "
    "online privacy; the Roman Empire; vaccines; container ships; coffee; bees and pollination; "
    "password security; budget travel; chess; the human heart; 3D printing; sorting algorithms; "
    "writing clean code; recursion; HTTP and web servers; unit testing; regular expressions; spreadsheets; "
    "city planning; dinosaurs; ocean tides; job interviews; public speaking; cooking pasta; starting a podcast; "
    "the immune system; bicycles; libraries; rainforests; electricity at home; friendship"
).split("; ")


def templated_code_prompts(rng: random.Random) -> list[str]:
    """One prompt per documented function of [`DEFAULT_SET_MODULES`], each from a template `rng` picks."""
    prompts = []
    for modname, name, obj, sig in stdlib_functions(DEFAULT_SET_MODULES, defined_here=False):
        doc = " ".join(obj.__doc__.strip().split("\n\n")[0].split())
        if len(doc) >= 20:
            template = rng.choice(CODE_TEMPLATES)
            prompts.append(template.format(name=name, sig=sig, doc=doc[:400], module=modname))
    return prompts


def templated_chat_prompts() -> list[str]:
    """Every chat template crossed with every topic ([`CHAT_TEMPLATES`] x [`TOPICS`], topic-major)."""
    return [t.format(topic=topic) for topic in TOPICS for t in CHAT_TEMPLATES]


def default_prompt_set(seed: int = 0) -> list[str]:
    """The default heads' first prompt set: templated coding and chat prompts, de-duplicated and shuffled."""
    rng = random.Random(seed)
    prompts = list(dict.fromkeys(templated_code_prompts(rng) + templated_chat_prompts()))
    prompts = drop_evaluation_prompts(prompts, source="default_prompt_set")
    rng.shuffle(prompts)
    return prompts


__all__ = [
    "Prompt",
    "is_token_ids",
    "chat_prompt_ids",
    "check_chat_template",
    "has_chat_template",
    "user_turn_template",
    "prompt_text",
    "check_not_evaluation",
    "drop_evaluation_prompts",
    "load_prompts",
    "stdlib_functions",
    "stdlib_code_prompts",
    "stdlib_stub_prompts",
    "templated_code_prompts",
    "templated_chat_prompts",
    "default_prompt_set",
]
