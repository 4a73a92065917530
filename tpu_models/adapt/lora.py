"""LoRA: --enable-lora on our models, adapters held in tpu_models.lora_slots's slots."""

from tpu_models.features import LORA
from tpu_models.patching import Patch, Target
from tpu_models.registry import our_model


def load_model_with_adapter_slots(original, self, *args, **kwargs):
    """TPUModelRunner.load_model: on our models, AdapterSlots are the lora_manager."""
    from tpu_models import lora_slots
    original(self, *args, **kwargs)
    if self.lora_config is not None and our_model(self.vllm_config) is not None:
        lora_slots.serve_from_slots(self)


def set_active_loras_in_slots(original, self, num_scheduled_tokens_per_req,
                              total_num_scheduled_tokens, padded_total_num_scheduled_tokens):
    """LoraUtils.set_active_loras: each token mapped onto its adapter's slot."""
    from tpu_models import lora_slots
    if lora_slots.of_runner(self.runner) is None:
        return original(self, num_scheduled_tokens_per_req, total_num_scheduled_tokens,
                        padded_total_num_scheduled_tokens)
    lora_slots.set_active_loras(self.runner, num_scheduled_tokens_per_req,
                                total_num_scheduled_tokens, padded_total_num_scheduled_tokens)


def extract_lora_metadata_of_slots(original, self):
    """LoraUtils.extract_lora_metadata: the slots' LoraBatch, the model's `lora_metadata`."""
    from tpu_models import lora_slots
    slots = lora_slots.of_runner(self.runner)
    return original(self) if slots is None else slots.batch()


async def check_load_lora_adapter_request_reading_it(original, self, request):
    """OpenAIServingModels._check_load_lora_adapter_request: on our models, an adapter
    the slots cannot take refused here, by name (lora_slots.load_refusal)."""
    refused = await original(self, request)
    vllm_config = self.engine_client.vllm_config
    if refused is not None or vllm_config.lora_config is None or (
            model_class := our_model(vllm_config)) is None:
        return refused
    from tpu_models import lora_slots
    return lora_slots.load_refusal(request, model_class.checkpoint_table(
        self.model_config.hf_text_config), vllm_config.lora_config.max_lora_rank)


RUNNER = "tpu_inference.runner"
PATCHES = [
    Patch("adapter slots for our models", LORA, (
        Target(f"{RUNNER}.tpu_runner.TPUModelRunner.load_model", "self",
               load_model_with_adapter_slots),
        Target(f"{RUNNER}.tpu_runner.TPUModelRunner._set_active_loras",
               "self prompt_lora_mapping token_lora_mapping lora_requests mapping_type"),
        Target(f"{RUNNER}.lora_utils.LoraUtils.set_active_loras",
               "self num_scheduled_tokens_per_req total_num_scheduled_tokens "
               "padded_total_num_scheduled_tokens", set_active_loras_in_slots),
        Target(f"{RUNNER}.lora_utils.LoraUtils.extract_lora_metadata", "self",
               extract_lora_metadata_of_slots)),
        "the engine's warm-up stopped at 'LoRA is not enabled' for flax_nnx models",
        "tests/test_multi_lora.py::test_served_adapters_share_batches_load_and_unload"),
    Patch("adapters checked in the API server", LORA, (
        Target("vllm.entrypoints.openai.models.serving.OpenAIServingModels"
               "._check_load_lora_adapter_request", "self request",
               check_load_lora_adapter_request_reading_it), ),
        "a bad adapter got a 500 from the engine instead of a 400 naming it",
        "tests/test_multi_lora.py::test_adapters_the_slots_cannot_take_are_refused_by_name"),
]
