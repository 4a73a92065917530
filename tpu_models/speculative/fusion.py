"""EAGLE-3 verification and drafting in one compiled program per step.

After the target's forward pass tpu-inference 0.32.0 launches about ten small
programs per EAGLE-3 step (two row selections, the bonus sampler, the draft
ids, the rejection sampler, the last sampled tokens, the draft's inputs, the
draft passes, the next step's tokens), each a dispatch with its own overhead.
Here they are traced as one jit (`verify_and_draft`) calling upstream's own
functions, and upstream's `_sample_from_logits` then runs as it is, its device
calls answered from that program's results (`Replay`): its bookkeeping (async
or not) stays upstream's. The program compiles when a step first meets its
shapes (it is not among those tpu-inference compiles before serving). On XLA:CPU
a decode step of the demo model launched 15 programs, 7 fused (plain decoding:
6): tpu-models bench spec-calls. speculative.steps decides which steps run so.
"""

import collections
import contextlib
import functools
import inspect

# EAGLE-3 steps by how they ran: "fused", "fallback" (not eligible), "redrafted"
# (our draft inputs differed from upstream's: its own draft computed them),
# "failed" (no fusion).
STEPS: collections.Counter = collections.Counter()


def live_rows(requests: int, tokens: int) -> int:
    """The rows the draft's later passes run on: a power of two at least the step's
    requests, and at least an eighth of its token bucket, so that steps with a prompt
    chunk (a decode step has 4 tokens a request) share one program per bucket: each
    compiles at its first step, not among the buckets compiled before serving."""
    return max(1 << (requests - 1).bit_length(), tokens // 8)


def verify_and_draft(runner, live_rows, kv_shardings, rng, logits, input_ids, spec, sampling,
                     sampled, aux_hidden_states, attn_metadata, draft_inputs, state_leaves,
                     kv_caches):
    """Upstream's calls of an EAGLE-3 step after the forward pass, in its order and
    with its arguments, as one program (`runner` is static: its config and modules;
    `live_rows` too: speculation.live_rows; `kv_shardings`, the caches' shardings,
    which the caches it returns keep). Greedy and sampled steps share it: `sampling`
    is a sampled step's metadata (`as_sampled`), and `sampled` (traced) picks the
    branch, each branch upstream's calls for that kind of step (`_verify`)."""
    import jax
    from tpu_inference.runner import tpu_runner
    from tpu_inference.spec_decode.jax import utils

    mesh, drafter = runner.mesh, runner.drafter
    k = runner.speculative_config.num_speculative_tokens
    rng, next_tokens = _verify(runner, rng, logits, input_ids, spec, sampling, sampled)
    last, rejected = tpu_runner.extract_last_sampled_tokens(
        spec, next_tokens, k, runner.input_batch.vocab_size,
        runner.max_num_reqs // runner.dp_size, mesh)
    next_prompt_token_id, is_in_prefill, num_reqs, block_tables = draft_inputs
    hidden, draft_ids, last_token_indices, draft_attn = drafter._prepare_inputs(
        state_leaves=state_leaves, num_reqs=num_reqs, block_tables=block_tables,
        attn_metadata=attn_metadata, input_ids=input_ids, aux_hidden_states=aux_hidden_states,
        last_sampled_token_id=last, next_prompt_token_id=next_prompt_token_id,
        is_in_prefill=is_in_prefill, num_rejected_tokens=rejected)
    # Without its jit (and its donation); its parameters are guarded by EAGLE-3's own
    # patch of it (adapt.speculative), which refuses EAGLE-3 where they changed.
    propose = type(drafter)._propose.__wrapped__
    # Off-TPU, the draft's passes run on the live rows we know of (speculative.draft).
    bound = {"live_rows": live_rows} if "live_rows" in inspect.signature(propose).parameters else {}
    kv_caches, drafts = propose(drafter, state_leaves, kv_caches, draft_ids, draft_attn,
                                last_token_indices, hidden, k,
                                tuple(runner.layer_name_to_kvcache_index.items()), **bound)
    drafts = (drafts[:, None] if drafts.ndim == 1 else drafts)[:, :k]
    ahead = (utils.concat_last_sampled_tokens_and_draft_tokens(last, drafts)
             if runner.scheduler_config.async_scheduling else None)
    # Unconstrained, they came back replicated: a different argument for every later
    # step than the first (one more program each), and on several devices a copy each.
    kv_caches = [jax.lax.with_sharding_constraint(c, sharding)
                 for c, sharding in zip(kv_caches, kv_shardings)]
    return dict(rng=rng, next_tokens=next_tokens, last=last, rejected=rejected, drafts=drafts,
                ahead=ahead, kv_caches=kv_caches)


def _verify(runner, rng, logits, input_ids, spec, sampling, sampled):
    """The step's bonus tokens and rejection sampling (upstream's calls), greedy or
    sampled as `sampled` (traced) says; the rng the runner keeps, and the tokens."""
    import dataclasses

    import jax
    from tpu_inference.runner import tpu_runner

    mesh = runner.mesh
    pcp = runner.vllm_config.sharding_config.prefill_cp_size
    select = type(runner)._select_from_array_fn
    bonus_logits = select(logits, spec.bonus_logits_indices, mesh, pcp)
    target_logits = select(logits, spec.target_logits_indices, mesh, pcp)
    draft_token_ids = runner._extract_draft_token_ids(
        input_ids, spec.final_logits_indices, spec.target_logits_indices)

    def verify(bonus_rng, rejection_rng, metadata):
        # A jit with compiler options cannot be nested: the sampler's own function.
        bonus_token_ids, _ = tpu_runner.sample.__wrapped__(
            bonus_rng, mesh, bonus_logits, metadata,
            allow_distributed_sampling=tpu_runner.distributed_sampling_allowed(
                metadata.logprobs, runner.model_config.logprobs_mode))
        return runner.rejection_sampler(
            draft_token_ids=draft_token_ids, num_draft_tokens=spec.draft_lengths,
            draft_probs=None, target_logits=target_logits, bonus_token_ids=bonus_token_ids,
            sampling_metadata=metadata, key=rejection_rng)

    def sampled_step(rng):  # the same keys as upstream's two splits
        rng, step_rng = jax.random.split(rng)
        bonus_rng, rejection_rng = jax.random.split(step_rng)
        return rng, verify(bonus_rng, rejection_rng, sampling)

    def greedy_step(rng):
        return rng, verify(rng, rng, dataclasses.replace(
            sampling, do_sampling=False, temperature=None, top_k=None, top_p=None))

    return jax.lax.cond(sampled, sampled_step, greedy_step, rng)


@functools.cache
def _compiled():
    import jax
    return jax.jit(verify_and_draft, static_argnums=(0, 1, 2), donate_argnames=("kv_caches", ))



def run(runner, a: dict) -> "Replay":
    """Runs `verify_and_draft` for a step of `_sample_from_logits` (its arguments
    `a`), the runner's caches replaced by the program's; the Replay that answers
    upstream's calls of the step from its results."""
    from jax.sharding import PartitionSpec
    from tpu_inference.layers.common.sharding import ShardingAxisName
    from tpu_inference.utils import device_array

    host = draft_host_inputs(runner, a)
    # The draft's inputs in one transfer (upstream's two are answered from it).
    device = device_array(runner.mesh, host, sharding=PartitionSpec(ShardingAxisName.ATTN_DATA))
    rows = live_rows(int(host[2][0]), a["input_ids"].shape[0])
    sampling = a["tpu_sampling_metadata"]
    args = (runner.rng_params_for_sampling, a["logits"], a["input_ids"],
            a["spec_decode_metadata"], as_sampled(runner, sampling, a["spec_decode_metadata"]),
            sampling.do_sampling, a["aux_hidden_states"], draft_attention(a["attn_metadata"]),
            device, runner.drafter.state_leaves, runner.kv_caches)
    statics = (runner, rows, tuple(c.sharding for c in runner.kv_caches))
    fused = _compiled()(*statics, *args)
    runner.kv_caches = fused["kv_caches"]  # the old ones were donated
    return Replay(runner, a, fused, host, device)


def as_sampled(runner, sampling, spec):
    """A step's sampling metadata as a sampled step's: a greedy step's has no
    temperature, top_k or top_p, so it is given rows of ones (the runner's dtypes and
    sharding, one row a padded request), kept per shape; its branch ignores them."""
    import dataclasses

    if sampling.do_sampling:
        return sampling
    return dataclasses.replace(sampling, do_sampling=True,
                               **_ones(runner.mesh, spec.bonus_logits_indices.shape))


@functools.cache
def _ones(mesh, rows: tuple) -> dict:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec
    from tpu_inference.layers.common.sharding import ShardingAxisName

    sharding = NamedSharding(mesh, PartitionSpec(ShardingAxisName.ATTN_DATA))
    return {name: jax.device_put(np.ones(rows, dtype), sharding)
            for name, dtype in (("temperature", np.float32), ("top_k", np.int32),
                                ("top_p", np.float32))}


def draft_attention(attn_metadata):
    """The attention metadata upstream's manager hands the draft: with a KV cache
    group per kind of layer (a dict by layer), an attention layer's."""
    if not isinstance(attn_metadata, dict):
        return attn_metadata
    return next((m for name, m in attn_metadata.items() if ".self_attn." in name),
                next(iter(attn_metadata.values())))


def draft_host_inputs(runner, a: dict):
    """What upstream's manager and prepare_inputs put on the device for the draft
    (speculative_decoding_manager.propose_eagle3_draft_token_ids, dp_size 1): a
    request whose prompt is still being read continues from its next prompt token."""
    import numpy as np

    rows = draft_attention(a["attn_metadata"]).seq_lens.shape[0]
    next_prompt_token_id, is_in_prefill = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
    indices = a["spec_decode_metadata"].req_indices_dp[0]
    scheduled = a["scheduler_output"].num_scheduled_tokens
    for row, index in enumerate(indices):
        req_id = runner.input_batch.req_ids[index]
        state = runner.requests[req_id]
        seq_len = state.num_computed_tokens + scheduled[req_id]
        if seq_len < state.num_tokens:  # a prompt chunk: upstream discards its sample
            next_prompt_token_id[row], is_in_prefill[row] = state.get_token_id(seq_len), 1
    num_reqs = np.array([len(indices)], np.int32)
    draft_group = len(runner.kv_cache_config.kv_cache_groups) - 1  # the draft's, last
    block_tables = runner.input_batch.block_table[draft_group].get_cpu_tensor().reshape(-1)
    return next_prompt_token_id, is_in_prefill, num_reqs, block_tables


class _Unused:
    """What a stand-in hands upstream for a value only other stand-ins read."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"<fused into verify_and_draft: {self.name}>"


class _Rejecting:
    """The runner's rejection sampler (parse_output and all), its call answered."""

    def __init__(self, sampler, answer):
        self._sampler, self._answer = sampler, answer

    def __call__(self, **kwargs):
        return self._answer(**kwargs)

    def __getattr__(self, name):
        return getattr(self._sampler, name)


@contextlib.contextmanager
def _swapped(obj, name, value):
    own = name in vars(obj)
    before = vars(obj).get(name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if own:
            setattr(obj, name, before)
        else:
            delattr(obj, name)  # an instance's stand-in: the class's attribute again


class Replay:
    """Upstream's device calls of one step, answered from `verify_and_draft`'s
    results: each recognises its call by the objects it was handed (anything else,
    from another caller, goes to the real function)."""

    def __init__(self, runner, a, fused, host, device):
        self.runner, self.a, self.fused, self.host, self.device = runner, a, fused, host, device
        self.rng_in, self.step_rng = runner.rng_params_for_sampling, _Unused("step rng")
        self.bonus_logits, self.target_logits = _Unused("bonus logits"), _Unused("target logits")
        self.bonus_ids, self.redrafted = _Unused("bonus token ids"), False

    @contextlib.contextmanager
    def standing_in(self):
        import jax
        from tpu_inference.runner import speculative_decoding_manager, tpu_runner

        runner, drafter = self.runner, self.runner.drafter
        self.real = {"split": jax.random.split, "sample": tpu_runner.sample,
                     "extract": tpu_runner.extract_last_sampled_tokens,
                     "concat": tpu_runner.concat_last_sampled_tokens_and_draft_tokens,
                     "device_array": speculative_decoding_manager.device_array,
                     "reject": runner.rejection_sampler,
                     "prepare_inputs": drafter.prepare_inputs, "propose": drafter.propose}
        swaps = [(jax.random, "split", self.split), (tpu_runner, "sample", self.sample),
                 (tpu_runner, "extract_last_sampled_tokens", self.extract_last),
                 (tpu_runner, "concat_last_sampled_tokens_and_draft_tokens", self.concat),
                 (speculative_decoding_manager, "device_array", self.device_array),
                 (runner, "_select_from_array_fn", self.select),
                 (runner, "_extract_draft_token_ids", lambda *_: _Unused("draft token ids")),
                 (runner, "rejection_sampler", _Rejecting(runner.rejection_sampler, self.reject)),
                 (drafter, "prepare_inputs", self.prepare_inputs),
                 (drafter, "propose", self.propose)]
        with contextlib.ExitStack() as stack:
            for obj, name, value in swaps:
                stack.enter_context(_swapped(obj, name, value))
            yield

    def split(self, key, num=2):
        if key is self.rng_in:
            return self.fused["rng"], self.step_rng
        if key is self.step_rng:
            return _Unused("bonus rng"), _Unused("rejection rng")
        return self.real["split"](key, num)

    def select(self, array, indices, mesh, pcp_size=1):
        spec = self.a["spec_decode_metadata"]
        if indices is spec.bonus_logits_indices:
            return self.bonus_logits
        if indices is spec.target_logits_indices:
            return self.target_logits
        return type(self.runner)._select_from_array_fn(array, indices, mesh, pcp_size)

    def sample(self, rng, mesh, logits, *args, **kwargs):
        if logits is self.bonus_logits:
            return self.bonus_ids, None  # its processed logits serve logprobs only
        return self.real["sample"](rng, mesh, logits, *args, **kwargs)

    def reject(self, **kwargs):
        if kwargs.get("bonus_token_ids") is self.bonus_ids:
            return self.fused["next_tokens"]
        return self.real["reject"](**kwargs)

    def extract_last(self, spec, sampled_token_ids, *args, **kwargs):
        if sampled_token_ids is self.fused["next_tokens"]:
            return self.fused["last"], self.fused["rejected"]
        return self.real["extract"](spec, sampled_token_ids, *args, **kwargs)

    def device_array(self, mesh, *args, **kwargs):
        # The manager's transfer of the draft's inputs: ours were built alike and
        # are on the device already (compared by value, a check of ours).
        import numpy as np
        values = args[0] if len(args) == 1 else None
        if (isinstance(values, tuple) and len(values) == 3 and all(
                np.array_equal(v, h) for v, h in zip(values, self.host[:3]))):
            return self.device[:3]
        return self.real["device_array"](mesh, *args, **kwargs)

    def prepare_inputs(self, attn_metadata, input_ids, aux_hidden_states,
                       last_sampled_token_id, next_prompt_token_id, *args):
        if (next_prompt_token_id is self.device[0] and last_sampled_token_id is self.fused["last"]
                and attn_metadata is draft_attention(self.a["attn_metadata"])):
            return tuple(_Unused(n) for n in ("hidden", "input ids", "indices", "metadata"))
        # Our draft inputs were not upstream's: its own draft computes them.
        self.redrafted = True
        return self.real["prepare_inputs"](attn_metadata, input_ids, aux_hidden_states,
                                           last_sampled_token_id, next_prompt_token_id, *args)

    def propose(self, kv_caches, *args, **kwargs):
        if self.redrafted:
            return self.real["propose"](kv_caches, *args, **kwargs)
        return kv_caches, self.fused["drafts"]  # the caches the program returned

    def concat(self, last_sampled_tokens, draft_tokens):
        if last_sampled_tokens is self.fused["last"] and not self.redrafted:
            return self.fused["ahead"]
        return self.real["concat"](last_sampled_tokens, draft_tokens)
