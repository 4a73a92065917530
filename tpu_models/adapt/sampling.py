"""Sampling: tpu-inference's sampler, with min_p, seeds, logit_bias, allowed ids,
min_tokens, the presence, frequency and repetition penalties and bad words.

Its sampler applies temperature, top-k and top-p. A batch in which some request
sets one of ours gets our metadata (sampler.metadata.ExtendedMetadata), which its
sample() hands to ours (sampler.programs); other batches keep tpu-inference's
metadata and compiled sampler, so requests without them run as before. For every
model tpu-inference runs. logprobs=0 (the sampled token's log-probability, what
chat's `logprobs: true` asks for) is served, and logprobs beside drafts.

A request's presence_penalty, for one: `prepare_inputs` notes the step
(adapt.state.Step), `from_input_batch` builds our metadata from it
(sampler.metadata.for_step: its `presence` row), `sample` or, beside drafts,
`verify_bonus` runs the program that penalizes the logits (sampler.programs:
`penalize`).
"""

from tpu_models.adapt import state
from tpu_models.adapt.guard import (LOGPROBS_WITH_DRAFTS, LOGPROBS_ZERO, SAMPLER_EXTRAS, Patch,
                                    Target, rebind)
from tpu_models.sampler import metadata as extended_metadata
from tpu_models.sampler import programs


class DrawnInVerification:
    """The bonus token ids a penalized step beside drafts hands the rejection sampler
    (upstream passes `sample`'s result on as they are): its rng and logits, drawn in
    verification, which knows the drafts (sampler.programs.verify)."""

    def __init__(self, rng, logits):
        self.rng, self.logits = rng, logits

    def __repr__(self):
        return "<bonus token ids: drawn in verification (tpu_models.adapt.sampling)>"


def extras_sampled() -> None:
    from tpu_inference.layers.jax.sample import sampling
    from tpu_inference.layers.jax.sample.rejection_sampler import RejectionSampler
    from tpu_inference.layers.jax.sample.sampling_metadata import TPUSupportedSamplingMetadata
    from tpu_inference.runner.input_batch import InputBatch
    from tpu_inference.runner.tpu_runner import TPUModelRunner

    if originals:  # installed already
        return
    originals.update(prepare=TPUModelRunner._prepare_inputs, add=InputBatch.add_request,
                     metadata=TPUSupportedSamplingMetadata.from_input_batch.__func__,
                     sample=sampling.sample, reject=RejectionSampler.__call__)
    TPUModelRunner._prepare_inputs = prepare_inputs
    InputBatch.add_request = add_request
    TPUSupportedSamplingMetadata.from_input_batch = classmethod(from_input_batch)
    sample.lower, sample.__wrapped__ = sampling.sample.lower, sample_traced
    rebind(sampling.__name__, "sample", sample)
    RejectionSampler.__call__ = verify_bonus


originals: dict = {}  # upstream's functions the replacements below call


def prepare_inputs(self, scheduler_output):
    """TPUModelRunner._prepare_inputs, its step and the requests asking for what the
    extended sampler adds noted for from_input_batch."""
    seam = state.of(self)
    spec = self.speculative_config
    seam.step = state.Step(scheduler_output.num_scheduled_tokens, self.requests,
                           spec.num_speculative_tokens if spec else 0)
    seam.wanting.update(new.req_id for new in scheduler_output.scheduled_new_reqs
                        if extended_metadata.asks_for_extras(new.sampling_params))
    with state.preparing(seam):
        return originals["prepare"](self, scheduler_output)


def add_request(self, request, req_index=None, dp_rank=0):
    """InputBatch.add_request: allowed_token_ids hidden from it, ours applies them
    (its own mask for them was allocated wrongly: the engine died)."""
    params = request.sampling_params
    if params is None or params.allowed_token_ids is None:
        return originals["add"](self, request, req_index, dp_rank)
    request.sampling_params = params.clone()
    request.sampling_params.allowed_token_ids = None
    try:
        return originals["add"](self, request, req_index, dp_rank)
    finally:
        request.sampling_params = params


def from_input_batch(cls, mesh, input_batch, padded_num_reqs, req_indices_dp, sharding=None):
    """TPUSupportedSamplingMetadata.from_input_batch: ours where a request asks."""
    metadata = originals["metadata"](cls, mesh, input_batch, padded_num_reqs, req_indices_dp,
                                     sharding)
    seam = state.being_prepared()
    if seam is None or seam.step is None:  # precompilation's dummy batches
        return metadata
    return extended_metadata.for_step(metadata, input_batch, padded_num_reqs, req_indices_dp,
                                      sharding, seam.step, seam.wanting)


def sample(rng, mesh, logits, tpu_sampling_metadata, allow_distributed_sampling=True):
    """tpu-inference's sample(): ours for our metadata."""
    if not isinstance(tpu_sampling_metadata, extended_metadata.metadata_class()):
        return originals["sample"](rng, mesh, logits, tpu_sampling_metadata,
                                   allow_distributed_sampling=allow_distributed_sampling)
    if tpu_sampling_metadata.slot is not None and tpu_sampling_metadata.drafts:
        # The bonus token: its counts include the drafts, which the rejection sampler
        # is handed next, with this in place of the bonus token ids.
        return DrawnInVerification(rng, logits), logits
    return programs.sample(rng, mesh, logits, tpu_sampling_metadata)


def sample_traced(rng, mesh, logits, tpu_sampling_metadata, allow_distributed_sampling=True):
    """The same choice inside a program that calls it (adapt.spec_fusion): a jit with
    compiler options, as tpu-inference's, cannot be nested. (The precompiler builds
    plain metadata only, and lowers upstream's `lower`.)"""
    if isinstance(tpu_sampling_metadata, extended_metadata.metadata_class()):
        return programs.sample_extended(rng, mesh, logits, tpu_sampling_metadata)
    return originals["sample"].__wrapped__(rng, mesh, logits, tpu_sampling_metadata,
                                           allow_distributed_sampling=allow_distributed_sampling)


def verify_bonus(self, draft_token_ids, num_draft_tokens, draft_probs, target_logits,
                 bonus_token_ids, sampling_metadata, key=None):
    """RejectionSampler.__call__: a bonus drawn in verification verified by ours."""
    if not isinstance(bonus_token_ids, DrawnInVerification):
        return originals["reject"](self, draft_token_ids, num_draft_tokens, draft_probs,
                                   target_logits, bonus_token_ids, sampling_metadata, key)
    return programs.verify(draft_token_ids, num_draft_tokens, target_logits,
                           (bonus_token_ids.rng, bonus_token_ids.logits), sampling_metadata,
                           key, self.mesh)


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
