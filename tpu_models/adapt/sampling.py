"""Sampling: tpu-inference's sampler, with min_p, seeds, logit_bias, allowed ids,
min_tokens, the presence, frequency and repetition penalties and bad words.

The extended sampler is tpu_models.sampler (its docstring: what it takes and when);
logprobs=0 and logprobs beside drafts, tpu_models.logprobs.
"""

import functools

from tpu_models import logprobs, patching
from tpu_models.adapt import state
from tpu_models.features import LOGPROBS_WITH_DRAFTS, LOGPROBS_ZERO, SAMPLER_EXTRAS
from tpu_models.patching import Patch, Target
from tpu_models.sampler import metadata as extended_metadata
from tpu_models.sampler import programs


def prepare_inputs(original, self, scheduler_output):
    """TPUModelRunner._prepare_inputs: the step, and its requests that ask for the
    extended sampler, noted for from_input_batch."""
    seam = state.of(self)
    spec = self.speculative_config
    seam.step = state.Step(scheduler_output.num_scheduled_tokens, self.requests,
                           spec.num_speculative_tokens if spec else 0)
    seam.wanting.update(extended_metadata.new_requests_asking(scheduler_output))
    with state.preparing(seam):
        return original(self, scheduler_output)


def add_request(original, self, request, req_index=None, dp_rank=0):
    """InputBatch.add_request: allowed_token_ids hidden from it, ours applies them."""
    with extended_metadata.allowed_ids_hidden(request):
        return original(self, request, req_index, dp_rank)


def from_input_batch(original, cls, mesh, input_batch, padded_num_reqs, req_indices_dp,
                     sharding=None):
    """TPUSupportedSamplingMetadata.from_input_batch: logprobs=0 gathered; the extended
    sampler's metadata where a request of the step asks."""
    metadata = original(cls, mesh, logprobs.gathered_for_zero(input_batch), padded_num_reqs,
                        req_indices_dp, sharding)
    seam = state.being_prepared()
    if seam is None or seam.step is None:  # precompilation's dummy batches
        return metadata
    return extended_metadata.for_step(metadata, input_batch, padded_num_reqs, req_indices_dp,
                                      sharding, seam.step, seam.wanting)


def sample(original, rng, mesh, logits, tpu_sampling_metadata, allow_distributed_sampling=True):
    """tpu-inference's sample(): ours for our metadata. Upstream allows distributed
    sampling exactly where its processed logits are not read, and ours then
    returns none."""
    if isinstance(tpu_sampling_metadata, extended_metadata.metadata_class()):
        return programs.sample(rng, mesh, logits, tpu_sampling_metadata,
                               processed=not allow_distributed_sampling)
    return original(rng, mesh, logits, tpu_sampling_metadata,
                    allow_distributed_sampling=allow_distributed_sampling)


def sample_traced(original, rng, mesh, logits, tpu_sampling_metadata,
                  allow_distributed_sampling=True):
    """sample()'s `__wrapped__`: the same choice inside a program that calls it
    (adapt.spec_fusion); `original` is upstream's, unjitted."""
    if isinstance(tpu_sampling_metadata, extended_metadata.metadata_class()):
        return programs.sample_extended(rng, mesh, logits, tpu_sampling_metadata,
                                        processed=not allow_distributed_sampling)
    return original(rng, mesh, logits, tpu_sampling_metadata,
                    allow_distributed_sampling=allow_distributed_sampling)


def sample_lowered_and_traced() -> None:
    """Our sample() keeps upstream's `lower` (the precompiler lowers plain metadata
    only), and its `__wrapped__` chooses as it does: a jit with compiler options, as
    upstream's, cannot be nested."""
    from tpu_inference.layers.jax.sample import sampling
    upstream = patching.ORIGINALS[f"{SAMPLING}.sample"]
    sampling.sample.lower = upstream.lower
    sampling.sample.__wrapped__ = functools.partial(sample_traced, upstream.__wrapped__)


def verify_bonus(original, self, draft_token_ids, num_draft_tokens, draft_probs, target_logits,
                 bonus_token_ids, sampling_metadata, key=None):
    """RejectionSampler.__call__: bonus tokens left to verification verified by ours."""
    if isinstance(bonus_token_ids, programs.DrawnInVerification):
        return programs.verify(draft_token_ids, num_draft_tokens, target_logits,
                               bonus_token_ids, sampling_metadata, key, self.mesh)
    return original(self, draft_token_ids, num_draft_tokens, draft_probs, target_logits,
                    bonus_token_ids, sampling_metadata, key)


def logprobs_materialized(original, logprobs_tensors, logits_indices_selector=None,
                          cu_num_generated_tokens=None, spec_decode_metadata=None, runner=None,
                          num_reqs=None):
    """tpu_runner._jax_logprobs_materialize: a drafting step without drafts read from
    its bonus rows."""
    if logprobs.drafting_without_drafts(spec_decode_metadata):
        return logprobs.bonus_rows(logprobs_tensors, spec_decode_metadata, runner, num_reqs)
    return original(logprobs_tensors, logits_indices_selector, cu_num_generated_tokens,
                    spec_decode_metadata, runner, num_reqs)


SAMPLING = "tpu_inference.layers.jax.sample.sampling"
METADATA = "tpu_inference.layers.jax.sample.sampling_metadata.TPUSupportedSamplingMetadata"
REJECTION = "tpu_inference.layers.jax.sample.rejection_sampler"
# One replacement of from_input_batch serves both features that need it.
FROM_INPUT_BATCH = Target(f"{METADATA}.from_input_batch",
                          "mesh input_batch padded_num_reqs req_indices_dp sharding",
                          from_input_batch)
PATCHES = [
    Patch("logprobs=0 served", LOGPROBS_ZERO, (FROM_INPUT_BATCH, ),
          "logprobs=0 (chat's logprobs: true) answered 500 'list index out of range'",
          "tests/test_sampling_params.py::test_logprobs_zero_gives_the_sampled_tokens_logprob",
          upstream="tpu-inference issue 3572 (fix PR closed unmerged)"),
    Patch("logprobs beside drafts served", LOGPROBS_WITH_DRAFTS, (
        Target("tpu_inference.runner.tpu_runner._jax_logprobs_materialize",
               "logprobs_tensors logits_indices_selector cu_num_generated_tokens "
               "spec_decode_metadata runner num_reqs", logprobs_materialized),
        Target("tpu_inference.spec_decode.jax.utils.filter_speculative_logprobs",
               "log_token_ids logprobs_arr selected_token_ranks spec_decode_metadata vocab_size "
               "dp_size num_reqs")),
        "a drafting engine's step with no drafts (the first) read logprobs from its draft "
        "rows; the engine died",
        "tests/test_spec_decode.py::test_ngram_on_gemma3_matches_transformers"),
    Patch("min_p, seeds, logit_bias, allowed ids, min_tokens, penalties and bad words "
          "sampled (drafts verified with the penalties and bad words)", SAMPLER_EXTRAS, (
        Target("tpu_inference.runner.tpu_runner.TPUModelRunner._prepare_inputs",
               "self scheduler_output", prepare_inputs),
        Target("tpu_inference.runner.input_batch.InputBatch.add_request",
               "self request req_index dp_rank", add_request),
        FROM_INPUT_BATCH,
        Target(f"{SAMPLING}.sample",
               "rng mesh logits tpu_sampling_metadata allow_distributed_sampling", sample),
        Target(f"{SAMPLING}._apply_sampling_transforms", "logits tpu_sampling_metadata"),
        Target(f"{REJECTION}.RejectionSampler.__call__", "self draft_token_ids num_draft_tokens "
               "draft_probs target_logits bonus_token_ids sampling_metadata key", verify_bonus),
        Target(f"{REJECTION}.rejection_sample", "draft_token_ids num_draft_tokens draft_probs "
               "target_probs bonus_token_ids do_sampling key"),
        Target(f"{REJECTION}._compute_probs", "logits num_draft_tokens sampling_metadata"),
        Target(f"{REJECTION}._get_segment_info", "num_draft_tokens total_tokens")),
        "ignored (allowed_token_ids killed the engine); a seed answered 500; no penalties, "
        "bad words",
        "tests/test_sampler.py::test_seeded_replies_repeat_and_differ_by_seed",
        sample_lowered_and_traced, upstream="tpu-inference sampler: temperature, top-k, top-p only"),
]
