"""vLLM general plugin: adapts tpu-inference, then puts our architectures into its registry
and our reasoning parser (`--reasoning-parser tunix`, tpu_models.reasoning) into vLLM's.

vLLM runs it in every process (API server, engine core, workers), possibly more
than once, so it only adapts (tpu_models.adapt) and registers, idempotently.
"""

REASONING_PARSERS = {"tunix": ("tpu_models.reasoning", "TunixReasoningParser")}


def register() -> None:
    from tpu_inference.layers.common.attention_backend import (
        _REGISTERED_BACKENDS, register_attention_backend)
    from tpu_inference.models.common.model_loader import _MODEL_REGISTRY, register_model

    from vllm.reasoning import ReasoningParserManager

    from tpu_models import adapt, features, off_tpu, registry, runtime
    from tpu_models.adapt import loading
    from tpu_models.attention import PortableAttentionBackend
    from tpu_models.sampler import requests

    adapt.apply()
    # The seam's part in building and loading our models (the core imports no patch).
    if not runtime.SEAM.build_checks:
        runtime.SEAM.build_checks += [
            features.require,  # features whose adaptation cannot apply here
            lambda config, _model: requests.check_server_defaults(config)]
    runtime.SEAM.cast_by_loader = off_tpu.mark if loading.installed() else None
    for arch in registry.architectures():
        if arch.model is None or arch.hf_name in _MODEL_REGISTRY:
            continue
        if arch.new_to_vllm:
            # register_model also adds a vLLM-side placeholder, so that vLLM's
            # config validation accepts an architecture it does not know.
            register_model(arch.hf_name, arch.model_class())
        else:
            # vLLM runs it in PyTorch: register_model would replace vLLM's class with
            # a JAX placeholder (breaking MODEL_IMPL_TYPE=vllm); tpu-inference's
            # registry is the dict it writes into.
            _MODEL_REGISTRY[arch.hf_name] = arch.model_class()
    if PortableAttentionBackend.name not in _REGISTERED_BACKENDS:
        register_attention_backend(
            PortableAttentionBackend.name, attention=PortableAttentionBackend,
            vllm_backend="tpu_models.vllm_attention.PortableVllmAttentionBackend")
    # By name, imported on first use. `vllm serve` loads general plugins while it
    # builds its argument parser, before it checks --reasoning-parser's choice.
    for name, (module, class_name) in REASONING_PARSERS.items():
        ReasoningParserManager.register_lazy_module(name, module, class_name)
