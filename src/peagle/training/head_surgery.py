"""Head surgery: changing a trained head's shape without losing what it learned, and starting a new head's
weights from the target's.

[`resize_draft_vocab`] / [`grow_draft_vocab`] give a head another draft vocabulary (kept ids keep their rows, new
rows start from the target's mapped through a least-squares fit); [`grow_layers`] appends decoder layers that add
nothing until trained; [`init_lm_head_from_target`] and [`init_layers_from_target`] start a new head's LM head and
layers from the target.  The recipe (`recipe.train_head`) calls them; each is usable alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ..modeling_peagle import PEagleDrafter

logger = logging.getLogger(__name__)


def eos_ids(target) -> list[int]:
    """The target's end-of-sequence ids (a draft vocabulary always keeps them)."""
    eos = target.config.get_text_config().eos_token_id
    return [int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None]


def grow_draft_vocab(
    head: PEagleDrafter, target, examples: Sequence[dict[str, Any]], draft_vocab_size: int
) -> PEagleDrafter:
    """[`resize_draft_vocab`] to `draft_vocab_size` ids chosen from `examples`: a larger vocabulary keeps every id
    the head has and adds the examples' most frequent response tokens it lacks; a smaller one is the examples' most
    frequent (plus EOS), as a new head's would be.  Logs the share of the examples' response tokens each covers.

    A head continued on data unlike the data its vocabulary was chosen from can miss many of the tokens its target
    writes: the shipped SmolLM2 head's 8,192 ids, chosen from its first 549k response tokens, cover 93.7% of its
    held-out greedy continuations, and the most frequent 16,384 of its 10M training tokens 99.4%
    (docs/training.md, section 3).
    """

    from ..data.vocab import select_draft_vocab, token_counts

    vocab_size = head.config.vocab_size
    own = head.draft_vocab_ids.cpu()
    extra = eos_ids(target) + (own.tolist() if draft_vocab_size >= own.numel() else [])
    ids = select_draft_vocab(examples, draft_vocab_size, vocab_size, extra)
    counts = token_counts(examples, vocab_size)[0]
    total = max(int(counts.sum()), 1)
    logger.info(
        "draft vocabulary: %d -> %d ids, covering %.1f%% -> %.1f%% of the examples' response tokens",
        own.numel(),
        ids.numel(),
        100 * int(counts[own].sum()) / total,
        100 * int(counts[ids].sum()) / total,
    )
    return resize_draft_vocab(head, target, ids)


def init_layers_from_target(head: PEagleDrafter, target) -> None:
    """Start the drafter's n decoder layers as the target's last n layers (drafter layer i from target layer
    `L - n + i`), copying every weight whose name and shape match.

    Layer 0 is the fused layer: its q/k/v projections read `[input_layernorm(embeds), hidden_norm(h)]`, so the
    target's projection goes into the columns that read the hidden state (the embedding columns keep their
    initialisation), and `hidden_norm` takes the target layer's `input_layernorm`.  Attention output, MLP and
    post-attention norm copy as they are.  Layers 1.. are plain Llama layers and copy whole.

    Raises:
        ValueError: the target has fewer layers than the head, or a layer shares no weight of the head's Llama
            layout (another layer family, or other widths).
    """
    import torch

    decoder = target.get_decoder() if hasattr(target, "get_decoder") else target.model
    source = list(getattr(decoder, "layers", []))
    n = len(head.layers)
    if len(source) < n:
        raise ValueError(f"the target has {len(source)} decoder layers; the head needs {n} to start from.")
    hidden = head.config.hidden_size
    with torch.no_grad():
        for i, (mine, theirs) in enumerate(zip(head.layers, source[len(source) - n :])):
            params = dict(mine.named_parameters())
            copied = 0
            for name, weight in theirs.state_dict().items():
                if i == 0 and name == "input_layernorm.weight":
                    name = "hidden_norm.weight"
                ours = params.get(name)
                if ours is None:
                    continue
                weight = weight.to(ours.device, ours.dtype)
                fused = i == 0 and name.split(".")[-2] in ("q_proj", "k_proj", "v_proj") and ours.dim() == 2
                if fused and tuple(weight.shape) == (ours.shape[0], hidden) and ours.shape[1] == 2 * hidden:
                    ours[:, hidden:].copy_(weight)
                    copied += 1
                elif tuple(weight.shape) == tuple(ours.shape):
                    ours.copy_(weight)
                    copied += 1
            if not copied:
                raise ValueError(
                    f"target layer {len(source) - n + i} shares no weight with drafter layer {i} (names and "
                    f"shapes of a Llama layer of hidden size {hidden}); use layers_init='random'."
                )


def init_lm_head_from_target(head: PEagleDrafter, target) -> None:
    """Start the head's LM head as the target's output-embedding rows of the draft vocabulary (`i + d2t[i]`),
    rescaled to the standard deviation of a fresh layer (`config.initializer_range`).

    The rows give the head the target's geometry of the output space; the rescaling keeps its first predictions
    soft.  Measured on SmolLM2-135M (2 layers, draft vocabulary 8,192, 12 steps of 4 examples, the same data and
    seed): KL loss 8.00 -> 5.74 with rescaled rows, 7.89 -> 6.68 from a random LM head, and 13.4 -> 7.17 with the
    rows at the target's own scale (confident random logits at first; docs/families.md).
    """
    import torch

    weight = target.get_output_embeddings().weight
    if tuple(weight.shape) != (head.config.vocab_size, head.config.hidden_size):
        raise ValueError(
            f"the target's output embeddings have shape {tuple(weight.shape)}; the head's LM head takes rows of "
            f"({head.config.vocab_size}, {head.config.hidden_size})."
        )
    ids = head.draft_vocab_ids
    with torch.no_grad():
        rows = weight.detach()[ids.to(weight.device)].float()
        rows = rows * (head.config.initializer_range / rows.std().clamp_min(1e-12))
        head.lm_head.weight.copy_(rows.to(head.lm_head.weight.device, head.lm_head.weight.dtype))


def _require_plain_head(head, caller: str) -> None:
    from ..modeling_peagle import PEagleDrafter

    if not isinstance(head, PEagleDrafter):
        raise TypeError(
            f"{caller} takes a PEagleDrafter (a LoRA-wrapped head merges first), got {type(head).__name__}."
        )


def _rebuilt_head(
    head: PEagleDrafter, fresh: Callable[[str], bool], *, skip=(), **config_changes
) -> PEagleDrafter:
    """A new head of `head`'s config with `config_changes`, on its device and dtype, holding every weight of `head`
    but those named in `skip`.  Only the weights `fresh(name)` accepts (and the target's shared embeddings) may
    stay unloaded; any other mismatch is a ValueError."""
    from ..modeling_peagle import PEagleDrafter

    config = head.config.__class__.from_dict({**head.config.to_dict(), **config_changes})
    new = PEagleDrafter(config).to(head.lm_head.weight.device, head.lm_head.weight.dtype)
    state = {k: v for k, v in head.state_dict().items() if k not in skip}
    missing, unexpected = new.load_state_dict(state, strict=False)
    if unexpected or any(not fresh(k) and k != "embed_tokens.weight" for k in missing):
        raise ValueError(
            f"the head's weights do not fit its own config: missing {missing}, unexpected {unexpected}."
        )
    return new


def resize_draft_vocab(head: PEagleDrafter, target, draft_ids: torch.Tensor) -> PEagleDrafter:
    """A copy of a trained `head` whose draft vocabulary is `draft_ids` (target ids, any size).

    Everything but the LM head is copied as it is.  Ids the head already had keep their trained LM-head rows; the
    others start from the target's output-embedding rows mapped through the least-squares linear fit of the
    trained rows on the target's rows of the kept ids, which gives them the trained rows' scale and as much of
    their geometry as the fit explains (when fewer ids are kept than twice the hidden size, the fit is a single
    scale).  Train the result before using it: untrained, the new rows do not win drafts (docs/training.md,
    section 3).  [`grow_draft_vocab`] chooses the ids from training examples.
    """
    import torch

    _require_plain_head(head, "resize_draft_vocab")
    ids = torch.as_tensor(draft_ids, dtype=torch.long).flatten().unique()  # sorted, as set_draft_vocab wants
    lm = ("lm_head.weight", "d2t", "t2d")
    new = _rebuilt_head(head, lambda name: name in lm, skip=lm, draft_vocab_size=int(ids.numel()))
    config = new.config
    new.set_draft_vocab(ids)
    old_ids = head.draft_vocab_ids
    with torch.no_grad():
        trained = head.lm_head.weight.detach().float().cpu()
        rows_of = target.get_output_embeddings().weight.detach().float().cpu()
        where = torch.full((config.vocab_size,), -1, dtype=torch.long)
        where[old_ids.cpu()] = torch.arange(old_ids.numel())
        old_row = where[ids]
        kept = old_row >= 0
        x, y = rows_of[ids[kept]], trained[old_row[kept]]
        if int(kept.sum()) >= 2 * config.hidden_size:
            rows = rows_of[ids] @ torch.linalg.lstsq(x, y, driver="gelsd").solution
        else:  # too few kept rows for a linear map: one scale (or a fresh layer's when none is kept)
            scale = float((x * y).sum() / (x * x).sum().clamp_min(1e-12)) if bool(kept.any()) else None
            src = rows_of[ids]
            rows = src * scale if scale else src * (config.initializer_range / src.std().clamp_min(1e-12))
        rows[kept] = y
        new.lm_head.weight.copy_(rows.to(new.lm_head.weight.device, new.lm_head.weight.dtype))
    new.train(head.training)
    return new


def grow_layers(head: PEagleDrafter, num_hidden_layers: int) -> PEagleDrafter:
    """A copy of a trained `head` with `num_hidden_layers` decoder layers: new layers appended after its last.

    Every weight the head has is copied.  Each new layer starts as a copy of the head's last plain layer (a fresh
    one when the head has only its fused first layer) with the two projections that write into the residual stream,
    `self_attn.o_proj` and `mlp.down_proj`, set to zero, so it adds nothing: the grown head drafts exactly as the
    head did, and training opens the new layers from there (block expansion, as LLaMA Pro grows a trained model).
    The gradient reaches the zeroed projections first and the rest of the layer once they move.

    Raises:
        TypeError: `head` is not a plain `PEagleDrafter` (merge a LoRA-wrapped head first).
        ValueError: `num_hidden_layers` is not larger than the head's.
    """
    import torch

    _require_plain_head(head, "grow_layers")
    have = head.config.num_hidden_layers
    if num_hidden_layers <= have:
        raise ValueError(
            f"grow_layers adds layers: the head has {have}, asked for {num_hidden_layers} (a head does not shrink)."
        )
    added = tuple(f"layers.{i}." for i in range(have, num_hidden_layers))
    new = _rebuilt_head(head, lambda name: name.startswith(added), num_hidden_layers=num_hidden_layers)
    with torch.no_grad():
        for layer in new.layers[have:]:
            if have > 1:  # the fused first layer has another shape; a head of one layer grows fresh layers
                layer.load_state_dict(head.layers[have - 1].state_dict())
            for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                proj.weight.zero_()
                if proj.bias is not None:
                    proj.bias.zero_()
    new.train(head.training)
    return new


__all__ = [
    "eos_ids",
    "grow_draft_vocab",
    "grow_layers",
    "init_layers_from_target",
    "init_lm_head_from_target",
    "resize_draft_vocab",
]
