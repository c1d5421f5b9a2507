"""P-EAGLE speculative decoding as a transformers `custom_generate` recipe; needs torch + transformers only.

    out = target.generate(input_ids, custom_generate="<head repo>", trust_remote_code=True, max_new_tokens=128)

The drafter head is loaded from the repository this file ships in (`HEAD_REPO`, written by peagle when
the repository was prepared) with `AutoModel.from_pretrained(..., trust_remote_code=True)` and attached
to the target; pass `peagle_head=` (a loaded head or another repo id) or `assistant_model=` (a loaded
head) to use another one, and `num_speculative_tokens=` to change K.

Each round the head drafts K tokens (one forward pass for a parallel P-EAGLE head, K passes for an
EAGLE-3 head) from the target features of the previous verify pass, keeping its own KV cache; the target
verifies [last token, drafts] in one forward pass and keeps the longest prefix of drafts equal to its
own greedy choices plus its next token.  With a confidence cut (`assistant_confidence_threshold=`, default
the head's `config.confidence_threshold`) a round keeps its drafts up to and including the first one the
head gives a probability below it; 0 keeps all K.  With neither (the default of current heads) and peagle
installed, each round verifies the number of drafts peagle's cost-aware rule picks from the head's calibrated
probabilities and the machine's measured verify cost; without peagle it drafts K every round.  The output is token-for-token the target's own greedy output.
Batches run row by row (left padding is removed per row and put back).  Sampling, beam search, logits
processors and stopping criteria go to transformers' own `generate()` unchanged.

Statistics of the last call: `head.last_generation_stats`, with the field names of peagle's
`PEagleGenerationStats` (`rounds`, `draft_tokens`, `accepted_tokens`, `generated_tokens`, ... and the metrics
`tokens_per_target_pass` and `acceptance_length`).

The drafting round itself is not copied here: it is the head's own `PEagleDrafter.draft_round` (remote code
shipped with the head), the same function peagle's `generate()` hook calls.  This file adds only the greedy
verify loop, mirroring transformers' assisted decoding with greedy verification.
"""

from __future__ import annotations

import copy
import inspect
import logging

import torch
from transformers import AutoModel, DynamicCache, GenerationMixin
from transformers.generation.utils import GenerateDecoderOnlyOutput

HEAD_REPO: str | None = None  # replaced by peagle.integrations.hub.prepare_upload_folder
logger = logging.getLogger(__name__)
_HEADS: dict = {}
# generation settings this greedy loop does not implement: any of them hands over to transformers' generate()
_UNSUPPORTED = {
    "do_sample": (None, False),
    "num_beams": (None, 1),
    "num_return_sequences": (None, 1),
    "repetition_penalty": (None, 1.0),
    "no_repeat_ngram_size": (None, 0),
    "bad_words_ids": (None,),
    "min_new_tokens": (None, 0),
    "min_length": (None, 0),
    "suppress_tokens": (None,),
    "begin_suppress_tokens": (None,),
    "sequence_bias": (None,),
    "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,),
    "guidance_scale": (None, 1.0),
}


def _load_head(spec, model):
    if spec is None:
        raise ValueError("no drafter head: HEAD_REPO is unset; pass peagle_head=<repo id or loaded head>.")
    if isinstance(spec, str):
        key = (spec, str(model.device))
        if key not in _HEADS:  # the head keeps its own dtype (FP8 heads stay FP8); it casts features itself
            _HEADS[key] = AutoModel.from_pretrained(spec, trust_remote_code=True).to(model.device).eval()
        head = _HEADS[key]
    else:
        head = spec.eval()
    return head.attach_target(model)


def _layer_ids(head, model):
    ids = head.config.eagle_aux_hidden_state_layer_ids
    if ids:
        return list(ids)
    n = model.config.get_text_config().num_hidden_layers
    return [2, n // 2, n - 3] if n >= 8 else [min(1, n - 1), n // 2, n - 1]


def _features(hidden_states, layer_ids):
    """`(1, T, 3 * H)`: the inputs of the chosen target layers (hidden_states[0] = embeddings)."""
    return torch.cat([hidden_states[i] for i in layer_ids], dim=-1)


def _cache_name(model):
    """The name `model.forward` takes the KV cache under: `cache` from transformers 5.24, `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _drop(cache, n):
    if n > 0:
        cache.crop(-n)


def _new_stats(head, k, cut):
    """Statistics under the field names of `peagle.generation.PEagleGenerationStats` (that class itself when
    peagle is installed; otherwise a namespace with the same fields and the two named metrics)."""
    fields = dict(drafting_mode=head.config.drafting_mode, num_speculative_tokens=k, confidence_threshold=cut)
    try:
        from peagle.generation import PEagleGenerationStats
    except ImportError:
        return _Stats(**fields)
    return PEagleGenerationStats(**fields)


class _Stats:
    """Counts of the greedy loop; `tokens_per_target_pass` and `acceptance_length` as peagle defines them."""

    def __init__(self, **fields):
        self.rounds = self.draft_tokens = self.accepted_tokens = self.plain_steps = 0
        self.generated_tokens = self.drafter_forward_calls = 0
        self.__dict__.update(fields)

    @property
    def tokens_per_target_pass(self):
        passes = self.rounds + self.plain_steps
        return self.generated_tokens / passes if passes else 0.0

    @property
    def acceptance_length(self):
        return (self.accepted_tokens + self.rounds) / self.rounds if self.rounds else 0.0


def _draft(head, tokens, feats, cache, k, cut=0.0, choose=None):
    """Up to K greedy drafts `(1, m)` for the real slots (tokens, feats), through the head's own `draft_round`
    (the one drafting round peagle's generate() uses too): cut after the first one the head gives a probability
    below `cut`, or, with `choose` (the cost rule), the number `choose(confidences)` picks.  Returns the drafts
    and the number of speculative slots the drafter cache gained."""
    confidences = []

    def select(logits, depth):
        prob, picked = logits.softmax(-1).max(-1)
        confidences.append(float(prob[0]))
        stop = cut > 0 and confidences[-1] < cut
        return head.draft_to_target(picked), None, stop

    start = cache.get_seq_length()
    round_ = head.draft_round(tokens, feats, k, cache, start, select=select)
    drafts = round_.tokens if choose is None else round_.tokens[:, : choose(confidences)]
    return drafts, round_.speculative_slots


class _CostRule:
    """peagle's cost-aware choice of how many drafts to verify: `rule(confidences) -> k`, and `rule.observe(n)`
    after verification (n drafts accepted) so the head's calibration is corrected by the rounds this generation
    verified, as in peagle's generate()."""

    def __init__(self, model, head, k, cost_mod):
        self.cost_mod = cost_mod
        self.cost = cost_mod.cost_model_for(model, head, k + 1)
        self.calibration = getattr(head.config, "draft_calibration", None)
        correction = getattr(cost_mod, "AcceptanceCorrection", None)  # older peagle: none
        self.correction = correction() if correction is not None else None
        self.verified = []

    def __call__(self, confidences):
        calibrated = self.cost_mod.calibrated_probabilities(self.calibration, confidences)
        probs = self.correction.apply(calibrated) if self.correction is not None else calibrated
        k = self.cost_mod.choose_num_drafts(probs, self.cost.curve(len(probs) + 1), self.cost.drafter_seconds)
        self.verified = calibrated[:k]  # the correction learns from the uncorrected prediction
        return k

    def observe(self, accepted):
        if self.correction is not None and self.verified:
            self.correction.observe(self.verified, accepted)


def _cost_rule(model, head, k):
    """peagle's cost-aware rule (a `_CostRule`), or None without peagle."""
    try:
        from peagle.generation import cost as cost_mod
    except ImportError:
        logger.warning("custom_generate: cost-aware drafting needs peagle installed; drafting K every round.")
        return None
    return _CostRule(model, head, k, cost_mod)


@torch.no_grad()
def _generate_row(model, head, ids, max_new, eos, k, cut, stats, choose=None):
    """Greedy speculative decoding of one unpadded row `ids` `(1, p)`; returns the new tokens `(1, n)`."""
    layer_ids = _layer_ids(head, model)
    cache = DynamicCache(config=model.config)
    cache_kwarg = {_cache_name(model): cache}
    out = model(input_ids=ids, use_cache=True, output_hidden_states=True, **cache_kwarg)
    feats = _features(out.hidden_states, layer_ids)
    tokens = out.logits[:, -1:].argmax(-1)  # the target's own next token
    slots = torch.cat([ids[:, 1:], tokens], dim=1)  # slot t pairs token t+1 with the features of position t
    pieces, count = [tokens], 1
    draft_cache = DynamicCache(config=head.config)
    while count < max_new and not any(int(t) in eos for t in tokens[0]):
        drafts, speculative = _draft(head, slots, feats, draft_cache, k, cut, choose)
        _drop(draft_cache, speculative)  # keep only real slots in the drafter cache
        m = drafts.shape[1]
        out = model(
            input_ids=torch.cat([tokens[:, -1:], drafts], dim=1),
            use_cache=True,
            output_hidden_states=True,
            **cache_kwarg,
        )
        choice = out.logits.argmax(-1)  # (1, m + 1)
        n = int((drafts == choice[:, :m]).int().cumprod(dim=-1).sum())
        if choose is not None and m:
            choose.observe(n)
        tokens = torch.cat([drafts[:, :n], choice[:, n : n + 1]], dim=1)
        _drop(cache, m - n)  # the rejected drafts
        feats = _features(out.hidden_states, layer_ids)[:, : n + 1]
        slots = tokens
        pieces.append(tokens)
        count += n + 1
        # a parallel round is one drafter pass; an autoregressive one adds a pass per speculative slot
        stats.drafter_forward_calls += 1 if head.config.drafting_mode == "parallel" else speculative + 1
        if m:  # a round whose drafts the cost rule declined is a plain step
            stats.rounds += 1
            stats.accepted_tokens += n
            stats.draft_tokens += m
    new = torch.cat(pieces, dim=1)[:, :max_new]
    hits = [i for i, t in enumerate(new[0].tolist()) if t in eos]
    return new[:, : hits[0] + 1] if hits else new


def generate(model, *args, **kwargs):
    """`target.generate(..., custom_generate=repo, trust_remote_code=True)` entry point (see module docstring)."""
    inputs = args[0] if args else kwargs.pop("inputs", None)
    kwargs.pop("inputs", None)
    if inputs is None:
        inputs = kwargs.pop("input_ids", None)
    kwargs.pop("input_ids", None)
    head_spec = kwargs.pop("peagle_head", None)
    k = kwargs.pop("num_speculative_tokens", None)
    cut = kwargs.pop("assistant_confidence_threshold", None)
    assistant = kwargs.pop("assistant_model", None)
    if head_spec is None and assistant is not None and hasattr(assistant, "draft"):
        head_spec = assistant
    generation_config = copy.deepcopy(kwargs.pop("generation_config", None) or model.generation_config)
    hooks = {n: kwargs.pop(n, None) for n in ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn",
                                               "streamer", "negative_prompt_ids", "negative_prompt_attention_mask")}  # fmt: skip
    kwargs.pop("synced_gpus", None)
    model_kwargs = generation_config.update(**kwargs)
    unsupported = [n for n, ok in _UNSUPPORTED.items() if getattr(generation_config, n, None) not in ok]
    unsupported += [n for n, v in hooks.items() if v]
    if unsupported or inputs is None:
        logger.warning(
            "custom_generate: %s not supported by the greedy P-EAGLE loop; using generate().", unsupported
        )
        if assistant is not None and not hasattr(assistant, "draft"):
            model_kwargs["assistant_model"] = assistant
        if cut is not None:
            model_kwargs["assistant_confidence_threshold"] = cut
        return GenerationMixin.generate(
            model,
            inputs,
            generation_config=generation_config,
            **{k_: v for k_, v in hooks.items() if v},
            **model_kwargs,
        )

    head = _load_head(head_spec if head_spec is not None else HEAD_REPO, model)
    k = int(k or head.config.num_speculative_tokens)
    if cut is None:
        cut = getattr(head.config, "confidence_threshold", 0.0)
    # no cut given and none in the head's config: peagle's cost-aware rule (when peagle is installed)
    choose = _cost_rule(model, head, k) if cut is None else None
    cut = float(cut or 0.0)
    eos = generation_config.eos_token_id
    eos = set() if eos is None else {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}
    pad = generation_config.pad_token_id
    pad = pad if pad is not None else (min(eos) if eos else 0)
    mask = model_kwargs.pop("attention_mask", None)
    if model_kwargs:
        logger.warning("custom_generate: ignoring %s", sorted(model_kwargs))
    prompt_len = inputs.shape[1]
    if generation_config.max_new_tokens is not None:
        max_new = generation_config.max_new_tokens
    else:
        max_new = max(0, (generation_config.max_length or 20) - prompt_len)
    stats = _new_stats(head, k, cut)
    stats.draft_policy = "cost" if choose is not None else ("threshold" if cut > 0 else "fixed")
    rows = []
    for b in range(inputs.shape[0]):
        ids = inputs[b : b + 1]
        if mask is not None:
            ids = ids[:, mask[b].bool()]
        rows.append(
            _generate_row(model, head, ids, max_new, eos, k, cut, stats, choose)
            if max_new > 0
            else ids[:, :0]
        )
    width = max(r.shape[1] for r in rows)
    padded = [torch.cat([r, r.new_full((1, width - r.shape[1]), pad)], dim=1) for r in rows]
    sequences = torch.cat([inputs, torch.cat(padded, dim=0)], dim=1)
    stats.generated_tokens = sum(r.shape[1] for r in rows)
    stats.plain_steps = stats.generated_tokens - stats.accepted_tokens - stats.rounds
    head.last_generation_stats = stats
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences
