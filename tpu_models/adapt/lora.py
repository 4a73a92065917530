"""LoRA: --enable-lora on our models, adapters held in tpu_models.lora_slots's slots.

tpu-inference builds a LoRA manager only for PyTorch models (its flax_nnx loader
returns none, and its LoraUtils reads a torch Punica wrapper). Here the runner
gets our AdapterSlots as its lora_manager, each step's tokens are mapped onto
slots, and the model is handed the slots as its `lora_metadata` argument.
"""

from tpu_models.adapt.guard import LORA, Patch, Target, our_model


def adapter_slots_for_our_models() -> None:
    import numpy as np
    from tpu_inference.runner.lora_utils import LoraUtils
    from tpu_inference.runner.tpu_runner import TPUModelRunner

    from tpu_models.lora_slots import AdapterSlots

    original_load = TPUModelRunner.load_model
    original_set_active = LoraUtils.set_active_loras
    original_extract = LoraUtils.extract_lora_metadata

    def load_model(self, *args, **kwargs):
        original_load(self, *args, **kwargs)
        if self.lora_config is not None and our_model(self.vllm_config) is not None:
            self.lora_manager = self.model.adapter_slots(self.mesh)
            self.compute_logits_fn = _WithoutLora(self.compute_logits_fn)

    def set_active_loras(self, num_scheduled_tokens_per_req, total, padded_total):
        if not isinstance(getattr(self.runner, "lora_manager", None), AdapterSlots):
            return original_set_active(self, num_scheduled_tokens_per_req, total, padded_total)
        counts = np.copy(num_scheduled_tokens_per_req)
        counts[-1] += padded_total - total  # padding rows: the last request's adapter
        prompt, tokens, requests = self.runner.input_batch.make_lora_inputs(counts)
        self.runner._set_active_loras(prompt, tokens, requests)

    def extract_lora_metadata(self):
        manager = getattr(self.runner, "lora_manager", None)
        if isinstance(manager, AdapterSlots):
            return manager.batch()
        return original_extract(self)

    TPUModelRunner.load_model = load_model
    LoraUtils.set_active_loras = set_active_loras
    LoraUtils.extract_lora_metadata = extract_lora_metadata


class _WithoutLora:
    """compute_logits without the step's LoRA batch: the vocab projection is no
    target, and per-token slots would give it a new shape to compile per batch.
    The runner's warm-up lowers it, hence `lower`."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, state, hidden, _lora=None, **kwargs):
        return self.fn(state, hidden, None, **kwargs)

    def lower(self, state, hidden, _lora=None, **kwargs):
        return self.fn.lower(state, hidden, None, **kwargs)


def adapters_checked_before_loading() -> None:
    # vLLM answers any failure inside the engine with a 500: read and check the
    # adapter in the API server first, so a bad one gets a 400 naming the fault.
    from http import HTTPStatus

    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.entrypoints.serve import create_error_response

    from tpu_models.lora_slots import AdapterError, read_adapter

    original = OpenAIServingModels._check_load_lora_adapter_request

    async def check(self, request):
        refused = await original(self, request)
        if refused is not None:
            return refused
        vllm_config = self.engine_client.vllm_config
        model_class = our_model(vllm_config)
        if model_class is None or vllm_config.lora_config is None:
            return None
        table = model_class.checkpoint_table(self.model_config.hf_text_config)
        try:
            read_adapter(request.lora_name, request.lora_path, base_table=table,
                         max_rank=vllm_config.lora_config.max_lora_rank)
        except AdapterError as e:
            return create_error_response(message=str(e), err_type="BadRequestError",
                                         status_code=HTTPStatus.BAD_REQUEST)
        return None

    OpenAIServingModels._check_load_lora_adapter_request = check


RUNNER = "tpu_inference.runner"
PATCHES = [
    Patch("adapter slots for our models", LORA, (
        Target(f"{RUNNER}.tpu_runner.TPUModelRunner.load_model", "self"),
        Target(f"{RUNNER}.tpu_runner.TPUModelRunner._set_active_loras",
               "self prompt_lora_mapping token_lora_mapping lora_requests mapping_type"),
        Target(f"{RUNNER}.lora_utils.LoraUtils.set_active_loras",
               "self num_scheduled_tokens_per_req total_num_scheduled_tokens "
               "padded_total_num_scheduled_tokens"),
        Target(f"{RUNNER}.lora_utils.LoraUtils.extract_lora_metadata", "self")),
        "the engine's warm-up stopped at 'LoRA is not enabled' for flax_nnx models",
        "tests/test_multi_lora.py::test_served_adapters_share_batches_load_and_unload",
        adapter_slots_for_our_models),
    Patch("adapters checked in the API server", LORA, (
        Target("vllm.entrypoints.openai.models.serving.OpenAIServingModels"
               "._check_load_lora_adapter_request", "self request"), ),
        "a bad adapter got a 500 from the engine instead of a 400 naming it",
        "tests/test_multi_lora.py::test_adapters_the_slots_cannot_take_are_refused_by_name",
        adapters_checked_before_loading),
]
