"""The extended sampler's metadata: what a request asks for beyond tpu-inference's
sampler (`ADDED`), `ExtendedMetadata`, and its arrays built on the host from a
step's rows (`for_step`), a row per request laid out as tpu-inference lays them (a
block per data-parallel rank)."""

import contextlib
import dataclasses
import functools

from tpu_models.sampler.counts import ANY_TOKEN, RECENT, bucket, token_counts

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
# The steps over the vocabulary a row may apply (ExtendedMetadata.applies);
# "logit_bias" covers min_tokens' stop ids too.
APPLIED = ("allowed_token_ids", "logit_bias", "min_p", "top_k", "top_p")
# Those that read what the request has seen (TokenCounts).
COUNTED = ("presence_penalty", "frequency_penalty", "repetition_penalty", "bad_words")


def asks_for_extras(params) -> bool:
    return params is not None and any(is_set(params) for is_set in ADDED.values())


def new_requests_asking(scheduler_output) -> set[str]:
    """The ids of a step's new requests that ask for something we add."""
    return {new.req_id for new in scheduler_output.scheduled_new_reqs
            if asks_for_extras(new.sampling_params)}


@contextlib.contextmanager
def allowed_ids_hidden(request):
    """While tpu-inference's input batch takes a request (the runner's
    CachedRequestState): its allowed_token_ids hidden, which `extended` applies
    (the batch's own mask for them was allocated wrongly: the engine died)."""
    params = request.sampling_params
    if params is None or params.allowed_token_ids is None:
        yield
        return
    request.sampling_params = params.clone()
    request.sampling_params.allowed_token_ids = None
    try:
        yield
    finally:
        request.sampling_params = params


def _counted(params) -> bool:
    return any(ADDED[name](params) for name in COUNTED)


def for_step(metadata, input_batch, n, req_indices_dp, sharding, step, wanting: set[str]):
    """tpu-inference's `metadata`, or ours when a request of the step asks for
    something we add. `step`: its tokens scheduled, requests and drafts
    (adapt.state.Step); `wanting`: the live requests that ask (asks_for_extras),
    pruned here to the runner's requests."""
    if not wanting:  # a step without any costs this test
        return metadata
    requests, ids = step.requests, input_batch.req_ids
    wanting.intersection_update(requests)
    per_rank = n // len(req_indices_dp)
    rows = [(row, index, requests[ids[index]], ids[index])
            for rank, indices in req_indices_dp.items()
            for row, index in enumerate(indices, start=rank * per_rank)]
    if not any(req_id in wanting for *_, req_id in rows):
        return metadata
    counted = [(row, index, request, req_id) for row, index, request, req_id in rows
               if request.sampling_params is not None and _counted(request.sampling_params)]
    return extended(metadata, input_batch, n, sharding, rows, counted, step)


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
        meta_fields=["do_sampling", "logprobs", "drafts", "applies"])
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
        # Which of APPLIED some row of the step applies: each is a pass or a binary
        # search over the vocabulary (at 262,144 ids, 32 rows, on this host's CPU:
        # top-k 0.27 s, top-p 0.27 s, allowed ids and logit_bias 0.02 s) that a step
        # without it skips. Metadata built elsewhere (tests) applies them all.
        applies: tuple = APPLIED

    return ExtendedMetadata


def extended(metadata, input_batch, n, sharding, rows, counted, step):
    """ExtendedMetadata of `n` rows (padded) for a step's `rows`, each (row, index in
    the batch, request, request id); `counted`: those of them whose penalties or bad
    words read TokenCounts."""
    import numpy as np
    from tpu_inference.layers.jax.sample import sampling
    from tpu_inference.utils import device_array

    num_scheduled, requests, drafts = step.num_scheduled, step.requests, step.drafts
    vocab = input_batch.vocab_size
    if counted:
        penalties = _penalty_arrays(metadata, input_batch, n, rows, counted, num_scheduled,
                                    requests)
    settings, biases, allowed = _row_arrays(input_batch, n, rows, num_scheduled)
    bias_ids, bias, allowed_ids = _id_tables(n, vocab, biases, allowed)
    mesh = metadata._cache_collision_dummy.sharding.mesh

    def put(values):
        return device_array(mesh, values, sharding=sharding)
    temperature, seed = settings["temperature"], settings["seed"]
    sampled = temperature >= sampling._SAMPLING_EPS
    by_row = {"allowed_token_ids": settings["restricted"], "logit_bias": bias_ids < vocab,
              "min_p": (settings["min_p"] > 0) & sampled,
              "top_k": (settings["top_k"] > 0) & sampled,
              "top_p": (settings["top_p"] < 1) & sampled}
    return metadata_class()(
        temperature=put(temperature), top_k=put(settings["top_k"]),
        top_p=put(settings["top_p"]), _cache_collision_dummy=metadata._cache_collision_dummy,
        do_sampling=bool(sampled.any()),
        applies=tuple(name for name in APPLIED if by_row[name].any()),
        logprobs=metadata.logprobs, min_p=put(settings["min_p"]),
        seeded=put(settings["seeded"]), seed_low=put((seed & 0xFFFF_FFFF).astype(np.uint32)),
        seed_high=put((seed >> np.uint64(32)).astype(np.uint32)),
        position=put(settings["position"]), bias_ids=put(bias_ids), bias=put(bias),
        allowed_ids=put(allowed_ids), restricted=put(settings["restricted"]),
        **({} if not counted else dict(
            drafts=drafts, **{name: put(values) for name, values in penalties.items()})))


def _row_arrays(input_batch, n, rows, num_scheduled):
    """Each row's temperature, top-k, top-p, min_p, seed and position; and its
    logit_bias (with min_tokens' stop ids) and allowed ids, as lists."""
    import numpy as np
    from vllm.sampling_params import SamplingType

    temperature = np.full(n, -1.0, np.float32)
    top_k, top_p, min_p = np.zeros(n, np.int32), np.ones(n, np.float32), np.zeros(n, np.float32)
    seeded, seed, position = np.zeros(n, bool), np.zeros(n, np.uint64), np.zeros(n, np.int32)
    restricted = np.zeros(n, bool)
    biases, allowed = [[] for _ in range(n)], [[] for _ in range(n)]
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
    settings = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                    seeded=seeded, seed=seed, position=position, restricted=restricted)
    return settings, biases, allowed


def _id_tables(n, vocab, biases, allowed):
    """The rows' (id, bias) lists and allowed ids as [rows, k] tables, k a bucket
    (few compiled shapes); unused entries hold the vocabulary size."""
    import numpy as np
    bias_ids = np.full((n, bucket(max(map(len, biases)))), vocab, np.int32)
    bias = np.zeros(bias_ids.shape, np.float32)
    allowed_ids = np.full((n, bucket(max(map(len, allowed)))), vocab, np.int32)
    for row in range(n):
        if biases[row]:
            ids, values = zip(*biases[row])
            bias_ids[row, :len(ids)], bias[row, :len(ids)] = ids, values
        allowed_ids[row, :len(allowed[row])] = allowed[row]
    return bias_ids, bias, allowed_ids


def _penalty_arrays(metadata, input_batch, n, rows, counted, num_scheduled, requests) -> dict:
    """The penalties' and bad words' arrays for the `counted` rows, each given its
    TokenCounts slot (the counts rebuilt for requests new to them)."""
    import numpy as np
    counts = token_counts(metadata._cache_collision_dummy.sharding.mesh,
                          input_batch.max_num_reqs, input_batch.vocab_size)
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
    bad_last, bad_prefix = _bad_word_tables(n, input_batch.vocab_size, words)
    return dict(slot=slot, kept=kept, repetition=repetition, frequency=frequency,
                presence=presence, bad_last=bad_last, bad_prefix=bad_prefix)


def _bad_word_tables(n, vocab, words):
    """Each row's bad words as their last ids [rows, words] and the ids before them,
    right-aligned [rows, words, RECENT] (ANY_TOKEN where a word is shorter)."""
    import numpy as np
    bad_last = np.full((n, bucket(max(map(len, words)))), vocab, np.int32)
    bad_prefix = np.full((*bad_last.shape, RECENT), ANY_TOKEN, np.int32)
    for row in range(n):
        for w, word in enumerate(words[row]):
            bad_last[row, w] = word[-1]
            bad_prefix[row, w, RECENT - len(word) + 1:] = word[:-1]
    return bad_last, bad_prefix
