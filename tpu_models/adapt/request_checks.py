"""Requests: vLLM's validation, with a 400 before the engine for what the sampler
cannot do or a value that would break the engine (the checks: sampler.requests).
For every model tpu-inference runs.
"""

from tpu_models import features, patching
from tpu_models.features import LOGPROBS_WITH_DRAFTS, LOGPROBS_ZERO, SAMPLER_EXTRAS, SAMPLING_CHECKS
from tpu_models.patching import Patch, Target
from tpu_models.sampler import requests


def _served(feature) -> bool:
    return feature.name not in features.refused()


def refuse_what_is_ignored(params) -> None:
    requests.refuse_what_is_ignored(params, _served(SAMPLER_EXTRAS), _served(LOGPROBS_ZERO))


def validate_request(original, cls, processed_inputs, params):
    """TpuPlatform.validate_request: ours first (every entry point, offline vllm.LLM
    included); its own skipped for a seed, its only check of one."""
    refuse_what_is_ignored(params)
    if not requests.seeded(params):
        return original(cls, processed_inputs, params)


def to_sampling_params(original, self, max_tokens, default_sampling_params):
    """(Chat)CompletionRequest.to_sampling_params, checked: a streamed request is then
    refused before its 200 response starts."""
    params = original(self, max_tokens, default_sampling_params)
    refuse_what_is_ignored(params)
    return params


def check_structured_outputs_count(original, data):
    """(Chat)CompletionRequest's validator of `structured_outputs`, which took any value."""
    requests.refuse_structured_outputs_not_an_object(data)
    return original(data)


def validators_checked() -> None:
    """The requests' validators, compiled by pydantic: ours put in place."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    for request_class in (CompletionRequest, ChatCompletionRequest):
        patching.replace_model_validator(request_class, "check_structured_outputs_count",
                                         check_structured_outputs_count)


def update_from_tokenizer(original, self, tokenizer):
    """SamplingParams.update_from_tokenizer: bad words longer than the ids kept refused."""
    original(self, tokenizer)
    requests.refuse_long_bad_words(self)


def _validate_spec_decode(original, self, speculative_config):
    """SamplingParams._validate_spec_decode: vLLM's (min_p, logit_bias), then ours."""
    original(self, speculative_config)
    if speculative_config is not None:
        requests.refuse_beside_drafts(self, _served(LOGPROBS_WITH_DRAFTS))


PROTOCOL = "vllm.entrypoints.openai"
PATCHES = [
    Patch("sampling parameters the sampler ignores refused", SAMPLING_CHECKS, (
        Target("tpu_inference.platforms.tpu_platform.TpuPlatform.validate_request",
               "processed_inputs params", validate_request),
        Target(f"{PROTOCOL}.completion.protocol.CompletionRequest.to_sampling_params",
               "self max_tokens default_sampling_params", to_sampling_params),
        Target(f"{PROTOCOL}.chat_completion.protocol.ChatCompletionRequest.to_sampling_params",
               "self max_tokens default_sampling_params", to_sampling_params),
        Target(f"{PROTOCOL}.completion.protocol.CompletionRequest"
               ".check_structured_outputs_count", "data"),
        Target(f"{PROTOCOL}.chat_completion.protocol.ChatCompletionRequest"
               ".check_structured_outputs_count", "data")),
        "logprob_token_ids and thinking_token_budget were ignored; allowed_token_ids killed "
        "the engine; huge ints answered 500",
        "tests/test_sampling_params.py::test_parameters_the_sampler_ignores_get_a_400_naming_them",
        validators_checked, upstream="tpu-inference sampler: temperature, top-k, top-p only"),
    Patch("sampler additions refused beside drafts", SAMPLER_EXTRAS, (
        Target("vllm.sampling_params.SamplingParams._validate_spec_decode",
               "self speculative_config", _validate_spec_decode), ),
        "drafts were verified without seed, allowed ids or min_tokens",
        "tests/test_spec_decode.py::test_speculative_demo_gives_the_text_of_plain_decoding"),
    Patch("bad words longer than the ids kept refused", SAMPLER_EXTRAS, (
        Target("vllm.sampling_params.SamplingParams.update_from_tokenizer",
               "self tokenizer", update_from_tokenizer), ),
        "a bad word of more ids than the device keeps would be matched on its tail only",
        "tests/test_sampler.py::test_bad_words_follow_their_definition"),
]
