"""Tunix's VllmSampler (google-tunix 0.1.5) on vLLM 0.32 and tpu-inference 0.32.

Installed by `import tpu_models.tunix`, not by the plugin: the vLLM processes a
server starts never import Tunix.
- Its engine arguments carry `swap_space`, which vLLM 0.32's EngineArgs no longer
  takes (vLLM refused to start); an adapter in our LoRA slots needs --enable-lora.
- Its prompts gained the EOS id at their end, which Tunix's own Sampler does not
  add: the rollout engine answered another prompt than the trainer scores.
- Its per-request `seed` is dropped ("vLLM Jax backend doesn't support per request
  seed"); ours applies it: request i of a call gets seed + i, so a batch's rows
  differ and two rollouts with the same seed agree.
- It asks for prompt log-probabilities and never reads them: a vocabulary-wide
  projection and softmax per prompt token (262,144 wide on Gemma 3). Not asked.
- A weight sync wrote into the runner's `state` and left `state_leaves`, which
  the runner dispatches with: rollouts went on with the weights of before
  (random ones, after a dummy load). And the prefix cache kept KV blocks computed
  with the old weights. Both are refreshed after every sync, for any mapping;
  a mapping with its own copy (tpu_models.tunix.RolloutMapping) is used for it.
- qwix 0.1.2 (tpu-inference's pin) gives a LoRA model a subclass of the model's
  class that is a flax pytree where Tunix's models are not (flax 0.12): the LoRA
  model's nnx.state was empty, so nothing could be trained or synced. And its A
  and B kept the weight's partition spec (more axes than they have).
"""

import dataclasses
import inspect

from tpu_models.adapt.guard import TUNIX_ROLLOUTS, Patch, Target

SAMPLER = "tunix.generate.vllm_sampler.VllmSampler"
# The adapter every rollout of a mapping in "slots" mode runs with (tpu_models.tunix
# writes it into the engine's LoRA slots; vLLM's LoRA ids start at 1).
ADAPTER_NAME, ADAPTER_ID, ADAPTER_PATH = "tunix-trainer", 1, "in memory: synced from the trainer"


def _ours(sampler):
    """The sampler's mapping when it copies itself (tpu_models.tunix), else None."""
    mapping = sampler.config.mapping_config
    return mapping if callable(getattr(mapping, "sync", None)) else None


def engine_arguments() -> None:
    from tunix.generate.vllm_sampler import VllmSampler
    from vllm.engine.arg_utils import EngineArgs

    original = VllmSampler._vllm_config
    fields = {f.name for f in dataclasses.fields(EngineArgs)}

    def _vllm_config(self, config):
        args = original(self, config)
        for name in [k for k in args if k not in fields]:
            del args[name]  # swap_space: the KV cache never swaps in vLLM 0.32
        mapping = config.mapping_config
        if callable(getattr(mapping, "sync", None)) and mapping.dtype:
            args.setdefault("dtype", mapping.dtype)
        if callable(getattr(mapping, "sync", None)) and mapping.lora_mode == "slots":
            if config.server_mode:
                raise ValueError("tpu_models.tunix: lora='slots' rollouts run with "
                                 "rollout_vllm_server_mode=False")
            args.update(enable_lora=True, max_loras=1, max_lora_rank=_lora_rank(mapping.lora_rank))
        return args

    VllmSampler._vllm_config = _vllm_config


def _lora_rank(rank: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that holds `rank` (slots pad with zeros)."""
    import typing

    from vllm.config.lora import LoRAConfig
    allowed = sorted(typing.get_args(typing.get_type_hints(LoRAConfig)["max_lora_rank"]))
    fits = [r for r in allowed if r >= rank]
    if not fits:
        raise ValueError(f"LoRA rank {rank} is above vLLM's largest, {allowed[-1]}")
    return fits[0]


def prompts_as_tunix_samples_them() -> None:
    from tunix.generate.vllm_sampler import VllmSampler

    def tokenize(self, input_string):
        ids = self.tokenizer.encode(input_string)
        bos = self.tokenizer.bos_id()
        return ([bos] if bos and (not ids or ids[0] != bos) else []) + ids

    VllmSampler.tokenize = tokenize


def seeds_and_adapter_per_request() -> None:
    from tunix.generate.vllm_sampler import VllmSampler
    from vllm.lora.request import LoRARequest

    original = VllmSampler.__call__
    signature = inspect.signature(original)

    def __call__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        seed = _seed(bound.arguments.get("seed"))
        mapping = _ours(self)
        adapter = (LoRARequest(ADAPTER_NAME, ADAPTER_ID, ADAPTER_PATH)
                   if mapping is not None and mapping.lora_mode == "slots" else None)
        if self.llm is None:
            return original(self, *args, **kwargs)
        generate = self.llm.generate

        def per_request(prompts, sampling_params=None, **options):
            params = []
            for i in range(len(prompts)):
                p = sampling_params.clone()
                p.prompt_logprobs = None
                if seed is not None:
                    p.seed = seed + i
                params.append(p)
            if adapter is not None:
                options["lora_request"] = adapter
            return generate(prompts, sampling_params=params, **options)

        self.llm.generate = per_request
        try:
            return original(self, *args, **kwargs)
        finally:
            del self.llm.generate

    VllmSampler.__call__ = __call__


def _seed(seed) -> int | None:
    """RolloutConfig.seed (an int, an integer array or a JAX key) as vLLM's int seed."""
    if seed is None:
        return None
    import jax
    import numpy as np
    if isinstance(seed, jax.Array) and jax.dtypes.issubdtype(seed.dtype, jax.dtypes.prng_key):
        seed = jax.random.key_data(seed)
    return int(np.asarray(seed).ravel()[-1])


def synced_weights_reach_the_step() -> None:
    from tunix.generate.vllm_sampler import VllmSampler

    original = VllmSampler.update_params

    def update_params(self, updated_weights, filter_types=None):
        runner = self._model_runner
        mapping = _ours(self)
        if mapping is not None:
            mapping.sync(updated_weights, runner)
        else:
            original(self, updated_weights, filter_types)
        runner.refresh_state_leaves()
        engine = self.llm if self.llm is not None else self._driver.llm_engine
        engine.reset_prefix_cache()

    VllmSampler.update_params = update_params


def lora_models_keep_their_pytree_mode() -> None:
    import qwix._src.model as qwix_model

    original = qwix_model.quantize_nnx_model

    def quantize_nnx_model(model, provider, *model_inputs, call_method="__call__",
                           **model_inputs_kwargs):
        quantized = original(model, provider, *model_inputs, call_method=call_method,
                             **model_inputs_kwargs)
        cls = type(quantized)
        base = cls._unquantized_type
        if cls._pytree__is_pytree != base._pytree__is_pytree:
            fields = {k: v for k, v in vars(cls).items() if k in ("_unquantized_type", call_method)}
            quantized.__class__ = type(base.__name__, (base, ), fields,
                                       pytree=base._pytree__is_pytree)
        _lora_specs_of_their_arrays(quantized)
        return quantized

    qwix_model.quantize_nnx_model = quantize_nnx_model


def _lora_specs_of_their_arrays(model) -> None:
    """qwix 0.1.2 shards A and B by the weight's spec, transposed, but writes the
    transposed spec to `sharding`, which flax 0.12 no longer reads: their partition
    spec stayed the weight's (three or four axes for a two-axis A), and Tunix's
    optimizer sharding refused them. Their arrays' own placement is the spec."""
    from flax import nnx

    for _, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
        value, spec = var.get_value(), var.get_metadata().get("out_sharding")
        if spec is None or len(spec) == value.ndim:
            continue
        placed = tuple(getattr(value.sharding, "spec", ()))
        var.set_metadata("out_sharding", placed + (None, ) * (value.ndim - len(placed)))


TEST = "tests/test_tunix_rollouts.py"
PATCHES = [
    Patch("engine arguments vLLM 0.32 takes", TUNIX_ROLLOUTS,
          (Target(f"{SAMPLER}._vllm_config", "self config"), ),
          "VllmSampler stopped at EngineArgs(swap_space=...), which vLLM 0.32 no longer has",
          f"{TEST}::test_rollouts_equal_tunix_sampler_at_load_and_after_each_sync",
          engine_arguments),
    Patch("prompts without an appended EOS", TUNIX_ROLLOUTS,
          (Target(f"{SAMPLER}.tokenize", "self input_string"), ),
          "every vLLM rollout prompt ended in EOS, unlike Tunix's Sampler's",
          f"{TEST}::test_rollouts_equal_tunix_sampler_at_load_and_after_each_sync",
          prompts_as_tunix_samples_them),
    Patch("per-request seeds, the trainer's adapter, no prompt log-probs", TUNIX_ROLLOUTS,
          (Target(f"{SAMPLER}.__call__", "self input_strings max_generation_steps "
                  "max_prompt_length temperature top_p top_k beam_size seed multi_sampling "
                  "return_logits echo pad_output"), ),
          "RolloutConfig.seed never reached vLLM; a LoRA in slots was not applied",
          f"{TEST}::test_seeded_rollouts_repeat_and_rows_differ", seeds_and_adapter_per_request),
    Patch("synced weights reach the step", TUNIX_ROLLOUTS,
          (Target(f"{SAMPLER}.update_params", "self updated_weights filter_types"),
           Target("tpu_inference.runner.tpu_runner.TPUModelRunner.refresh_state_leaves", "self")),
          "after a sync the runner ran its previous arrays (random after a dummy load) and "
          "reused stale prefix KV",
          f"{TEST}::test_rollouts_equal_tunix_sampler_at_load_and_after_each_sync",
          synced_weights_reach_the_step),
    Patch("qwix LoRA models keep their pytree mode", TUNIX_ROLLOUTS,
          (Target("qwix._src.model.quantize_nnx_model",
                  "model provider model_inputs call_method model_inputs_kwargs"), ),
          "a Tunix model with qwix LoRA had an empty nnx.state: no LoRA parameter to train or sync",
          f"{TEST}::test_lora_rollouts_equal_tunix_sampler_merged_and_in_slots",
          lora_models_keep_their_pytree_mode),
]
