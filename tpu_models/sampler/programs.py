"""The extended sampler's device programs: `sample_extended` for a step's rows,
`verify_extended` for drafts, and the definitions they apply (`penalize`,
`ban_bad_words`). vLLM's definitions in vLLM's order, tpu-inference's own masks
and rejection sampler around them. `sample` and `verify` run them compiled, with
the engine's TokenCounts where a batch reads them.
"""

import dataclasses
import functools

from tpu_models.sampler.counts import ANY_TOKEN, IN_PROMPT, NO_TOKEN, RECENT, record, token_counts

MASKED = -1e12  # tpu-inference's value for a token top-k or top-p removed


@functools.cache
def _compiled(counting: bool):
    import jax
    # The counts are donated: updated in place, a step's new arrays the next's input.
    return jax.jit(sample_extended, static_argnames=["mesh", "processed"],
                   donate_argnums=(4, 5) if counting else ())


class DrawnInVerification:
    """What `sample` returns in place of the bonus token ids of a penalized step beside
    drafts, which the rejection sampler is handed next (upstream passes them on as
    they are): their rng and logits, the tokens drawn in verification, which knows
    the drafts (`verify`)."""

    def __init__(self, rng, logits):
        self.rng, self.logits = rng, logits

    def __repr__(self):
        return "<bonus token ids: drawn in verification (tpu_models.sampler.programs)>"


def sample(rng, mesh, logits, metadata, processed: bool = True):
    """(tokens, processed logits) for a batch with our metadata; a batch whose
    penalties or bad words read TokenCounts adds its tokens to them. Beside drafts,
    such a batch's bonus tokens are left to `verify` (DrawnInVerification): their
    counts include the drafts. `processed`: whether the processed logits are read
    (log-probs of a processed --logprobs-mode); if not, None in their place."""
    if metadata.slot is not None and metadata.drafts:
        return DrawnInVerification(rng, logits), logits
    if metadata.slot is None:
        return _compiled(False)(rng, mesh, logits, metadata, processed=processed)
    counts = token_counts()
    tokens, out, counts.counts, counts.recent = _compiled(True)(
        rng, mesh, logits, metadata, counts.counts, counts.recent, processed=processed)
    return tokens, out


@functools.cache
def _verifying():
    import jax
    return jax.jit(verify_extended, static_argnames=["ranks"],
                   donate_argnames=("counts", "recent"))


def verify(draft_ids, num_draft, target_logits, bonus: DrawnInVerification, metadata, key,
           mesh):
    """The rejection sampler's output for a penalized step beside drafts, its bonus
    tokens drawn here; TokenCounts updated."""
    counts = token_counts()
    out, counts.counts, counts.recent = _verifying()(
        draft_ids, num_draft, target_logits, bonus.logits, metadata, bonus.rng, key,
        counts.counts, counts.recent, ranks=data_ranks(mesh))
    return out


def sample_extended(rng, mesh, logits, metadata, counts=None, recent=None, processed=True):
    """vLLM's order (v1/sample/sampler.py): allowed ids, bad words, min_tokens and
    logit_bias, then the penalties, on the logits (greedy rows too); then temperature,
    min_p, top-k, top-p (tpu-inference's own masks), and one categorical draw per row.
    A seeded row draws with key(seed) folded with the token's position, so its reply
    depends on its seed alone, not on the batch.

    With `counts` and `recent` (TokenCounts' arrays) it also returns them updated
    with the tokens it kept. Without `processed`, None in place of the processed
    logits: a [rows, vocab] array written for nothing where log-probs are of the raw
    logits (--logprobs-mode's default) or not asked."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from tpu_inference.layers.common.sharding import ShardingAxisName

    logits = jax.lax.with_sharding_constraint(
        logits.astype(jnp.float32), NamedSharding(mesh, P(ShardingAxisName.ATTN_DATA, None)))
    penalized = counts is not None
    seen = own = None
    if penalized:
        own = recent.at[metadata.slot].get(mode="fill", fill_value=NO_TOKEN)
        seen = counts.at[metadata.slot].get(mode="fill", fill_value=0)
    tokens, processed = _sample_rows(rng, adjusted(logits, metadata, seen, own), metadata,
                                     processed)
    tokens = jax.lax.with_sharding_constraint(tokens, NamedSharding(mesh, P()))
    if not penalized:
        return tokens, processed
    counts, recent = record(counts, recent, _kept_slot(metadata, counts), own, tokens[:, None],
                            jnp.ones_like(tokens))
    return tokens, processed, counts, recent


def _kept_slot(metadata, counts):
    """Each row's slot; out of range (its update dropped) for a row without one or a
    token sampled mid-prefill, which is discarded."""
    import jax.numpy as jnp
    return jnp.where(metadata.kept, metadata.slot, counts.shape[0])


def adjusted(logits, metadata, seen=None, own=None):
    """The logits after allowed ids, bad words, min_tokens and logit_bias, and the
    penalties, in vLLM's order; `seen` and `own` are each row's TokenCounts row and
    recent ids (None in a batch without penalties or bad words). A step no row of
    the batch applies (`metadata.applies`) is not computed."""
    import jax.numpy as jnp
    rows = jnp.arange(logits.shape[0], dtype=jnp.int32)[:, None]
    if "allowed_token_ids" in metadata.applies:
        allowed = jnp.zeros(logits.shape, bool).at[rows, metadata.allowed_ids].set(
            True, mode="drop")
        logits = jnp.where(metadata.restricted[:, None] & ~allowed, -jnp.inf, logits)
    if seen is not None:
        logits = ban_bad_words(logits, rows, own, metadata)
    if "logit_bias" in metadata.applies:
        logits = logits.at[rows, metadata.bias_ids].add(metadata.bias, mode="drop")
    if seen is not None:
        logits = penalize(logits, seen, metadata)
    return logits


def ban_bad_words(logits, rows, recent, metadata):
    """vLLM's bad words (v1/sample/ops/bad_words.py): a word's last id is banned when
    the ids before it end the output; a one-token word always is."""
    import jax.numpy as jnp
    prefix = metadata.bad_prefix
    ends = jnp.all((prefix == ANY_TOKEN) | (prefix == recent[:, None, :]), axis=-1)
    ban = jnp.where(ends, -jnp.inf, jnp.inf)  # min with +inf leaves a logit as it is
    return logits.at[rows, metadata.bad_last].min(ban, mode="drop")


def penalize(logits, counts, metadata):
    """vLLM's penalties (model_executor/layers/utils.py, apply_penalties): repetition
    over prompt and output (positive logits divided, others multiplied), then the
    output counts times the frequency penalty and their presence times the presence
    penalty, subtracted."""
    import jax.numpy as jnp
    if counts.shape[1] < logits.shape[1]:  # a vocabulary padded past the tokenizer's
        counts = jnp.pad(counts, ((0, 0), (0, logits.shape[1] - counts.shape[1])))
    output = (counts & (IN_PROMPT - 1)).astype(jnp.float32)
    repetition = jnp.where(counts != 0, metadata.repetition[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / repetition, logits * repetition)
    return (logits - metadata.frequency[:, None] * output
            - metadata.presence[:, None] * (output > 0))


def with_drafts(seen, own, drafts, before):
    """Rows of counts and recent ids as they stand after the first `before` of a
    request's `drafts` (ids past its own drafts: the vocabulary size): what draft
    position `before` is verified against (vLLM, rejection_sampler.py
    _combine_outputs_with_spec_tokens)."""
    import jax.numpy as jnp
    k = drafts.shape[1]
    before = jnp.minimum(before, k)[:, None]
    rows = jnp.arange(seen.shape[0], dtype=jnp.int32)[:, None]
    counted = jnp.where(jnp.arange(k) < before, drafts, seen.shape[1])
    seen = seen.at[rows, counted].add(1, mode="drop")
    ids = jnp.concatenate([own, drafts.astype(own.dtype)], axis=1)
    return seen, jnp.take_along_axis(ids, before + jnp.arange(RECENT), axis=1)


def _sample_rows(rng, logits, metadata, processed=True):
    """(tokens, processed logits) from adjusted logits."""
    import jax.numpy as jnp
    greedy = jnp.argmax(logits, axis=-1)
    if metadata.do_sampling:
        return _draw(rng, logits, greedy, metadata, processed)
    # A batch of greedy requests: nothing to draw, no vocabulary-wide sort.
    return greedy, logits if processed else None


def _draw(rng, logits, greedy, metadata, processed=True):
    """Temperature, min_p, top-k, top-p (tpu-inference's own masks), one categorical
    draw per row: (tokens, processed logits), greedy rows keeping their argmax. A
    filter no row of the step applies is not computed (`metadata.applies`); the
    processed logits only where `processed` (else None)."""
    import jax
    import jax.numpy as jnp
    from tpu_inference.layers.common.binary_search import topk_mask, topp_mask
    from tpu_inference.layers.jax.sample import sampling

    is_greedy = metadata.temperature < sampling._SAMPLING_EPS
    temperature = jnp.where(is_greedy, 1.0, metadata.temperature)
    scaled = logits / temperature[:, None]
    if "min_p" in metadata.applies:
        probs = jax.nn.softmax(scaled, axis=-1)
        kept = probs >= metadata.min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
        scaled = jnp.where(kept, scaled, MASKED)
    # As tpu-inference's _apply_sampling_transforms applies them, after temperature.
    filtered = scaled
    if "top_k" in metadata.applies:
        filtered = jnp.where((metadata.top_k > 0)[:, None],
                             topk_mask(filtered, metadata.top_k, replace_val=MASKED), filtered)
    if "top_p" in metadata.applies:
        filtered = jnp.where((metadata.top_p < 1.0)[:, None],
                             topp_mask(filtered, metadata.top_p, replace_val=MASKED), filtered)

    impl = jax.random.key_impl(rng)
    rows = jnp.arange(logits.shape[0], dtype=jnp.int32)

    def row_key(seeded, low, high, position, row):
        own = jax.random.fold_in(jax.random.fold_in(jax.random.key(low, impl=impl), high),
                                 position)
        return jnp.where(seeded, jax.random.key_data(own),
                         jax.random.key_data(jax.random.fold_in(rng, row)))

    keys = jax.random.wrap_key_data(
        jax.vmap(row_key)(metadata.seeded, metadata.seed_low, metadata.seed_high,
                          metadata.position, rows), impl=impl)
    if any(f in metadata.applies for f in ("min_p", "top_k", "top_p")):
        drawn = jax.vmap(categorical)(keys, filtered)
    else:  # temperature alone: applied inside the draw, no scaled copy of the logits
        drawn = jax.vmap(categorical)(keys, logits, 1.0 / temperature)
    tokens = jnp.where(is_greedy, greedy, drawn)
    return tokens, jnp.where(is_greedy[:, None], logits, filtered) if processed else None


BLOCK = 512  # ids a block; Gemma 3's 262,144 are 512 blocks of 512


def categorical(key, logits, scale=1.0):
    """One id drawn from softmax(`logits` x `scale`) ([vocab]; `scale` > 0, the inverse
    temperature) in two draws: a block of BLOCK ids by its probability mass, then an
    id within it. P(id) = P(its block) x P(id | its block), exactly softmax's;
    Gumbel-max over the whole row (jax.random.categorical) needs a random number per
    id: at 262,144 ids, 32 rows, 0.30 s on this host's CPU against 0.01-0.02 s so.
    The scale is applied inside the sums: a scaled copy of the logits, which XLA:CPU
    writes out, made the draw 3x slower at 32 rows."""
    import jax
    import jax.numpy as jnp
    vocab = logits.shape[-1]
    if vocab <= BLOCK:
        return jax.random.categorical(key, logits * scale)
    blocks = -(-vocab // BLOCK)
    padded = jnp.pad(logits, (0, blocks * BLOCK - vocab), constant_values=-jnp.inf)
    padded = padded.reshape(blocks, BLOCK)
    top = jnp.max(padded)
    mass = jnp.log(jnp.sum(jnp.exp((padded - top) * scale), axis=-1))  # -inf: a masked block
    outer, inner = jax.random.split(key)
    block = jax.random.categorical(outer, mass)
    return block * BLOCK + jax.random.categorical(inner, (padded[block] - top) * scale)


# Per-row fields of ExtendedMetadata (all but the dummy).
_ROW_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seeded", "seed_low", "seed_high",
               "position", "bias_ids", "bias", "allowed_ids", "restricted", "slot", "kept",
               "repetition", "frequency", "presence", "bad_last", "bad_prefix")


def verify_extended(draft_ids, num_draft, target_logits, bonus_logits, metadata, bonus_rng,
                    key, counts, recent, ranks: int):
    """tpu-inference's rejection sampler (rejection_sample, on each data-parallel
    rank's block of rows as its shard_map lays them) on logits adjusted as vLLM's
    does beside drafts (v1/sample/rejection_sampler.py): a request's draft position
    j sees its counts and recent ids with its drafts before j, its bonus token all of
    its drafts. `ranks`: the data-parallel blocks rows are laid out in. Returns
    upstream's output (each rank's [tokens] then [rows]) and TokenCounts' arrays with
    the accepted tokens added."""
    import jax
    import jax.numpy as jnp
    from tpu_inference.layers.jax.sample import rejection_sampler as upstream

    vocab, k = counts.shape[1], metadata.drafts
    own = recent.at[metadata.slot].get(mode="fill", fill_value=NO_TOKEN)
    seen = counts.at[metadata.slot].get(mode="fill", fill_value=0)

    def by_rank(a):
        return None if a is None else a.reshape(ranks, a.shape[0] // ranks, *a.shape[1:])

    rows = dataclasses.replace(metadata, _cache_collision_dummy=None,
                               **{f: by_rank(getattr(metadata, f)) for f in _ROW_FIELDS})

    def rank(draft_ids, num_draft, target, bonus, meta, seen, own, key, bonus_key):
        tokens = draft_ids.shape[0]
        segment, before = upstream._get_segment_info(num_draft, tokens)
        start = jnp.cumsum(num_draft) - num_draft
        at = jnp.minimum(start[:, None] + jnp.arange(k), tokens - 1)
        drafted = jnp.arange(k) < num_draft[:, None]
        drafts = jnp.where(drafted, draft_ids[at], vocab)
        per_token = dataclasses.replace(meta, **{f: None if getattr(meta, f) is None else
                                                 getattr(meta, f)[segment] for f in _ROW_FIELDS})
        target = adjusted(target.astype(jnp.float32), per_token,
                          *with_drafts(seen[segment], own[segment], drafts[segment], before))
        bonus = adjusted(bonus.astype(jnp.float32), meta,
                         *with_drafts(seen, own, drafts, num_draft))
        bonus_ids, _ = _sample_rows(bonus_key, bonus, meta)
        probs = upstream._compute_probs(target, num_draft, meta) if meta.do_sampling else target
        out = upstream.rejection_sample(draft_ids, num_draft, None, probs, bonus_ids,
                                        meta.do_sampling, key=key)
        # The accepted ids in order: a prefix of the drafts' positions, then the bonus.
        main = jnp.where(drafted, out[at], upstream.PLACEHOLDER_TOKEN_ID)
        n_main = jnp.sum((main >= 0) & (main < vocab), axis=1)
        bonus_out = out[tokens:]
        bonus_ok = (bonus_out >= 0) & (bonus_out < vocab)
        main = jnp.concatenate([main, jnp.full_like(main[:, :1], vocab)], axis=1)
        slots = jnp.arange(k + 1)
        accepted = jnp.where(slots < n_main[:, None], main,
                             jnp.where(slots == n_main[:, None], bonus_out[:, None], vocab))
        return out, accepted, n_main + bonus_ok

    keys = jax.vmap(lambda r: jax.random.fold_in(key, r))(jnp.arange(ranks))
    bonus_keys = jax.vmap(lambda r: jax.random.fold_in(bonus_rng, r))(jnp.arange(ranks))
    out, accepted, n = jax.vmap(rank)(
        by_rank(draft_ids), by_rank(num_draft), by_rank(target_logits), by_rank(bonus_logits),
        rows, by_rank(seen), by_rank(own), keys, bonus_keys)
    rows_total = metadata.slot.shape[0]
    counts, recent = record(counts, recent, _kept_slot(metadata, counts), own,
                            accepted.reshape(rows_total, k + 1), n.reshape(rows_total))
    return out.reshape(-1), counts, recent


def data_ranks(mesh) -> int:
    """The blocks tpu-inference lays rows out in: its data-parallel sharding's size."""
    import math
    from tpu_inference.layers.common.sharding import ShardingAxisName
    axes = ShardingAxisName.ATTN_DATA
    return math.prod(mesh.shape.get(a, 1) for a in ((axes, ) if isinstance(axes, str) else axes))
