"""Sampling: tpu-inference's sampler with min_p and seeds added, a 400 for the rest.

Its sampler applies temperature, top-k and top-p. We add min_p and per-request
seeds (`SeededMinPMetadata`, sampled by `sample_min_p_seeded`), for every model
tpu-inference runs. Penalties, logit_bias, allowed_token_ids, bad words and
min_tokens reached the engine and were dropped there (the reply was the one
without them); allowed_token_ids crashed its input batch (the engine died). Each
is refused before the engine, with a 400 naming the parameter. logprobs=0 (the
sampled token's log-probability, what chat's `logprobs: true` asks for) is served.
"""

import dataclasses
import functools

from tpu_models.adapt.guard import (LOGPROBS_ZERO, MIN_P_AND_SEEDS, SAMPLING_CHECKS, Patch,
                                    Target, rebind)

# SamplingParams field -> whether a value asks for something the sampler ignores.
IGNORED = {
    "presence_penalty": lambda v: v != 0,
    "frequency_penalty": lambda v: v != 0,
    "repetition_penalty": lambda v: v != 1,
    "logit_bias": bool,
    "allowed_token_ids": lambda v: v is not None,
    "bad_words": bool,
    "min_tokens": lambda v: v > 0,
    "logprob_token_ids": lambda v: v is not None,
    "thinking_token_budget": lambda v: v is not None,
}


def refuse_what_is_ignored(params) -> None:
    """Raises vLLM's validation error (HTTP 400, `param` set) for a parameter the
    sampler would drop; passes anything else (pooling params included)."""
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams, SamplingType

    from tpu_models.adapt import guard
    if not isinstance(params, SamplingParams):
        return
    _refuse_out_of_range(params)
    for name, is_set in IGNORED.items():
        value = getattr(params, name, None)
        if value is not None and is_set(value):
            raise VLLMValidationError(
                f"{name}={value!r} is not supported by tpu-inference's sampler: the reply "
                "would ignore it", parameter=name, value=value)
    if MIN_P_AND_SEEDS.name in guard.refused():
        if params.min_p > 0:
            raise VLLMValidationError("min_p is not supported on this tpu-inference",
                                      parameter="min_p", value=params.min_p)
        if params.sampling_type == SamplingType.RANDOM_SEED:
            raise VLLMValidationError(
                "seed is not supported on this tpu-inference with temperature > 0 (greedy "
                "decoding, temperature 0, is reproducible)", parameter="seed", value=params.seed)
    if params.logprobs == 0 and LOGPROBS_ZERO.name in guard.refused():
        raise VLLMValidationError("logprobs=0 is not supported on this tpu-inference; ask for "
                                  "logprobs >= 1", parameter="logprobs", value=0)


def _refuse_out_of_range(params) -> None:
    """An int past 64 bits cannot cross to the engine (msgpack: a 500), a NaN or
    infinite float would reach the step: a 400 naming the field instead."""
    import math

    from vllm.exceptions import VLLMValidationError
    for name in params.__struct_fields__:
        value = getattr(params, name)
        items = (value if isinstance(value, (list, tuple)) else
                 [*value, *value.values()] if isinstance(value, dict) else [value])
        for item in items:
            if isinstance(item, str) and isinstance(value, dict):
                item = int(item) if item.lstrip("-").isdigit() else 0
            if isinstance(item, bool) or not isinstance(item, (int, float)):
                continue
            if (isinstance(item, int) and not -2**63 <= item < 2**63) or (
                    isinstance(item, float) and not math.isfinite(item)):
                raise VLLMValidationError(f"{name}: {item!r} is out of range",
                                          parameter=name, value=item)


def _structured_outputs_an_object(request_class) -> None:
    """vLLM's check of `structured_outputs` calls .get() on whatever came: a number
    there answered 500. Pydantic compiled the validator, hence the rebuild."""
    from vllm.sampling_params import StructuredOutputsParams
    validators = request_class.__pydantic_decorators__.model_validators
    decorator = validators["check_structured_outputs_count"]

    def checked(data, _original=decorator.func):
        if isinstance(data, dict) and not isinstance(data.get("structured_outputs"), (
                dict, StructuredOutputsParams, type(None))):
            raise ValueError("structured_outputs must be an object")
        return _original(data)

    validators["check_structured_outputs_count"] = dataclasses.replace(decorator, func=checked)
    request_class.model_rebuild(force=True)


def check_server_defaults(model_config) -> None:
    """A checkpoint's generation_config.json is every request's default: one the
    sampler cannot apply would have every request refused. Stop at start-up instead."""
    defaults = model_config.get_diff_sampling_param()
    for name, is_set in IGNORED.items():
        if name in defaults and is_set(defaults[name]):
            raise ValueError(
                f"tpu-models: {model_config.model}'s generation_config.json sets {name}="
                f"{defaults[name]!r}, which tpu-inference's sampler cannot apply, so every "
                "request would be refused; serve without the checkpoint's sampling defaults "
                "(--generation-config vllm) or override it (--override-generation-config "
                f"'{{\"{name}\": ...}}')")


def parameters_checked() -> None:
    from tpu_inference.platforms.tpu_platform import TpuPlatform
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.sampling_params import SamplingType

    original_validate = TpuPlatform.validate_request

    def validate_request(cls, processed_inputs, params):
        refuse_what_is_ignored(params)  # every entry point, offline vllm.LLM included
        if getattr(params, "sampling_type", None) == SamplingType.RANDOM_SEED:
            return  # its only check, "JAX does not support per-request seed": we sample seeds
        return original_validate(processed_inputs, params)

    TpuPlatform.validate_request = classmethod(validate_request)
    # Also where the OpenAI server builds the parameters: a streamed request is then
    # refused before its 200 response starts.
    for request_class in (CompletionRequest, ChatCompletionRequest):
        original = request_class.to_sampling_params

        def to_sampling_params(self, max_tokens, default_sampling_params, _original=original):
            params = _original(self, max_tokens, default_sampling_params)
            refuse_what_is_ignored(params)
            return params

        request_class.to_sampling_params = to_sampling_params
        _structured_outputs_an_object(request_class)


class _AskingForLogprobs:
    """An input batch read as asking for the logprobs gather when its requests asked
    for logprobs=0: tpu-inference gathers only for max_num_logprobs > 0, so such a
    request got no logprobs and vLLM's response builder raised IndexError (500)."""

    def __init__(self, batch):
        self._batch = batch

    def __getattr__(self, name):
        return getattr(self._batch, name)

    @property
    def max_num_logprobs(self):
        return 1  # the gather always returns the model's max_logprobs columns


def logprobs_zero_served() -> None:
    from tpu_inference.layers.jax.sample.sampling_metadata import TPUSupportedSamplingMetadata

    original = TPUSupportedSamplingMetadata.from_input_batch.__func__

    # Upstream's parameters, so that the min_p and seeds patch finds its target's shape.
    def from_input_batch(cls, mesh, input_batch, padded_num_reqs, req_indices_dp,
                         sharding=None):
        if input_batch.max_num_logprobs == 0:
            input_batch = _AskingForLogprobs(input_batch)
        return original(cls, mesh, input_batch, padded_num_reqs, req_indices_dp, sharding)

    TPUSupportedSamplingMetadata.from_input_batch = classmethod(from_input_batch)



# --- min_p and seeds --------------------------------------------------------------
# A batch in which some request sets min_p or a seed gets this metadata instead of
# tpu-inference's; its sample() hands it to ours. Other batches keep tpu-inference's
# metadata and compiled sampler, so requests without them run exactly as before.
def _metadata_class():
    import jax
    from tpu_inference.layers.jax.sample.sampling_metadata import TPUSupportedSamplingMetadata

    @functools.partial(
        jax.tree_util.register_dataclass,
        data_fields=["temperature", "top_k", "top_p", "_cache_collision_dummy", "min_p",
                     "seeded", "seed_low", "seed_high", "position"],
        meta_fields=["do_sampling", "logprobs"])
    @dataclasses.dataclass
    class SeededMinPMetadata(TPUSupportedSamplingMetadata):
        min_p: object = None  # (rows,) f32, 0 for none
        seeded: object = None  # (rows,) bool
        seed_low: object = None  # (rows,) u32: the seed's two 32-bit halves
        seed_high: object = None
        position: object = None  # (rows,) i32: the sampled token's index in its sequence

    return SeededMinPMetadata


@functools.cache
def metadata_class():
    return _metadata_class()


def sample_min_p_seeded(rng, mesh, logits, metadata):
    """vLLM's order: temperature, min_p, top-k, top-p (tpu-inference's own masks), then
    one categorical draw per row. A seeded row draws with key(seed) folded with the
    token's position, so its reply depends on its seed alone, not on the batch."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from tpu_inference.layers.common.sharding import ShardingAxisName
    from tpu_inference.layers.jax.sample import sampling

    logits = jax.lax.with_sharding_constraint(
        logits.astype(jnp.float32), NamedSharding(mesh, P(ShardingAxisName.ATTN_DATA, None)))
    greedy = jnp.argmax(logits, axis=-1)
    is_greedy = metadata.temperature < sampling._SAMPLING_EPS
    scaled = logits / jnp.where(is_greedy, 1.0, metadata.temperature)[:, None]
    probs = jax.nn.softmax(scaled, axis=-1)
    kept = probs >= metadata.min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
    scaled = jnp.where(kept, scaled, -1e12)
    top_k_top_p = dataclasses.replace(metadata, temperature=jnp.ones_like(metadata.temperature))
    processed = sampling._apply_sampling_transforms(scaled, top_k_top_p)

    impl = jax.random.key_impl(rng)

    def row_key(seeded, low, high, position, row):
        own = jax.random.fold_in(jax.random.fold_in(jax.random.key(low, impl=impl), high),
                                 position)
        return jnp.where(seeded, jax.random.key_data(own),
                         jax.random.key_data(jax.random.fold_in(rng, row)))

    rows = jnp.arange(logits.shape[0], dtype=jnp.int32)
    keys = jax.random.wrap_key_data(
        jax.vmap(row_key)(metadata.seeded, metadata.seed_low, metadata.seed_high,
                          metadata.position, rows), impl=impl)
    drawn = jax.vmap(jax.random.categorical)(keys, processed)
    tokens = jax.lax.with_sharding_constraint(jnp.where(is_greedy, greedy, drawn),
                                              NamedSharding(mesh, P()))
    return tokens, jnp.where(is_greedy[:, None], logits, processed)


def _with_min_p_and_seeds(metadata, input_batch, padded_num_reqs, req_indices_dp, sharding):
    """tpu-inference's metadata, or ours when a scheduled request sets min_p or a seed.
    Rows are laid out as tpu-inference lays them (a block per data-parallel rank)."""
    import numpy as np
    from vllm.sampling_params import SamplingType
    step = getattr(input_batch, "_tpu_models_step", None)
    if step is None or not metadata.do_sampling:
        return metadata
    num_scheduled, requests = step
    min_p = np.zeros(padded_num_reqs, np.float32)
    seeded = np.zeros(padded_num_reqs, bool)
    seed = np.zeros(padded_num_reqs, np.uint64)
    position = np.zeros(padded_num_reqs, np.int32)
    per_rank = padded_num_reqs // len(req_indices_dp)
    for rank, indices in req_indices_dp.items():
        for row, index in enumerate(indices, start=rank * per_rank):
            req_id = input_batch.req_ids[index]
            params = requests[req_id].sampling_params
            min_p[row] = params.min_p
            if params.sampling_type == SamplingType.RANDOM_SEED:
                seeded[row] = True
                seed[row] = params.seed & 0xFFFF_FFFF_FFFF_FFFF
                position[row] = (input_batch.num_computed_tokens_cpu[index]
                                 + num_scheduled.get(req_id, 0))
    if not (min_p.any() or seeded.any()):
        return metadata
    from tpu_inference.utils import device_array
    mesh = metadata.temperature.sharding.mesh

    def put(values):
        return device_array(mesh, values, sharding=sharding)
    fields = {f.name: getattr(metadata, f.name) for f in dataclasses.fields(metadata)}
    return metadata_class()(
        **fields, min_p=put(min_p), seeded=put(seeded),
        seed_low=put((seed & 0xFFFF_FFFF).astype(np.uint32)),
        seed_high=put((seed >> np.uint64(32)).astype(np.uint32)), position=put(position))


def min_p_and_seeds_sampled() -> None:
    import jax
    from tpu_inference.layers.jax.sample import sampling
    from tpu_inference.layers.jax.sample.sampling_metadata import TPUSupportedSamplingMetadata
    from tpu_inference.runner.tpu_runner import TPUModelRunner
    from vllm.sampling_params import SamplingParams

    original_prepare = TPUModelRunner._prepare_inputs

    def _prepare_inputs(self, scheduler_output):
        # from_input_batch sees only the batch: lend it what a row's seed needs.
        self.input_batch._tpu_models_step = (scheduler_output.num_scheduled_tokens,
                                             self.requests)
        return original_prepare(self, scheduler_output)

    TPUModelRunner._prepare_inputs = _prepare_inputs

    original_metadata = TPUSupportedSamplingMetadata.from_input_batch.__func__

    def from_input_batch(cls, mesh, input_batch, padded_num_reqs, req_indices_dp,
                         sharding=None):
        metadata = original_metadata(cls, mesh, input_batch, padded_num_reqs, req_indices_dp,
                                     sharding)
        return _with_min_p_and_seeds(metadata, input_batch, padded_num_reqs, req_indices_dp,
                                     sharding)

    TPUSupportedSamplingMetadata.from_input_batch = classmethod(from_input_batch)

    original_sample = sampling.sample
    ours = jax.jit(sample_min_p_seeded, static_argnames=["mesh"])

    def sample(rng, mesh, logits, tpu_sampling_metadata, allow_distributed_sampling=True):
        if isinstance(tpu_sampling_metadata, metadata_class()):
            return ours(rng, mesh, logits, tpu_sampling_metadata)
        return original_sample(rng, mesh, logits, tpu_sampling_metadata,
                               allow_distributed_sampling=allow_distributed_sampling)

    rebind("tpu_inference.layers.jax.sample.sampling", "sample", sample)

    original_spec_check = SamplingParams._validate_spec_decode

    def _validate_spec_decode(self, speculative_config):
        original_spec_check(self, speculative_config)  # vLLM's: min_p, logit_bias
        if speculative_config is not None and self.sampling_type == SamplingType.RANDOM_SEED:
            from vllm.exceptions import VLLMValidationError
            # tpu-inference's rejection sampler draws from the batch's key.
            raise VLLMValidationError("seed is not supported with speculative decoding on "
                                      "tpu-inference at temperature > 0", parameter="seed",
                                      value=self.seed)

    from vllm.sampling_params import SamplingType
    SamplingParams._validate_spec_decode = _validate_spec_decode

PROTOCOL = "vllm.entrypoints.openai"
PATCHES = [
    Patch("sampling parameters the sampler ignores refused", SAMPLING_CHECKS, (
        Target("tpu_inference.platforms.tpu_platform.TpuPlatform.validate_request",
               "processed_inputs params"),
        Target(f"{PROTOCOL}.completion.protocol.CompletionRequest.to_sampling_params",
               "self max_tokens default_sampling_params"),
        Target(f"{PROTOCOL}.chat_completion.protocol.ChatCompletionRequest.to_sampling_params",
               "self max_tokens default_sampling_params"),
        Target(f"{PROTOCOL}.completion.protocol.CompletionRequest"
               ".check_structured_outputs_count", "data"),
        Target(f"{PROTOCOL}.chat_completion.protocol.ChatCompletionRequest"
               ".check_structured_outputs_count", "data")),
        "penalties, logit_bias, bad words, min_tokens ignored; allowed_token_ids killed the "
        "engine; huge ints 500",
        "tests/test_sampling_params.py::test_parameters_the_sampler_ignores_get_a_400_naming_them",
        parameters_checked, upstream="tpu-inference sampler: temperature, top-k, top-p only"),
    Patch("logprobs=0 served", LOGPROBS_ZERO, (
        Target("tpu_inference.layers.jax.sample.sampling_metadata.TPUSupportedSamplingMetadata"
               ".from_input_batch", "mesh input_batch padded_num_reqs req_indices_dp sharding"), ),
        "logprobs=0 (chat's logprobs: true) answered 500 'list index out of range'",
        "tests/test_sampling_params.py::test_logprobs_zero_gives_the_sampled_tokens_logprob",
        logprobs_zero_served, upstream="tpu-inference issue 3572 (fix PR closed unmerged)"),
    Patch("min_p and per-request seeds sampled", MIN_P_AND_SEEDS, (
        Target("tpu_inference.runner.tpu_runner.TPUModelRunner._prepare_inputs",
               "self scheduler_output"),
        Target("tpu_inference.layers.jax.sample.sampling_metadata.TPUSupportedSamplingMetadata"
               ".from_input_batch", "mesh input_batch padded_num_reqs req_indices_dp sharding"),
        Target("tpu_inference.layers.jax.sample.sampling.sample",
               "rng mesh logits tpu_sampling_metadata allow_distributed_sampling"),
        Target("tpu_inference.layers.jax.sample.sampling._apply_sampling_transforms",
               "logits tpu_sampling_metadata"),
        Target("vllm.sampling_params.SamplingParams._validate_spec_decode",
               "self speculative_config")),
        "min_p was ignored; a seed answered 500 ('JAX does not support per-request seed')",
        "tests/test_sampler.py::test_seeded_replies_repeat_and_differ_by_seed",
        min_p_and_seeds_sampled, upstream="tpu-inference sampler: temperature, top-k, top-p only"),
]
