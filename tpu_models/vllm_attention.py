"""The vLLM-side half of the portable attention backend (MODEL_IMPL_TYPE=vllm).

tpu-inference's register_attention_backend names a vLLM attention backend class
for models that run through vLLM's PyTorch definitions (torchax): its impl
names the tpu-inference backend to call. Imported by class path only, when
`--attention-backend portable` is selected for such a model.
"""

from tpu_inference.layers.vllm.backends.flash_attn import (PallasAttentionBackend,
                                                           PallasAttentionBackendImpl)


class PortableAttentionImpl(PallasAttentionBackendImpl):
    attention_backend = "portable"


class PortableVllmAttentionBackend(PallasAttentionBackend):

    @staticmethod
    def get_name() -> str:
        return "PORTABLE"

    @staticmethod
    def get_impl_cls() -> type[PortableAttentionImpl]:
        return PortableAttentionImpl
