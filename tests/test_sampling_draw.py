"""The sampler's draw (sampler.programs.categorical: a block by its mass, then an id
within it) against the definition, softmax's probabilities in float64: Pearson's
test over many seeded draws, at a vocabulary of several blocks and a partial last
one, with masked ids (top-k / top-p's -1e12) and a fully masked block, plain and
with the temperature applied inside the draw."""

import numpy as np
import pytest
from scipy import stats

from tpu_models.sampler.programs import BLOCK, MASKED, categorical

VOCAB = 5 * BLOCK + 100
DRAWS = 100_000


@pytest.mark.parametrize("temperature", [1.0, 1.5])
def test_two_level_draws_follow_the_softmax_of_the_logits(temperature):
    import jax
    logits = np.asarray(jax.random.normal(jax.random.key(0), (VOCAB, ))) * 2.0
    logits[BLOCK:2 * BLOCK] = MASKED  # a whole block masked
    logits[::7] = MASKED
    keys = jax.random.split(jax.random.key(1), DRAWS)
    draw = jax.vmap(categorical, in_axes=(0, None, None))
    ids = np.asarray(jax.jit(draw)(keys, logits, 1.0 / temperature))
    scaled = logits.astype(np.float64) / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    counts = np.bincount(ids, minlength=VOCAB)
    assert counts[logits == MASKED].sum() == 0  # nothing masked is ever drawn
    want = probs * DRAWS
    big = want >= 5
    observed = np.append(counts[big], counts[~big].sum())
    wanted = np.append(want[big], want[~big].sum())
    assert big.sum() > BLOCK  # ids of several blocks are tested one by one
    assert stats.chisquare(observed, wanted).pvalue >= 1e-3
