"""Requests: vLLM's validation, with a 400 before the engine for what the sampler
cannot do or a value that would break the engine (the checks: sampler.requests).
For every model tpu-inference runs.
"""

import dataclasses

from tpu_models.adapt.guard import (LOGPROBS_WITH_DRAFTS, LOGPROBS_ZERO, SAMPLER_EXTRAS,
                                    SAMPLING_CHECKS, Patch, Target)
from tpu_models.sampler import requests


def _served(feature) -> bool:
    from tpu_models.adapt import guard
    return feature.name not in guard.refused()


def refuse_what_is_ignored(params) -> None:
    requests.refuse_what_is_ignored(params, _served(SAMPLER_EXTRAS), _served(LOGPROBS_ZERO))


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


upstream: dict = {}  # the functions the replacements below call


def parameters_checked() -> None:
    from tpu_inference.platforms.tpu_platform import TpuPlatform
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    upstream["validate_request"] = TpuPlatform.validate_request
    TpuPlatform.validate_request = classmethod(validate_request)
    # Also where the OpenAI server builds the parameters: a streamed request is then
    # refused before its 200 response starts.
    for request_class in (CompletionRequest, ChatCompletionRequest):
        upstream[request_class] = request_class.to_sampling_params
        request_class.to_sampling_params = to_sampling_params
        _structured_outputs_an_object(request_class)


def validate_request(cls, processed_inputs, params):
    """TpuPlatform.validate_request: ours first (every entry point, offline vllm.LLM
    included); its only check of a seed, "JAX does not support per-request seed",
    skipped: we sample seeds."""
    from vllm.sampling_params import SamplingType
    refuse_what_is_ignored(params)
    if getattr(params, "sampling_type", None) == SamplingType.RANDOM_SEED:
        return
    return upstream["validate_request"](processed_inputs, params)


def to_sampling_params(self, max_tokens, default_sampling_params):
    """CompletionRequest / ChatCompletionRequest.to_sampling_params, checked."""
    original = next(upstream[c] for c in type(self).__mro__ if c in upstream)
    params = original(self, max_tokens, default_sampling_params)
    refuse_what_is_ignored(params)
    return params


def bad_words_checked() -> None:
    from vllm.sampling_params import SamplingParams

    upstream["update_from_tokenizer"] = SamplingParams.update_from_tokenizer
    SamplingParams.update_from_tokenizer = update_from_tokenizer


def update_from_tokenizer(self, tokenizer):
    """SamplingParams.update_from_tokenizer: bad words longer than the ids kept refused."""
    upstream["update_from_tokenizer"](self, tokenizer)
    requests.refuse_long_bad_words(self)


def not_beside_drafts() -> None:
    from vllm.sampling_params import SamplingParams

    upstream["validate_spec_decode"] = SamplingParams._validate_spec_decode
    SamplingParams._validate_spec_decode = _validate_spec_decode


def _validate_spec_decode(self, speculative_config):
    """SamplingParams._validate_spec_decode: vLLM's (min_p, logit_bias), then ours."""
    upstream["validate_spec_decode"](self, speculative_config)
    if speculative_config is not None:
        requests.refuse_beside_drafts(self, _served(LOGPROBS_WITH_DRAFTS))


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
        "logprob_token_ids and thinking_token_budget were ignored; allowed_token_ids killed "
        "the engine; huge ints answered 500",
        "tests/test_sampling_params.py::test_parameters_the_sampler_ignores_get_a_400_naming_them",
        parameters_checked, upstream="tpu-inference sampler: temperature, top-k, top-p only"),
    Patch("sampler additions refused beside drafts", SAMPLER_EXTRAS, (
        Target("vllm.sampling_params.SamplingParams._validate_spec_decode",
               "self speculative_config"), ),
        "drafts were verified without seed, allowed ids or min_tokens",
        "tests/test_spec_decode.py::test_speculative_demo_gives_the_text_of_plain_decoding",
        not_beside_drafts),
    Patch("bad words longer than the ids kept refused", SAMPLER_EXTRAS, (
        Target("vllm.sampling_params.SamplingParams.update_from_tokenizer",
               "self tokenizer"), ),
        "a bad word of more ids than the device keeps would be matched on its tail only",
        "tests/test_sampler.py::test_bad_words_follow_their_definition",
        bad_words_checked),
]
