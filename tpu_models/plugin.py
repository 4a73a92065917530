"""vLLM general plugin: puts our architectures into tpu-inference's registry.

vLLM runs it in every process (API server, engine core, workers), possibly more
than once, so it only registers, idempotently.
"""

# Architectures vLLM does not know: registered with tpu-inference *and* vLLM
# (register_model adds a vLLM-side placeholder so config validation accepts it).
NEW_ARCHITECTURES = {
    "Qwen3StructuralForCausalLM": "tpu_models.qwen3_structural",
}
# Architectures vLLM already runs in PyTorch: registered with tpu-inference only,
# so MODEL_IMPL_TYPE=vllm keeps vLLM's own implementation.
NATIVE_ARCHITECTURES = {
    "Gemma3ForCausalLM": "tpu_models.gemma3",
}


def register() -> None:
    import importlib

    from tpu_inference.layers.common.attention_backend import (
        _REGISTERED_BACKENDS, register_attention_backend)
    from tpu_inference.models.common.model_loader import _MODEL_REGISTRY, register_model

    from tpu_models import compat
    from tpu_models.attention import PortableAttentionBackend

    compat.install()

    for arch, module in NEW_ARCHITECTURES.items():
        if arch not in _MODEL_REGISTRY:
            register_model(arch, getattr(importlib.import_module(module), arch))
    for arch, module in NATIVE_ARCHITECTURES.items():
        # register_model would also replace vLLM's PyTorch class with a JAX
        # placeholder; tpu-inference's registry is the dict it writes into.
        _MODEL_REGISTRY.setdefault(arch, getattr(importlib.import_module(module), arch))
    if PortableAttentionBackend.name not in _REGISTERED_BACKENDS:
        register_attention_backend(
            PortableAttentionBackend.name, attention=PortableAttentionBackend,
            vllm_backend="tpu_models.vllm_attention.PortableVllmAttentionBackend")
