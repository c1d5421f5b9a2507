"""The folder a Hub upload holds: model card, remote code, custom_generate/; push and CLI without network."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard

import peagle
from helpers import BLOCK_PEAGLE, make_head, make_target
from peagle import PEagleDrafter
from peagle.evaluation.bench import summarize
from peagle.integrations.hub import DEFAULT_TAGS, prepare_upload_folder, render_model_card

TARGET_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _bench_json(tmp_path):
    """A bench.json in the shape `peagle bench` writes (its own `summarize` builds the summary)."""
    runs = []
    for method, k, rounds, seconds in (("greedy", 0, 64, 4.0), ("peagle", 7, 20, 2.0)):
        runs.append(dict(dataset="mtbench", method=method, k=k, new_tokens=64, seconds=seconds, target_passes=rounds,
                         target_seconds=seconds * 0.8, drafter_seconds=seconds * 0.1, lossless=True))  # fmt: skip
    path = tmp_path / "bench.json"
    path.write_text(
        json.dumps({"summary": summarize(runs), "machine": {"cpu": "2 cores"}, "command": "peagle bench"})
    )
    return path


def _load_recipe(folder):
    spec = importlib.util.spec_from_file_location(
        "peagle_custom_generate_test", folder / "custom_generate" / "generate.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _logits(head, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 120, (1, 10), generator=g)
    feats = torch.randn(1, 10, 3 * head.config.target_hidden_size, generator=g)
    par = torch.zeros_like(ids, dtype=torch.bool)
    par[:, -3:] = True
    with torch.no_grad():
        return head(ids, feats, parallel_mask=par).logits


# ------------------------------------------------------------------------------------------ card
def test_model_card_renders_and_parses(tmp_path):
    head = make_head(make_target(), target_model_name=TARGET_ID)
    training = {"data": "self-distilled UltraChat prompts", "tokens": "12M", "budget": "40 min on 1x H100"}
    card = render_model_card(head, repo_id="org/smol-peagle", bench=_bench_json(tmp_path), training=training)
    text = str(card)
    parsed = ModelCard(text)  # YAML front matter parses into ModelCardData
    assert parsed.data.library_name == "peagle" and parsed.data.base_model == TARGET_ID
    assert parsed.data.license == "apache-2.0" and set(DEFAULT_TAGS) <= set(parsed.data.tags)
    assert not re.search(r"\$[a-z_]+", parsed.text), "unfilled template placeholder"
    assert "| mtbench | peagle | 7 | 64 " not in text  # columns are formatted, not raw
    assert re.search(r"\| mtbench \| peagle \| 7 \| 1 \| 3\.20 \| 32\.0 \| 2\.00x \| yes \|", text)
    assert "counting the target's own (bonus) token" in text and "Machine: cpu: 2 cores" in text
    assert "- **budget**: 40 min on 1x H100" in text
    assert 'custom_generate="org/smol-peagle", trust_remote_code=True' in text
    assert '"parallel_drafting": true' in text and '"num_speculative_tokens": 7' in text
    assert f"vllm serve {TARGET_ID}" in text and "peagle export org/smol-peagle --layout vllm" in text


def test_model_card_without_hub_target_or_bench(tmp_path):
    head = make_head(make_target(), target_model_name=str(tmp_path), drafting_mode="autoregressive")
    parsed = ModelCard(str(render_model_card(head)))
    assert parsed.data.base_model is None  # a local path is not a Hub id
    assert "No benchmark was attached" in parsed.text and "autoregressive (EAGLE-3)" in parsed.text
    assert "parallel_drafting" not in parsed.text
    assert "| default drafting rule (`generate()`) | K drafts every round |" in parsed.text  # tiny heads: 0.0
    head.config.confidence_threshold = 0.4
    assert "| default drafting rule (`generate()`) | confidence cut 0.4: a round ends" in str(
        render_model_card(head)
    )
    head.config.confidence_threshold = None
    head.config.draft_calibration = {"method": "isotonic", "x": [[0.1, 0.9]], "y": [[0.0, 0.8]]}
    card = str(render_model_card(head))
    assert "| default drafting rule (`generate()`) | cost-aware" in card and "isotonic, 1 depth(s)" in card
    assert "| drafter window |" not in card
    head.config.drafter_window = 64
    assert "| drafter window | 64 slots" in str(render_model_card(head))
    with pytest.raises(ValueError, match="no result rows"):
        render_model_card(head, bench={"summary": []})


# ------------------------------------------------------------------------------------------ folder
def test_prepare_upload_folder(tmp_path):
    head = make_head(make_target(), target_model_name=TARGET_ID)
    folder = prepare_upload_folder(head, tmp_path / "up", repo_id="org/smol-peagle", license="mit")
    for name in (
        "README.md",
        "config.json",
        "model.safetensors",
        "configuration_peagle.py",
        "modeling_peagle.py",
        "drafting_peagle.py",
    ):
        assert (folder / name).is_file(), name
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"]["AutoModel"] == "modeling_peagle.PEagleDrafter"
    assert (folder / "custom_generate" / "requirements.txt").read_text().split() == [
        "torch",
        "transformers>=5.24",
    ]
    assert _load_recipe(folder).HEAD_REPO == "org/smol-peagle"
    assert ModelCard.load(folder / "README.md").data.license == "mit"
    torch.testing.assert_close(_logits(PEagleDrafter.from_pretrained(folder)), _logits(head))


@pytest.mark.parametrize("mode", ["parallel", "autoregressive"])
def test_custom_generate_equals_greedy_batched(tmp_path, mode):
    target = make_target()
    head = make_head(target, drafting_mode=mode)
    recipe = _load_recipe(prepare_upload_folder(head, tmp_path / "up"))
    ids = torch.randint(3, 120, (2, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0  # left padding
    expected = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=14)
    got = recipe.generate(
        target, ids, attention_mask=mask, peagle_head=head, max_new_tokens=14, num_speculative_tokens=3
    )
    assert torch.equal(got, expected)
    assert head.last_generation_stats.rounds > 0


@pytest.mark.parametrize("mode", ["parallel", "autoregressive"])
def test_custom_generate_confidence_cut(tmp_path, mode):
    """The head's default cut applies (threshold 1.0: every draft is unsure, one per round); an explicit
    `assistant_confidence_threshold=0.0` drafts K every round; the output is greedy's either way."""
    target = make_target()
    head = make_head(target, drafting_mode=mode)
    head.config.confidence_threshold = 1.0
    recipe = _load_recipe(prepare_upload_folder(head, tmp_path / "up"))
    ids = torch.randint(3, 120, (1, 8), generator=torch.Generator().manual_seed(7))
    expected = target.generate(ids, do_sample=False, max_new_tokens=16)
    for given, per_round in ((None, 1), (0.0, 4)):
        extra = {} if given is None else {"assistant_confidence_threshold": given}
        got = recipe.generate(
            target, ids, peagle_head=head, max_new_tokens=16, num_speculative_tokens=4, **extra
        )
        stats = head.last_generation_stats
        assert torch.equal(got, expected), given
        assert stats.rounds > 0 and stats.draft_tokens == per_round * stats.rounds, given


def test_custom_generate_accepts_drafts_and_pairs_features(tmp_path, monkeypatch):
    """Oracle drafts (right for a varying prefix) exercise acceptance and cache cropping; the real slots the
    drafter saw must be the EAGLE pairing of the final sequence: token t+1 with target features of position t."""
    target = make_target()
    head = make_head(target)
    recipe = _load_recipe(prepare_upload_folder(head, tmp_path / "up"))
    ids = torch.randint(3, 120, (1, 7), generator=torch.Generator().manual_seed(5))
    expected = target.generate(ids, do_sample=False, max_new_tokens=40)
    k, seen, real_draft = 4, [], recipe._draft

    def oracle(head_, slots, feats, cache, k_, cut, choose=None):
        seen.append((cache.get_seq_length(), slots.clone(), feats.clone()))
        # grows the drafter cache as a real round does
        _, speculative = real_draft(head_, slots, feats, cache, k_, cut, choose)
        last = cache.get_seq_length() - (k_ - 1) - 1  # index of the bonus slot, which holds token last + 1
        right = len(seen) % (k_ + 1)
        truth = expected[0, last + 2 : last + 2 + k_].tolist()
        truth += [0] * (k_ - len(truth))
        drafts = [t if i < right else (t + 1) % 128 for i, t in enumerate(truth)]
        return torch.tensor([drafts]), speculative

    monkeypatch.setattr(recipe, "_draft", oracle)
    got = recipe.generate(target, ids, peagle_head=head, max_new_tokens=40, num_speculative_tokens=k)
    assert torch.equal(got, expected)
    stats = head.last_generation_stats
    assert stats.accepted_tokens > 0 and stats.acceptance_length > 1.5
    starts = [s for s, _, _ in seen]
    slots = torch.cat([s for _, s, _ in seen], dim=1)
    feats = torch.cat([f for _, _, f in seen], dim=1)
    assert starts == [0, *torch.tensor([s.shape[1] for _, s, _ in seen]).cumsum(0)[:-1].tolist()]
    n = slots.shape[1]
    assert torch.equal(slots, expected[:, 1 : n + 1])
    with torch.no_grad():
        hs = target(expected[:, :n], output_hidden_states=True).hidden_states
    layer_ids = head.config.eagle_aux_hidden_state_layer_ids
    torch.testing.assert_close(feats, torch.cat([hs[i] for i in layer_ids], -1), rtol=1e-4, atol=1e-4)


def test_custom_generate_hands_sampling_to_transformers(tmp_path):
    target = make_target()
    head = make_head(target)
    recipe = _load_recipe(prepare_upload_folder(head, tmp_path / "up"))
    ids = torch.randint(3, 120, (1, 6), generator=torch.Generator().manual_seed(6))
    torch.manual_seed(0)
    got = recipe.generate(target, ids, peagle_head=head, do_sample=True, max_new_tokens=12)
    torch.manual_seed(0)
    assert torch.equal(got, target.generate(ids, do_sample=True, max_new_tokens=12))


# ------------------------------------------------------------------------------------------ push and CLI
def test_push_to_hub_uploads_the_prepared_folder(tmp_path, monkeypatch):
    from huggingface_hub import HfApi

    calls = {}

    def create_repo(self, repo_id, **kwargs):
        calls["create"] = (repo_id, kwargs)

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        files = sorted(str(p.relative_to(folder_path)) for p in folder_path.rglob("*") if p.is_file())
        recipe = (folder_path / "custom_generate" / "generate.py").read_text()
        calls["upload"] = (repo_id, files, recipe, kwargs)
        return "commit"

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    head = make_head(make_target(), target_model_name=TARGET_ID)
    assert head.push_to_hub("org/smol-peagle", private=True, bench=_bench_json(tmp_path)) == "commit"
    assert calls["create"] == ("org/smol-peagle", {"private": True, "exist_ok": True})
    repo_id, files, recipe, kwargs = calls["upload"]
    assert repo_id == "org/smol-peagle" and kwargs["commit_message"]
    for name in (
        "README.md",
        "config.json",
        "modeling_peagle.py",
        "drafting_peagle.py",
        "configuration_peagle.py",
        "custom_generate/generate.py",
    ):
        assert name in files, name
    assert "HEAD_REPO: str | None = 'org/smol-peagle'" in recipe
    # every other keyword is the upload folder's or the card's; a misspelt one fails before anything is created
    calls.clear()
    with pytest.raises(TypeError, match="licence"):
        head.push_to_hub("org/smol-peagle", licence="mit")
    assert calls == {}


def test_cli_push_prepare_only(tmp_path, capsys):
    from peagle.cli import main

    head = make_head(make_target(), target_model_name=TARGET_ID)
    head.save_pretrained(tmp_path / "head")
    out = tmp_path / "up"
    argv = [
        "push",
        str(tmp_path / "head"),
        "org/smol-peagle",
        "--prepare_only",
        str(out),
        "--bench",
        str(_bench_json(tmp_path)),
    ]
    assert main(argv) == 0
    assert "not uploaded" in capsys.readouterr().out
    assert "2.00x" in (out / "README.md").read_text() and (out / "custom_generate" / "generate.py").is_file()


def test_card_license_base_model_and_vllm_advice_come_from_the_target(tmp_path):
    """The card's license is the target's (Gemma: gemma), `base_model` is found for a local target folder, and a
    family vLLM does not serve gets no `peagle export --layout vllm` advice."""
    gemma = make_head(make_target(), target_model_name=str(tmp_path / "gemma-3-270m"))
    gemma.config.target_model_type = "gemma3_text"
    parsed = ModelCard(str(render_model_card(gemma, repo_id="me/gemma-peagle")))
    assert parsed.data.license == "gemma" and "--layout vllm" not in parsed.text
    assert "vllm serve" not in parsed.text and "vLLM does not serve this head" in parsed.text
    assert "Gemma 3" in parsed.text
    assert ModelCard(str(render_model_card(gemma, license="mit"))).data.license == "mit"  # the caller's wins

    # a local target folder: its card's base_model and license, or the Hub cache folder it sits in
    folder = tmp_path / "my-target"
    folder.mkdir()
    (folder / "README.md").write_text("---\nlicense: llama3.2\nbase_model: meta-llama/Llama-3.2-1B\n---\n")
    local = make_head(make_target(), target_model_name=str(folder))
    parsed = ModelCard(str(render_model_card(local)))
    assert parsed.data.base_model == "meta-llama/Llama-3.2-1B" and parsed.data.license == "llama3.2"
    assert "vllm serve meta-llama/Llama-3.2-1B" in parsed.text
    cached = tmp_path / "hub" / "models--Qwen--Qwen3-0.6B" / "snapshots" / "abc123"
    cached.mkdir(parents=True)
    parsed = ModelCard(str(render_model_card(make_head(make_target(), target_model_name=str(cached)))))
    assert (
        parsed.data.base_model == "Qwen/Qwen3-0.6B" and parsed.data.license == "other"
    )  # unknown: not apache


def test_push_with_a_file_that_is_not_json_writes_nothing(tmp_path):
    from peagle.cli import main

    head = make_head(make_target(), target_model_name=TARGET_ID)
    head.save_pretrained(tmp_path / "head")
    bad = tmp_path / "bench.json"
    bad.write_text('{"summary": [')
    latin = tmp_path / "training.json"
    latin.write_bytes(b'{"data": "caf\xe9"}')
    out = tmp_path / "up"
    base = ["push", str(tmp_path / "head"), "org/smol-peagle", "--prepare_only", str(out)]
    with pytest.raises(SystemExit, match=rf"benchmark file {re.escape(str(bad))} is not JSON \(line 1"):
        main([*base, "--bench", str(bad)])
    assert not out.exists()
    with pytest.raises(SystemExit, match=r"training description file .*training.json is not UTF-8"):
        main([*base, "--training", str(latin)])
    assert not out.exists()
    # over an existing folder: a bad file leaves it as it was; a good run replaces it whole (no stale files)
    assert main(base) == 0
    (out / "model-00001-of-00002.safetensors").write_text("stale")
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(SystemExit, match="is not JSON"):
        main([*base, "--bench", str(bad)])
    assert sorted(p.name for p in out.iterdir()) == before
    assert main(base) == 0 and not (out / "model-00001-of-00002.safetensors").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".up.")]  # nothing left aside
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(SystemExit, match=r"upload folder .*mine holds other files"):
        main([*base[:-1], str(mine)])
    assert (mine / "notes.txt").read_text() == "keep me"


# ------------------------------------------------------------------------------------------ without peagle
_NO_PEAGLE = BLOCK_PEAGLE + textwrap.dedent(
    """
    try:
        import peagle  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("peagle is importable; the test needs an environment without it")

    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    folder, target_dir, ref_file = sys.argv[1:4]
    ref = torch.load(ref_file)
    head = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
    assert type(head).__module__.startswith("transformers_modules"), type(head).__module__
    with torch.no_grad():
        logits = head(ref["ids"], ref["feats"], parallel_mask=ref["par"]).logits
    torch.testing.assert_close(logits, ref["logits"])
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    out = target.generate(ref["prompt"], custom_generate=folder, trust_remote_code=True, max_new_tokens=16)
    assert torch.equal(out, ref["greedy"]), (out, ref["greedy"])
    assert "peagle" not in sys.modules
    print("OK", head.last_custom_generate_stats if hasattr(head, "last_custom_generate_stats") else "")
    """
)


@pytest.mark.slow
def test_upload_folder_works_without_peagle(tmp_path):
    target = make_target()
    head = make_head(target)
    folder = prepare_upload_folder(head, tmp_path / "up")
    target.save_pretrained(tmp_path / "target")
    g = torch.Generator().manual_seed(0)
    ids, feats = torch.randint(3, 120, (1, 10), generator=g), torch.randn(1, 10, 192, generator=g)
    par = torch.zeros_like(ids, dtype=torch.bool)
    par[:, -3:] = True
    prompt = torch.randint(3, 120, (1, 8), generator=g)
    with torch.no_grad():
        ref = {"ids": ids, "feats": feats, "par": par, "logits": head(ids, feats, parallel_mask=par).logits}
    ref.update(prompt=prompt, greedy=target.generate(prompt, do_sample=False, max_new_tokens=16))
    torch.save(ref, tmp_path / "ref.pt")
    script = tmp_path / "no_peagle.py"
    script.write_text(_NO_PEAGLE)
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1", PYTHONPATH="")
    proc = subprocess.run(
        [sys.executable, "-I", str(script), str(folder), str(tmp_path / "target"), str(tmp_path / "ref.pt")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK" in proc.stdout


def test_peagle_export_is_public():
    assert peagle.export is peagle.formats.export


def test_push_is_registered_and_says_import_peagle_without_it(monkeypatch):
    assert (
        PEagleDrafter._hub_pusher is peagle.integrations.hub.push_to_hub
    )  # registered by importing peagle.integrations.hub
    monkeypatch.setattr(PEagleDrafter, "_hub_pusher", None)
    with pytest.raises(RuntimeError, match="import peagle"):
        make_head(make_target()).push_to_hub("org/smol-peagle")


@pytest.mark.parametrize(
    ("module", "allowed"),
    [
        ("modeling_peagle", {".configuration_peagle", ".drafting_peagle"}),
        ("drafting_peagle", set()),
    ],
)
def test_remote_code_imports_only_remote_code(module, allowed):
    """modeling_peagle.py and drafting_peagle.py ship as remote code: the model imports only its configuration and
    its drafting round, the round nothing from peagle (no formats, hub, fp8, targets or the package root)."""
    import ast
    import importlib

    tree = ast.parse(Path(importlib.import_module(f"peagle.{module}").__file__).read_text())
    imported = {
        ("." * node.level) + (node.module or "")
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("peagle"))
    }
    imported |= {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    assert {m for m in imported if m.startswith(".") or m.startswith("peagle")} == allowed


@pytest.mark.parametrize("mode", ["parallel", "autoregressive"])
def test_custom_generate_cost_rule(tmp_path, mode):
    """A head without a cut (the default) makes the recipe apply peagle's cost-aware rule: a flat cost curve
    verifies K drafts every round, verification far dearer than a step verifies none; output is greedy's."""
    from peagle.generation.cost import VerifyCostModel

    target = make_target()
    head = make_head(target, drafting_mode=mode, confidence_threshold=None)
    recipe = _load_recipe(prepare_upload_folder(head, tmp_path / "up"))
    ids = torch.randint(3, 120, (1, 8), generator=torch.Generator().manual_seed(9))
    expected = target.generate(ids, do_sample=False, max_new_tokens=12)
    head.cost_model = VerifyCostModel.flat(max_tokens=8)
    got = recipe.generate(target, ids, peagle_head=head, max_new_tokens=12, num_speculative_tokens=3)
    stats = head.last_generation_stats
    assert torch.equal(got, expected) and stats.draft_policy == "cost"
    assert stats.rounds > 0 and stats.draft_tokens == 3 * stats.rounds
    head.cost_model = VerifyCostModel([1.0] + [100.0] * 7)
    got = recipe.generate(target, ids, peagle_head=head, max_new_tokens=12, num_speculative_tokens=3)
    assert torch.equal(got, expected) and head.last_generation_stats.rounds == 0


def test_custom_generate_cost_rule_learns_from_the_rounds_it_verifies(tmp_path):
    """The recipe corrects an overconfident calibration with the rounds it verified, like generate(): a random
    head promised 0.9 per draft stops being verified after about ten rejections (every round without it)."""
    from peagle.generation.cost import VerifyCostModel

    target = make_target(eos_token_id=None)
    head = make_head(target, confidence_threshold=None)
    head.config.draft_calibration = {"method": "isotonic", "x": [[0.0, 1.0]], "y": [[0.9, 0.9]]}
    recipe = _load_recipe(prepare_upload_folder(head, tmp_path / "up"))
    ids = torch.randint(3, 120, (1, 6), generator=torch.Generator().manual_seed(6))
    expected = target.generate(ids, do_sample=False, max_new_tokens=60)
    head.cost_model = VerifyCostModel([1.0 + 0.2 * n for n in range(8)], drafter_seconds=0.01)
    got = recipe.generate(target, ids, peagle_head=head, max_new_tokens=60, num_speculative_tokens=4)
    assert torch.equal(got, expected)
    stats = head.last_generation_stats
    assert stats.accepted_tokens <= 2 and stats.rounds < 25


def test_custom_generate_correction_learns_from_uncorrected_predictions(tmp_path):
    """The recipe's correction compares the calibration's own predictions with the outcomes: drafts promised
    0.9 and accepted half the time end at a factor near 0.5 / 0.9 (fed its corrected predictions, it would settle
    at the square root, about 0.75)."""
    import random

    from peagle.generation import cost as cost_mod

    target = make_target()
    head = make_head(target, confidence_threshold=None)
    head.config.draft_calibration = {"method": "isotonic", "x": [[0.0, 1.0]], "y": [[0.9, 0.9]]}
    head.cost_model = cost_mod.VerifyCostModel.flat(max_tokens=8)
    recipe = _load_recipe(prepare_upload_folder(head, tmp_path / "up"))
    rule, rng = recipe._CostRule(target, head, 4, cost_mod), random.Random(0)
    for _ in range(400):
        assert rule([0.5] * 4) == 4  # a flat curve verifies every draft
        accepted = 0
        while accepted < 4 and rng.random() < 0.5:
            accepted += 1
        rule.observe(accepted)
    assert abs(rule.correction.factor(0) - 0.5 / 0.9) < 0.06, rule.correction.factor(0)
