"""What a request may ask of the sampler: a 400 before the engine for what it
cannot do, or for a value that would break the engine.

tpu-inference's sampler applies temperature, top-k and top-p, and this room adds
min_p, seeds, logit_bias, allowed_token_ids, min_tokens, the penalties and bad
words (metadata.ADDED). What is left would reach the engine and be dropped there
(the reply the one without it): it is refused with a 400 naming the parameter, as
are values vLLM's request handling answered with a 500. vLLM's engine core dies
on an exception inside a step: nothing may reach it that could raise there.
adapt.request_checks calls these where vLLM validates a request.
"""

from tpu_models.sampler.counts import RECENT
from tpu_models.sampler.metadata import ADDED

# SamplingParams field -> whether a value asks for something the sampler ignores.
IGNORED = {
    "logprob_token_ids": lambda v: v is not None,
    "thinking_token_budget": lambda v: v is not None,
}
# Drafts are verified by tpu-inference's rejection sampler (vLLM itself refuses min_p
# and logit_bias beside drafts). Penalties and bad words are applied there
# (programs.verify_extended); a seed would not reproduce (drafts are verified with
# the batch's key), and allowed ids and min_tokens are not applied there.
NOT_WITH_DRAFTS = ("seed", "allowed_token_ids", "min_tokens")


def refuse_what_is_ignored(params, extras: bool, logprobs_zero: bool) -> None:
    """Raises vLLM's validation error (HTTP 400, `param` set) for a parameter the
    sampler would drop; passes anything else (pooling params included). `extras`,
    `logprobs_zero`: whether the seam serves ADDED and logprobs=0 here."""
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams

    if not isinstance(params, SamplingParams):
        return
    _refuse_out_of_range(params)
    for name, is_set in IGNORED.items():
        value = getattr(params, name, None)
        if value is not None and is_set(value):
            raise VLLMValidationError(
                f"{name}={value!r} is not supported by tpu-inference's sampler: the reply "
                "would ignore it", parameter=name, value=value)
    if not extras:
        for name, is_set in ADDED.items():
            if is_set(params):
                raise VLLMValidationError(f"{name} is not supported on this tpu-inference",
                                          parameter=name, value=getattr(params, name))
    if params.logprobs == 0 and not logprobs_zero:
        raise VLLMValidationError("logprobs=0 is not supported on this tpu-inference; ask for "
                                  "logprobs >= 1", parameter="logprobs", value=0)


def seeded(params) -> bool:
    """Whether a request sets a seed, which tpu-inference's validate_request refuses
    ("JAX does not support per-request seed", its only check of one): we sample seeds."""
    from vllm.sampling_params import SamplingType
    return getattr(params, "sampling_type", None) == SamplingType.RANDOM_SEED


def refuse_structured_outputs_not_an_object(data) -> None:
    """A request body whose `structured_outputs` is not an object (vLLM's check of it
    calls .get() on whatever came: a number there answered 500)."""
    from vllm.sampling_params import StructuredOutputsParams
    if isinstance(data, dict) and not isinstance(data.get("structured_outputs"), (
            dict, StructuredOutputsParams, type(None))):
        raise ValueError("structured_outputs must be an object")


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


def refuse_beside_drafts(params, logprobs: bool) -> None:
    """A 400 for what is not applied beside speculative drafts (`logprobs`: whether
    log-probs are served beside them here)."""
    from vllm.exceptions import VLLMValidationError
    for name in NOT_WITH_DRAFTS:
        if ADDED[name](params):
            raise VLLMValidationError(
                f"{name} is not supported with speculative decoding on tpu-inference",
                parameter=name, value=getattr(params, name))
    if params.logprobs is not None and not logprobs:
        raise VLLMValidationError(
            "logprobs are not supported with speculative decoding on this tpu-inference",
            parameter="logprobs", value=params.logprobs)


def refuse_long_bad_words(params) -> None:
    """A bad word's ids before its last are matched against the request's last RECENT
    output ids (counts.TokenCounts): a longer word is refused, not cut."""
    from vllm.exceptions import VLLMValidationError
    for word, ids in zip(params.bad_words or [], params.bad_words_token_ids or []):
        if len(ids) > RECENT + 1:
            raise VLLMValidationError(
                f"bad_words: {word!r} is {len(ids)} tokens; at most {RECENT + 1} are "
                "matched on tpu-inference", parameter="bad_words", value=word)


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
