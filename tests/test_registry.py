"""Our plugin adds architectures without taking vLLM's own away."""

from tpu_models.harness.stepper import load_plugins


def test_vllm_keeps_its_pytorch_models_and_knows_ours():
    load_plugins()
    from tpu_inference.models.common.model_loader import _MODEL_REGISTRY
    from vllm.model_executor.models.registry import ModelRegistry

    from tpu_models.gemma3.model import Gemma3ForCausalLM
    from tpu_models.qwen3_structural.model import Qwen3StructuralForCausalLM

    # flax_nnx resolves to ours...
    assert _MODEL_REGISTRY["Gemma3ForCausalLM"] is Gemma3ForCausalLM
    assert _MODEL_REGISTRY["Qwen3StructuralForCausalLM"] is Qwen3StructuralForCausalLM
    # ...while MODEL_IMPL_TYPE=vllm still gets vLLM's PyTorch classes.
    for arch, module in [("Gemma3ForCausalLM", "vllm.model_executor.models.gemma3"),
                         ("Qwen3ForCausalLM", "vllm.model_executor.models.qwen3"),
                         ("LlamaForCausalLM", "vllm.model_executor.models.llama")]:
        cls = ModelRegistry._try_load_model_cls(arch)
        assert cls is not None and cls.__module__ == module, arch
    # vLLM accepts our new architecture (a JAX placeholder on its side).
    assert "Qwen3StructuralForCausalLM" in ModelRegistry.get_supported_archs()
