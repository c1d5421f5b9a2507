"""peagle's decoding loop: speculative decoding with a P-EAGLE head for a batch of B >= 1 left-padded prompts.

`target.generate(ids, attention_mask=..., assistant_model=head)` reaches [`peagle_decoding`] through transformers'
`custom_generate` (the hook in `hook.py` passes it), after `generate()` has prepared the generation config, the
logits processors, the stopping criteria and the cache.  Batch 1 and batch N run this same code.

A round: the drafter proposes k drafts per row ([`PEagleCandidateGenerator`]), the target verifies every row's
`[bonus, d_1..d_k]` in one pass, each row keeps its longest agreeing prefix plus one token of the target's own
(greedy), or runs the accept/resample rule (sampling).  Rows keep different numbers of tokens, so the target's
cache gets *holes*: the slots of rejected drafts stay in the cache, masked out of the 2D attention mask, and
each row's position ids count only its real tokens.  The slots no row kept are cropped; when holes pile up, both
caches are compacted (each row's real slots gathered to the right, holes becoming left padding).  Finished rows
leave the batch.  docs/DESIGN.md section 10 draws the cache after a ragged round.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicCache
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import MaxTimeCriteria, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput, _speculative_sampling

from ..modeling_peagle import PEagleDrafter, cache_kwarg
from .candidates import PEagleCandidateGenerator, grouped_processing
from .ragged import batch_refusal, compact, worth_compacting

_MANAGED_KWARGS = {
    "attention_mask", "position_ids", "cache", "use_cache", "logits_to_keep", "return_dict", "output_hidden_states",
    "output_attentions",
}  # fmt: skip
"""What generate() prepares for the loop; the output options come from the generation config."""


# ---------------------------------------------------------------------------------------------- the loop
class _Rows:
    """Per-row bookkeeping of one `generate()` call: the output buffer, each row's length and end, and which rows
    are still in the batch."""

    def __init__(self, input_ids: torch.LongTensor, max_length: int, pad: int):
        batch, prompt = input_ids.shape
        self.tokens = input_ids.new_full((batch, max_length), pad)
        self.tokens[:, :prompt] = input_ids
        self.lengths = [prompt] * batch  # tokens of each row, prompt padding included (what processors see)
        self.active = list(range(batch))  # original index of each row still in the batch

    def history(self, row: int) -> torch.LongTensor:
        return self.tokens[row : row + 1, : self.lengths[row]]

    def append(self, row: int, new: torch.LongTensor) -> None:
        n = new.shape[0]
        self.tokens[row, self.lengths[row] : self.lengths[row] + n] = new
        self.lengths[row] += n


def _accept(
    logits: torch.Tensor,
    scores: torch.Tensor,
    inputs: torch.LongTensor,
    draft_scores: torch.Tensor | None,
    do_sample: bool,
) -> list[torch.LongTensor]:
    """Each row's emitted tokens for one verified round: its longest prefix of drafts the target agrees with
    plus one token of the target's own (greedy), or transformers' accept/resample rule on the processed scores
    (sampling, which keeps the target's distribution)."""
    k = inputs.shape[1] - 1
    out = []
    if not do_sample:
        chosen = scores.argmax(dim=-1)  # (B, k + 1)
        agree = (inputs[:, 1:] == chosen[:, :k]).long().cumprod(dim=1).sum(dim=1)
        return [chosen[b, : int(agree[b]) + 1] for b in range(inputs.shape[0])]
    for b in range(inputs.shape[0]):
        if k == 0:
            token = torch.multinomial(scores[b, 0].softmax(dim=-1), num_samples=1)
            out.append(token)
            continue
        valid, _ = _speculative_sampling(inputs[b : b + 1], draft_scores[b : b + 1], k, scores[b : b + 1])
        out.append(valid[0])
    return out


def _cut(tokens: torch.LongTensor, budget: int, eos: torch.Tensor | None) -> tuple[torch.LongTensor, bool]:
    """A row's emitted tokens cut at `max_length` and after its first EOS; whether the row ended."""
    ended = tokens.shape[0] >= budget
    tokens = tokens[:budget]
    if eos is not None and tokens.numel():
        hits = torch.isin(tokens, eos.to(tokens.device)).nonzero()
        if hits.numel():
            tokens = tokens[: int(hits[0]) + 1]
            ended = True
    return tokens, ended


def _refuse_batch(model: Any, cache: Any, batch: int) -> None:
    reason = batch_refusal(cache) if batch > 1 else None
    if reason is not None:
        raise ValueError(
            f"P-EAGLE drafting for a batch of {batch} prompts cannot run on {type(model).__name__}'s cache: it has "
            f"{reason}. Call generate() once per prompt for this target (batch 1 works)."
        )


@torch.no_grad()
def peagle_decoding(
    model: Any,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: Any,
    synced_gpus: bool = False,
    streamer: Any = None,
    peagle_head: PEagleDrafter | None = None,
    peagle_streamer: Any = None,
    peagle_given: frozenset[str] | None = None,
    **model_kwargs: Any,
) -> GenerateDecoderOnlyOutput | torch.LongTensor:
    """Greedy or sampled decoding of B >= 1 left-padded prompts, drafted by `peagle_head` (transformers'
    `custom_generate` signature; `generate()` calls it).

    Output: what plain `generate()` with the same options returns: the same tokens under greedy decoding (the
    target's own distribution under sampling), rows that end early padded with `pad_token_id`, and a
    `GenerateDecoderOnlyOutput` when `return_dict_in_generate` (scores, logits and hidden states per step;
    a row's entries after its end hold its last values' shape filled with the padding a finished row has:
    -inf scores except at `pad_token_id`).
    """
    from .hook import check_decoding_inputs  # the request checks live together

    head = peagle_head
    streamer = peagle_streamer if peagle_streamer is not None else streamer
    check_decoding_inputs(model, head, input_ids, generation_config, streamer, model_kwargs, _MANAGED_KWARGS)
    if peagle_given is not None:
        generation_config._peagle_given = set(peagle_given)
    batch, prompt_len = input_ids.shape
    device = input_ids.device
    max_length = int(generation_config.max_length)
    pad = generation_config._pad_token_tensor
    pad_id = int(pad) if pad is not None else 0
    eos = generation_config._eos_token_tensor
    do_sample = bool(generation_config.do_sample)
    want_dict = bool(generation_config.return_dict_in_generate)
    want_scores = want_dict and bool(generation_config.output_scores)
    want_logits = want_dict and bool(generation_config.output_logits)
    want_hidden = want_dict and bool(generation_config.output_hidden_states)
    timers = [c for c in stopping_criteria if isinstance(c, MaxTimeCriteria)]

    cache = model_kwargs.get("cache")
    if cache is None:
        cache = DynamicCache(config=model.config)
    _refuse_batch(model, cache, batch)
    if hasattr(cache, "activate_past_recording"):
        cache.activate_past_recording()  # transformers' own assisted decoding does the same before cropping

    attention_mask = model_kwargs.get("attention_mask")
    kv_mask = (
        attention_mask.long()
        if attention_mask is not None
        else torch.ones(batch, prompt_len, dtype=torch.long, device=device)
    )
    has_holes = bool((kv_mask == 0).any())
    positions = kv_mask.cumsum(-1) - 1
    positions.masked_fill_(kv_mask == 0, 1)
    next_pos = kv_mask.sum(dim=1)  # each row's next position: its real tokens so far

    drafter = PEagleCandidateGenerator(model, head, generation_config, logits_processor, batch)
    aux = drafter.aux_layer_ids
    overrides = drafter.model_kwargs_overrides
    rows = _Rows(input_ids, max_length, pad_id)
    steps: dict[str, list[list[torch.Tensor]]] = {"scores": [], "logits": [], "hidden": []}
    per_row: dict[str, list[list[Any]]] = {name: [[] for _ in range(batch)] for name in steps}
    if streamer is not None:
        streamer.put(input_ids.cpu())

    def forward(ids: torch.LongTensor, pos: torch.LongTensor, mask: torch.Tensor | None) -> Any:
        return model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            use_cache=True,
            logits_to_keep=ids.shape[1],
            **cache_kwarg(cache),
            **overrides,
        )

    def features(out: Any) -> torch.Tensor:
        states = out.hidden_states
        if (
            states is None
            or len(states) != drafter.num_target_layers + 1
            or any(states[i] is None for i in aux)
        ):
            got = "none" if states is None else f"{len(states)} entries"
            raise RuntimeError(
                f"the target's forward returned hidden states ({got}) without layers {aux} in a tuple of "
                f"{drafter.num_target_layers + 1} (embeddings + one per layer); its `output_hidden_states` "
                "handling differs from what peagle expects."
            )
        return torch.cat([states[i] for i in aux], dim=-1)

    # ---- prefill: a plain step for every row
    drafter.get_candidates([], 0, is_first_iteration=True)
    out = model(
        input_ids=input_ids,
        attention_mask=kv_mask if has_holes else None,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
        **cache_kwarg(cache),
        **overrides,
    )
    _refuse_batch(model, cache, batch)  # layers a cache creates lazily exist now
    feats = features(out)
    raw = out.logits[:, -1:].float()
    scores = logits_processor(input_ids, raw[:, 0].clone())[:, None]
    if do_sample:
        first = torch.multinomial(scores[:, 0].softmax(dim=-1), num_samples=1)
    else:
        first = scores[:, 0].argmax(dim=-1, keepdim=True)
    emitted = [first[b] for b in range(batch)]
    round_inputs_start = [0] * batch
    prefill = True

    while True:
        # ---- bookkeeping of the round just verified (or the prefill)
        ended = []
        kept = []
        for j, b in enumerate(rows.active):
            tokens, done = _cut(emitted[j], max_length - rows.lengths[b], eos)
            emitted[j] = tokens
            kept.append(tokens.shape[0])
            if want_scores:
                per_row["scores"][b].extend(scores[j, : kept[j]])
            if want_logits:
                per_row["logits"][b].extend(raw[j, : kept[j]])
            if want_hidden:
                per_row["hidden"][b].append((out.hidden_states, j, kept[j], len(per_row["hidden"][b]) == 0))
            rows.append(b, tokens)
            if done:
                ended.append(j)
        if streamer is not None:
            streamer.put(emitted[0].cpu())
        drafter.update_candidate_strategy([n - 1 for n in kept])
        # new real slots for the drafter: each kept verify input pairs its feature with the token after it
        for j, b in enumerate(rows.active):
            if j in ended:
                continue
            if prefill:  # every real prompt position, each paired with the real token after it
                cols = kv_mask[j].nonzero()[:, 0]
                nxt = torch.cat([input_ids[b, cols[1:]], emitted[j][:1]])
                drafter.add_real_slots(j, nxt, feats[j, cols], 0)
            else:
                drafter.add_real_slots(j, emitted[j], feats[j, : kept[j]], round_inputs_start[j])
        prefill = False
        if timers and any(bool(t(rows.tokens, None).any()) for t in timers):
            ended = list(range(len(rows.active)))
        if ended:
            keep = [j for j in range(len(rows.active)) if j not in ended]
            if not keep:
                break
            index = torch.tensor(keep, device=device)
            cache.batch_select_indices(index)
            kv_mask, next_pos = kv_mask[index], next_pos[index]
            drafter.select_rows(torch.tensor(keep))
            emitted = [emitted[j] for j in keep]
            rows.active = [rows.active[j] for j in keep]
        if worth_compacting(kv_mask) and batch_refusal(cache) is None:
            kv_mask = compact(cache, kv_mask)
        has_holes = bool((kv_mask == 0).any())

        # ---- the next round: drafts, then one verify pass over every row
        budget = max(max_length - rows.lengths[b] for b in rows.active) - 1
        drafts, draft_scores = drafter.get_candidates(
            [rows.history(b) for b in rows.active], budget, rows=rows.active
        )
        last = torch.stack([e[-1] for e in emitted])[:, None].to(device)
        inputs = torch.cat([last, drafts.to(device)], dim=1)
        width = inputs.shape[1]
        pos = next_pos[:, None] + torch.arange(width, device=device)
        mask = torch.cat([kv_mask, kv_mask.new_ones(kv_mask.shape[0], width)], dim=1) if has_holes else None
        out = forward(inputs, pos, mask)
        feats = features(out)
        raw = out.logits[:, -width:].float()
        scores = raw.clone()
        if len(logits_processor) > 0:
            for i in range(width):
                hist = [
                    torch.cat([rows.history(b), inputs[j : j + 1, 1 : 1 + i].to(rows.tokens.device)], dim=1)
                    for j, b in enumerate(rows.active)
                ]
                scores[:, i] = grouped_processing(logits_processor, hist, raw[:, i], rows.active, batch)
        emitted = _accept(
            raw, scores, inputs, draft_scores.to(device) if draft_scores is not None else None, do_sample
        )
        # keep each row's verified inputs (bonus + accepted drafts); crop the slots no row kept
        budgets = [max_length - rows.lengths[b] for b in rows.active]
        lengths = [min(e.shape[0], n) for e, n in zip(emitted, budgets, strict=True)]
        longest = max(lengths)
        cache.crop(-(width - longest))
        new_mask = (
            torch.arange(longest, device=device)[None] < torch.tensor(lengths, device=device)[:, None]
        ).long()
        kv_mask = torch.cat([kv_mask, new_mask], dim=1)
        round_inputs_start = next_pos.tolist()
        next_pos = next_pos + torch.tensor(lengths, device=device)
        if any(n < longest for n in lengths):
            has_holes = True

    if streamer is not None:
        streamer.end()
    sequences = rows.tokens[:, : max(rows.lengths)]
    if not want_dict:
        return sequences
    return GenerateDecoderOnlyOutput(
        sequences=sequences,
        scores=_per_step(per_row["scores"], batch, pad_id, fill=float("-inf")) if want_scores else None,
        logits=_per_step(per_row["logits"], batch, pad_id, fill=float("-inf")) if want_logits else None,
        hidden_states=_hidden_per_step(per_row["hidden"], batch) if want_hidden else None,
        past_key_values=cache if batch == 1 else None,
    )


def _per_step(
    rows: list[list[torch.Tensor]], batch: int, pad_id: int, fill: float
) -> tuple[torch.Tensor, ...]:
    """Per-row lists of `(V,)` tensors -> one `(B, V)` tensor per step; a row past its end reads `fill`
    everywhere but 0 at `pad_token_id`."""
    steps = max(len(r) for r in rows)
    ref = next(t for r in rows for t in r)
    out = []
    for s in range(steps):
        column = []
        for r in rows:
            if s < len(r):
                column.append(r[s])
            else:
                ended = torch.full_like(ref, fill)
                ended[pad_id] = 0.0
                column.append(ended)
        out.append(torch.stack(column))
    return tuple(out)


def _hidden_per_step(rows: list[list[Any]], batch: int) -> tuple[tuple[torch.Tensor, ...], ...]:
    """Hidden states per emitted step, as plain `generate()` returns them: the prefill's states over the prompt,
    then one `(B, 1, H)` per layer per new token (zeros for rows past their end)."""
    per_row_steps: list[list[tuple[torch.Tensor, ...]]] = []
    for entries in rows:
        steps = []
        for states, j, kept, first in entries:
            if first:
                steps.append(tuple(s[j : j + 1] for s in states))
                rest = range(1, kept)
            else:
                rest = range(kept)
            for i in rest:
                steps.append(tuple(s[j : j + 1, i : i + 1] for s in states))
        per_row_steps.append(steps)
    count = max(len(s) for s in per_row_steps)
    out = []
    for step in range(count):
        layers = []
        ref = next(s[step] for s in per_row_steps if len(s) > step)
        for layer in range(len(ref)):
            parts = [s[step][layer] if len(s) > step else torch.zeros_like(ref[layer]) for s in per_row_steps]
            layers.append(torch.cat(parts, dim=0))
        out.append(tuple(layers))
    return tuple(out)


__all__ = ["peagle_decoding"]
