"""speculators' side of the interop suite; runs in the peers' environment (tests/interop/peer_env.sh).

    python peer_speculators.py load FOLDER RESAVE_DIR
        `SpeculatorModel.from_pretrained(FOLDER)`; compares every tensor of FOLDER's safetensors files with the
        model's (dtype, shape, values); saves the model again to RESAVE_DIR (speculators' own `save_pretrained`).
    python peer_speculators.py make KIND OUT VERIFIER
        a randomly initialised speculators head (KIND `peagle`: `PEagleDraftModel`, or `eagle3`:
        `Eagle3DraftModel`) at the sizes of the verifier folder's Llama config, with a draft vocabulary of 8192
        ids and the verifier's embeddings and lm_head rows, saved with `save_pretrained` to OUT.

Each prints one line `RESULT <json>`.  Imports nothing from peagle.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DRAFT_VOCAB = 8192
MASK_TOKEN = 16  # a reserved id of SmolLM2's tokenizer, the shipped head's mask token
DRAFT_LAYERS = {"peagle": 2, "eagle3": 1}


def file_tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def load(folder: str, resave: str) -> dict:
    import torch
    from speculators import SpeculatorModel

    model = SpeculatorModel.from_pretrained(folder)
    state = model.state_dict()
    stored = file_tensors(Path(folder))
    mismatched = sorted(
        name
        for name, t in stored.items()
        if name not in state
        or state[name].dtype != t.dtype
        or state[name].shape != t.shape
        or not torch.equal(state[name], t)
    )
    model.save_pretrained(resave)
    cfg = model.config
    return {
        "class": type(model).__name__,
        "file_tensors": len(stored),
        "mismatched": mismatched,
        "not_in_file": sorted(n for n in state if n not in stored),
        "speculative_tokens": cfg.speculators_config.proposal_methods[0].speculative_tokens,
        "verifier": cfg.speculators_config.verifier.name_or_path,
        "mask_token_id": getattr(cfg, "mask_token_id", None),
        "aux_layer_ids": list(cfg.eagle_aux_hidden_state_layer_ids or []),
    }


def make(kind: str, out: str, verifier: str) -> dict:
    import torch
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import AutoConfig

    torch.manual_seed(0)
    layer_config = AutoConfig.from_pretrained(verifier)
    target_layers = layer_config.num_hidden_layers
    layer_config.num_hidden_layers = DRAFT_LAYERS[kind]
    layer_config.tie_word_embeddings = False
    vocab = layer_config.vocab_size
    ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(1))[:DRAFT_VOCAB].sort().values
    d2t = ids - torch.arange(DRAFT_VOCAB)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    common = dict(
        transformer_layer_config=layer_config,
        draft_vocab_size=DRAFT_VOCAB,
        norm_before_residual=False,
        eagle_aux_hidden_state_layer_ids=[2, target_layers // 2, target_layers - 3],
        speculators_config=SpeculatorsConfig(
            algorithm=kind,
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig.from_pretrained(verifier),
        ),
    )
    if kind == "peagle":
        model = PEagleDraftModel(PEagleSpeculatorConfig(mask_token_id=MASK_TOKEN, **common))
    else:
        model = Eagle3DraftModel(Eagle3SpeculatorConfig(**common))
    model.load_vocab_mappings(t2d, d2t)
    model.load_verifier_weights()
    nan = sorted(n for n, t in model.state_dict().items() if t.is_floating_point() and t.isnan().any())
    if nan:
        raise RuntimeError(f"speculators left tensors uninitialised (NaN): {nan}")
    model.save_pretrained(out)
    return {"class": type(model).__name__, "file_tensors": len(file_tensors(Path(out)))}


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    result = load(*rest) if command == "load" else make(*rest)
    print("RESULT " + json.dumps(result), flush=True)
