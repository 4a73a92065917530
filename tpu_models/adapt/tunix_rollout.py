"""Tunix's VllmSampler (google-tunix 0.1.5) on vLLM 0.32 and tpu-inference 0.32.

Installed by `import tpu_models.tunix`, not by the plugin; what each patch
changes and why: tpu_models.tunix_sampler.
"""

from tpu_models import tunix_sampler
from tpu_models.features import TUNIX_ROLLOUTS
from tpu_models.patching import Patch, Target


def vllm_config_vllm_takes(original, self, config):
    """VllmSampler._vllm_config: engine arguments vLLM 0.32 takes (and LoRA slots)."""
    return tunix_sampler.engine_arguments(original(self, config), config)


def tokenize_as_tunix_samples(original, self, input_string):
    """VllmSampler.tokenize: no EOS appended, as Tunix's own Sampler."""
    return tunix_sampler.tokenized(self.tokenizer, input_string)


def call_with_seeds_and_adapter(original, self, *args, **kwargs):
    """VllmSampler.__call__: per-request seeds, the trainer's adapter, no prompt log-probs."""
    with tunix_sampler.requests_seeded_and_adapted(self, original, *args, **kwargs):
        return original(self, *args, **kwargs)


def update_params_reaching_the_step(original, self, updated_weights, filter_types=None):
    """VllmSampler.update_params: our mapping copies the weights itself; for any
    mapping, the runner and the prefix cache refreshed after."""
    mapping = tunix_sampler.ours(self)
    if mapping is not None:
        mapping.sync(updated_weights, self._model_runner)
    else:
        original(self, updated_weights, filter_types)
    tunix_sampler.engine_refreshed(self)


def quantize_keeping_pytree_mode(original, model, provider, *model_inputs,
                                 call_method="__call__", **model_inputs_kwargs):
    """qwix's quantize_nnx_model: a LoRA model as its model's pytree, A and B placed."""
    quantized = original(model, provider, *model_inputs, call_method=call_method,
                         **model_inputs_kwargs)
    return tunix_sampler.lora_model_repaired(quantized, call_method)


SAMPLER = "tunix.generate.vllm_sampler.VllmSampler"
TEST = "tests/test_tunix_rollouts.py"
PATCHES = [
    Patch("engine arguments vLLM 0.32 takes", TUNIX_ROLLOUTS,
          (Target(f"{SAMPLER}._vllm_config", "self config", vllm_config_vllm_takes), ),
          "VllmSampler stopped at EngineArgs(swap_space=...), which vLLM 0.32 no longer has",
          f"{TEST}::test_rollouts_equal_tunix_sampler_at_load_and_after_each_sync"),
    Patch("prompts without an appended EOS", TUNIX_ROLLOUTS,
          (Target(f"{SAMPLER}.tokenize", "self input_string", tokenize_as_tunix_samples), ),
          "every vLLM rollout prompt ended in EOS, unlike Tunix's Sampler's",
          f"{TEST}::test_rollouts_equal_tunix_sampler_at_load_and_after_each_sync"),
    Patch("per-request seeds, the trainer's adapter, no prompt log-probs", TUNIX_ROLLOUTS,
          (Target(f"{SAMPLER}.__call__", "self input_strings max_generation_steps "
                  "max_prompt_length temperature top_p top_k beam_size seed multi_sampling "
                  "return_logits echo pad_output", call_with_seeds_and_adapter), ),
          "RolloutConfig.seed never reached vLLM; a LoRA in slots was not applied",
          f"{TEST}::test_seeded_rollouts_repeat_and_rows_differ"),
    Patch("synced weights reach the step", TUNIX_ROLLOUTS,
          (Target(f"{SAMPLER}.update_params", "self updated_weights filter_types",
                  update_params_reaching_the_step),
           Target("tpu_inference.runner.tpu_runner.TPUModelRunner.refresh_state_leaves", "self")),
          "after a sync the runner ran its previous arrays (random after a dummy load) and "
          "reused stale prefix KV",
          f"{TEST}::test_rollouts_equal_tunix_sampler_at_load_and_after_each_sync"),
    Patch("qwix LoRA models keep their pytree mode", TUNIX_ROLLOUTS,
          (Target("qwix._src.model.quantize_nnx_model",
                  "model provider model_inputs call_method model_inputs_kwargs",
                  quantize_keeping_pytree_mode), ),
          "a Tunix model with qwix LoRA had an empty nnx.state: no LoRA parameter to train or sync",
          f"{TEST}::test_lora_rollouts_equal_tunix_sampler_merged_and_in_slots"),
]
