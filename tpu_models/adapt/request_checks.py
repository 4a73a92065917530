"""Requests: a 400 before the engine for what the sampler cannot do or a value that
would break the engine.

tpu-inference's sampler applies temperature, top-k and top-p, and adapt.sampling
adds min_p, seeds, logit_bias, allowed_token_ids, min_tokens, the penalties and
bad words. What is left would reach the engine and be dropped there (the reply
the one without it): it is refused with a 400 naming the parameter, for every
model tpu-inference runs, as are values vLLM's request handling answered with a
500. vLLM's engine core dies on an exception inside a step: nothing may reach it
that could raise there.
"""

import dataclasses

from tpu_models.adapt.guard import (LOGPROBS_WITH_DRAFTS, LOGPROBS_ZERO, SAMPLER_EXTRAS,
                                    SAMPLING_CHECKS, Patch, Target)
from tpu_models.sampler.counts import RECENT
# What adapt.sampling adds to the sampler: refused only where it could not be installed.
from tpu_models.sampler.metadata import ADDED

# SamplingParams field -> whether a value asks for something the sampler ignores.
IGNORED = {
    "logprob_token_ids": lambda v: v is not None,
    "thinking_token_budget": lambda v: v is not None,
}
# Drafts are verified by tpu-inference's rejection sampler (vLLM itself refuses min_p
# and logit_bias beside drafts). Penalties and bad words are applied there
# (sampler.programs.verify_extended); a seed would not reproduce (drafts are
# verified with the batch's key), and allowed ids and min_tokens are not applied there.
NOT_WITH_DRAFTS = ("seed", "allowed_token_ids", "min_tokens")


def refuse_what_is_ignored(params) -> None:
    """Raises vLLM's validation error (HTTP 400, `param` set) for a parameter the
    sampler would drop; passes anything else (pooling params included)."""
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams

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
    if SAMPLER_EXTRAS.name in guard.refused():
        for name, is_set in ADDED.items():
            if is_set(params):
                raise VLLMValidationError(f"{name} is not supported on this tpu-inference",
                                          parameter=name, value=getattr(params, name))
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


def check_server_defaults(vllm_config) -> None:
    """A checkpoint's generation_config.json is every request's default: one the
    sampler cannot apply would have every request refused. Stop at start-up instead."""
    from vllm.sampling_params import SamplingParams
    model_config = vllm_config.model_config
    drafts = vllm_config.speculative_config is not None
    for name, value in model_config.get_diff_sampling_param().items():
        if name in IGNORED and IGNORED[name](value):
            why = "which tpu-inference's sampler cannot apply"
        elif drafts and name in NOT_WITH_DRAFTS and ADDED[name](SamplingParams(**{name: value})):
            why = "which is not applied beside speculative decoding"
        else:
            continue
        raise ValueError(
            f"tpu-models: {model_config.model}'s generation_config.json sets {name}="
            f"{value!r}, {why}, so every request would be refused; serve without the "
            "checkpoint's sampling defaults (--generation-config vllm) or override it "
            f"(--override-generation-config '{{\"{name}\": ...}}')")


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


def bad_words_checked() -> None:
    """A bad word's ids before its last are matched against the request's last RECENT
    output ids (sampler.counts.TokenCounts): a longer word is refused, not cut."""
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams

    original = SamplingParams.update_from_tokenizer

    def update_from_tokenizer(self, tokenizer):
        original(self, tokenizer)
        for word, ids in zip(self.bad_words or [], self.bad_words_token_ids or []):
            if len(ids) > RECENT + 1:
                raise VLLMValidationError(
                    f"bad_words: {word!r} is {len(ids)} tokens; at most {RECENT + 1} are "
                    "matched on tpu-inference", parameter="bad_words", value=word)

    SamplingParams.update_from_tokenizer = update_from_tokenizer


def not_beside_drafts() -> None:
    from tpu_models.adapt import guard
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams

    original = SamplingParams._validate_spec_decode

    def _validate_spec_decode(self, speculative_config):
        original(self, speculative_config)  # vLLM's: min_p, logit_bias
        if speculative_config is None:
            return
        for name in NOT_WITH_DRAFTS:
            if ADDED[name](self):
                raise VLLMValidationError(
                    f"{name} is not supported with speculative decoding on tpu-inference",
                    parameter=name, value=getattr(self, name))
        if self.logprobs is not None and LOGPROBS_WITH_DRAFTS.name in guard.refused():
            raise VLLMValidationError(
                "logprobs are not supported with speculative decoding on this tpu-inference",
                parameter="logprobs", value=self.logprobs)

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
