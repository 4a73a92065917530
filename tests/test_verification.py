"""Drafts verified with penalties and bad words (sampler.programs.verify_extended),
against vLLM's own definitions beside drafts: its rejection sampler's outputs
combined with the drafts before each position (_combine_outputs_with_spec_tokens),
apply_all_penalties and apply_bad_words_with_drafts, over random logits. A draft is
accepted while it is its position's argmax (vLLM's greedy verification); the bonus
token sees every draft. The device's counts then hold what was accepted."""

import types

import numpy as np
import pytest

V, K, ROWS = 64, 3, 8  # vocabulary, drafts a request, rows a data-parallel rank
DECISIVE = 1e-3  # float32 penalties (ours, vLLM's in torch) agree to ~1e-6
# Sampled: at this temperature a gap of PEAKED between the best two logits leaves the
# others e^-30 of the mass, so that the draws are the argmax.
TEMPERATURE, PEAKED = 1e-4, 3e-3


def vllm_penalized(logits, prompt, outputs, params):
    """vLLM's penalties and bad words over rows of `logits`, row i having generated
    outputs[i] (its drafts before it included)."""
    import torch
    from vllm.v1.sample.ops.bad_words import apply_bad_words
    from vllm.v1.sample.ops.penalties import apply_all_penalties
    rows = torch.tensor(np.asarray(logits, np.float32))
    n = len(outputs)
    width = max(len(prompt), 1)
    prompt_t = torch.full((n, width), V, dtype=torch.long)
    prompt_t[:, :len(prompt)] = torch.tensor(prompt)
    rows = apply_all_penalties(rows, prompt_t, torch.full((n,), params["presence"]),
                               torch.full((n,), params["frequency"]),
                               torch.full((n,), params["repetition"]), outputs)
    apply_bad_words(rows, {i: params["bad_words"] for i in range(n)}, outputs)
    return rows.numpy()


def argmax(row, margin=DECISIVE) -> int:
    top = np.sort(row)[-2:]
    assert top[1] - top[0] > margin, top  # not a near-tie
    return int(np.argmax(row))


def request(rng, favoured):
    """A request whose logits favour two ids at every position, so that the drafts
    before a position change its argmax through the penalties and a two-id bad word."""
    f, g = favoured
    return {
        "prompt": rng.integers(0, V, rng.integers(1, 8)).tolist(),
        "history": rng.integers(0, V, rng.integers(0, 6)).tolist(),
        "repetition": float(rng.uniform(1.0, 2.5)), "frequency": float(rng.uniform(0, 1.5)),
        "presence": float(rng.uniform(0, 1.5)),
        "bad_words": [[int(rng.integers(0, V))], [f, g]],
        "drafts": int(rng.choice([0, 1, K, K])),
    }


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled-peaked"])
def test_drafts_are_verified_with_the_counts_of_the_drafts_before_them(ranks, sampled):
    """Each rank's rows as tpu-inference lays them: [tokens] then [rows], a padding
    row without a request. Sampled: a temperature at which the penalized argmax
    holds all the mass, through the random verification path."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    from tpu_models.sampler import metadata as sampler_metadata
    from tpu_models.sampler import programs
    from tpu_models.sampler.counts import ANY_TOKEN, IN_PROMPT, NO_TOKEN, RECENT, TokenCounts

    rng = np.random.default_rng(7 + ranks + 2 * sampled)
    margin = PEAKED if sampled else DECISIVE
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    rows_total, tokens_per = ROWS * ranks, ROWS * K
    slots = rows_total + 1
    counts = TokenCounts(mesh, slots, V)
    requests = [None if r % ROWS == ROWS - 1 else request(rng, rng.choice(V, 2, replace=False))
                for r in range(rows_total)]
    draft_ids = np.zeros(ranks * tokens_per, np.int32)
    num_draft = np.zeros(rows_total, np.int32)
    target = rng.normal(size=(ranks * tokens_per, V)).astype(np.float32)
    bonus = rng.normal(size=(rows_total, V)).astype(np.float32)
    want_out = np.full(ranks * (tokens_per + ROWS), -1, np.int32)
    read = np.zeros(want_out.shape, bool)
    want_seen, sensitive = {}, 0
    for r, req in enumerate(requests):
        rank, local = divmod(r, ROWS)
        start = rank * tokens_per + sum(num_draft[rank * ROWS:r])
        if req is None:
            continue
        f, g = req["bad_words"][1]
        n = num_draft[r] = req["drafts"]
        target[start:start + n, [f, g]] += [4.0, 3.5]
        bonus[r, [f, g]] += [4.0, 3.5]
        drafts = []
        for j in range(n):  # each draft: the position's penalized argmax, or not (25%)
            row = vllm_penalized(target[start + j:start + j + 1], req["prompt"],
                                 [req["history"] + drafts], req)[0]
            best = argmax(row)
            unaware = argmax(vllm_penalized(target[start + j:start + j + 1], req["prompt"],
                                            [req["history"]], req)[0])
            sensitive += unaware != best  # the drafts before it changed this position
            drafts.append(best if rng.random() < 0.75 else int((best + 1 + rng.integers(V - 1)) % V))
        draft_ids[start:start + n] = drafts
        combined = RejectionSampler._combine_outputs_with_spec_tokens(
            [req["history"]], [drafts])
        accepted = []
        penalized = vllm_penalized(target[start:start + n], req["prompt"], combined, req)
        for j in range(n):
            accepted.append(argmax(penalized[j], margin))
            if accepted[-1] != drafts[j]:
                break
        if accepted == drafts:  # every draft accepted (or none drafted): the bonus
            accepted.append(argmax(vllm_penalized(bonus[r:r + 1], req["prompt"],
                                                  [req["history"] + drafts], req)[0], margin))
        # Where tpu-inference's parse_output reads the row's tokens: its drafts'
        # positions, then its bonus.
        for j in range(n + 1):
            at = (start + rank * ROWS + j if j < n
                  else rank * (tokens_per + ROWS) + tokens_per + local)
            read[at], want_out[at] = True, accepted[j] if j < len(accepted) else -1
        want_seen[r] = (req["prompt"], req["history"] + accepted)
    assert sensitive >= 2, sensitive  # the test can tell drafts counted from drafts ignored

    slot = np.full(rows_total, slots, np.int32)
    live = {f"r{r}" for r, req in enumerate(requests) if req is not None}
    for r, req in enumerate(requests):
        if req is not None:
            slot[r] = counts.slot_of(f"r{r}", types.SimpleNamespace(
                prompt_token_ids=req["prompt"], output_token_ids=req["history"]), live)
    counts.rebuild()

    def per_row(key, fill, dtype=np.float32):
        return jnp.array([fill if req is None else req[key] for req in requests], dtype)

    words = np.full((rows_total, 8), V, np.int32)
    prefix = np.full((rows_total, 8, RECENT), ANY_TOKEN, np.int32)
    for r, req in enumerate(requests):
        for w, word in enumerate(req["bad_words"] if req else []):
            words[r, w] = word[-1]
            prefix[r, w, RECENT - len(word) + 1:] = word[:-1]
    zeros = jnp.zeros(rows_total, jnp.int32)
    metadata = sampler_metadata.metadata_class()(
        temperature=jnp.full(rows_total, TEMPERATURE if sampled else -1.0), top_k=zeros,
        top_p=jnp.ones(rows_total), _cache_collision_dummy=None, do_sampling=sampled,
        logprobs=False, min_p=jnp.zeros(rows_total), seeded=jnp.zeros(rows_total, bool),
        seed_low=zeros.astype(jnp.uint32), seed_high=zeros.astype(jnp.uint32), position=zeros,
        bias_ids=jnp.full((rows_total, 8), V, jnp.int32), bias=jnp.zeros((rows_total, 8)),
        allowed_ids=jnp.full((rows_total, 8), V, jnp.int32),
        restricted=jnp.zeros(rows_total, bool), slot=jnp.array(slot),
        kept=jnp.array([req is not None for req in requests]),
        repetition=per_row("repetition", 1.0), frequency=per_row("frequency", 0.0),
        presence=per_row("presence", 0.0), bad_last=jnp.array(words),
        bad_prefix=jnp.array(prefix), drafts=K)
    out, new_counts, new_recent = jax.jit(programs.verify_extended,
                                          static_argnames=["ranks"])(
        jnp.array(draft_ids), jnp.array(num_draft), jnp.array(target), jnp.array(bonus),
        metadata, jax.random.key(1), jax.random.key(2), counts.counts, counts.recent,
        ranks=ranks)
    np.testing.assert_array_equal(np.asarray(out)[read], want_out[read])
    new_counts, new_recent = np.asarray(new_counts), np.asarray(new_recent)
    for r, (prompt, output) in want_seen.items():
        row = new_counts[slot[r]]
        np.testing.assert_array_equal(row & (IN_PROMPT - 1), np.bincount(output, minlength=V))
        np.testing.assert_array_equal(row & IN_PROMPT != 0, np.isin(np.arange(V), prompt))
        last = output[-RECENT:]
        np.testing.assert_array_equal(new_recent[slot[r]],
                                      [NO_TOKEN] * (RECENT - len(last)) + last)
