"""Shared test helpers: tiny random models and data built in code, and a few generation utilities.

Fixtures live in conftest.py; everything a test module imports comes from here.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import peagle
from peagle.training.arguments import PEagleTrainingArguments

BLOCK_PEAGLE = """\
import importlib.abc, sys

class _BlockPeagle(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "peagle" or name.startswith("peagle."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked for this test)")
        return None

sys.meta_path.insert(0, _BlockPeagle())
"""
"""First lines of a script run in a fresh interpreter where `import peagle` must fail (remote-code tests)."""


def tiny_target_config(**overrides) -> LlamaConfig:
    values = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def make_target(seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_target_config(**overrides))
    return model.eval()


def make_head(target, seed: int = 1, **overrides) -> peagle.PEagleDrafter:
    torch.manual_seed(seed)
    # tiny heads draft K every round unless a test asks for the cost rule (confidence_threshold=None); they own
    # their embedding table (for_target's default shares the target's) so layouts, FP8 and adapters see all tensors
    values = dict(num_hidden_layers=2, mask_token_id=127, confidence_threshold=0.0, embed_from_target=False)
    values.update(overrides)
    cfg = peagle.PEagleConfig.for_target(target.config, **values)
    return peagle.PEagleDrafter(cfg).eval()


SYSTEM = "you are a helpful bot"


def tiny_tokenizer():
    """A word-level tokenizer (ids < 128) whose chat template inserts a default system prompt, like SmolLM2's."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "<|im_end|>": 2, "<|im_start|>": 3, "<unk>": 4}
    for w in [
        "system",
        "user",
        "assistant",
        "you",
        "are",
        "a",
        "helpful",
        "bot",
        "hello",
        "world",
        "write",
        "code",
        "please",
        "the",
        "of",
        "and",
        "to",
    ]:
        vocab[w] = len(vocab)
    for i in range(len(vocab), 100):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>", bos_token="<s>", unk_token="<unk>"
    )
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    fast.chat_template = (
        "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|> system "
        + SYSTEM
        + " <|im_end|> {% endif %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
        "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
    )
    return fast


def random_examples(n: int, seed: int = 0, lo: int = 18, hi: int = 40, vocab: int = 120) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(lo, hi, (1,), generator=g))
        prompt = int(torch.randint(3, 10, (1,), generator=g))
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        out.append({"input_ids": ids, "loss_mask": [0] * prompt + [1] * (length - prompt)})
    return out


def make_args(tmp_path, **overrides) -> PEagleTrainingArguments:
    values = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=2,
        max_steps=1,
        optim="sgd",
        learning_rate=1.0,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        num_parallel_positions=4,
        cod_ratio=0.8,
        cod_min_ratio=0.2,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=1,
        seed=0,
    )
    values.update(overrides)
    return PEagleTrainingArguments(**values)


def rel_diff(a: dict, b: dict) -> float:
    num = sum(float(((a[k] - b[k]) ** 2).sum()) for k in a) ** 0.5
    den = sum(float((b[k] ** 2).sum()) for k in b) ** 0.5
    assert den > 0, "the reference update is zero: the test would prove nothing"
    return num / den


LAYERS = 4  # aux layers default to (1, 2, 3): distinct, so an off-by-one layer index shows


def prompt_ids(seed: int, length: int) -> torch.LongTensor:
    return torch.randint(3, 127, (1, length), generator=torch.Generator().manual_seed(seed))


def greedy(target, ids, **kw) -> torch.LongTensor:
    return target.generate(ids, do_sample=False, **kw)


class Oracle:
    """Forward hook: each drafting slot's logits point at the reference continuation with probability `p`.

    A random head almost never drafts a right token; the oracle makes rounds accept 0..K drafts, so the cache
    crop/append path and the stats see real acceptance.  The slot at position q predicts token q + 2 of its
    row's reference.

    With `second=True` a miss still ranks the right token second, where a draft tree finds it.
    `reference`: `(1, n)` for one row, or one unpadded sequence per row of a batch (a `(B, n)` tensor or a list),
    with `p` a float or one probability per row (1.0: always right, 0.0: never).  Rows leave a batch when they
    finish, so each drafter call finds its rows' references by their real slots' tokens.
    """

    def __init__(self, head, reference, p: float | list[float] = 0.7, seed: int = 0, second: bool = False):
        self.second = second  # a miss still ranks the right token second (what a draft tree can catch)
        self.references = [r.tolist() for r in reference]
        self.p = [p] * len(self.references) if isinstance(p, (int, float)) else list(p)
        self.generator = torch.Generator().manual_seed(seed)
        target_ids = (torch.arange(head.config.draft_vocab_size) + head.d2t).tolist()
        self.draft_index = {t: i for i, t in enumerate(target_ids)}
        self.mask_token_id = head.config.mask_token_id
        self.rows: list[int] = list(range(len(self.references)))
        self.handle = head.register_forward_hook(self, with_kwargs=True)

    @property
    def reference(self) -> list[int]:
        return self.references[0]

    def _find_rows(self, kwargs) -> None:
        ids, pos = kwargs["input_ids"], kwargs["position_ids"]
        par = kwargs.get("parallel_mask")
        rows = []
        for b in range(ids.shape[0]):
            slots = [
                (q, t)
                for q, t, is_par in zip(
                    pos[b].tolist(),
                    ids[b].tolist(),
                    par[b].tolist() if par is not None else [False] * ids.shape[1],
                )
                if not is_par and t != self.mask_token_id and q >= 0
            ]
            match = [
                r
                for r, ref in enumerate(self.references)
                if all(q + 1 < len(ref) and ref[q + 1] == t for q, t in slots)
            ]
            rows.append(match[0] if match else -1)
        self.rows = rows

    def __call__(self, module, args, kwargs, out):
        if len(self.references) > 1 and kwargs.get("projected_hidden_states") is None:
            self._find_rows(kwargs)
        k = out.logits.shape[1]
        logits = out.logits.clone()
        for b in range(logits.shape[0]):
            r = self.rows[b] if len(self.references) > 1 else 0
            if r < 0:
                continue
            ref = self.references[r]
            for j, q in enumerate(kwargs["position_ids"][b, -k:].tolist()):
                hit = torch.rand((), generator=self.generator).item() < self.p[r]
                if q + 2 < len(ref) and ref[q + 2] in self.draft_index:
                    right = self.draft_index[ref[q + 2]]
                    top = logits[b, j].max()
                    if hit:
                        logits[b, j, right] = top + 10.0
                    elif self.second:
                        logits[b, j, right] = top + 5.0
                        logits[b, j, (right + 1) % logits.shape[-1]] = top + 10.0
        out.logits = logits
        return out


def exact_distribution(target, prompt: torch.LongTensor, steps: int, processors) -> dict[tuple, float]:
    """Probability of every continuation of `steps` tokens under plain sampling with `processors`."""
    probs = {(): 1.0}
    for _ in range(steps):
        prefixes = list(probs)
        batch = torch.cat([prompt.expand(len(prefixes), -1), torch.tensor(prefixes, dtype=torch.long)], dim=1)
        with torch.no_grad():
            logits = target(batch).logits[:, -1].float()
        rows = [processors(batch[i : i + 1], logits[i : i + 1]).softmax(-1)[0] for i in range(len(prefixes))]
        probs = {
            prefix + (t,): probs[prefix] * float(row[t])
            for prefix, row in zip(prefixes, rows, strict=True)
            for t in torch.nonzero(row > 0).flatten().tolist()
        }
    return probs


def check_tree_logits(target, tree, vocab: int = 128) -> None:
    """A verify pass over `tree` laid out flat (after a left-padded past, with the tree mask and depth positions)
    gives every slot the logits a plain forward over the past and that slot's path gives."""
    from transformers.cache_utils import DynamicCache

    from peagle.generation.tree import tree_attention_mask
    from peagle.modeling_peagle import custom_attention_mask

    past_ids = torch.tensor([[0, 0, 11, 12, 13]]) % vocab
    past_mask = torch.tensor([[0, 0, 1, 1, 1]])
    cache = DynamicCache(config=target.config)
    pos = (past_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        target(input_ids=past_ids, attention_mask=past_mask, position_ids=pos, cache=cache, use_cache=True)
        inputs = torch.tensor([[14] + tree.tokens]) % vocab
        depths = torch.tensor([[0] + tree.depths])
        mask = custom_attention_mask(
            tree_attention_mask([tree], past_mask), target.config._attn_implementation, torch.float32
        )
        logits = target(
            input_ids=inputs, attention_mask=mask, position_ids=3 + depths, cache=cache, use_cache=True
        ).logits[0]
        for slot in range(len(tree) + 1):
            path, node = [], slot - 1
            while node >= 0:
                path.append(tree.tokens[node])
                node = tree.parents[node]
            seq = torch.tensor([[11, 12, 13, 14] + path[::-1]]) % vocab
            plain = target(input_ids=seq).logits[0, -1]
            torch.testing.assert_close(logits[slot], plain, atol=1e-4, rtol=1e-4)
