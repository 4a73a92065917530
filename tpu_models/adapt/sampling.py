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

import dataclasses
import functools

from tpu_models.adapt.guard import (LOGPROBS_WITH_DRAFTS, LOGPROBS_ZERO, SAMPLER_EXTRAS, Patch,
                                    Target, rebind)
from tpu_models.adapt.sampler_programs import data_ranks, sample_extended, verify_extended
from tpu_models.penalties import ANY_TOKEN, RECENT, bucket, token_counts


@functools.cache
def metadata_class():
    import jax
    from tpu_inference.layers.jax.sample.sampling_metadata import TPUSupportedSamplingMetadata

    @functools.partial(
        jax.tree_util.register_dataclass,
        data_fields=["temperature", "top_k", "top_p", "_cache_collision_dummy", "min_p",
                     "seeded", "seed_low", "seed_high", "position", "bias_ids", "bias",
                     "allowed_ids", "restricted", "slot", "kept", "repetition", "frequency",
                     "presence", "bad_last", "bad_prefix"],
        meta_fields=["do_sampling", "logprobs", "drafts"])
    @dataclasses.dataclass
    class ExtendedMetadata(TPUSupportedSamplingMetadata):
        min_p: object = None  # (rows,) f32, 0 for none
        seeded: object = None  # (rows,) bool
        seed_low: object = None  # (rows,) u32: the seed's two 32-bit halves
        seed_high: object = None
        position: object = None  # (rows,) i32: the sampled token's index in its sequence
        bias_ids: object = None  # (rows, k) i32, the vocabulary size where unused
        bias: object = None  # (rows, k) f32: logit_bias, and -inf on stop ids under min_tokens
        allowed_ids: object = None  # (rows, k) i32, the vocabulary size where unused
        restricted: object = None  # (rows,) bool: only allowed_ids may be drawn
        # Penalties and bad words; None in a batch where no request asks for them.
        slot: object = None  # (rows,) i32: the row's TokenCounts slot, `slots` for none
        kept: object = None  # (rows,) bool: the sampled token is kept (not mid-prefill)
        repetition: object = None  # (rows,) f32, 1 for none
        frequency: object = None  # (rows,) f32, 0 for none
        presence: object = None  # (rows,) f32, 0 for none
        bad_last: object = None  # (rows, words) i32: a bad word's last id, vocab if unused
        bad_prefix: object = None  # (rows, words, RECENT) i32: the ids before it, right-aligned
        # Beside drafts, with penalties or bad words: the drafts a request may have. Its
        # bonus token is then drawn in verification, which knows them (verify_extended).
        drafts: int = 0

    return ExtendedMetadata


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
    num_scheduled, requests, drafts = step
    _WANTING.intersection_update(requests)
    ids = input_batch.req_ids
    per_rank = padded_num_reqs // len(req_indices_dp)
    rows = [(row, index, requests[ids[index]], ids[index])
            for rank, indices in req_indices_dp.items()
            for row, index in enumerate(indices, start=rank * per_rank)]
    if not any(req_id in _WANTING for *_, req_id in rows):
        return metadata
    import numpy as np
    from tpu_inference.layers.jax.sample import sampling
    from vllm.sampling_params import SamplingType
    vocab = input_batch.vocab_size
    n = padded_num_reqs
    temperature = np.full(n, -1.0, np.float32)
    top_k, top_p, min_p = np.zeros(n, np.int32), np.ones(n, np.float32), np.zeros(n, np.float32)
    seeded, seed, position = np.zeros(n, bool), np.zeros(n, np.uint64), np.zeros(n, np.int32)
    restricted = np.zeros(n, bool)
    biases, allowed = [[] for _ in range(n)], [[] for _ in range(n)]
    counted = [(row, index, request, req_id) for row, index, request, req_id in rows
               if request.sampling_params is not None and _counted(request.sampling_params)]
    if counted:
        counts = token_counts(metadata._cache_collision_dummy.sharding.mesh,
                               input_batch.max_num_reqs, vocab)
        counts.forget(requests)
        in_batch = {req_id for *_, req_id in rows}
        slot, kept = np.full(n, counts.slots, np.int32), np.zeros(n, bool)
        repetition, frequency, presence = (np.ones(n, np.float32), np.zeros(n, np.float32),
                                           np.zeros(n, np.float32))
        words = [[] for _ in range(n)]
        for row, index, request, req_id in counted:
            params = request.sampling_params
            slot[row] = counts.slot_of(req_id, request, in_batch)
            # tpu-inference's own test for a token it discards: one sampled mid-prefill.
            kept[row] = (input_batch.num_computed_tokens_cpu[index]
                         + num_scheduled.get(req_id, 0) >= request.num_tokens)
            repetition[row] = params.repetition_penalty
            frequency[row], presence[row] = params.frequency_penalty, params.presence_penalty
            words[row] = params.bad_words_token_ids or []
        counts.rebuild()
        bad_last = np.full((n, bucket(max(map(len, words)))), vocab, np.int32)
        bad_prefix = np.full((*bad_last.shape, RECENT), ANY_TOKEN, np.int32)
        for row in range(n):
            for w, word in enumerate(words[row]):
                bad_last[row, w] = word[-1]
                bad_prefix[row, w, RECENT - len(word) + 1:] = word[:-1]
    for row, index, request, req_id in rows:
        params = request.sampling_params
        temperature[row] = input_batch.temperature_cpu[index]
        top_k[row], top_p[row] = input_batch.top_k_cpu[index], input_batch.top_p_cpu[index]
        min_p[row] = params.min_p
        # The token sampled now is at this index of prompt + output.
        position[row] = input_batch.num_computed_tokens_cpu[index] + num_scheduled.get(req_id, 0)
        if params.sampling_type == SamplingType.RANDOM_SEED:
            seeded[row] = True
            seed[row] = params.seed & 0xFFFF_FFFF_FFFF_FFFF
        biases[row] = list((params.logit_bias or {}).items())
        if position[row] - request.num_prompt_tokens < params.min_tokens:
            biases[row] += [(t, -np.inf) for t in params.all_stop_token_ids]
        if params.allowed_token_ids is not None:
            restricted[row], allowed[row] = True, params.allowed_token_ids
    bias_ids = np.full((n, bucket(max(map(len, biases)))), vocab, np.int32)
    bias = np.zeros(bias_ids.shape, np.float32)
    allowed_ids = np.full((n, bucket(max(map(len, allowed)))), vocab, np.int32)
    for row in range(n):
        if biases[row]:
            ids, values = zip(*biases[row])
            bias_ids[row, :len(ids)], bias[row, :len(ids)] = ids, values
        allowed_ids[row, :len(allowed[row])] = allowed[row]
    from tpu_inference.utils import device_array
    mesh = metadata._cache_collision_dummy.sharding.mesh

    def put(values):
        return device_array(mesh, values, sharding=sharding)
    return metadata_class()(
        temperature=put(temperature), top_k=put(top_k), top_p=put(top_p),
        _cache_collision_dummy=metadata._cache_collision_dummy,
        do_sampling=bool((temperature >= sampling._SAMPLING_EPS).any()),
        logprobs=metadata.logprobs, min_p=put(min_p), seeded=put(seeded),
        seed_low=put((seed & 0xFFFF_FFFF).astype(np.uint32)),
        seed_high=put((seed >> np.uint64(32)).astype(np.uint32)), position=put(position),
        bias_ids=put(bias_ids), bias=put(bias), allowed_ids=put(allowed_ids),
        restricted=put(restricted),
        **({} if not counted else dict(
            drafts=drafts, slot=put(slot), kept=put(kept), repetition=put(repetition),
            frequency=put(frequency), presence=put(presence), bad_last=put(bad_last),
            bad_prefix=put(bad_prefix))))


def extras_sampled() -> None:
    import jax
    from tpu_inference.layers.jax.sample import sampling
    from tpu_inference.layers.jax.sample.rejection_sampler import RejectionSampler
    from tpu_inference.layers.jax.sample.sampling_metadata import TPUSupportedSamplingMetadata
    from tpu_inference.runner.input_batch import InputBatch
    from tpu_inference.runner.tpu_runner import TPUModelRunner

    original_prepare = TPUModelRunner._prepare_inputs

    def _prepare_inputs(self, scheduler_output):
        # from_input_batch sees only the batch: lend it the requests and this step's sizes.
        spec = self.speculative_config
        self.input_batch._tpu_models_step = (scheduler_output.num_scheduled_tokens,
                                             self.requests,
                                             spec.num_speculative_tokens if spec else 0)
        return original_prepare(self, scheduler_output)

    TPUModelRunner._prepare_inputs = _prepare_inputs
    original_add = InputBatch.add_request

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

    InputBatch.add_request = add_request
    original_metadata = TPUSupportedSamplingMetadata.from_input_batch.__func__

    def from_input_batch(cls, mesh, input_batch, padded_num_reqs, req_indices_dp,
                         sharding=None):
        metadata = original_metadata(cls, mesh, input_batch, padded_num_reqs, req_indices_dp,
                                     sharding)
        return _extended(metadata, input_batch, padded_num_reqs, req_indices_dp, sharding)

    TPUSupportedSamplingMetadata.from_input_batch = classmethod(from_input_batch)
    original_sample = sampling.sample
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
    rebind("tpu_inference.layers.jax.sample.sampling", "sample", sample)

    original_reject = RejectionSampler.__call__
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

    RejectionSampler.__call__ = __call__


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
