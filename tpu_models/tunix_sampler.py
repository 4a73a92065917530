"""Tunix's VllmSampler (google-tunix 0.1.5) on vLLM 0.32, tpu-inference 0.32 and our models.

What the seam (adapt.tunix_rollout, installed by `import tpu_models.tunix`, not
by the plugin: the vLLM processes a server starts never import Tunix) changes of
the sampler, and why:
- Its engine arguments carry `swap_space`, which vLLM 0.32's EngineArgs no longer
  takes (vLLM refused to start); an adapter in our LoRA slots needs --enable-lora
  (`engine_arguments`).
- It turns vLLM's asynchronous scheduling off (RolloutConfig's default, False,
  where vLLM's own is on): every step's scheduling and output handling then waited
  for the model. With our mapping vLLM decides, as for `vllm serve`
  (benchmarks/README.md, `bench tunix`); the mapping's `async_scheduling=False`
  keeps it off.
- Its prompts gained the EOS id at their end, which Tunix's own Sampler does not
  add: the rollout engine answered another prompt than the trainer scores
  (`tokenized`).
- It asks every request for logprobs=1, and leaves the engine's --max-logprobs at
  vLLM's 20: each step took the top 20 of every row's log-probs where a top 1 is
  an argmax (at 32 rows of 262,144 ids on this host: 41 ms against 31 ms).
  With our mapping the engine's --max-logprobs is 1 (`engine_arguments`).
- Its per-request `seed` is dropped ("vLLM Jax backend doesn't support per request
  seed"); ours applies it: request i of a call gets seed + i, so a batch's rows
  differ and two rollouts with the same seed agree (`requests_seeded_and_adapted`).
- It asks for prompt log-probabilities and never reads them: a vocabulary-wide
  projection and softmax per prompt token (262,144 wide on Gemma 3). Not asked.
- A weight sync wrote into the runner's `state` and left `state_leaves`, which
  the runner dispatches with: rollouts went on with the weights of before
  (random ones, after a dummy load). And the prefix cache kept KV blocks computed
  with the old weights. Both are refreshed after every sync, for any mapping
  (`engine_refreshed`); a mapping with its own copy (tpu_models.tunix.RolloutMapping,
  `ours`) is used for it.
- qwix 0.1.2 (tpu-inference's pin) gives a LoRA model a subclass of the model's
  class that is a flax pytree where Tunix's models are not (flax 0.12): the LoRA
  model's nnx.state was empty, so nothing could be trained or synced. And its A
  and B kept the weight's partition spec, with more axes than they have
  (`lora_model_repaired`).

Standard library only at import: the ledger of adaptations reads the seam's
module without Tunix.
"""

import contextlib
import dataclasses
import functools
import inspect

# The adapter every rollout of a mapping in "slots" mode runs with (tpu_models.tunix
# writes it into the engine's LoRA slots; vLLM's LoRA ids start at 1).
ADAPTER_NAME, ADAPTER_ID, ADAPTER_PATH = "tunix-trainer", 1, "in memory: synced from the trainer"


def ours(sampler):
    """The sampler's mapping when it copies itself (tpu_models.tunix), else None."""
    return _own_copy(sampler.config.mapping_config)


def _own_copy(mapping):
    """`mapping` when it is ours (RolloutMapping: it syncs itself), else None."""
    return mapping if callable(getattr(mapping, "sync", None)) else None


def engine_arguments(args: dict, config) -> dict:
    """VllmSampler's engine arguments `args` for its `config`, as vLLM 0.32 takes them:
    those EngineArgs no longer has dropped (swap_space: the KV cache never swaps), our
    mapping's dtype and asynchronous scheduling, the log-probs it asks for, and LoRA
    slots for a mapping that writes its adapter there."""
    from vllm.engine.arg_utils import EngineArgs
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    for name in [k for k in args if k not in fields]:
        del args[name]
    mapping = _own_copy(config.mapping_config)
    if mapping is None:  # Tunix's own copy
        return args
    if not args.get("async_scheduling"):
        args["async_scheduling"] = mapping.async_scheduling  # None: vLLM's default
    # The sampler asks every request for logprobs=1: a step's top 1, not vLLM's 20.
    args.setdefault("max_logprobs", 1)
    if mapping.dtype:
        args.setdefault("dtype", mapping.dtype)
    if mapping.lora_mode == "slots":
        if config.server_mode:
            raise ValueError("tpu_models.tunix: lora='slots' rollouts run with "
                             "rollout_vllm_server_mode=False")
        args.update(enable_lora=True, max_loras=1, max_lora_rank=_lora_rank(mapping.lora_rank))
    return args


def _lora_rank(rank: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that holds `rank` (slots pad with zeros)."""
    import typing

    from vllm.config.lora import LoRAConfig
    allowed = sorted(typing.get_args(typing.get_type_hints(LoRAConfig)["max_lora_rank"]))
    fits = [r for r in allowed if r >= rank]
    if not fits:
        raise ValueError(f"LoRA rank {rank} is above vLLM's largest, {allowed[-1]}")
    return fits[0]


def tokenized(tokenizer, text: str) -> list[int]:
    """`text`'s ids as Tunix's Sampler makes them: BOS first, no EOS appended."""
    ids = tokenizer.encode(text)
    bos = tokenizer.bos_id()
    return ([bos] if bos and (not ids or ids[0] != bos) else []) + ids


@contextlib.contextmanager
def requests_seeded_and_adapted(sampler, call, *args, **kwargs):
    """While the sampler's `call` (VllmSampler.__call__) runs with `args`, its
    engine's `generate` gives request i seed + i (RolloutConfig.seed), the trainer's
    adapter (lora='slots'), and no prompt log-probs."""
    seed = _seed(inspect.signature(call).bind(sampler, *args, **kwargs).arguments.get("seed"))
    mapping = ours(sampler)
    adapter = None
    if mapping is not None and mapping.lora_mode == "slots":
        from vllm.lora.request import LoRARequest
        adapter = LoRARequest(ADAPTER_NAME, ADAPTER_ID, ADAPTER_PATH)
    if sampler.llm is None:  # server mode: the engine is not ours to call
        yield
        return
    sampler.llm.generate = functools.partial(_per_request, sampler.llm.generate, seed, adapter)
    try:
        yield
    finally:
        del sampler.llm.generate


def _per_request(generate, seed, adapter, prompts, sampling_params=None, **options):
    params = []
    for i in range(len(prompts)):
        p = sampling_params.clone()
        p.prompt_logprobs = None
        if seed is not None:
            p.seed = seed + i
        params.append(p)
    if adapter is not None:
        options["lora_request"] = adapter
    return generate(prompts, sampling_params=params, **options)


def _seed(seed) -> int | None:
    """RolloutConfig.seed (an int, an integer array or a JAX key) as vLLM's int seed."""
    if seed is None:
        return None
    import jax
    import numpy as np
    if isinstance(seed, jax.Array) and jax.dtypes.issubdtype(seed.dtype, jax.dtypes.prng_key):
        seed = jax.random.key_data(seed)
    return int(np.asarray(seed).ravel()[-1])


def engine_refreshed(sampler) -> None:
    """After a weight sync: the runner dispatches with the synced arrays, and the
    prefix cache forgets KV blocks computed with the weights of before."""
    sampler._model_runner.refresh_state_leaves()
    engine = sampler.llm if sampler.llm is not None else sampler._driver.llm_engine
    engine.reset_prefix_cache()


def lora_model_repaired(quantized, call_method: str):
    """qwix's LoRA model `quantized` in its model's pytree mode, its A and B with
    partition specs of their own arrays' placement."""
    cls = type(quantized)
    base = cls._unquantized_type
    if cls._pytree__is_pytree != base._pytree__is_pytree:
        fields = {k: v for k, v in vars(cls).items() if k in ("_unquantized_type", call_method)}
        quantized.__class__ = type(base.__name__, (base, ), fields,
                                   pytree=base._pytree__is_pytree)
    _lora_specs_of_their_arrays(quantized)
    return quantized


def _lora_specs_of_their_arrays(model) -> None:
    """qwix 0.1.2 shards A and B by the weight's spec, transposed, but writes the
    transposed spec to `sharding`, which flax 0.12 no longer reads: their partition
    spec stayed the weight's (three or four axes for a two-axis A), and Tunix's
    optimizer sharding refused them. Their arrays' own placement is the spec."""
    from flax import nnx

    for _, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
        value, spec = var.get_value(), var.get_metadata().get("out_sharding")
        if spec is None or len(spec) == value.ndim:
            continue
        placed = tuple(getattr(value.sharding, "spec", ()))
        var.set_metadata("out_sharding", placed + (None, ) * (value.ndim - len(placed)))
