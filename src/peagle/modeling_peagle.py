"""The P-EAGLE drafter head as a transformers model.

Read top to bottom: fused first layer -> pre-trained model base -> drafter.  The drafting round (`draft_round`,
`draft`) is the mixin `PEagleDrafting` of `drafting_peagle.py`, which ships with this file as remote code.  The building blocks (RMSNorm,
rotary embedding, attention, MLP, decoder layer) are transformers' own Llama modules; attention goes
through transformers' attention interface, so `attn_implementation="eager" | "sdpa" | "flex_attention"`
all work.

Slot layout of one drafting round (docs/DESIGN.md section 3).  Context x_0..x_{p-1} with target features
f_0..f_{p-1}; bonus token b = x_p:

    slot              token embedding     hidden input        position     predicts
    context t         embed(x_{t+1})      fc(f_t)             t            x_{t+2}
    bonus             embed(b)            fc(f_{p-1})         p-1          draft 1
    parallel i>=1     mask embedding      fc(mask_hidden)     p-1+i        draft i+1
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)
from transformers.utils.deprecation import deprecate_kwarg

from .configuration_peagle import PEagleConfig, check_aux_layer_ids
from .drafting_peagle import CACHE_KWARG, PEagleDrafting, _CacheOutput, cache_kwarg, custom_attention_mask

_THREAD_STATS = threading.local()
"""Per thread: head -> the statistics of its last `generate()` call on that thread (`last_generation_stats`)."""


def _thread_stats() -> weakref.WeakKeyDictionary:
    """This thread's head -> statistics map (created on first use)."""
    return _THREAD_STATS.__dict__.setdefault("by_head", weakref.WeakKeyDictionary())


CheckpointLoader = Callable[..., Any]
"""`loader(path_or_id, *model_args, cls=..., target=..., allow_pickle=..., **kwargs) -> head`: what
`from_pretrained` calls when registered (`PEagleDrafter.register_checkpoint_loader`; `peagle.formats` registers
`load_head`)."""
HubPusher = Callable[..., Any]
"""`pusher(head, repo_id, **kwargs) -> commit info`: what `push_to_hub` calls (`peagle.integrations.hub` registers its
`push_to_hub`)."""
FolderWriter = Callable[..., Any]
"""`writer(folder, overwrite=False)`: a context manager yielding the folder to write a head into, then putting it in
place of `folder` (`peagle.formats` registers `head_folder`, which never leaves old files beside new ones and refuses
a folder holding a model other than a head unless `overwrite`)."""
ExtensionBuilder = Callable[[Any, Any], None]
"""`build(head, config_value)`: rebuilds modules a `peagle_*` config block describes, in `__init__`."""
ExtensionSaver = Callable[[Any, str], None]
"""`save(head, folder)`: writes what such a head needs besides weights and config, after `save_pretrained`."""
EXTENSION_PREFIX = "peagle_"
"""Config attributes named `peagle_<name>` are extension blocks (e.g. `peagle_fp8`); each needs a builder."""


@dataclass
class PEagleDrafterOutput(_CacheOutput):
    """Output of [`PEagleDrafter.forward`].

    Args:
        loss: unused by the model itself (the trainer computes its own); kept for the Trainer protocol.
        logits: `(batch, slots, draft_vocab_size)` logits over the draft vocabulary, one row per slot.
        last_hidden_state: `(batch, slots, hidden_size)` output of the last decoder layer *before* the
            final norm (what EAGLE-3 feeds back as the next slot's hidden input).
        cache: the drafter's KV cache, updated with these slots when `use_cache` (also readable as
            `past_key_values`, transformers' name before 5.24).
    """

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    last_hidden_state: torch.Tensor | None = None
    cache: Cache | None = None


class PEagleFusedAttention(LlamaAttention):
    """Llama attention whose q/k/v projections read `2 * hidden_size` (embeddings and features side by side)."""

    def __init__(self, config: PEagleConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        bias = config.attention_bias
        in_dim = 2 * config.hidden_size
        self.q_proj = nn.Linear(in_dim, config.num_attention_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(in_dim, config.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(in_dim, config.num_key_value_heads * self.head_dim, bias=bias)


class PEagleFusedDecoderLayer(GradientCheckpointingLayer):
    """Layer 0: attention over `cat([input_layernorm(embeds), hidden_norm(h)])`, residual `h`."""

    def __init__(self, config: PEagleConfig, layer_idx: int = 0):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.norm_before_residual = config.norm_before_residual
        self.self_attn = PEagleFusedAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> torch.Tensor:
        normed_hidden = self.hidden_norm(hidden_states)
        residual = normed_hidden if self.norm_before_residual else hidden_states
        fused = torch.cat([self.input_layernorm(inputs_embeds), normed_hidden], dim=-1)
        attn_out, _ = self.self_attn(
            hidden_states=fused,
            attention_mask=attention_mask,
            position_embeddings=position_embeddings,
            **cache_kwarg(cache),
            **kwargs,
        )
        hidden_states = residual + attn_out
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states


class PEaglePreTrainedModel(PreTrainedModel):
    config_class = PEagleConfig
    config: PEagleConfig
    base_model_prefix = ""
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _no_split_modules = ["PEagleFusedDecoderLayer", "LlamaDecoderLayer"]
    _skip_keys_device_placement = [CACHE_KWARG]
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_flash_attn = True
    _supports_attention_backend = True

    def _init_weights(self, module):
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, PEagleDrafter):
            nn.init.normal_(module.mask_hidden, mean=0.0, std=std)
            if module.mask_embedding is not None:
                nn.init.normal_(module.mask_embedding, mean=0.0, std=std)


class PEagleDrafter(PEagleDrafting, PEaglePreTrainedModel):
    """P-EAGLE drafter: drafts K tokens for a target model in one forward pass.

    Parameters: `embed_tokens` (V, H), `fc` (H, 3*H_t), `mask_hidden` (1, 1, 3*H_t), `layers[0]` fused,
    `layers[1:]` plain Llama layers, `norm`, `lm_head` (V_draft, H), buffers `d2t` (V_draft,) int64 offsets
    and `t2d` (V,) bool.  With `config.embed_from_target`, `embed_tokens` holds the target's embeddings (not
    saved) and the learned mask embedding is the separate parameter `mask_embedding` (1, H).
    """

    def __init__(self, config: PEagleConfig):
        super().__init__(config)
        hidden, feat = config.hidden_size, config.target_hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.fc = nn.Linear(3 * feat, hidden, bias=False)
        self.mask_hidden = nn.Parameter(torch.zeros(1, 1, 3 * feat))
        if config.embed_from_target:
            self.mask_embedding = nn.Parameter(torch.zeros(1, hidden))
            self._keys_to_ignore_on_save = {"embed_tokens.weight"}
            self._keys_to_ignore_on_load_missing = [r"embed_tokens\.weight"]
        else:
            self.mask_embedding = None
        layers: list[nn.Module] = [PEagleFusedDecoderLayer(config, 0)]
        layers += [LlamaDecoderLayer(config, i) for i in range(1, config.num_hidden_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        self.gradient_checkpointing = False
        self._apply_config_extensions()  # e.g. FP8 layers for `config.peagle_fp8`, before weights load
        self.post_init()

    @property
    def last_generation_stats(self) -> Any:
        """The statistics (`PEagleGenerationStats`) of the last `generate()` call this thread made with this head,
        or None.  Each thread sees its own calls only, so a server that decodes on several threads with one head
        reads each request's own figures; `generate(..., return_dict_in_generate=True)` also returns them with
        the output (`output.peagle_stats`)."""
        return _thread_stats().get(self)

    @last_generation_stats.setter
    def last_generation_stats(self, stats: Any) -> None:
        _thread_stats()[self] = stats

    # ------------------------------------------------------------------ loading, saving and uploading
    # Registration points: this file imports nothing from the rest of peagle, because it ships as remote code
    # (docs/DESIGN.md section 5).  `peagle.formats`, `peagle.integrations.hub` and `peagle.fp8` plug themselves in here when
    # imported, the way peft's tuners register themselves; as remote code without peagle nothing is registered.
    _checkpoint_loader: ClassVar[CheckpointLoader | None] = None
    _hub_pusher: ClassVar[HubPusher | None] = None
    _folder_writer: ClassVar[FolderWriter | None] = None
    _config_extensions: ClassVar[dict[str, tuple[ExtensionBuilder, ExtensionSaver | None]]] = {}

    @classmethod
    def register_checkpoint_loader(cls, loader: CheckpointLoader) -> None:
        """Make `from_pretrained` load through `loader` (replacing any earlier one).

        `loader(path_or_id, *model_args, cls=cls, target=target_model, allow_pickle=..., **kwargs)` returns
        the head; for peagle's own layout it ends in `cls.from_pretrained_native`.
        """
        cls._checkpoint_loader = staticmethod(loader)

    @classmethod
    def register_folder_writer(cls, writer: FolderWriter) -> None:
        """Make `save_pretrained` write through `writer(folder)` (a context manager yielding where to write)."""
        cls._folder_writer = staticmethod(writer)

    @classmethod
    def register_hub_pusher(cls, pusher: HubPusher) -> None:
        """Make `push_to_hub` upload through `pusher(head, repo_id, **kwargs)` (replacing any earlier one)."""
        cls._hub_pusher = staticmethod(pusher)

    @classmethod
    def register_config_extension(
        cls, key: str, build: ExtensionBuilder, save: ExtensionSaver | None = None
    ) -> None:
        """Let the config block `key` (`peagle_<name>`) rebuild modules of the head.

        `build(head, config.<key>)` runs in `__init__`, before weights load, whenever `config.<key>` is set
        (`peagle.fp8` swaps in FP8 layers for `peagle_fp8`); `save(head, folder)` runs after `save_pretrained`
        (it may write the remote code those modules need).
        """
        if not key.startswith(EXTENSION_PREFIX):
            raise ValueError(f"config extension keys start with {EXTENSION_PREFIX!r}; got {key!r}.")
        cls._config_extensions[key] = (build, save)

    def _apply_config_extensions(self) -> None:
        """Run the registered builder of every `peagle_*` block set in the config; refuse unregistered ones."""
        for key, value in list(vars(self.config).items()):
            if not key.startswith(EXTENSION_PREFIX) or not value:
                continue
            if key not in self._config_extensions:
                module = "peagle." + key.removeprefix(EXTENSION_PREFIX)
                raise ValueError(
                    f"config.{key} is set, but nothing registered how to build it; import the module that "
                    f"writes it first (`import {module}`, which needs peagle installed)."
                )
            build, _ = self._config_extensions[key]
            build(self, value)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """Load a head saved by peagle, or convert one saved in another published layout.

        With peagle imported, the registered loader (`peagle.formats.load_head`) recognises the AWS/vLLM,
        speculators and EAGLE-3 layouts, refuses pickle checkpoints unless `allow_pickle=True`, and checks
        every tensor against the config (errors name the file and tensor).  `target_model=` attaches the head
        to its target after loading and supplies `embed_tokens` / `lm_head` a foreign checkpoint lacks.  With
        no loader registered (as Hub remote code without peagle), only peagle's own layout loads, through
        plain transformers loading.
        """
        target_model = kwargs.pop("target_model", None)
        allow_pickle = kwargs.pop("allow_pickle", False)
        loader = cls._checkpoint_loader
        if loader is not None:
            return loader(
                pretrained_model_name_or_path,
                *model_args,
                cls=cls,
                target=target_model,
                allow_pickle=allow_pickle,
                **kwargs,
            )
        model = cls.from_pretrained_native(pretrained_model_name_or_path, *model_args, **kwargs)
        if target_model is not None:
            model.attach_target(target_model)
        return model

    @classmethod
    def from_pretrained_native(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """transformers' own `from_pretrained`: peagle's layout only, without layout detection or tensor checks."""
        return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' `save_pretrained`, then the `save` hooks of the config extensions this head uses.

        With peagle imported, the head is written into a sibling folder that then replaces `save_directory`
        (`peagle.formats.io.replacing_folder`): old weights, shards, index and config never stay beside new ones;
        other files in the folder are kept.  A folder that holds a model other than a head (a target's, say) is
        refused unless `overwrite=True`.
        """
        writer = self._folder_writer
        overwrite = kwargs.pop("overwrite", False)
        # as remote code without peagle nothing is registered; in distributed runs only the main process writes
        if writer is None or not kwargs.get("is_main_process", True):
            return self._save_into(save_directory, *args, **kwargs)
        if kwargs.get("push_to_hub"):  # transformers names the repo after the folder it writes
            kwargs.setdefault("repo_id", Path(save_directory).name)
        with writer(save_directory, overwrite=overwrite) as folder:
            return self._save_into(folder, *args, **kwargs)

    def _save_into(self, folder, *args, **kwargs):
        result = super().save_pretrained(folder, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            for key, (_, save) in self._config_extensions.items():
                if save is not None and getattr(self.config, key, None):
                    save(self, str(folder))
        return result

    def push_to_hub(self, repo_id: str, **kwargs):
        """Upload with a model card, the remote-code files and `custom_generate/` (the registered pusher:
        `peagle.integrations.hub.push_to_hub`, which documents the arguments)."""
        pusher = self._hub_pusher
        if pusher is None:
            raise RuntimeError(
                "PEagleDrafter.push_to_hub uploads through peagle.integrations.hub, which is not loaded: `import peagle` "
                "first (pip install peagle). Without peagle, save_pretrained the head and upload the folder "
                "with huggingface_hub.HfApi().upload_folder."
            )
        return pusher(self, repo_id, **kwargs)

    def _apply(self, fn, recurse=True):
        """`nn.Module._apply` (behind `.to()`, `.half()`, `.cuda()`, `.float()`, ...), converting the head only.

        With `embed_from_target` the head may hold its target's embedding parameter itself (`attach_target`), which
        is also the target's input table and, when tied, its output layer.  torch converts parameters in place, so
        casting or moving the head would cast or move the target.  The head first takes a parameter of its own
        over the same tensor (no copy): the conversion then replaces the head's and leaves the target's untouched.
        """
        # a cast may overflow (bfloat16 -> float16): generate() checks the weights again
        self._finite_weights_checked = False
        emb = getattr(self, "embed_tokens", None)
        if self.config.embed_from_target and emb is not None:
            weight = emb.weight
            emb.weight = nn.Parameter(weight.data, requires_grad=weight.requires_grad)
        return super()._apply(fn, recurse)

    # ------------------------------------------------------------------ embeddings and vocabularies
    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    @property
    def mask_vector(self) -> torch.Tensor:
        """The learned mask embedding, shape `(hidden_size,)`."""
        if self.mask_embedding is not None:
            return self.mask_embedding[0]
        return self.embed_tokens.weight[self.config.mask_token_id]

    def set_draft_vocab(self, draft_to_target: torch.Tensor) -> None:
        """Set the draft vocabulary from the sorted target ids it keeps, shape `(draft_vocab_size,)`.

        Stores `d2t[i] = draft_to_target[i] - i` (offsets, as vLLM and EAGLE-3 expect) and the `t2d` mask.
        """
        ids = torch.as_tensor(draft_to_target, dtype=torch.long).flatten()
        if ids.numel() != self.config.draft_vocab_size:
            raise ValueError(
                f"got {ids.numel()} draft ids; expected draft_vocab_size={self.config.draft_vocab_size}."
            )
        if (
            bool((ids[1:] <= ids[:-1]).any())
            or int(ids.min()) < 0
            or int(ids.max()) >= self.config.vocab_size
        ):
            raise ValueError(
                f"draft ids must be strictly increasing target ids in [0, {self.config.vocab_size})."
            )
        ids = ids.to(self.d2t.device)
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    @property
    def draft_vocab_ids(self) -> torch.Tensor:
        """The target ids of the draft vocabulary, ascending, shape `(draft_vocab_size,)` (`i + d2t[i]`)."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary ids to target ids: `target = i + d2t[i]`."""
        return draft_ids + self.d2t[draft_ids]

    def draft_logits_to_target(self, logits: torch.Tensor) -> torch.Tensor:
        """Scatter `(..., V_draft)` logits into `(..., V)` target-vocabulary logits, `-inf` outside the draft vocab."""
        if self.config.draft_vocab_size == self.config.vocab_size and not bool(self.d2t.any()):
            return logits
        out = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        out[..., self.draft_vocab_ids.to(logits.device)] = logits
        return out

    def check_target(self, target) -> None:
        """Raise a clear error when this head does not fit `target` (a model or its config)."""
        tc = getattr(target, "config", target)
        if hasattr(tc, "get_text_config"):
            tc = tc.get_text_config()
        cfg = self.config
        kind, theirs = getattr(cfg, "target_model_type", None), getattr(tc, "model_type", None)
        if kind and theirs and kind != theirs:  # heads without a recorded family (older, converted) skip this
            raise ValueError(
                f"head was built for a target of model_type {kind!r} (config.target_model_type); this target's "
                f"model_type is {theirs!r}. Another family's hidden states differ even when the shapes match: train "
                "a head for this target (`peagle train --target ...`)."
            )
        if getattr(tc, "hidden_size", cfg.target_hidden_size) != cfg.target_hidden_size:
            raise ValueError(
                f"head was trained for target hidden size {cfg.target_hidden_size}, target has {tc.hidden_size}."
            )
        if getattr(tc, "vocab_size", cfg.vocab_size) != cfg.vocab_size:
            raise ValueError(f"head was built for vocab size {cfg.vocab_size}, target has {tc.vocab_size}.")
        layers = getattr(tc, "num_hidden_layers", None)
        if (
            cfg.target_num_hidden_layers is not None
            and layers is not None
            and layers != cfg.target_num_hidden_layers
        ):
            raise ValueError(
                f"head was built for a target with {cfg.target_num_hidden_layers} layers, target has {layers}."
            )
        ids = cfg.eagle_aux_hidden_state_layer_ids
        if ids is not None and layers is not None:
            check_aux_layer_ids(ids, int(layers))

    def nonfinite_tensors(self) -> dict[str, str]:
        """The head's floating-point parameters and buffers that hold NaN or inf, by name, each with a count
        (`{"fc.weight": "3 NaN, 1 inf of 12288 values"}`); empty for a usable head.  The target's embeddings an
        `embed_from_target` head holds are the target's, not checked here; tensors on the meta device are skipped.
        FP8 tensors are read through float16 (e4m3 has NaN but no inf).  Reads every weight once, in slices."""
        skip = {"embed_tokens.weight"} if self.config.embed_from_target else set()
        found: dict[str, str] = {}
        for name, tensor in [*self.named_parameters(), *self.named_buffers()]:
            if name in skip or not tensor.is_floating_point() or tensor.device.type == "meta":
                continue
            nan = inf = 0
            for part in tensor.detach().reshape(-1).split(1 << 24):
                part = part.to(torch.float16) if part.element_size() == 1 else part
                if not bool(torch.isfinite(part).all()):  # counted only where something is wrong
                    nan += int(torch.isnan(part).sum())
                    inf += int(torch.isinf(part).sum())
            if nan or inf:
                counts = [f"{n} {kind}" for n, kind in ((nan, "NaN"), (inf, "inf")) if n]
                found[name] = f"{', '.join(counts)} of {tensor.numel()} values"
        return found

    def check_finite_weights(
        self,
        where: str | Path = "the head",
        tensor_name: Callable[[str], str] | None = None,
        once: bool = False,
    ) -> None:
        """Raise a `ValueError` naming every tensor of the head that holds NaN or inf ([`nonfinite_tensors`]): such a
        head loads and runs, but its drafts are garbage and none is accepted.  `where` names the head (its folder);
        `tensor_name` spells a tensor name as the checkpoint's layout does.  With `once=True` (generate() checks
        each head passed to it) a head object that passed before is not read again, so a call costs nothing."""
        if once and getattr(self, "_finite_weights_checked", False):
            return
        bad = self.nonfinite_tensors()
        if bad:
            spell = tensor_name or (lambda name: name)
            listed = "; ".join(f"{spell(name)!r}: {what}" for name, what in bad.items())
            raise ValueError(
                f"{where}: tensors {[spell(n) for n in bad]} hold NaN or inf values ({listed}); a head with them "
                "drafts nothing useful (a diverged training run or a damaged file?). Expected finite weights: "
                "retrain the head or load an earlier checkpoint."
            )
        self._finite_weights_checked = True

    def attach_target(self, target: PreTrainedModel) -> PEagleDrafter:
        """Check the head against `target`; with `embed_from_target`, take the target's (frozen) embeddings."""
        self.check_target(target)
        if self.config.embed_from_target:
            weight = target.get_input_embeddings().weight
            emb = self.embed_tokens
            if weight.dtype == emb.weight.dtype and weight.device == emb.weight.device:
                emb.weight = weight
            else:
                emb.weight = nn.Parameter(
                    weight.detach().to(emb.weight.device, emb.weight.dtype), requires_grad=False
                )
            emb.weight.requires_grad_(False)
        return self

    # ------------------------------------------------------------------ forward
    def project_target_hidden_states(self, target_hidden_states: torch.Tensor) -> torch.Tensor:
        """`fc` over concatenated target features `(..., 3 * target_hidden_size) -> (..., hidden_size)`."""
        expected = 3 * self.config.target_hidden_size
        if target_hidden_states.shape[-1] != expected:
            raise ValueError(
                f"target hidden states have width {target_hidden_states.shape[-1]}; expected {expected} "
                f"(3 aux layers x target_hidden_size {self.config.target_hidden_size})."
            )
        return self.fc(target_hidden_states.to(self.mask_hidden.dtype))  # not fc.weight: FP8 heads store e4m3

    def _attention_mask(self, attention_mask, inputs_embeds, cache, position_ids) -> torch.Tensor | None:
        """A 4D boolean mask (True = attend) is converted for the active attention implementation;
        anything else goes through transformers' `create_causal_mask`."""
        if (
            isinstance(attention_mask, torch.Tensor)
            and attention_mask.dim() == 4
            and attention_mask.dtype == torch.bool
        ):
            return custom_attention_mask(
                attention_mask, self.config._attn_implementation, inputs_embeds.dtype
            )
        return create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **cache_kwarg(cache),
        )

    @deprecate_kwarg("past_key_values", version="5.40.0", new_name="cache")
    def forward(
        self,
        input_ids: torch.LongTensor,
        target_hidden_states: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        parallel_mask: torch.BoolTensor | None = None,
        projected_hidden_states: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> PEagleDrafterOutput:
        """Run the drafter over a block of slots.

        Args:
            input_ids: `(B, T)` token of each slot (the token *after* the feature's position).
            target_hidden_states: `(B, T, 3 * target_hidden_size)` concatenated target features per slot;
                ignored at parallel slots.
            position_ids: `(B, T)` RoPE positions; default continues the cache.
            cache: drafter cache (`DynamicCache`); new slots are appended when `use_cache`. `past_key_values`,
                transformers' name before 5.24, is accepted with a deprecation warning.
            attention_mask: `None` (causal), a 2D padding mask, or a 4D `(B, 1, T, past+T)` boolean mask
                (True = attend), e.g. the P-EAGLE training mask.
            parallel_mask: `(B, T)` True at parallel (mask) slots; default `input_ids == mask_token_id`.
                Those slots get the mask embedding and `fc(mask_hidden)`.
            projected_hidden_states: `(B, T, hidden_size)` hidden inputs that skip `fc` (EAGLE-3 feeds the
                drafter's own `last_hidden_state` back this way); replaces `target_hidden_states`.
            logits_to_keep: compute logits for the last N slots only (0 = all).
        """
        if parallel_mask is None:
            parallel_mask = input_ids == self.config.mask_token_id
        if projected_hidden_states is not None:
            hidden = projected_hidden_states
        elif target_hidden_states is not None:
            hidden = self.project_target_hidden_states(target_hidden_states)
        elif bool(parallel_mask.all()):
            hidden = None
        else:
            raise ValueError(
                "forward needs target_hidden_states (or projected_hidden_states) for non-parallel slots."
            )
        inputs_embeds = self.embed_tokens(input_ids)
        # no host read of the mask (a stall per drafting round on an accelerator): where it selects nothing,
        # `torch.where` leaves every slot as it is
        dtype = inputs_embeds.dtype
        mask_feat = self.fc(self.mask_hidden).to(dtype).expand(*input_ids.shape, -1)
        hidden = (
            mask_feat
            if hidden is None
            else torch.where(parallel_mask[..., None], mask_feat, hidden.to(dtype))
        )
        inputs_embeds = torch.where(parallel_mask[..., None], self.mask_vector.to(dtype), inputs_embeds)

        if use_cache is None:
            use_cache = cache is not None
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(input_ids.shape[1], device=input_ids.device) + past).unsqueeze(0)
            position_ids = position_ids.expand(input_ids.shape[0], -1)

        mask = self._attention_mask(attention_mask, inputs_embeds, cache, position_ids)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids=position_ids)
        if not use_cache:
            cache = None
        hidden = self.layers[0](
            inputs_embeds,
            hidden,
            attention_mask=mask,
            position_embeddings=position_embeddings,
            cache=cache,
            **kwargs,
        )
        for layer in self.layers[1:]:
            hidden = layer(
                hidden,
                attention_mask=mask,
                position_ids=position_ids,
                position_embeddings=position_embeddings,
                **cache_kwarg(cache),
                **kwargs,
            )
        kept = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        logits = self.lm_head(self.norm(kept))
        return PEagleDrafterOutput(logits=logits, last_hidden_state=hidden, cache=cache)


__all__ = [
    "PEagleDrafter",
    "PEaglePreTrainedModel",
    "PEagleDrafterOutput",
]
