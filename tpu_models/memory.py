"""A chip's HBM beside its weights and KV cache: the room the cache leaves a step.

tpu-inference sizes the KV cache as --gpu-memory-utilization of HBM less what is
allocated by then (weights, drafts, LoRA slots, the penalties' counts); the rest
of HBM is left to the programs' working memory. The largest of those work over
the vocabulary: sampling --max-num-seqs rows, log-probs of drafted rows, and
log-probs of a step's prompt tokens. `largest_step` bounds them by arithmetic, so
that a server on a TPU can size its cache before any program is compiled;
`tpu-models compile` checks the bound against the TPU compiler's own accounting.
Where the bound is more than the utilization leaves, the cache gives up the
difference (`room_beyond_utilization`).
"""

import dataclasses

from tpu_models.logprobs import PIECE_BYTES

# tpu-inference precompiles prompt log-probs for steps of at most this many tokens.
PROMPT_LOGPROB_TOKENS = 1024


@dataclasses.dataclass(frozen=True)
class Step:
    """The largest working set a step needs beside the chip's buffers."""
    bytes: int
    what: str


def largest_step(vocab: int, max_num_seqs: int, draft_tokens: int, max_num_batched_tokens: int,
                 dtype_bytes: int) -> Step:
    """A bound on one chip's working memory for the vocabulary-wide programs; each row
    of float32 logits is 4 * vocab bytes, whole on every chip (the sampler gathers them)."""
    row = 4 * vocab
    prompt_rows = min(max_num_batched_tokens, PROMPT_LOGPROB_TOKENS)
    steps = [
        # logits in, two float32 working copies (top-k/top-p), the processed logits out
        Step(4 * max_num_seqs * row, f"sampling {max_num_seqs} requests"),
        # the drafted rows' logits, then log-probs a piece at a time (tpu_models.logprobs)
        Step(max_num_seqs * (1 + draft_tokens) * row + 4 * PIECE_BYTES,
             f"log-probs of {max_num_seqs * (1 + draft_tokens)} rows"),
        # the step's logits in the model's dtype and in float32, then log-probs in pieces
        Step(prompt_rows * vocab * (4 + dtype_bytes) + 4 * PIECE_BYTES,
             f"prompt log-probs of {prompt_rows} tokens"),
    ]
    return max(steps, key=lambda s: s.bytes)


def step_of(vllm_config) -> Step:
    """`largest_step` for an engine's configuration."""
    spec = vllm_config.speculative_config
    return largest_step(
        vocab=vllm_config.model_config.get_vocab_size(),
        max_num_seqs=vllm_config.scheduler_config.max_num_seqs,
        draft_tokens=spec.num_speculative_tokens if spec is not None else 0,
        max_num_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
        dtype_bytes=vllm_config.model_config.dtype.itemsize)


def room_beyond_utilization(step: Step, hbm_bytes: int, utilization: float) -> int:
    """Bytes a chip's KV cache gives up so that `step` fits beside it: what the step
    needs beyond the share of HBM the utilization leaves unallocated."""
    return max(0, step.bytes - int(hbm_bytes * (1 - utilization)))


def kv_cache_bytes(hbm_bytes: int, utilization: float, held_bytes: int, step: Step) -> int:
    """A chip's KV cache as the engine sizes it: the utilization's share of HBM, less
    what the chip holds when it is sized and the room the largest step needs."""
    return (int(hbm_bytes * utilization) - held_bytes
            - room_beyond_utilization(step, hbm_bytes, utilization))
