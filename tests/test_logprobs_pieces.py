"""Log-probs a piece of rows at a time (tpu_models.logprobs) against tpu-inference's
whole-vocabulary definition (its compute_logprobs and gather_logprobs, unpatched)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpu_models import logprobs


def test_a_piece_holds_64_mib_of_gemma3_rows():
    assert logprobs.rows_per_piece(262_144) == 64
    assert logprobs.rows_per_piece(151_936) == 64
    assert logprobs.rows_per_piece(1_000) == 16_384
    assert logprobs.rows_per_piece(1 << 30) == 8


@pytest.mark.parametrize("k", [5, 1])  # 1: an argmax in place of top_k
@pytest.mark.parametrize("rows", [1, 37, 64, 200])
def test_pieces_give_upstreams_ids_logprobs_and_ranks(monkeypatch, rows, k):
    from tpu_inference.layers.jax.sample import sampling
    vocab = 3_000
    monkeypatch.setattr(logprobs, "PIECE_BYTES", 16 * 4 * vocab)  # 16 rows a piece
    rng = np.random.default_rng(rows)
    logits = rng.normal(0, 4, (rows, vocab))
    logits[:, [9, 3]] = logits.max(axis=1, keepdims=True) + 1  # a tie for the top: id 3 first
    logits = jnp.asarray(logits, jnp.float32)
    ids = jnp.asarray(rng.integers(0, vocab, rows), jnp.int32)
    expected = sampling.gather_logprobs(sampling.compute_logprobs(logits), ids, k)
    got = jax.jit(logprobs.gather, static_argnums=2)(logits, ids, k)
    np.testing.assert_array_equal(got.logprob_token_ids, expected.logprob_token_ids)
    np.testing.assert_array_equal(got.selected_token_ranks, expected.selected_token_ranks)
    # The same float32 operations on each row; XLA may fuse the reductions differently.
    np.testing.assert_allclose(got.logprobs, expected.logprobs, rtol=1e-6, atol=1e-5)
