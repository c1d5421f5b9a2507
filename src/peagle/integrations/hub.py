"""Model cards and Hub uploads for drafter heads.

`prepare_upload_folder(head, folder, ...)` writes everything a Hub repository of a head needs:

- `config.json` (with `auto_map`) and `model*.safetensors` in peagle's layout;
- the remote-code files `configuration_peagle.py`, `modeling_peagle.py` and `drafting_peagle.py`,
  so `AutoModel.from_pretrained(repo, trust_remote_code=True)` works without peagle installed;
- `custom_generate/generate.py` (+ `requirements.txt`), so `target.generate(..., custom_generate=repo,
  trust_remote_code=True)` runs greedy speculative decoding with the head without peagle installed;
- `README.md`, a model card rendered from `model_card_templates/peagle_head.md` (YAML: `library_name`,
  `base_model` = the target, tags, license; body: the head, its training, the acceptance/speedup table of
  a `peagle bench` JSON, usage for transformers and vLLM).

`push_to_hub` (also `PEagleDrafter.push_to_hub`, which importing this module registers, and `peagle push`)
uploads that folder with `huggingface_hub.HfApi.upload_folder`.  The card parses with
`huggingface_hub.ModelCard`; the Hub's own YAML validation (`ModelCard.validate`, a network call) runs
when the Hub receives the upload.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from string import Template
from typing import Any

from huggingface_hub import ModelCard, ModelCardData

from .._version import __version__
from ..formats.vllm import speculative_config
from ..modeling_peagle import PEagleDrafter
from ..sizing.target_config import recorded_target_name

TEMPLATES = Path(__file__).parent.parent / "model_card_templates"
REMOTE_CODE_FILES = ("configuration_peagle.py", "modeling_peagle.py", "drafting_peagle.py")
"""The files `save_pretrained` writes as remote code (a model file and its relative imports)."""
CARD_TEMPLATE = TEMPLATES / "peagle_head.md"
CUSTOM_GENERATE_SOURCE = TEMPLATES / "custom_generate.py"
CUSTOM_GENERATE_REQUIREMENTS = "torch\ntransformers>=5.24\n"
DEFAULT_TAGS = ("peagle", "p-eagle", "eagle3", "speculative-decoding", "drafter", "custom_generate")
BenchInput = str | Path | dict | list | None
"""A `peagle bench` JSON: a file path, or the parsed JSON."""
TrainingInput = dict[str, Any] | str | Path | None
"""What the card says about training: a dict such as `{"data": ..., "tokens": ...}`, or a JSON file of one."""
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# bench summary columns shown on the card (key, header), in this order when some row has a value
# ("tau" is what bench JSONs before the named metrics called tokens per target pass)
_BENCH_COLUMNS = (
    ("dataset", "set"),
    ("method", "method"),
    ("k", "K"),
    ("prompts", "prompts"),
    ("tokens_per_target_pass", "tokens/target pass"),
    ("tau", "tau"),
    ("acceptance_length", "acceptance length"),
    ("tokens_per_s", "tok/s"),
    ("speedup", "speedup"),
    ("lossless", "lossless"),
)


FAMILY_LICENSES = {"gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "gemma3_text": "gemma"}
"""Licenses a whole target family is published under (Hub license ids), by transformers `model_type`."""


def check_repo_id(repo_id: Any) -> str:
    """`repo_id` when the Hub accepts it as a model repo id (`name` or `namespace/name`, checked by
    `huggingface_hub.utils.validate_repo_id`); otherwise a `ValueError` naming it and what is expected, before
    anything is written or uploaded.

    >>> check_repo_id("you/smollm2-peagle")
    'you/smollm2-peagle'
    """
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except ValueError as err:  # HFValidationError; a non-string is one too
        raise ValueError(
            f"repo_id is {repo_id!r}, which the Hub refuses: {err} Expected 'name' or 'namespace/name' (letters, "
            "digits, '-', '_' and '.', at most 96 characters), e.g. 'you/SmolLM2-135M-Instruct-peagle'."
        ) from None
    return repo_id


def _is_repo_id(name: str | None) -> bool:
    return bool(name) and bool(_REPO_ID.match(name)) and not Path(name).exists()


def _front_matter(readme: Path) -> dict[str, Any]:
    """The YAML metadata of a model card file ({} when there is none or it does not parse)."""
    try:
        return ModelCard.load(readme).data.to_dict()
    except Exception:  # a card we cannot read only means we learn nothing from it
        return {}


def _local_target_folders(names: list[str | None]) -> list[Path]:
    return [Path(n).expanduser() for n in names if n and Path(n).expanduser().is_dir()]


def target_hub_id(name: str | None, target_model: Any = None) -> str | None:
    """The Hub id of a head's target: `name` when it is one; for a local folder, the Hub id it records
    ([`sizing.recorded_target_name`], the one rule); else the loaded target's `_name_or_path` or `name_or_path`
    read the same way; None when none is known."""
    names = [name]
    if target_model is not None:
        config = getattr(target_model, "config", None)
        names += [getattr(config, "_name_or_path", None), getattr(target_model, "name_or_path", None)]
    return next((found for found in map(recorded_target_name, names) if found is not None), None)


def target_license(head: PEagleDrafter, target_model: Any = None) -> str:
    """The license a head's card declares: its target's (a local target folder's card, else the target family's,
    `FAMILY_LICENSES`); `apache-2.0` for the embedded default target; `other` when unknown (pass `license=`)."""
    config = head.config
    names = [config.target_model_name]
    if target_model is not None:
        names.append(getattr(getattr(target_model, "config", None), "_name_or_path", None))
    for folder in _local_target_folders(names):
        found = _front_matter(folder / "README.md").get("license")
        if isinstance(found, str) and found:
            return found
    kind = getattr(config, "target_model_type", None)
    if target_model is not None:
        from ..sizing import target_model_type

        kind = target_model_type(target_model) or kind
    if kind in FAMILY_LICENSES:
        return FAMILY_LICENSES[kind]
    from ..targets import DEFAULT_TARGET_NAME

    if DEFAULT_TARGET_NAME in names:
        return "apache-2.0"
    return "other"


def _read_json_file(path: str | Path, what: str) -> Any:
    """`path` parsed as JSON, or a `ValueError` naming the file and what it was for."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{what} file {path} is not UTF-8 text (byte {e.start}); expected a JSON file."
        ) from e
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{what} file {path} is not JSON (line {e.lineno}, column {e.colno}: {e.msg})."
        ) from e


def load_bench(bench: str | Path | dict | list | None) -> dict | list | None:
    """A benchmark result: a `peagle bench` JSON file path, or the already-parsed JSON."""
    if bench is None or isinstance(bench, dict | list):
        return bench
    data = _read_json_file(bench, "benchmark")
    if not isinstance(data, dict | list):
        raise ValueError(
            f"benchmark file {bench} holds a JSON {type(data).__name__}; expected an object or a list."
        )
    return data


def _cell(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if key == "speedup" and isinstance(value, int | float):
        return f"{value:.2f}x"
    if isinstance(value, float):
        return f"{value:.1f}" if key == "tokens_per_s" else f"{value:.2f}"
    return str(value)


def bench_section(bench: str | Path | dict | list | None) -> str:
    """Markdown: the acceptance/speedup table of a bench JSON (its `summary` rows), with machine and command."""
    data = load_bench(bench)
    if not data:
        return (
            "No benchmark was attached to this upload; run `peagle bench` and push with `--bench bench.json`."
        )
    rows = (
        data
        if isinstance(data, list)
        else data.get("summary") or data.get("results") or data.get("rows") or []
    )
    rows = [r for r in rows if isinstance(r, dict)]
    if not rows:
        raise ValueError("bench JSON has no result rows; expected a list of dicts or a 'summary' list.")
    columns = [(k, h) for k, h in _BENCH_COLUMNS if any(r.get(k) is not None for r in rows)]
    columns = columns or [(k, k) for k in rows[0]]
    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(k, r.get(k)) for k, _ in columns) + " |" for r in rows]
    notes = [
        "Tokens/target pass = new tokens / target forward passes (prefill included), counting the target's "
        "own (bonus) token; plain decoding has 1.0. Acceptance length = (accepted drafts + rounds) / rounds "
        "over drafting rounds. Speedup = tokens/s over greedy decoding of the same prompts."
    ]
    if isinstance(data, dict):
        machine = data.get("machine")
        if machine:
            desc = machine if isinstance(machine, str) else ", ".join(f"{k}: {v}" for k, v in machine.items())
            notes.append(f"Machine: {desc}.")
        if data.get("command"):
            notes.append(f"Command: `{data['command']}`.")
    return "\n".join(lines) + "\n\n" + "\n".join(notes)


def training_section(training: dict[str, Any] | str | Path | None) -> str:
    """Markdown bullets from a dict (or JSON file) such as `{"data": ..., "tokens": ..., "budget": ...}`."""
    if isinstance(training, str | Path):
        path, training = training, _read_json_file(training, "training description")
        if not isinstance(training, dict):
            raise ValueError(
                f"training description file {path} holds a JSON {type(training).__name__}; expected an object."
            )
    if not training:
        return "Training data and budget were not recorded with this upload."
    lines = []
    for key, value in training.items():
        if isinstance(value, list | tuple):
            value = ", ".join(str(v) for v in value)
        elif isinstance(value, dict):
            value = ", ".join(f"{k}: {v}" for k, v in value.items())
        lines.append(f"- **{key.replace('_', ' ')}**: {value}")
    return "\n".join(lines)


def _architecture_rows(config: Any) -> str:
    parallel = config.drafting_mode == "parallel"
    rows = [
        (
            "drafting",
            "parallel (P-EAGLE): K drafts in one forward pass" if parallel else "autoregressive (EAGLE-3)",
        ),
        ("decoder layers", f"{config.num_hidden_layers} (layer 0 fused: embeddings + target features)"),
        (
            "width / heads",
            f"{config.hidden_size} / {config.num_attention_heads} q, {config.num_key_value_heads} kv, "
            f"head_dim {config.head_dim}",
        ),  # fmt: skip
        ("draft vocabulary", f"{config.draft_vocab_size} of {config.vocab_size} target tokens"),
        ("target layers read", str(config.eagle_aux_hidden_state_layer_ids)),
    ]
    if parallel:
        rows += [
            ("mask token id", str(config.mask_token_id)),
            ("trained parallel depth (K_train)", str(config.num_parallel_positions)),
        ]
    rows.append(("default K", str(config.num_speculative_tokens)))
    cut = config.confidence_threshold
    if cut is None:
        rule = "cost-aware: each round verifies the drafts expected to pay on the machine at hand"
    elif cut > 0:
        rule = f"confidence cut {cut:g}: a round ends after its first draft below this probability"
    else:
        rule = "K drafts every round"
    rows.append(("default drafting rule (`generate()`)", rule))
    if getattr(config, "draft_calibration", None):
        depths = len(config.draft_calibration.get("x", []))
        rows.append(
            (
                "draft calibration",
                f"isotonic, {depths} depth(s), fitted on held-out text (`peagle calibrate`)",
            )
        )
    if getattr(config, "drafter_window", None):
        rows.append(
            ("drafter window", f"{config.drafter_window} slots: each round attends over its last ones only")
        )
    if config.embed_from_target:
        rows.append(("token embeddings", "the target's (not stored; attached at load)"))
    return "\n".join(f"| {a} | {b} |" for a, b in rows)


_VLLM_SECTION = """vLLM serves the EAGLE-3 / AWS P-EAGLE layout; convert once with peagle, then serve:

```bash
peagle export $repo_id --layout vllm --out ./$short_name-vllm$export_target
vllm serve $base_model --speculative-config '$vllm_spec'
```

The export keeps this head's settings in its `peagle` block, which peagle reads back and vLLM ignores: vLLM
takes K from `num_speculative_tokens` above and drafts K tokens every round, so the confidence cut
(`confidence_threshold`), the calibration map (`draft_calibration`), the drafter window (`drafter_window`) and
cost-aware drafting apply in peagle's
`generate()` only; K_train and the target's layer count are peagle's checks."""
_NO_VLLM_SECTION = """vLLM does not serve this head: its EAGLE-3 path has no interface for $family targets (model_type
`$model_type`), so peagle does not export it to vLLM's layout (the families vLLM serves are listed in peagle's
docs/families.md). Use it with transformers' `generate()` as above."""


def render_model_card(
    head: PEagleDrafter,
    *,
    repo_id: str | None = None,
    base_model: str | None = None,
    license: str | None = None,
    tags: list[str] | None = None,
    bench: BenchInput = None,
    training: TrainingInput = None,
    template: str | Path | None = None,
    target_model: Any = None,
) -> ModelCard:
    """The head's model card (a `huggingface_hub.ModelCard`).

    Args:
        head: a `PEagleDrafter`.
        repo_id: where the card will live (used in the usage snippets).
        base_model: the target's Hub id (default: [`target_hub_id`] of `head.config.target_model_name`, which
            reads a local target folder's recorded name); written to the YAML only when it is a Hub repo id.
        license: YAML license (default: the target's, [`target_license`]).
        tags: YAML tags (`DEFAULT_TAGS` are always included).
        bench: a `peagle bench` JSON (path or parsed) for the acceptance/speedup table.
        training: dict (or JSON file) describing the training data and budget.
        template: another body template (`string.Template` placeholders, see `peagle_head.md`).
        target_model: the loaded target, when at hand (its recorded name and family help the defaults).
    """
    from ..sizing import VLLM_EAGLE3_MODEL_TYPES, family_name, target_model_type

    config = head.config
    from ..sizing import recorded_target_name

    # the card names the target by Hub id, never by a folder of the machine it was written on
    base = base_model or target_hub_id(config.target_model_name, target_model)
    base = base or recorded_target_name(config.target_model_name)
    all_tags = list(dict.fromkeys([*DEFAULT_TAGS, *(tags or [])]))
    data = ModelCardData(
        library_name="peagle",
        license=license or target_license(head, target_model),
        base_model=base if _is_repo_id(base) else None,
        tags=all_tags,
    )
    parallel = config.drafting_mode == "parallel"
    repo = repo_id or "<this repo>"
    short = repo.rsplit("/", 1)[-1].strip("<>").replace(" ", "-")
    kind_of_target = (target_model_type(target_model) if target_model is not None else None) or getattr(
        config, "target_model_type", None
    )
    served = kind_of_target is None or kind_of_target in VLLM_EAGLE3_MODEL_TYPES
    spec = speculative_config(head, f"./{short}-vllm") if served else {}
    vllm = Template(_VLLM_SECTION if served else _NO_VLLM_SECTION).safe_substitute(
        family=family_name(kind_of_target), model_type=kind_of_target
    )
    kind = "P-EAGLE (parallel drafting)" if parallel else "EAGLE-3"
    target_name = (
        f"[`{base}`](https://huggingface.co/{base})" if _is_repo_id(base) else f"`{base or 'its target'}`"
    )
    summary = (
        f"A {kind} drafter head for {target_name}, for speculative decoding with the `peagle` library. "
        + (
            "It drafts K tokens in one forward pass: the bonus slot plus K-1 parallel slots that read a learned "
            "mask embedding and a shared learned hidden state; the target verifies them in one pass."
            if parallel
            else "It drafts K tokens in K forward passes, feeding its own hidden state back."
        )
        + " Greedy output is identical to the target's own."
    )
    attach = (
        ""
        if not config.embed_from_target
        else "; then head.attach_target(target) (it uses the target's embeddings)"
    )
    values = {
        "vllm": vllm,
        "title": repo_id.rsplit("/", 1)[-1] if repo_id else f"{kind} head for {base or 'its target'}",
        "summary": summary,
        "architecture": _architecture_rows(config),
        "aux_ids": str(config.eagle_aux_hidden_state_layer_ids),
        "target_hidden": str(config.target_hidden_size),
        "hidden": str(config.hidden_size),
        "training": training_section(training),
        "bench": bench_section(bench),
        "base_model": base or "<target model>",
        "repo_id": repo,
        "short_name": short,
        "attach_note": attach,
        "export_target": " --target " + base if config.embed_from_target and base else "",
        "vllm_spec": json.dumps(spec),
        "peagle_version": __version__,
    }
    values["vllm"] = Template(vllm).safe_substitute(values)
    body = Template(Path(template or CARD_TEMPLATE).read_text()).safe_substitute(values)
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}")


def custom_generate_source(head_repo: str | None) -> str:
    """`custom_generate/generate.py` with `HEAD_REPO` set to the repository (or folder) holding the head."""
    source = CUSTOM_GENERATE_SOURCE.read_text()
    line = re.compile(r"^HEAD_REPO: str \| None = None.*$", re.MULTILINE)
    if not line.search(source):
        raise RuntimeError(
            f"{CUSTOM_GENERATE_SOURCE} lost its HEAD_REPO line; cannot set the head repository."
        )
    return line.sub(f"HEAD_REPO: str | None = {head_repo!r}", source, count=1)


def _record_target_hub_id(path: Path, config: dict[str, Any], target_model: Any) -> None:
    """An uploaded config names its target by Hub id (or not at all), never by a folder of this machine."""
    from ..sizing import recorded_target_name

    name = config.get("target_model_name")
    hub = target_hub_id(name, target_model) or recorded_target_name(name)
    if hub != name:
        config["target_model_name"] = hub
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def prepare_upload_folder(
    head: PEagleDrafter,
    folder: str | Path,
    *,
    repo_id: str | None = None,
    target_model: Any = None,
    max_shard_size: int | str = "5GB",
    **card: Any,
) -> Path:
    """Write the folder `push_to_hub` uploads (see the module docstring); returns it.

    Args:
        head: a `PEagleDrafter`.
        folder: output folder (created).
        repo_id: the destination repository, one the Hub accepts ([`check_repo_id`]);
            `custom_generate/generate.py` loads the head from it.  Without it the recipe points at `folder` itself
            (for local use).
        target_model: checked against the head (`attach_target`) before writing.

    Raises:
        ValueError: before anything is written, for a repo id the Hub refuses, an empty folder name, a head whose
            weights hold NaN or inf, or a bench/training file that does not read.
        NotADirectoryError: when `folder`, or a folder above it, is a file.
        max_shard_size: passed to `save_pretrained`.
        card: the model card's keywords (`base_model`, `license`, `tags`, `bench`, `training`, `template`; see
            [`render_model_card`]).
    """
    if repo_id is not None:
        check_repo_id(repo_id)
    out = check_upload_folder(folder)
    if target_model is not None:
        head.attach_target(target_model)
    head.check_finite_weights("the head to upload")  # loading it from the Hub would refuse it
    # everything that reads the caller's files (bench, training) comes first: a bad file writes nothing
    card = render_model_card(head, repo_id=repo_id, target_model=target_model, **card)
    earlier = (out / "config.json").is_file() and (out / "custom_generate").is_dir()
    if out.is_dir() and any(out.iterdir()) and not earlier:
        raise FileExistsError(
            f"upload folder {out} holds other files (it is replaced whole); pass a new or empty folder, or one an "
            "earlier upload preparation wrote."
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    # written aside, then swapped in: the folder never holds a mix of old and new files
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        head.save_pretrained(tmp, max_shard_size=max_shard_size)
        config = json.loads((tmp / "config.json").read_text())
        _record_target_hub_id(tmp / "config.json", config, target_model)
        missing = [f for f in REMOTE_CODE_FILES if not (tmp / f).is_file()]
        if "auto_map" not in config or missing:
            raise RuntimeError(
                f"save_pretrained wrote no remote code into {out} (auto_map: {config.get('auto_map')}, missing "
                f"{missing}); import peagle (it registers PEagleDrafter for AutoModel) before preparing an upload."
            )
        gen = tmp / "custom_generate"
        gen.mkdir(exist_ok=True)
        (gen / "generate.py").write_text(custom_generate_source(repo_id or str(out.resolve())))
        (gen / "requirements.txt").write_text(CUSTOM_GENERATE_REQUIREMENTS)
        card.save(tmp / "README.md")
        _swap_in(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def check_upload_folder(folder: str | Path) -> Path:
    """`folder` as a `Path` when an upload folder can be written there; a `NotADirectoryError` naming it when it,
    or a folder above it, is a file, and a `ValueError` for an empty name (which would mean the working folder)."""
    if not str(folder).strip():
        raise ValueError(
            f"the upload folder is {str(folder)!r}; expected a folder path to write the upload into."
        )
    out = Path(folder).expanduser()
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(
            f"upload folder {out} is a file; expected a new, empty or earlier upload folder."
        )
    blocking = next((p for p in out.absolute().parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise NotADirectoryError(
            f"upload folder {out} cannot be created: {blocking} is a file, not a folder."
        )
    return out


def _swap_in(new: Path, out: Path) -> None:
    """Replace folder `out` (if any) by folder `new`, on the same file system."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
        os.replace(out, old / "folder")
    try:
        os.replace(new, out)
    except OSError:
        if old is not None:
            os.replace(old / "folder", out)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def push_to_hub(
    head: PEagleDrafter,
    repo_id: str,
    *,
    token: str | None = None,
    private: bool | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    commit_message: str | None = None,
    **upload: Any,
) -> Any:
    """Prepare the upload folder in a temporary directory and upload it with `HfApi.upload_folder`.

    Also `PEagleDrafter.push_to_hub(repo_id, **kwargs)` (registered below) and `peagle push`.  `token`,
    `private`, `revision`, `create_pr` and `commit_message` are transformers' `push_to_hub` keywords; `upload` goes
    to [`prepare_upload_folder`]: `target_model`, `max_shard_size` and the model card's keywords (`base_model`,
    `license`, `tags`, `bench`, `training`, `template`; see [`render_model_card`]).

    Returns:
        The `huggingface_hub.CommitInfo` of the upload.
    """
    from huggingface_hub import HfApi

    check_repo_id(repo_id)
    api = HfApi(token=token)
    with tempfile.TemporaryDirectory() as tmp:
        folder = prepare_upload_folder(head, Path(tmp) / "upload", repo_id=repo_id, **upload)
        api.create_repo(repo_id, private=private, exist_ok=True)
        return api.upload_folder(
            repo_id=repo_id,
            folder_path=folder,
            commit_message=commit_message or "Upload P-EAGLE head with peagle",
            revision=revision,
            create_pr=create_pr,
        )


PEagleDrafter.register_hub_pusher(push_to_hub)

__all__ = [
    "render_model_card",
    "prepare_upload_folder",
    "push_to_hub",
    "check_repo_id",
    "check_upload_folder",
    "bench_section",
    "training_section",
    "custom_generate_source",
    "load_bench",
    "target_hub_id",
    "target_license",
]
