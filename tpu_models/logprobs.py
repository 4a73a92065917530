"""Log-probs over a large vocabulary, a piece of rows at a time.

tpu-inference's `compute_and_gather_logprobs` takes the log-softmax of every
row at once: for prompt log-probs over 1,024 tokens of Gemma 3's 262,144 ids
that is 1 GiB of float32 and, with top-k and the ranks, 2 GiB of temporaries,
more than a v5e chip has left beside its KV cache. Here the rows go through in
pieces of `rows_per_piece(vocab)` (a piece's log-softmax at most PIECE_BYTES), so
a program's temporaries no longer grow with the rows. Each row's result is what
upstream's computes: the same operations, on the same row.

Also served where tpu-inference's own answer failed: logprobs=0
(`gathered_for_zero`), and a drafting engine's step without drafts
(`drafting_without_drafts`, `bonus_rows`). The seam calls these (adapt.logprobs,
adapt.sampling).
"""

import functools

# The float32 log-softmax of one piece of rows: 64 MiB (64 rows of Gemma 3, 110 of Qwen3).
PIECE_BYTES = 64 * 2**20


def rows_per_piece(vocab: int) -> int:
    """Rows a piece holds: a power of two, at least 8, its log-softmax within PIECE_BYTES."""
    rows = max(8, PIECE_BYTES // (4 * vocab))
    return 1 << (rows.bit_length() - 1)


def gather(logits, token_ids, max_logprobs: int):
    """LogprobsTensors (ids, logprobs, ranks) of each row: the token's own log-prob and
    rank first, then the top `max_logprobs`; vLLM's definition (v1/sample/sampler.py
    gather_logprobs), a piece of rows at a time."""
    import jax
    import jax.numpy as jnp
    from vllm.v1.outputs import LogprobsTensors

    rows, vocab = logits.shape
    piece = rows_per_piece(vocab)
    if rows <= piece:
        return LogprobsTensors(*_gather_rows(logits, token_ids, max_logprobs))
    # Pieces are sliced where they lie (a reshape or pad of the logits would copy them
    # all: vocabularies such as 262,208 are no multiple of the TPU's 128 lanes). The
    # last piece ends at the last row, overlapping the one before: those rows are
    # computed twice, to the same values.
    width = max_logprobs + 1
    out = (jnp.zeros((rows, width), jnp.int32), jnp.zeros((rows, width), jnp.float32),
           jnp.zeros((rows,), jnp.int32))

    def one_piece(i, out):
        start = jnp.minimum(i * piece, rows - piece)
        found = _gather_rows(jax.lax.dynamic_slice_in_dim(logits, start, piece),
                             jax.lax.dynamic_slice_in_dim(token_ids, start, piece), max_logprobs)
        return tuple(jax.lax.dynamic_update_slice_in_dim(o, f.astype(o.dtype), start, 0)
                     for o, f in zip(out, found))

    return LogprobsTensors(*jax.lax.fori_loop(0, -(-rows // piece), one_piece, out))


def _gather_rows(logits, token_ids, max_logprobs: int):
    """jax.nn.log_softmax's arithmetic, (x - max) - log(sum(exp(x - max))), applied
    where it is read: the [rows, vocab] log-probs are written only for lax.top_k of
    more than one (it reads an array); a top 1 is their argmax (top_k, too, puts the
    lower id first among equals). Each value is upstream's, computed by the same
    operations."""
    import jax
    import jax.numpy as jnp
    x = logits.astype(jnp.float32)
    shift = jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    log_z = jnp.log(jnp.sum(jnp.exp(x - shift), axis=-1, keepdims=True))

    def logprob(values):
        return (values - shift) - log_z

    logprobs = logprob(x)
    token_ids = token_ids[:, None]
    token_logprobs = logprob(jnp.take_along_axis(x, token_ids, axis=-1))
    if max_logprobs == 1:
        top_ids = jnp.argmax(logprobs, axis=-1, keepdims=True)
        top_logprobs = logprob(jnp.take_along_axis(x, top_ids, axis=-1))
    else:
        top_logprobs, top_ids = jax.lax.top_k(logprobs, k=max_logprobs)
    ranks = jnp.sum(logprobs >= token_logprobs, axis=-1)
    ids = jnp.concatenate((token_ids, top_ids), axis=1).astype(jnp.int32)
    return ids, jnp.concatenate((token_logprobs, top_logprobs), axis=1), ranks


@functools.cache
def programs():
    """(sampled, prompt): the jitted programs the runner calls in place of upstream's,
    with its signatures and its replicated outputs."""
    import jax
    from jax.sharding import PartitionSpec as P

    @jax.jit(static_argnames=("max_logprobs",), out_shardings=P())
    def compute_and_gather_logprobs(logits, next_tokens, max_logprobs):
        return gather(logits, next_tokens, max_logprobs)

    @jax.jit(static_argnames=("max_logprobs",), out_shardings=P())
    def compute_and_gather_prompt_logprobs(logits, prompt_target_ids, max_logprobs):
        return gather(logits, prompt_target_ids, max_logprobs)

    return compute_and_gather_logprobs, compute_and_gather_prompt_logprobs


class _AskingForLogprobs:
    """An input batch read as asking for the log-probs gather."""

    def __init__(self, batch):
        self._batch = batch

    def __getattr__(self, name):
        return getattr(self._batch, name)

    @property
    def max_num_logprobs(self):
        return 1  # the gather always returns the model's max_logprobs columns


def gathered_for_zero(input_batch):
    """The input batch, read as asking for the gather when its requests asked for
    logprobs=0 (the sampled token's log-prob, chat's `logprobs: true`): tpu-inference
    gathers only for max_num_logprobs > 0, so such a request got no logprobs and
    vLLM's response builder raised IndexError (a 500)."""
    return _AskingForLogprobs(input_batch) if input_batch.max_num_logprobs == 0 else input_batch


def drafting_without_drafts(spec_decode_metadata) -> bool:
    """Whether a step of a drafting engine had no drafts (the first step, for one). It
    is laid out [draft rows, bonus rows] per rank all the same; tpu-inference unpicks
    that layout only when some request drafted, so such a step's logprobs were read
    from the draft rows' -1 placeholders, which killed the engine."""
    import numpy as np
    return (spec_decode_metadata is not None
            and np.sum(spec_decode_metadata.draft_lengths_cpu) == 0)


def bonus_rows(logprobs_tensors, spec_decode_metadata, runner, num_reqs):
    """vLLM's LogprobsLists of a drafting step without drafts: its bonus rows, unpicked
    by tpu-inference's own filter_speculative_logprobs."""
    import jax
    import numpy as np
    from tpu_inference.spec_decode.jax.utils import filter_speculative_logprobs
    from vllm.v1.outputs import LogprobsLists

    ids, logprobs, ranks, cu_num_generated_tokens = filter_speculative_logprobs(
        *(np.asarray(jax.device_get(a)) for a in (logprobs_tensors.logprob_token_ids,
          logprobs_tensors.logprobs, logprobs_tensors.selected_token_ranks)),
        spec_decode_metadata,
        runner.input_batch.vocab_size, runner.dp_size,
        runner.input_batch.num_reqs if num_reqs is None else num_reqs)
    return LogprobsLists(logprob_token_ids=ids, logprobs=logprobs, sampled_token_ranks=ranks,
                         cu_num_generated_tokens=cu_num_generated_tokens)
