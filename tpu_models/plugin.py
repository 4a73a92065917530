"""vLLM general plugin: puts our architectures into tpu-inference's registry.

vLLM runs it in every process (API server, engine core, workers), possibly more
than once, so it only registers and is idempotent.
"""

ARCHITECTURES = {
    "Qwen3StructuralForCausalLM": "tpu_models.qwen3_structural",
}


def register() -> None:
    import importlib

    from tpu_inference.layers.common.attention_backend import (
        _REGISTERED_BACKENDS, register_attention_backend)
    from tpu_inference.models.common.model_loader import _MODEL_REGISTRY, register_model

    from tpu_models.attention import PortableAttentionBackend

    for arch, module in ARCHITECTURES.items():
        if arch not in _MODEL_REGISTRY:
            register_model(arch, getattr(importlib.import_module(module), arch))
    if PortableAttentionBackend.name not in _REGISTERED_BACKENDS:
        register_attention_backend(
            PortableAttentionBackend.name, attention=PortableAttentionBackend,
            vllm_backend="tpu_models.vllm_attention.PortableVllmAttentionBackend")
