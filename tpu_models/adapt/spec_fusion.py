"""Speculative steps: EAGLE-3 verification and drafting in one compiled program.

After the target's forward pass tpu-inference 0.32.0 launches about ten small
programs per EAGLE-3 step (two row selections, the bonus sampler, the draft
ids, the rejection sampler, the last sampled tokens, the draft's inputs, the
draft passes, the next step's tokens), each a dispatch with its own overhead.
Here they are traced as one jit (`verify_and_draft`) calling upstream's own
functions, and upstream's `_sample_from_logits` then runs as it is, its device
calls answered from that program's results (`Replay`): its bookkeeping (async
or not) stays upstream's. Steps it does not cover run upstream's code unchanged
(`eligible`). The program compiles when a step first meets its shapes (it is not
among those tpu-inference compiles before serving). TPU_MODELS_SPEC_FUSION=0
leaves it uninstalled. On XLA:CPU a decode step of the demo model launched 15
programs, 7 fused (plain decoding: 6): tpu-models bench spec-calls.
"""

import contextlib
import functools
import inspect
import os

from tpu_models.adapt.guard import SPEC_FUSION, Patch, Target
from tpu_models.speculation import STEPS, live_rows

RUNNER = "tpu_inference.runner.tpu_runner"
PROPOSER = "tpu_inference.spec_decode.jax.eagle3.Eagle3Proposer"
MANAGER = "tpu_inference.runner.speculative_decoding_manager"


def _logger():
    from tpu_inference.logger import init_logger
    return init_logger("tpu_models.adapt")


def verify_and_draft(runner, live_rows, rng, logits, input_ids, spec, sampling,
                     aux_hidden_states, attn_metadata, draft_inputs, state_leaves, kv_caches):
    """Upstream's calls of an EAGLE-3 step after the forward pass, in its order and
    with its arguments, as one program (`runner` is static: its config and modules;
    `live_rows` too: speculation.live_rows)."""
    import jax
    from tpu_inference.runner import tpu_runner
    from tpu_inference.spec_decode.jax import utils

    mesh, drafter = runner.mesh, runner.drafter
    pcp = runner.vllm_config.sharding_config.prefill_cp_size
    k = runner.speculative_config.num_speculative_tokens
    if sampling.do_sampling:  # the same keys as upstream's two splits
        rng, step_rng = jax.random.split(rng)
        bonus_rng, rejection_rng = jax.random.split(step_rng)
    else:
        bonus_rng = rejection_rng = rng
    select = type(runner)._select_from_array_fn
    # A jit with compiler options cannot be nested: the sampler's own function.
    bonus_token_ids, _ = tpu_runner.sample.__wrapped__(
        bonus_rng, mesh, select(logits, spec.bonus_logits_indices, mesh, pcp), sampling,
        allow_distributed_sampling=tpu_runner.distributed_sampling_allowed(
            sampling.logprobs, runner.model_config.logprobs_mode))
    next_tokens = runner.rejection_sampler(
        draft_token_ids=runner._extract_draft_token_ids(
            input_ids, spec.final_logits_indices, spec.target_logits_indices),
        num_draft_tokens=spec.draft_lengths, draft_probs=None,
        target_logits=select(logits, spec.target_logits_indices, mesh, pcp),
        bonus_token_ids=bonus_token_ids, sampling_metadata=sampling, key=rejection_rng)
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
    # Off-TPU, adapt.speculative's draft passes run on the live rows we know of.
    bound = {"live_rows": live_rows} if "live_rows" in inspect.signature(propose).parameters else {}
    kv_caches, drafts = propose(drafter, state_leaves, kv_caches, draft_ids, draft_attn,
                                last_token_indices, hidden, k,
                                tuple(runner.layer_name_to_kvcache_index.items()), **bound)
    drafts = (drafts[:, None] if drafts.ndim == 1 else drafts)[:, :k]
    ahead = (utils.concat_last_sampled_tokens_and_draft_tokens(last, drafts)
             if runner.scheduler_config.async_scheduling else None)
    return dict(rng=rng, next_tokens=next_tokens, last=last, rejected=rejected, drafts=drafts,
                ahead=ahead, kv_caches=kv_caches)


@functools.cache
def _compiled():
    import jax
    return jax.jit(verify_and_draft, static_argnums=(0, 1), donate_argnames=("kv_caches", ))


def fuses(runner) -> bool:
    """Whether this runner's EAGLE-3 steps can run as one program: the patch installed
    (not refused, not TPU_MODELS_SPEC_FUSION=0), EAGLE-3 on one data-parallel rank,
    compiling allowed at run time. Not on a multi-chip TPU: there upstream's sampler
    and draft jits carry collective options (xla_tpu_*, one against a v7x deadlock)
    that this one program would not."""
    from tpu_inference import envs
    from tpu_inference.runner import tpu_runner
    from tpu_inference.spec_decode.jax.eagle3 import Eagle3Proposer

    from tpu_models.adapt import guard
    from tpu_models.host import host_platform

    return (os.environ.get("TPU_MODELS_SPEC_FUSION") != "0"
            and guard.SPEC_FUSION.name not in guard.refused()
            and runner.speculative_config.method == "eagle3"
            and isinstance(runner.drafter, Eagle3Proposer) and runner.dp_size == 1
            and runner.is_last_rank and hasattr(tpu_runner.sample, "__wrapped__")
            and (host_platform() is not None or runner.mesh.size == 1)
            and not envs.VLLM_XLA_CHECK_RECOMPILATION)


def eligible(runner, a: dict) -> bool:
    """The steps `verify_and_draft` covers: a runner that `fuses`, no logprobs of
    either kind, no penalties or bad words."""
    from tpu_inference.layers.jax.sample.sampling_metadata import TPUSupportedSamplingMetadata

    spec, sampling = a["spec_decode_metadata"], a["tpu_sampling_metadata"]
    return (spec is not None and isinstance(sampling, TPUSupportedSamplingMetadata)
            and not sampling.logprobs and a["full_logits"] is None
            # Penalties or bad words: verified with the device's counts (adapt.sampling).
            and getattr(sampling, "slot", None) is None
            and a["input_ids"] is not None and len(a["aux_hidden_states"] or ()) > 0
            and fuses(runner))


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


def verification_and_drafting_fused() -> None:
    if os.environ.get("TPU_MODELS_SPEC_FUSION") == "0":
        return
    from jax.sharding import PartitionSpec
    from tpu_inference.layers.common.sharding import ShardingAxisName
    from tpu_inference.runner.tpu_runner import TPUModelRunner
    from tpu_inference.utils import device_array

    original = TPUModelRunner._sample_from_logits
    signature = inspect.signature(original)

    def _sample_from_logits(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if getattr(self, "_tpu_models_unfused", False) or not eligible(self, a):
            STEPS["fallback"] += 1
            return original(*bound.args, **bound.kwargs)
        host = draft_host_inputs(self, a)
        # The draft's inputs in one transfer (upstream's two are answered from it).
        device = device_array(self.mesh, host,
                              sharding=PartitionSpec(ShardingAxisName.ATTN_DATA))
        try:
            rows = live_rows(int(host[2][0]), a["input_ids"].shape[0])
            fused = _compiled()(self, rows, self.rng_params_for_sampling, a["logits"],
                                a["input_ids"], a["spec_decode_metadata"], a["tpu_sampling_metadata"],
                                a["aux_hidden_states"], draft_attention(a["attn_metadata"]),
                                device, self.drafter.state_leaves, self.kv_caches)
        except Exception:  # traced or compiled wrong: upstream's calls from now on
            if any(getattr(c, "is_deleted", lambda: False)() for c in self.kv_caches):
                raise  # the caches were donated: nothing to fall back on
            _logger().exception("tpu-models: EAGLE-3 steps could not be fused; "
                                "running tpu-inference's calls")
            self._tpu_models_unfused = True
            STEPS["failed"] += 1
            return original(*bound.args, **bound.kwargs)
        self.kv_caches = fused["kv_caches"]  # the old ones were donated
        replay = Replay(self, a, fused, host, device)
        with replay.standing_in():
            output = original(*bound.args, **bound.kwargs)
        if STEPS["fused"] == 0 and not replay.redrafted:
            _logger().info("tpu-models: EAGLE-3 verification and drafting fused "
                           "(one program per step)")
        if STEPS["redrafted"] == 0 and replay.redrafted:
            _logger().warning("tpu-models: our EAGLE-3 draft inputs differ from tpu-inference's "
                              "(spec_fusion.draft_host_inputs); its own calls draft instead")
        STEPS["redrafted" if replay.redrafted else "fused"] += 1
        return output

    TPUModelRunner._sample_from_logits = _sample_from_logits


_SAMPLE_FROM_LOGITS = (
    "self scheduler_output attn_metadata tpu_sampling_metadata input_ids hidden_states logits "
    "aux_hidden_states spec_decode_metadata kv_connector_output logits_indices_selector "
    "padded_num_reqs expert_indices full_hidden_states full_logits req_ids_dp "
    "padded_num_scheduled_tokens_per_dp_rank")
PATCHES = [
    Patch("EAGLE-3 verification and drafting fused", SPEC_FUSION, (
        Target(f"{RUNNER}.TPUModelRunner._sample_from_logits", _SAMPLE_FROM_LOGITS),
        Target(f"{RUNNER}.TPUModelRunner._select_from_array_fn",
               "array indices_to_select mesh pcp_size"),
        Target(f"{RUNNER}.TPUModelRunner._extract_draft_token_ids",
               "self input_ids logits_indices target_logits_indices"),
        Target(f"{RUNNER}.sample",
               "rng mesh logits tpu_sampling_metadata allow_distributed_sampling"),
        Target("tpu_inference.layers.jax.sample.rejection_sampler.RejectionSampler.__call__",
               "self draft_token_ids num_draft_tokens draft_probs target_logits "
               "bonus_token_ids sampling_metadata key"),
        Target(f"{RUNNER}.extract_last_sampled_tokens", "spec_decode_metadata sampled_token_ids "
               "num_speculative_tokens vocab_size max_num_reqs_per_dp_rank mesh"),
        Target(f"{RUNNER}.concat_last_sampled_tokens_and_draft_tokens",
               "last_sampled_tokens draft_tokens"),
        Target(f"{MANAGER}.SpeculativeDecodingManager.propose_eagle3_draft_token_ids",
               "self spec_decode_metadata last_sampled_token_id num_rejected_tokens "
               "discard_sampled_tokens_req_indices aux_hidden_states attn_metadata "
               "scheduler_output input_ids async_scheduling hidden_states"),
        Target(f"{MANAGER}.device_array", "mesh args sharding kwargs"),
        Target(f"{PROPOSER}.prepare_inputs", "self attn_metadata input_ids aux_hidden_states "
               "last_sampled_token_id next_prompt_token_id is_in_prefill num_rejected_tokens "
               "num_reqs_dp"),
        Target(f"{PROPOSER}._prepare_inputs", "self state_leaves num_reqs block_tables "
               "attn_metadata input_ids aux_hidden_states last_sampled_token_id "
               "next_prompt_token_id is_in_prefill num_rejected_tokens"),
        Target(f"{PROPOSER}.propose", "self kv_caches input_ids attn_metadata "
               "last_token_indices target_hidden_states"),
        Target("jax.random.split", "key num")),
        "an EAGLE-3 step launched ~10 small programs after the forward pass, one dispatch each",
        "tests/test_spec_fusion.py::test_fused_eagle3_steps_give_the_text_of_plain_decoding",
        verification_and_drafting_fused, speed="tpu-models bench spec-calls"),
]
