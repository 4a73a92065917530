"""Sampling: what tpu-inference's sampler honours, and a 400 for what it would ignore.

Its sampler applies temperature, top-k and top-p. Penalties, min_p, logit_bias,
allowed_token_ids, bad words and min_tokens reach the engine and are dropped
there (the reply is the one without them); allowed_token_ids crashes its input
batch (the engine dies); a seeded request raised a ValueError that vLLM answers
500. Each is refused before the engine, with a 400 naming the parameter, for
every model tpu-inference runs. logprobs=0 (the sampled token's log-probability,
what chat's `logprobs: true` asks for) is served.
"""

from tpu_models.adapt.guard import LOGPROBS_ZERO, SAMPLING_CHECKS, Patch, Target

# SamplingParams field -> whether a value asks for something the sampler ignores.
IGNORED = {
    "presence_penalty": lambda v: v != 0,
    "frequency_penalty": lambda v: v != 0,
    "repetition_penalty": lambda v: v != 1,
    "min_p": lambda v: v > 0,
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
    for name, is_set in IGNORED.items():
        value = getattr(params, name, None)
        if value is not None and is_set(value):
            raise VLLMValidationError(
                f"{name}={value!r} is not supported by tpu-inference's sampler: the reply "
                "would ignore it", parameter=name, value=value)
    if params.sampling_type == SamplingType.RANDOM_SEED:
        raise VLLMValidationError(
            "seed is not supported by tpu-inference's sampler with temperature > 0 "
            "(greedy decoding, temperature 0, is reproducible)", parameter="seed",
            value=params.seed)
    if params.logprobs == 0 and LOGPROBS_ZERO.name in guard.refused():
        raise VLLMValidationError("logprobs=0 is not supported on this tpu-inference; ask for "
                                  "logprobs >= 1", parameter="logprobs", value=0)


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

    original_validate = TpuPlatform.validate_request

    def validate_request(cls, processed_inputs, params):
        refuse_what_is_ignored(params)  # every entry point, offline vllm.LLM included
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

    def from_input_batch(cls, mesh, input_batch, *args, **kwargs):
        if input_batch.max_num_logprobs == 0:
            input_batch = _AskingForLogprobs(input_batch)
        return original(cls, mesh, input_batch, *args, **kwargs)

    TPUSupportedSamplingMetadata.from_input_batch = classmethod(from_input_batch)


PROTOCOL = "vllm.entrypoints.openai"
PATCHES = [
    Patch("sampling parameters the sampler ignores refused", SAMPLING_CHECKS, (
        Target("tpu_inference.platforms.tpu_platform.TpuPlatform.validate_request",
               "processed_inputs params"),
        Target(f"{PROTOCOL}.completion.protocol.CompletionRequest.to_sampling_params",
               "self max_tokens default_sampling_params"),
        Target(f"{PROTOCOL}.chat_completion.protocol.ChatCompletionRequest.to_sampling_params",
               "self max_tokens default_sampling_params")),
        "penalties, min_p, logit_bias, bad words, min_tokens were ignored; allowed_token_ids "
        "killed the engine",
        "tests/test_sampling_params.py::test_parameters_the_sampler_ignores_get_a_400_naming_them",
        parameters_checked, upstream="tpu-inference sampler: temperature, top-k, top-p only"),
    Patch("logprobs=0 served", LOGPROBS_ZERO, (
        Target("tpu_inference.layers.jax.sample.sampling_metadata.TPUSupportedSamplingMetadata"
               ".from_input_batch", "mesh input_batch padded_num_reqs req_indices_dp sharding"), ),
        "logprobs=0 (chat's logprobs: true) answered 500 'list index out of range'",
        "tests/test_sampling_params.py::test_logprobs_zero_gives_the_sampled_tokens_logprob",
        logprobs_zero_served, upstream="tpu-inference issue 3572 (fix PR closed unmerged)"),
]
