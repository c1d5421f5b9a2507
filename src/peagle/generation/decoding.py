"""peagle's decoding loop: speculative decoding with a P-EAGLE head for a batch of B >= 1 left-padded prompts.

`target.generate(ids, attention_mask=..., assistant_model=head)` reaches [`peagle_decoding`] through transformers'
`custom_generate` (the hook in `hook.py` passes it), after `generate()` has prepared the generation config, the
logits processors, the stopping criteria and the cache.  Batch 1 and batch N run this same code.

A round: the drafter proposes k drafts per row ([`DraftingSession`]), the target verifies every row's
`[bonus, d_1..d_k]` in one pass, each row keeps its longest agreeing prefix plus one token of the target's own
(greedy), or runs the accept/resample rule (sampling).  Rows keep different numbers of tokens, so the target's
cache gets *holes*: the slots of rejected drafts stay in the cache, masked out of the 2D attention mask, and
each row's position ids count only its real tokens.  The slots no row kept are cropped; when holes pile up, both
caches are compacted (each row's real slots gathered to the right, holes becoming left padding).  Finished rows
leave the batch; a static cache, whose batch is fixed, keeps them as frozen rows instead (docs/DESIGN.md section
10.2).  docs/DESIGN.md section 10 draws the cache after a ragged round.

A round may verify a draft *tree* instead of a chain (docs/DESIGN.md section 11); a chain is the tree with one
path, so one verify step ([`_Decoder.verify`]) serves both: the nodes are laid out flat after the bonus token at
their depths' positions, each row keeps its accepted path, and only that path stays in the target's cache.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicCache
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import MaxTimeCriteria, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..drafting_peagle import cache_kwarg, custom_attention_mask
from . import ragged
from .attention import packed_attention
from .checks import check_continuation, check_decoding_inputs
from .drafting import DraftingSession
from .outputs import gather_slots, hidden_entries_upto, hidden_per_step, per_step, wanted_outputs
from .processing import grouped_processing
from .ragged import KeptWindows, batch_refusal, compact, keep_tail, tree_refusal, worth_compacting
from .resume import CATCH_UP_SLOTS, leave_state, prefix_view, take_state
from .rows import Rows, cut_at_end
from .sampling import KeyedSampler
from .settings import DraftingOptions, PEagleCall
from .stats import PEagleGenerationStats
from .stopping import LockstepStops, replayed_criteria
from .tree import DraftCandidates, greedy_path
from .vocab_ops import vocab_argmax
from .windows import FULL, SLIDING, causal_block, kept_masks, positional_windows

_MANAGED_KWARGS = {
    "attention_mask", "position_ids", "cache", "use_cache", "logits_to_keep", "return_dict", "output_hidden_states",
    "output_attentions",
}  # fmt: skip
"""What generate() prepares for the loop; the output options come from the generation config."""


@dataclass
class PEagleGenerateOutput(GenerateDecoderOnlyOutput):
    """What `generate(..., assistant_model=head, return_dict_in_generate=True)` returns: transformers'
    `GenerateDecoderOnlyOutput` plus `peagle_stats`, the call's own [`PEagleGenerationStats`] (the same object
    `head.last_generation_stats` gives the calling thread)."""

    peagle_stats: PEagleGenerationStats | None = None


# ---------------------------------------------------------------------------------------------- the loop
class _PathOutput:
    """A verify pass's hidden states at each row's accepted path (what `record` reads of the target's output)."""

    def __init__(self, hidden_states: tuple[torch.Tensor, ...] | None):
        self.hidden_states = hidden_states


def _refuse_batch(model: Any, cache: Any, batch: int) -> None:
    reason = batch_refusal(cache) if batch > 1 else None
    if reason is not None:
        raise ValueError(
            f"P-EAGLE drafting for a batch of {batch} prompts cannot run on {type(model).__name__}'s cache: it has "
            f"{reason}. Call generate() once per prompt for this target (batch 1 works)."
        )


class _Decoder:
    """One `generate()` call's state: the target's cache with its validity mask and each row's next position,
    the drafting side, the output buffer and what the call asked to return.  [`peagle_decoding`] runs it.

    The loop times its own passes with `clock`: each target pass here and the drafter's round on the drafting side,
    and hands those seconds to the drafting policy after every round (docs/DESIGN.md section 7)."""

    clock = staticmethod(time.perf_counter)

    def __init__(
        self,
        model,
        head,
        input_ids,
        logits_processor,
        stopping_criteria,
        generation_config,
        streamer,
        model_kwargs,
        options: DraftingOptions | None = None,
    ):
        options = options or DraftingOptions()
        self.model, self.input_ids, self.processors = model, input_ids, logits_processor
        self.streamer = streamer
        (self.batch, prompt_len), self.device = input_ids.shape, input_ids.device
        self.max_length = int(generation_config.max_length)
        pad = generation_config._pad_token_tensor
        self.pad_id = int(pad) if pad is not None else 0
        self.eos = generation_config._eos_token_tensor
        self.eos_ids = set(self.eos.reshape(-1).tolist()) if self.eos is not None else set()
        self.do_sample = bool(generation_config.do_sample)
        self.want_dict = bool(generation_config.return_dict_in_generate)
        self.want = wanted_outputs(generation_config)
        self.timers = [c for c in stopping_criteria if isinstance(c, MaxTimeCriteria)]
        replayed = replayed_criteria(stopping_criteria)
        pads = any(hasattr(c, "eos_token_id") for c in stopping_criteria)  # as plain decoding decides it
        self.stops = LockstepStops(replayed, self.batch, prompt_len, pads) if replayed else None
        cache = model_kwargs.get("cache")
        self.cached = cache.get_seq_length() if cache is not None else 0  # tokens an earlier call left there
        if self.cached:
            check_continuation(model, cache, self.cached, input_ids)
        self.cache = cache if cache is not None else DynamicCache(config=model.config)
        # sliding layers: the window by position, each keeping its window's slots (DESIGN 10.1)
        self.windows = positional_windows(model, self.cache, trim=True)
        self.kept: KeptWindows | None = None  # the sliding layers' own slots, from the prefill on
        self.slots = ragged.static_slots(self.cache)  # a static cache's slots (DESIGN 10.2)
        _refuse_batch(model, self.cache, self.batch)
        if hasattr(self.cache, "activate_past_recording"):
            self.cache.activate_past_recording()  # transformers' own assisted decoding does the same
        mask = model_kwargs.get("attention_mask")
        ones = torch.ones(self.batch, prompt_len, dtype=torch.long, device=self.device)
        self.kv_mask = mask.long() if mask is not None else ones  # 0: left padding or a hole
        self.next_pos = self.kv_mask.sum(dim=1)  # each row's next position: its real tokens so far
        self.mask_host = self.kv_mask.tolist()  # the prompt's mask on the host (read once, for the prefill)
        self.pos_host = [sum(row) for row in self.mask_host]  # next_pos on the host (no read per round)
        # whether the cache has left padding or holes (host-side, so that rounds need not read the mask), and
        # whether they changed since compaction was last considered
        self.gaps = any(0 in row for row in self.mask_host)
        self.gaps_changed = self.gaps
        # sampling draws keyed by (row, position): the seed fixes the tokens whatever the rule chooses
        self.sampler = KeyedSampler.from_global_generator(self.device) if self.do_sample else None
        self.drafter = DraftingSession(
            model,
            head,
            generation_config,
            logits_processor,
            self.batch,
            options,
            sampler=self.sampler,
            resume=take_state(self.cache, head, input_ids) if self.cached else None,
            clock=self.clock,
        )
        self._target_seconds = 0.0  # the last target pass's measured seconds
        self.drafter.stats.cached_tokens = self.cached
        tree_size = options.draft_tree_size
        self.trees_asked = (isinstance(tree_size, int) and tree_size > 0) or bool(
            options.prompt_lookup_num_tokens
        )
        self._check_trees()
        self.rows = Rows(input_ids, self.max_length, self.pad_id)
        self.per_row: dict[str, list[list[Any]]] = {
            name: [[] for _ in range(self.batch)] for name in self.want
        }
        self._streamed = prompt_len  # row 0's tokens handed to the streamer
        self._stop_scores: list[torch.Tensor] = []  # the `scores` replayed criteria were passed, per step
        if streamer is not None:
            streamer.put(input_ids.cpu())

    def _check_trees(self) -> None:
        """Draft trees need a custom attention mask and a cache that keeps only the accepted path: refuse them by
        name when asked for, else fall back to chains."""
        if not self.drafter.tree_nodes:
            return
        reason = tree_refusal(self.model, self.cache)
        if reason is None:
            return
        if self.trees_asked:
            raise ValueError(
                f"draft trees cannot be verified on {type(self.model).__name__}: it has {reason}. Use "
                'draft_tree_size=0 (chains) or "auto" (chains where trees cannot run), without '
                "prompt_lookup_num_tokens."
            )
        self.drafter.disable_trees()

    # ------------------------------------------------------------------ target passes
    def _forward(
        self,
        ids: torch.LongTensor,
        pos: torch.LongTensor,
        mask: torch.Tensor | None,
        keep: int,
        cache: Any = None,
    ):
        tic = self.clock()
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            use_cache=True,
            logits_to_keep=keep,
            **cache_kwarg(self.cache if cache is None else cache),
            **self.drafter.model_kwargs_overrides,
        )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._target_seconds = self.clock() - tic
        aux, layers = list(self.drafter.settings.aux_layer_ids), self.drafter.settings.num_target_layers
        states = out.hidden_states
        if states is None or len(states) != layers + 1 or any(states[i] is None for i in aux):
            got = "none" if states is None else f"{len(states)} entries"
            raise RuntimeError(
                f"the target's forward returned hidden states ({got}) without layers {aux} in a tuple of "
                f"{layers + 1} (embeddings + one per layer); its `output_hidden_states` handling differs from "
                "what peagle expects."
            )
        return out, torch.cat([states[i] for i in aux], dim=-1)

    def prefill(self) -> list[torch.LongTensor]:
        """The prompt through the target (after what a filled cache holds), a plain step for every row; the
        drafter gets every real prompt slot it does not hold yet."""
        self.drafter.prefill_next()
        positions = (self.kv_mask.cumsum(-1) - 1).masked_fill_(self.kv_mask == 0, 1)
        padded = self.gaps
        mask = self.kv_mask if padded else None
        first = self.cached  # the first slot the target has not read
        if first and not self.drafter.resumed:
            self._catch_up(positions, mask)
        out, feats = self._forward(self.input_ids[:, first:], positions[:, first:], mask, 1)
        if self.windows is not None:
            self.kept = KeptWindows(self.cache, self.kv_mask)
        _refuse_batch(self.model, self.cache, self.batch)  # layers a cache creates lazily exist now
        self._check_trees()
        raw = out.logits[:, -1:].float()
        scores = self.processors(self.input_ids, raw[:, 0].clone())[:, None]
        if self.sampler is not None:
            token = self.sampler.sample(scores[:, 0], self.rows.active, [self.rows.lengths[0]] * self.batch)[
                :, None
            ]
        else:
            token = vocab_argmax(scores[:, 0])[:, None]
        emitted = self.record(
            [token[b] for b in range(self.batch)], raw, scores, out, host=[[t] for t in token[:, 0].tolist()]
        )
        for j, b in enumerate(self.rows.active):  # every real prompt position with the real token after it
            if emitted[j].numel() == 0:
                continue
            real = self.mask_host[j]
            cols = [c for c in range(first, len(real)) if real[c]]
            index = torch.tensor(cols, device=self.device)
            nxt = torch.cat([self.input_ids[b, index[1:]], emitted[j][:1]])
            self.drafter.add_real_slots(j, nxt, feats[j, index - first], sum(real[: cols[0]]))
        return emitted

    def _catch_up(self, positions: torch.LongTensor, mask: torch.Tensor | None) -> None:
        """A cache arrived without the head's state: the target re-reads the cache's last W tokens on a view of
        the slots before them (the cache itself stays as it is), and the drafter gets their features as real
        slots (docs/DESIGN.md section 12.2).  Nothing happens where no view can be made: the head then drafts from
        the new tokens alone (the output is the same, the first rounds accept less)."""
        first = self.cached
        span = min(first, self.drafter.settings.window or CATCH_UP_SLOTS)
        view = prefix_view(self.cache, first - span) if self.windows is None else None
        if view is None:
            return
        tic = self.clock()
        lo = first - span
        _, feats = self._forward(
            self.input_ids[:, lo:first],
            positions[:, lo:first],
            None if mask is None else mask[:, :first],
            1,
            view,
        )
        cols = self.kv_mask[0, lo:first].nonzero()[:, 0] + lo
        if cols.numel():
            nxt = self.input_ids[0, cols + 1]
            self.drafter.add_real_slots(0, nxt, feats[0, cols - lo], int(positions[0, cols[0]]))
        stats = self.drafter.stats
        stats.catch_up_tokens += span
        stats.catch_up_seconds += self.clock() - tic

    def round(self, emitted: list[torch.LongTensor]) -> list[torch.LongTensor]:
        """Drafts for every row, then [`verify`]: one target pass over all rows and each row's accepted
        tokens."""
        rows = self.rows
        budget = max(self.max_length - rows.lengths[b] for b in rows.active if b not in rows.idle) - 1
        room = None
        if self.slots is not None:  # the pass must fit the static cache's slots (DESIGN 10.2)
            s = self.drafter.settings
            most = max([s.num_speculative_tokens, s.tree_nodes, *s.verify_widths]) + 1
            self.kv_mask, room = ragged.static_room(self.cache, self.kv_mask, self.slots, most)
            budget = min(budget, room - 1)
        candidates = self.drafter.propose(
            [rows.history(b) for b in rows.active],
            budget,
            rows=rows.active,
            host_histories=[rows.host[b] for b in rows.active],
            max_nodes=None if room is None else room - 1,
        )
        return self.verify(emitted, self.drafter.fixed_width(candidates, room))

    def verify(self, emitted: list[torch.LongTensor], candidates: DraftCandidates) -> list[torch.LongTensor]:
        """Verify every row's candidates in one target pass: the nodes laid out flat after the row's bonus token,
        each at its depth's position, seeing the row's valid past and its own ancestors (a chain: plain causal
        attention).  Each row keeps its accepted path ([`_accept`]); the target's cache keeps only that path,
        whose features go to the drafter as its next real slots."""
        rows, device = self.rows, self.device
        width = len(candidates) + 1
        last = torch.stack([e[-1] for e in emitted])[:, None].to(device)
        inputs = torch.cat([last, candidates.tokens.to(device)], dim=1)
        depths = torch.cat([torch.zeros_like(last), candidates.depths.to(device)], dim=1)
        positions = self.next_pos[:, None] + depths
        if self.windows is None and candidates.parents is None:
            # a chain: whether the cache has padding or holes is known on the host
            mask = ragged.span_slots(candidates.attention_mask(self.kv_mask, self.gaps), self.slots)
        else:
            mask = self._verify_mask(candidates, positions)
        out, feats = self._forward(inputs, positions, mask, width)
        raw = out.logits[:, -width:].float()
        scores = raw.clone() if len(self.processors) > 0 else raw  # (B, width, V): no copy unless processed
        if len(self.processors) > 0:  # each slot sees the row's history plus the drafts on its own path
            for i in range(width):
                hist = [
                    torch.cat(
                        [rows.history(b), inputs[j, candidates.path_to(j, i)][None].to(rows.tokens.device)],
                        dim=1,
                    )
                    for j, b in enumerate(rows.active)
                ]
                scores[:, i] = grouped_processing(self.processors, hist, raw[:, i], rows.active, self.batch)
        paths, accepted, host, together = self._accept(inputs, scores, candidates)
        # each row keeps its path (bonus + accepted nodes, within max_length); the rest are dropped or holes; a
        # frozen row (an ended row that stays in a static cache) keeps nothing
        frozen = [self.slots is not None and b in rows.idle for b in rows.active]
        lengths = [
            0 if f else min(len(p), self.max_length - rows.lengths[b])
            for p, b, f in zip(paths, rows.active, frozen)
        ]
        starts = self._keep_paths(paths, lengths, width)
        if width == 1:  # a plain step: every row's path is its one slot
            gather = lambda x: x  # noqa: E731
        else:
            slots = torch.tensor([(p + [0] * width)[:width] for p in paths], device=device)
            gather = lambda x: gather_slots(x, slots)  # noqa: E731
        hidden = None
        if self.want["hidden"]:
            hidden = tuple(gather(h[:, -width:]) for h in out.hidden_states)
        # the path's logits and scores only where the call returns them ((B, width, V) each: a tree's are large)
        kept_raw = gather(raw) if self.want["logits"] else None
        kept_scores = gather(scores) if self.want["scores"] else None
        emitted = self.record(accepted, kept_raw, kept_scores, _PathOutput(hidden), paths, host)
        path_feats = gather(feats)
        n = lengths[0]
        shared = together is not None and n > 0 and lengths.count(n) == len(lengths) and not any(frozen)
        if shared:  # every row kept n slots: one chunk for the drafter
            self.drafter.add_shared_slots(together[:, :n], path_feats[:, :n], starts)
        for j in range(len(rows.active)):  # each kept verify input's feature with the token after it
            ended = frozen[j] or rows.ended(rows.active[j])
            if shared and not ended:
                continue
            verified = accepted[j][: lengths[j]]
            if frozen[j]:  # it feeds the same token at the same position every pass
                emitted[j] = inputs[j, :1]
            elif ended:  # an idle row continues from what its cache holds
                emitted[j] = verified
            if not shared:
                self.drafter.add_real_slots(j, verified, path_feats[j, : verified.shape[0]], starts[j])
        return emitted

    def _verify_mask(
        self, candidates: DraftCandidates, positions: torch.LongTensor
    ) -> torch.Tensor | dict[str, torch.Tensor] | None:
        """The verify pass's attention mask in the form the target's attention takes it: a chain's 2D mask, a
        tree's 4D one; on sliding-window layers, 4D masks with each layer kind's window applied by position."""
        if self.windows is not None:
            self.kept.trim(self.cache, self.next_pos)  # sliding layers drop what no later query sees

            def allowed(valid: torch.Tensor) -> torch.BoolTensor:
                tree = candidates.attention_mask(valid)
                return (
                    tree if tree is not None and tree.dim() == 4 else causal_block(valid, len(candidates) + 1)
                )

            kept = {FULL: self.kv_mask, SLIDING: self.kept.valid}
            masks = kept_masks(allowed, kept, positions, self.next_pos, self.windows)
            if isinstance(masks, dict):  # full-attention layers hold the call's slot axis (static: all of it)
                spans = {FULL: self.slots}
                return {
                    kind: self._as_model_mask(ragged.span_slots(m, spans.get(kind)))
                    for kind, m in masks.items()
                }
            return self._as_model_mask(masks)
        mask = ragged.span_slots(candidates.attention_mask(self.kv_mask), self.slots)
        if mask is None or mask.dim() == 2:
            return mask
        return self._as_model_mask(mask)

    def _as_model_mask(self, mask: torch.BoolTensor) -> torch.Tensor:
        impl = self.model.config._attn_implementation
        return custom_attention_mask(mask, impl, self.model.get_input_embeddings().weight.dtype)

    def _accept(
        self, inputs: torch.LongTensor, scores: torch.Tensor, candidates: DraftCandidates
    ) -> tuple[list[list[int]], list[torch.LongTensor], list[list[int]], torch.LongTensor | None]:
        """Each row's accepted path (slots, root first) and emitted tokens, as a tensor and as host ids: the path
        of the target's own choices ([`greedy_path`]) and its choice after the path.  Greedy, a choice is the
        argmax; sampling, the keyed draw for the position the slot decides ([`sampling.KeyedSampler`]: an exact
        draw from the target's distribution that does not depend on the drafts, so a draft is kept iff it equals
        the target's draw).  Greedy chains (plain steps included) read the whole batch's outcome in one go, and
        return it as one tensor too (row j's emitted tokens are its first `len(paths[j])`; else None)."""
        paths, accepted, host = [], [], []
        picks = vocab_argmax(scores) if self.sampler is None else None
        if picks is not None and candidates.parents is None:
            if picks.shape[1] == 1:  # a plain step: each row emits its one choice
                return [[0] for _ in range(picks.shape[0])], list(picks.unbind(0)), picks.tolist(), picks
            # a chain's path is its drafts' leading agreement with the target's choices, which it then emits
            agree = (inputs[:, 1:] == picks[:, :-1]).long().cumprod(dim=1).sum(dim=1)
            for j, row in enumerate(torch.cat([picks, agree[:, None]], dim=1).tolist()):
                m = row[-1]
                paths.append(list(range(m + 1)))
                accepted.append(picks[j, : m + 1])
                host.append(row[: m + 1])
            return paths, accepted, host, picks
        read = picks.tolist() if picks is not None else None
        for j, b in enumerate(self.rows.active):
            if read is not None:
                choices = read[j]
            else:  # each slot's keyed draw at the position its output decides
                at = self.rows.lengths[b]
                depths = [0] + candidates.depths[j].tolist()
                choices = self.sampler.sample(scores[j], [b] * len(depths), [at + d for d in depths]).tolist()
                self.sampler.forget_before(b, at)
            path = greedy_path(candidates.row(j), choices)
            paths.append(path)
            host.append([choices[slot] for slot in path])  # a kept node is its parent slot's choice
        # the emitted tokens are the choices along the path, on the host already: one tensor for the batch
        most = max(len(h) for h in host)
        together = torch.tensor([h + h[-1:] * (most - len(h)) for h in host], device=inputs.device)
        accepted = [together[j, : len(h)] for j, h in enumerate(host)]
        return paths, accepted, host, together

    def _keep_paths(self, paths: list[list[int]], lengths: list[int], width: int) -> list[int]:
        """The target's cache after a verify pass: each row keeps the first `lengths[j]` slots of its path at the
        end of its cache ([`ragged.keep_tail`]; a crop when every path is a prefix of the pass, as a chain's is),
        rows that kept fewer get holes, and positions advance by what each row kept.  Returns each row's position
        of its first kept slot."""
        device = self.device
        longest = max(lengths)
        if all(p[:n] == list(range(n)) for p, n in zip(paths, lengths)):
            if longest < width:
                self.cache.crop(-(width - longest))
        else:
            index = torch.tensor([(p + [0] * longest)[:longest] for p in paths], device=device)
            in_place = ragged.slots_in_place(paths, lengths)
            keep_tail(self.cache, index, width, used=self.kv_mask.shape[1] + width, in_place=in_place)
        if min(lengths) == longest:  # every row kept as many: no new holes
            self.kv_mask = torch.cat([self.kv_mask, self.kv_mask.new_ones(len(lengths), longest)], 1)
            self.next_pos = self.next_pos + longest
        else:
            kept = torch.tensor(lengths, device=device)
            self.kv_mask = torch.cat(
                [self.kv_mask, (torch.arange(longest, device=device)[None] < kept[:, None]).long()], 1
            )
            self.next_pos = self.next_pos + kept
            self.gaps = self.gaps_changed = True
        if self.kept is not None:
            self.kept.extend(self.kv_mask[:, -longest:])
        starts = self.pos_host
        self.pos_host = [p + n for p, n in zip(starts, lengths)]
        return starts

    # ------------------------------------------------------------------ rows
    def record(
        self,
        emitted,
        raw,
        scores,
        out,
        paths: list[list[int]] | None = None,
        host: list[list[int]] | None = None,
    ) -> list[torch.LongTensor]:
        """Cut each row's new tokens at `max_length` and its first EOS, append them, keep what the call returns,
        and tell the drafting side how many drafts each row kept (and, after a verify pass, the slots of each
        row's accepted path)."""
        rows = self.rows
        cut = []
        for j, b in enumerate(rows.active):
            if (
                b in rows.idle
            ):  # an idle row's tokens are never output (its place in the batch is what counts)
                cut.append(emitted[j][:0])
                continue
            ids = host[j] if host is not None else emitted[j].tolist()
            tokens, done = cut_at_end(emitted[j], ids, self.max_length - rows.lengths[b], self.eos_ids)
            n = tokens.shape[0]
            if self.want["scores"]:
                self.per_row["scores"][b].extend(scores[j, :n])
            if self.want["logits"]:
                self.per_row["logits"][b].extend(raw[j, :n])
            if self.want["hidden"]:
                self.per_row["hidden"][b].append((out.hidden_states, j, n, not self.per_row["hidden"][b]))
            rows.append(b, tokens, ids, done)
            cut.append(tokens)
        if self.stops is not None:
            self._replay_stops()
        if self.streamer is not None:  # what is left of row 0's new tokens once the criteria had their say
            end = rows.lengths[0]
            if end > self._streamed:
                self.streamer.put(rows.tokens[0, self._streamed : end].cpu())
                self._streamed = end
        self.drafter.verified([t.shape[0] - 1 for t in cut], rows.live(), paths, self._target_seconds)
        return cut

    def _replay_stops(self) -> None:
        """Run the call's own stopping criteria as plain decoding runs them ([`stopping.LockstepStops`]) and cut
        each row they stop back to that step."""
        rows = self.rows
        prompt = self.input_ids.shape[1]
        step_scores = None
        if self.want["scores"]:
            built = self._stop_scores  # steps already replayed never change: build each step's (B, V) once

            def step_scores(length: int) -> tuple[torch.Tensor, ...]:
                done, n = len(built), length - prompt
                if n > done:
                    built.extend(
                        per_step([r[done:n] for r in self.per_row["scores"]], self.pad_id, float("-inf"))
                    )
                return tuple(built[:n])

        def cut(b: int, length: int) -> None:
            n = length - prompt
            for name in ("scores", "logits"):
                if self.want[name]:
                    del self.per_row[name][b][n:]
            if self.want["hidden"]:
                self.per_row["hidden"][b] = hidden_entries_upto(self.per_row["hidden"][b], n)
            rows.cut(b, length, self.pad_id)

        if self.stops.advance(rows.tokens, rows.lengths, rows.done, cut, step_scores):
            rows.done.update(rows.active)

    def drop_finished(self, emitted: list[torch.LongTensor]) -> list[torch.LongTensor]:
        """Remove the rows that ended (EOS, `max_length`, or every row at `max_time`) from both caches; compact the
        target's cache when its holes pile up.  Returns the remaining rows' last tokens."""
        rows = self.rows
        if self.timers and any(bool(t(rows.tokens, None).any()) for t in self.timers):
            for b in rows.active:
                rows.done.add(b)
        live = [j for j, b in enumerate(rows.active) if not rows.ended(b)]
        keep = sorted(live + self._idle_rows(live)) if live else []
        idle = {b for j, b in enumerate(rows.active) if j in keep and j not in live}
        if self.slots is not None and idle - rows.idle:  # frozen rows' slots are holes from now on
            frozen = torch.tensor([b in idle for b in rows.active], device=self.device)
            self.kv_mask = self.kv_mask.masked_fill(frozen[:, None], 0)
            self.gaps = self.gaps_changed = True
        rows.idle = idle
        self.drafter.set_idle([rows.active[j] in rows.idle for j in keep])
        if len(keep) < len(rows.active):
            rows.active = [rows.active[j] for j in keep]
            if keep:
                index = torch.tensor(keep, device=self.device)
                self.cache.batch_select_indices(index)
                self.kv_mask, self.next_pos = self.kv_mask[index], self.next_pos[index]
                if self.kept is not None:
                    self.kept.select_rows(index)
                self.pos_host = [self.pos_host[j] for j in keep]
                self.gaps_changed = self.gaps
                self.drafter.select_rows(keep)
            emitted = [emitted[j] for j in keep]
        if self.gaps_changed and rows.active:  # holes pile up only in rounds that add some (or drop rows)
            self.gaps_changed = False
            # a row's valid slots are its positions (a frozen row's are holes): no read of the mask
            frozen = rows.idle if self.slots is not None else set()
            valid = max((p for p, b in zip(self.pos_host, rows.active) if b not in frozen), default=0)
            if worth_compacting(self.kv_mask, valid) and batch_refusal(self.cache) is None:
                self.kv_mask = compact(self.cache, self.kv_mask, valid)
        return emitted

    def _idle_rows(self, live: list[int]) -> list[int]:
        """The ended rows (indices into the batch) to keep as idle rows: as many as make a target pass cheapest
        by the cost model's measured step seconds per row count (a CPU's matrix kernels can take longer for 7
        rows than for 8), preferring rows kept before.  Only rows that ended at EOS with room left in the
        position range qualify (an idle row advances with the batch); none without the cost rule.  A static
        cache cannot drop rows: every ended row stays, frozen (it keeps no slot of later passes)."""
        rows, batch = self.rows, len(self.rows.active)
        ended = [j for j in range(batch) if j not in live]
        if self.slots is not None:
            return ended
        if not ended or batch_refusal(self.cache) is not None:
            return []
        positions = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        room = (self.drafter.settings.num_speculative_tokens + 2) * max(
            self.max_length - rows.lengths[rows.active[j]] for j in live
        )
        eligible = [
            j
            for j in ended
            if rows.lengths[rows.active[j]] < self.max_length
            and (positions is None or self.pos_host[j] + room < int(positions))
        ]
        eligible.sort(key=lambda j: rows.active[j] not in rows.idle)  # rows already idle first
        count = self.drafter.rows_to_keep(len(live), len(live) + len(eligible))
        return eligible[: count - len(live)]

    def leave_state(self) -> None:
        """One sequence: cut the target's cache to the sequence but its last token (what plain decoding leaves
        there; a row that ended inside a round kept more) and leave the head's state on it for the next call
        ([`resume`])."""
        if self.batch != 1 or self.cache is None:
            return
        length = self.rows.lengths[0] - 1
        extra = self.kv_mask.shape[1] - length  # the call's slot axis (sliding layers keep fewer slots)
        if extra > 0:
            self.cache.crop(-extra)
            self.kv_mask = self.kv_mask[:, :length]
        if self.kept is not None:  # plain decoding's sliding layers (no continuing with the head there)
            self.kept.restore(self.cache, self.kv_mask.shape[1])
            return
        end = int(self.kv_mask[0, :length].sum())
        if self.drafter.cache.drop_slots_from(end):
            leave_state(self.cache, self.drafter.cache, self.drafter.head, int(self.rows.tokens[0, length]))

    def result(self) -> GenerateDecoderOnlyOutput | torch.LongTensor:
        if self.streamer is not None:
            self.streamer.end()
        self.leave_state()
        sequences = self.rows.tokens[:, : max(self.rows.lengths)]
        if not self.want_dict:
            return sequences
        fill = float("-inf")
        return PEagleGenerateOutput(
            sequences=sequences,
            scores=per_step(self.per_row["scores"], self.pad_id, fill) if self.want["scores"] else None,
            logits=per_step(self.per_row["logits"], self.pad_id, fill) if self.want["logits"] else None,
            hidden_states=hidden_per_step(self.per_row["hidden"]) if self.want["hidden"] else None,
            **cache_kwarg(self.cache if self.batch == 1 else None),
            peagle_stats=self.drafter.stats,
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
    peagle: PEagleCall | None = None,
    **model_kwargs: Any,
) -> GenerateDecoderOnlyOutput | torch.LongTensor:
    """Greedy or sampled decoding of B >= 1 left-padded prompts, drafted by `peagle.head` (transformers'
    `custom_generate` signature; `generate()` calls it with what the hook passed as `peagle`).

    Output: what plain `generate()` with the same options returns: the same tokens under greedy decoding (the
    target's own distribution under sampling), rows that end early padded with `pad_token_id`, and a
    `GenerateDecoderOnlyOutput` when `return_dict_in_generate` (scores, logits and hidden states per step;
    a row's entries after its end read -inf except 0 at `pad_token_id`, and zeros for hidden states).
    """
    call = peagle if peagle is not None else PEagleCall(head=None)
    streamer = call.streamer if call.streamer is not None else streamer
    check_decoding_inputs(
        model,
        call.head,
        input_ids,
        generation_config,
        streamer,
        model_kwargs,
        _MANAGED_KWARGS,
        logits_processor,
    )
    if call.given is not None:
        generation_config._peagle_given = set(call.given)
    with packed_attention(model):  # verify passes read the cache without a copy per query head
        loop = _Decoder(
            model,
            call.head,
            input_ids,
            logits_processor,
            stopping_criteria,
            generation_config,
            streamer,
            model_kwargs,
            call.options,
        )
        emitted = loop.drop_finished(loop.prefill())
        while loop.rows.active:
            emitted = loop.drop_finished(loop.round(emitted))
        loop.drafter.finish()
        return loop.result()


__all__ = ["PEagleGenerateOutput", "peagle_decoding"]
