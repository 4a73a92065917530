"""An EAGLE-3 engine's first requests, served before it says it is ready.

The fused EAGLE-3 step (speculative.fusion) is not among the programs
tpu-inference compiles before serving: each shape compiles when a step first
meets it (3-5 s apiece for the demo on two cores), so a user's first request
waited 5-10 s and looked hung. Here the engine core serves greedy requests of
its own before its start-up handshake ends (`serve`), one for each token bucket
a lone request's prompt step can meet (the runner's, `prompt_lengths`): through its own
scheduler and runner, so the programs compiled are exactly those real steps
run, whatever their arguments' shapes. A sampled step runs the same program
(fusion.verify_and_draft branches on a traced flag). Their outputs go nowhere,
and the prefix cache is emptied after them. Steps of several requests still
compile at first use. The cost is in the ready time (benchmarks/README.md,
bench startup).
"""

import time

TOKENS = 4  # a prompt step, then decode steps with the draft's tokens to verify
PREFIX = "tpu-models-warm-up-"


def precompiled_eagle3(vllm_config) -> bool:
    """An EAGLE-3 engine that precompiles at all (SKIP_JAX_PRECOMPILE=1: nothing here)."""
    from tpu_inference import envs

    spec = vllm_config.speculative_config
    return (spec is not None and spec.method == "eagle3" and not envs.SKIP_JAX_PRECOMPILE
            and not vllm_config.model_config.enforce_eager)


def wanted(vllm_config) -> bool:
    """Whether the engine serves the warm-up: a `precompiled_eagle3` engine on one
    data-parallel rank (ranks step together: one alone would wait for the rest) that
    runs (`tpu-models compile`'s engine has no arrays to run requests on)."""
    from tpu_models.host import compile_target

    return (precompiled_eagle3(vllm_config) and compile_target() is None
            and vllm_config.parallel_config.data_parallel_size == 1)


def decode_step_tokens(vllm_config) -> int:
    """The token bucket of a lone request's decode step: 1 + k tokens, padded to a
    power of two."""
    return 1 << vllm_config.speculative_config.num_speculative_tokens.bit_length()


def buckets_from_a_decode_step(runner) -> None:
    """The runner's token buckets less those below a lone decode step's (off-TPU they
    start at 1): only a request's last steps (fewer drafts to fit max_tokens) and
    prompts of under 1 + k tokens met them, and each was a program of the model
    step and of the fused step to compile and warm up; those steps pad to it."""
    if not precompiled_eagle3(runner.vllm_config):
        return
    smallest = decode_step_tokens(runner.vllm_config)
    kept = [b for b in runner.num_tokens_paddings if b // runner.dp_size >= smallest]
    if kept and len(kept) < len(runner.num_tokens_paddings):
        runner.num_tokens_paddings = kept
        runner.num_tokens_paddings_per_dp = [b // runner.dp_size for b in kept]


def token_buckets(worker=None) -> list[int]:
    """The runner's token buckets (on a worker, by the engine's collective_rpc), as
    it pads a step to them after `buckets_from_a_decode_step`."""
    return list(worker.model_runner.num_tokens_paddings_per_dp)


def prompt_lengths(buckets: list[int], max_model_len: int) -> list[int]:
    """A prompt for each token bucket (`buckets`) a lone request's prompt step can
    meet: its prompt step runs at that bucket, its decode steps at the smallest.
    Longer prompts are read in chunks of the largest."""
    return sorted({min(bucket, max_model_len - TOKENS) for bucket in buckets})


def requests(engine_core) -> list:
    """The warm-up's requests, as vLLM's own (`vllm.v1.request.Request`): one a
    prompt length, greedy (a sampled step runs the same programs)."""
    import numpy as np
    from vllm import SamplingParams
    from vllm.v1.request import Request

    config = engine_core.vllm_config
    rng = np.random.default_rng(0)
    vocab = config.model_config.get_vocab_size()
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    buckets = engine_core.collective_rpc(token_buckets)[0]
    return [Request(f"{PREFIX}{i}", rng.integers(3, vocab, length).tolist(), params, None,
                    block_hasher=engine_core.request_block_hasher)
            for i, length in enumerate(prompt_lengths(buckets, config.model_config.max_model_len))]


def serve(engine_core) -> None:
    """Serves the warm-up's `requests` on `engine_core` (vLLM's EngineCore, its
    scheduler built), one at a time, as its busy loop would."""
    from tpu_inference.logger import init_logger

    began = time.perf_counter()
    made = requests(engine_core)
    for request in made:
        engine_core.add_request(request)
        while engine_core.scheduler.has_requests() or engine_core.batch_queue:
            _, executed = engine_core.step_fn()
            engine_core.post_step(executed)
    engine_core.reset_prefix_cache()
    init_logger(__name__).info(
        "tpu-models: EAGLE-3 warm-up: %d requests served before ready (%.1f s), so that "
        "a lone request's steps, greedy or sampled, find their programs compiled",
        len(made), time.perf_counter() - began)
