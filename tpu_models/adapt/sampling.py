"""Sampling: tpu-inference's sampler, with min_p, seeds, logit_bias, allowed ids,
min_tokens, the presence, frequency and repetition penalties and bad words.

Its sampler applies temperature, top-k and top-p. A batch in which some request
sets one of ours gets our metadata (`ExtendedMetadata`), which its sample() hands
to ours (`sample_extended`); other batches keep tpu-inference's metadata and
compiled sampler, so requests without them run as before. For every model
tpu-inference runs. logprobs=0 (the sampled token's log-probability, what chat's
`logprobs: true` asks for) is served, and logprobs beside drafts.

Penalties and bad words read what a request has generated, which under
asynchronous scheduling the host learns a step late: `TokenCounts` keeps it on
the device, a row per request, updated inside the sampling program from the
tokens it samples.
"""

from tpu_models.adapt.guard import (LOGPROBS_WITH_DRAFTS, LOGPROBS_ZERO, SAMPLER_EXTRAS, Patch,
                                    Target, rebind)
from tpu_models.adapt.sampler_metadata import extended, metadata_class
from tpu_models.adapt.sampler_programs import data_ranks, sample_extended, verify_extended
from tpu_models.penalties import token_counts


class _DrawnInVerification:
    """The bonus token ids a penalized step beside drafts hands the rejection sampler,
    which draws them (verify_extended)."""

    def __repr__(self):
        return "<bonus token ids: drawn in verification (tpu_models.adapt.sampling)>"


# What we add to the sampler: SamplingParams field -> whether a request asks for it.
# (A seed at temperature 0 asks for nothing: greedy decoding is reproducible.)
ADDED = {
    "min_p": lambda p: p.min_p > 0,
    "seed": lambda p: p.sampling_type.name == "RANDOM_SEED",
    "logit_bias": lambda p: bool(p.logit_bias),
    "allowed_token_ids": lambda p: p.allowed_token_ids is not None,
    "min_tokens": lambda p: p.min_tokens > 0,
    "presence_penalty": lambda p: p.presence_penalty != 0,
    "frequency_penalty": lambda p: p.frequency_penalty != 0,
    "repetition_penalty": lambda p: p.repetition_penalty != 1,
    "bad_words": lambda p: bool(p.bad_words),
}
# Those that read what the request has seen (TokenCounts).
COUNTED = ("presence_penalty", "frequency_penalty", "repetition_penalty", "bad_words")


def _counted(params) -> bool:
    return any(ADDED[name](params) for name in COUNTED)


def _wants_extras(params) -> bool:
    return params is not None and any(is_set(params) for is_set in ADDED.values())


# Live requests that need ExtendedMetadata (added with the request, pruned as they
# finish): a step without any costs one test of this set.
_WANTING: set[str] = set()


def _extended(metadata, input_batch, padded_num_reqs, req_indices_dp, sharding):
    """tpu-inference's metadata, or ours when a scheduled request needs it. Rows are
    laid out as tpu-inference lays them (a block per data-parallel rank)."""
    step = getattr(input_batch, "_tpu_models_step", None)
    if not _WANTING or step is None:
        return metadata
    _, requests, _ = step
    _WANTING.intersection_update(requests)
    ids = input_batch.req_ids
    per_rank = padded_num_reqs // len(req_indices_dp)
    rows = [(row, index, requests[ids[index]], ids[index])
            for rank, indices in req_indices_dp.items()
            for row, index in enumerate(indices, start=rank * per_rank)]
    if not any(req_id in _WANTING for *_, req_id in rows):
        return metadata
    counted = [(row, index, request, req_id) for row, index, request, req_id in rows
               if request.sampling_params is not None and _counted(request.sampling_params)]
    return extended(metadata, input_batch, padded_num_reqs, sharding, rows, counted, step)


def extras_sampled() -> None:
    from tpu_inference.layers.jax.sample import sampling
    from tpu_inference.layers.jax.sample.rejection_sampler import RejectionSampler
    from tpu_inference.layers.jax.sample.sampling_metadata import TPUSupportedSamplingMetadata
    from tpu_inference.runner.input_batch import InputBatch
    from tpu_inference.runner.tpu_runner import TPUModelRunner

    TPUModelRunner._prepare_inputs = _step_lent(TPUModelRunner._prepare_inputs)
    InputBatch.add_request = _extras_noted(InputBatch.add_request)
    TPUSupportedSamplingMetadata.from_input_batch = classmethod(
        _metadata_extended(TPUSupportedSamplingMetadata.from_input_batch.__func__))
    rebind(sampling.__name__, "sample", _sampler_extended(sampling.sample))
    RejectionSampler.__call__ = _bonus_verified(RejectionSampler.__call__)


def _step_lent(original_prepare):
    def _prepare_inputs(self, scheduler_output):
        # from_input_batch sees only the batch: lend it the requests and this step's sizes.
        spec = self.speculative_config
        self.input_batch._tpu_models_step = (scheduler_output.num_scheduled_tokens,
                                             self.requests,
                                             spec.num_speculative_tokens if spec else 0)
        return original_prepare(self, scheduler_output)

    return _prepare_inputs


def _extras_noted(original_add):
    def add_request(self, request, req_index=None, dp_rank=0):
        params = request.sampling_params
        if not _wants_extras(params):
            return original_add(self, request, req_index, dp_rank)
        _WANTING.add(request.req_id)
        if params.allowed_token_ids is None:
            return original_add(self, request, req_index, dp_rank)
        # Its own mask for allowed ids is allocated wrongly (the engine died); ours applies.
        request.sampling_params = params.clone()
        request.sampling_params.allowed_token_ids = None
        try:
            return original_add(self, request, req_index, dp_rank)
        finally:
            request.sampling_params = params

    return add_request


def _metadata_extended(original_metadata):
    def from_input_batch(cls, mesh, input_batch, padded_num_reqs, req_indices_dp,
                         sharding=None):
        metadata = original_metadata(cls, mesh, input_batch, padded_num_reqs, req_indices_dp,
                                     sharding)
        return _extended(metadata, input_batch, padded_num_reqs, req_indices_dp, sharding)

    return from_input_batch


def _sampler_extended(original_sample):
    import jax
    ours = jax.jit(sample_extended, static_argnames=["mesh"])
    # The counts are donated: updated in place, a step's new arrays the next's input.
    counting = jax.jit(sample_extended, static_argnames=["mesh"], donate_argnums=(4, 5))

    def sample(rng, mesh, logits, tpu_sampling_metadata, allow_distributed_sampling=True):
        if isinstance(tpu_sampling_metadata, metadata_class()):
            if tpu_sampling_metadata.slot is not None:
                if tpu_sampling_metadata.drafts:
                    # The bonus token: its counts include the drafts, which the
                    # rejection sampler is handed next (the same metadata object).
                    tpu_sampling_metadata._tpu_models_bonus = (rng, logits)
                    return _DrawnInVerification(), logits
                counts = token_counts()
                tokens, processed, counts.counts, counts.recent = counting(
                    rng, mesh, logits, tpu_sampling_metadata, counts.counts, counts.recent)
                return tokens, processed
            return ours(rng, mesh, logits, tpu_sampling_metadata)
        return original_sample(rng, mesh, logits, tpu_sampling_metadata,
                               allow_distributed_sampling=allow_distributed_sampling)

    def traced(rng, mesh, logits, tpu_sampling_metadata, allow_distributed_sampling=True):
        # The same choice inside a program that calls it (adapt.spec_fusion): a jit
        # with compiler options, as tpu-inference's, cannot be nested.
        if isinstance(tpu_sampling_metadata, metadata_class()):
            return sample_extended(rng, mesh, logits, tpu_sampling_metadata)
        return original_sample.__wrapped__(rng, mesh, logits, tpu_sampling_metadata,
                                           allow_distributed_sampling=allow_distributed_sampling)

    # The precompiler builds plain metadata only, and lowers what has a `lower`.
    sample.lower, sample.__wrapped__ = original_sample.lower, traced
    return sample


def _bonus_verified(original_reject):
    import jax
    verifying = jax.jit(verify_extended, static_argnames=["ranks"],
                        donate_argnames=("counts", "recent"))

    def __call__(self, draft_token_ids, num_draft_tokens, draft_probs, target_logits,
                 bonus_token_ids, sampling_metadata, key=None):
        deferred = getattr(sampling_metadata, "_tpu_models_bonus", None)
        if deferred is None:
            return original_reject(self, draft_token_ids, num_draft_tokens, draft_probs,
                                   target_logits, bonus_token_ids, sampling_metadata, key)
        del sampling_metadata._tpu_models_bonus
        bonus_rng, bonus_logits = deferred
        counts = token_counts()
        out, counts.counts, counts.recent = verifying(
            draft_token_ids, num_draft_tokens, target_logits, bonus_logits, sampling_metadata,
            bonus_rng, key, counts.counts, counts.recent, ranks=data_ranks(self.mesh))
        return out

    return __call__


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

    # Upstream's parameters, so that the other patch of from_input_batch finds its shape.
    def from_input_batch(cls, mesh, input_batch, padded_num_reqs, req_indices_dp,
                         sharding=None):
        if input_batch.max_num_logprobs == 0:
            input_batch = _AskingForLogprobs(input_batch)
        return original(cls, mesh, input_batch, padded_num_reqs, req_indices_dp, sharding)

    TPUSupportedSamplingMetadata.from_input_batch = classmethod(from_input_batch)


def logprobs_beside_drafts() -> None:
    # A step of a drafting engine is laid out [draft rows, bonus rows] per rank even
    # when no request drafted; upstream unpicks that layout only when some did, so
    # such a step's logprobs (the first step's, for one) were read from the draft
    # rows' -1 placeholders, which killed the engine.
    import jax
    import numpy as np
    from tpu_inference.runner import tpu_runner
    from tpu_inference.spec_decode.jax.utils import filter_speculative_logprobs
    from vllm.v1.outputs import LogprobsLists

    original = tpu_runner._jax_logprobs_materialize

    def materialize(logprobs_tensors, logits_indices_selector=None, cu_num_generated_tokens=None,
                    spec_decode_metadata=None, runner=None, num_reqs=None):
        if spec_decode_metadata is None or np.sum(spec_decode_metadata.draft_lengths_cpu) > 0:
            return original(logprobs_tensors, logits_indices_selector, cu_num_generated_tokens,
                            spec_decode_metadata, runner, num_reqs)
        ids, logprobs, ranks, cu_num_generated_tokens = filter_speculative_logprobs(
            *(np.asarray(jax.device_get(a)) for a in (logprobs_tensors.logprob_token_ids,
              logprobs_tensors.logprobs, logprobs_tensors.selected_token_ranks)),
            spec_decode_metadata,
            runner.input_batch.vocab_size, runner.dp_size,
            runner.input_batch.num_reqs if num_reqs is None else num_reqs)
        return LogprobsLists(logprob_token_ids=ids, logprobs=logprobs, sampled_token_ranks=ranks,
                             cu_num_generated_tokens=cu_num_generated_tokens)

    tpu_runner._jax_logprobs_materialize = materialize


METADATA = "tpu_inference.layers.jax.sample.sampling_metadata.TPUSupportedSamplingMetadata"
REJECTION = "tpu_inference.layers.jax.sample.rejection_sampler"
PATCHES = [
    Patch("logprobs=0 served", LOGPROBS_ZERO, (
        Target(f"{METADATA}.from_input_batch",
               "mesh input_batch padded_num_reqs req_indices_dp sharding"), ),
        "logprobs=0 (chat's logprobs: true) answered 500 'list index out of range'",
        "tests/test_sampling_params.py::test_logprobs_zero_gives_the_sampled_tokens_logprob",
        logprobs_zero_served, upstream="tpu-inference issue 3572 (fix PR closed unmerged)"),
    Patch("logprobs beside drafts served", LOGPROBS_WITH_DRAFTS, (
        Target("tpu_inference.runner.tpu_runner._jax_logprobs_materialize",
               "logprobs_tensors logits_indices_selector cu_num_generated_tokens "
               "spec_decode_metadata runner num_reqs"),
        Target("tpu_inference.spec_decode.jax.utils.filter_speculative_logprobs",
               "log_token_ids logprobs_arr selected_token_ranks spec_decode_metadata vocab_size "
               "dp_size num_reqs")),
        "a drafting engine's step with no drafts (the first) read logprobs from its draft "
        "rows; the engine died",
        "tests/test_spec_decode.py::test_ngram_on_gemma3_matches_transformers",
        logprobs_beside_drafts),
    Patch("min_p, seeds, logit_bias, allowed ids, min_tokens, penalties and bad words "
          "sampled (drafts verified with the penalties and bad words)", SAMPLER_EXTRAS, (
        Target("tpu_inference.runner.tpu_runner.TPUModelRunner._prepare_inputs",
               "self scheduler_output"),
        Target("tpu_inference.runner.input_batch.InputBatch.add_request",
               "self request req_index dp_rank"),
        Target(f"{METADATA}.from_input_batch",
               "mesh input_batch padded_num_reqs req_indices_dp sharding"),
        Target("tpu_inference.layers.jax.sample.sampling.sample",
               "rng mesh logits tpu_sampling_metadata allow_distributed_sampling"),
        Target("tpu_inference.layers.jax.sample.sampling._apply_sampling_transforms",
               "logits tpu_sampling_metadata"),
        Target(f"{REJECTION}.RejectionSampler.__call__", "self draft_token_ids num_draft_tokens "
               "draft_probs target_logits bonus_token_ids sampling_metadata key"),
        Target(f"{REJECTION}.rejection_sample", "draft_token_ids num_draft_tokens draft_probs "
               "target_probs bonus_token_ids do_sampling key"),
        Target(f"{REJECTION}._compute_probs", "logits num_draft_tokens sampling_metadata"),
        Target(f"{REJECTION}._get_segment_info", "num_draft_tokens total_tokens")),
        "ignored (allowed_token_ids killed the engine); a seed answered 500; no penalties, "
        "bad words",
        "tests/test_sampler.py::test_seeded_replies_repeat_and_differ_by_seed",
        extras_sampled, upstream="tpu-inference sampler: temperature, top-k, top-p only"),
]
