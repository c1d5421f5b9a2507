"""Import and export of drafter heads in the checkpoint layouts found in the wild.

`PEagleDrafter.from_pretrained` calls `inspect_checkpoint` and, for a foreign layout, `load_converted`;
users never pick a layout by hand (`loading`).  The layouts (`detect_layout`):

- ``"peagle"``: this library's own (`config.json` with `model_type: "peagle"`), loaded by transformers
  after `check_native` has checked every tensor's shape against the config.
- ``"vllm"``: AWS P-EAGLE heads, i.e. vLLM's EAGLE-3 Llama drafter with parallel drafting.  Flat Llama
  `config.json` (`num_hidden_layers` counts the fused first layer) plus `draft_vocab_size`,
  `ptd_token_id` / `pard_token` / `mask_token_id`, optional `target_hidden_size`,
  `eagle_aux_hidden_state_layer_ids` (or `eagle_config.eagle_aux_hidden_state_layer_ids`),
  `norm_before_residual`, `attention_bias`, `head_dim`, `rope_scaling`.  Tensors without a `model.`
  prefix: `embed_tokens.weight`, `fc.weight`, `mask_hidden` (3H elements), `midlayer.*` (layer 0),
  `layers.N.*`, `norm.weight`, `lm_head.weight`, `d2t` (offsets), `t2d`.
- ``"speculators"``: vllm-project/speculators (`speculators_model_type` "peagle" or "eagle3", nested
  `transformer_layer_config`, `mask_token_id`, layer 0 stored as `layers.0.*` with `hidden_norm`).
- ``"eagle3"``: EAGLE-3 research heads (SafeAILab / SpecForge / vLLM EAGLE-3 without a mask token):
  the vLLM tensor names without `mask_hidden`; loaded with `drafting_mode="autoregressive"`.

`export(head, out_dir, layout=...)` (`exporting`) writes ``"vllm"``, ``"speculators"`` or ``"peagle"``.

Names and semantics checked against (read through the code-search index, July 2026):

- vLLM `vllm/model_executor/models/llama_eagle3.py` @ 00bd1493b3e8: `Eagle3LlamaForCausalLM.load_weights`
  maps `midlayer.` -> `layers.0.`, `d2t` -> `draft_id_to_target_id`, skips `t2d`, prefixes every other
  non-`lm_head` name with `model.`, copies `mask_hidden` with `.view(1, -1)` into a `(1, 3 * hidden_size)`
  buffer and raises "mask_hidden not found in weights" without it; `embed_tokens` may be absent (shared
  from the target); q/k/v bias from `attention_bias`; `norm_before_residual` defaults to False.
- vLLM `vllm/v1/spec_decode/llm_base_proposer.py` @ 00c4f22dae47: the mask id is read from
  `mask_token_id`, `pard_token` or `ptd_token_id` (older releases: `pard_token` / `ptd_token_id` only);
  `mask_hidden` goes through `fc` like real features; draft embeddings identical to the target's are
  replaced by the target's.
- vLLM model registry: `LlamaForCausalLMEagle3`, `Eagle3LlamaForCausalLM`, `PEagleDraftModel`,
  `PeagleLlamaForCausalLM` all map to `llama_eagle3.Eagle3LlamaForCausalLM`; aux layer ids are read from
  `eagle_aux_hidden_state_layer_ids` or `eagle_config.eagle_aux_hidden_state_layer_ids` and index the
  input of target layer i (vLLM captures hidden + residual before layer i runs).
- vLLM `vllm/transformers_utils/configs/speculators/{base,algos}.py`: `transformer_layer_config` is
  flattened into the draft config; `speculators_config.proposal_methods[0].speculative_tokens` and
  `speculators_config.verifier.name_or_path` are required; eagle3 defaults `norm_before_residual` to
  True, peagle to False; peagle copies `mask_token_id` to `pard_token`; `norm_before_fc` adds an
  RMSNorm before `fc` (not supported here).
- speculators `src/speculators/config.py` @ 03a7c149, `models/eagle3/config.py` @ 11ecdd33,
  `models/eagle3/core.py` @ 033c87f2, `models/eagle3/model_definitions.py` @ 08af5f4d,
  `models/peagle/config.py` @ 0d202e28 / ff325b26 (older configs call the mask id `ptd_token_id`).
- SafeAILab/EAGLE `eagle/model/cnets.py` @ 148042c5: `midlayer` (`hidden_norm`, `input_layernorm`,
  `post_attention_layernorm`, no attention bias), residual = the un-normed hidden state.
"""

from .exporting import cli_export, export, load_target_model, speculators_config, vllm_config
from .loading import (
    EXPORT_LAYOUTS,
    LAYOUTS,
    VLLM_ARCHITECTURE,
    VLLM_EAGLE3_ARCHITECTURES,
    Checkpoint,
    check_native,
    detect_layout,
    inspect_checkpoint,
    load_converted,
    resolve_folder,
    weight_files,
)

__all__ = [
    "Checkpoint",
    "LAYOUTS",
    "EXPORT_LAYOUTS",
    "VLLM_ARCHITECTURE",
    "VLLM_EAGLE3_ARCHITECTURES",
    "detect_layout",
    "inspect_checkpoint",
    "check_native",
    "load_converted",
    "resolve_folder",
    "weight_files",
    "export",
    "vllm_config",
    "speculators_config",
    "load_target_model",
    "cli_export",
]
