"""The architectures hybrid_scale converts, one record each: the Hugging Face causal-LM class, its model_type, the
class-name prefix (transformers' {prefix}Config and {prefix}ForCausalLM; an export's HybridScale{prefix}Config and
HybridScale{prefix}ForCausalLM, made from the record by configuration_/modeling_hybrid_scale.py), its tensor-parallel
plan (distributed/tensor_parallel.py's TP_PLANS), the model_type of an export made from it, and what differs. Adding
an architecture is one record here and its tiny model in tests/conftest.py's ARCHS (conversion, export and the TP
plan's tests run over them). The attention module of all of them
has q/k/v/o_proj, scaling and head_dim and takes the model's rotary embeddings, so one conversion serves them all.
(Inside attention/ so that an export, which copies this folder, knows the same table.)"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    hf_class: str  # e.g. LlamaForCausalLM
    model_type: str  # config.json's model_type, e.g. llama
    prefix: str  # class-name prefix: LlamaDecoderLayer, LlamaRotaryEmbedding, HybridScaleLlamaConfig
    note: str  # what differs
    tp_plan: str = "llama_like"  # its tensor-parallel plan (distributed/tensor_parallel.py TP_PLANS)

    @property
    def export_type(self) -> str:
        """config.json's model_type of an export: its own, so that loading needs trust_remote_code."""
        return f"hybrid_scale_{self.model_type}"


ARCHITECTURES = {
    a.hf_class: a
    for a in (
        Architecture("LlamaForCausalLM", "llama", "Llama", "Llama 2/3 (rope_parameters incl. llama3 scaling)"),
        Architecture(
            "MistralForCausalLM",
            "mistral",
            "Mistral",
            "Mistral (its own sliding_window applies only to layers left unconverted)",
        ),
        Architecture("Qwen2ForCausalLM", "qwen2", "Qwen2", "Qwen2 (q/k/v biases)"),
        Architecture(
            "GraniteForCausalLM",
            "granite",
            "Granite",
            "IBM Granite 3 (attention_multiplier as the scores' scale; the embedding, residual and logits multipliers "
            "stay in the model)",
        ),
    )
}
BY_MODEL_TYPE = {a.model_type: a for a in ARCHITECTURES.values()}
BY_EXPORT_TYPE = {a.export_type: a for a in ARCHITECTURES.values()}


def base_model_type(model_type: str | None) -> str | None:
    """The base architecture's model_type of an export's model_type; any other model_type as it is."""
    return BY_EXPORT_TYPE[model_type].model_type if model_type in BY_EXPORT_TYPE else model_type
