"""Log-probs: tpu-inference's programs over the whole vocabulary, a piece of rows at a time."""

from tpu_models.features import LOGPROBS_IN_PIECES
from tpu_models.patching import Patch, Target, rebind


def logprobs_in_pieces() -> None:
    """Upstream's jits replaced by ours, not wrapped: the runner's precompiler lowers them."""
    from tpu_models import logprobs
    sampled, prompt = logprobs.programs()
    module = "tpu_inference.layers.jax.sample.sampling"
    rebind(module, "compute_and_gather_logprobs", sampled)
    rebind(module, "compute_and_gather_prompt_logprobs", prompt)


SAMPLING = "tpu_inference.layers.jax.sample.sampling"
PATCHES = [
    Patch("log-probs a piece of rows at a time", LOGPROBS_IN_PIECES, (
        Target(f"{SAMPLING}.compute_and_gather_logprobs", "logits next_tokens max_logprobs"),
        Target(f"{SAMPLING}.compute_and_gather_prompt_logprobs",
               "logits prompt_target_ids max_logprobs")),
        "prompt log-probs of 1,024 tokens over Gemma 3's 262,144 ids took 2 GiB of "
        "temporaries, too much for a v5e",
        "tests/test_compile.py::test_gemma3_prompt_logprobs_temporaries_stay_within_their_share",
        logprobs_in_pieces),
]
