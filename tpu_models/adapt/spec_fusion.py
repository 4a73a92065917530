"""Speculative steps: EAGLE-3 verification and drafting in one compiled program
(speculative.fusion), where a step allows it (`eligible`); other steps run
upstream's code unchanged. TPU_MODELS_SPEC_FUSION=0 leaves it uninstalled.
"""

import inspect
import os

from tpu_models.adapt import state
from tpu_models.adapt.guard import SPEC_FUSION, Patch, Target
from tpu_models.speculative import fusion
from tpu_models.speculative.fusion import STEPS

RUNNER = "tpu_inference.runner.tpu_runner"
PROPOSER = "tpu_inference.spec_decode.jax.eagle3.Eagle3Proposer"
MANAGER = "tpu_inference.runner.speculative_decoding_manager"


def _logger():
    from tpu_inference.logger import init_logger
    return init_logger("tpu_models.adapt")


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


def verification_and_drafting_fused() -> None:
    if os.environ.get("TPU_MODELS_SPEC_FUSION") == "0":
        return
    from tpu_inference.runner.tpu_runner import TPUModelRunner

    if not upstream:  # installed once
        original = TPUModelRunner._sample_from_logits
        upstream.update(sample_from_logits=original, signature=inspect.signature(original))
        TPUModelRunner._sample_from_logits = sample_from_logits


upstream: dict = {}  # tpu-inference's _sample_from_logits and its signature


def sample_from_logits(self, *args, **kwargs):
    """TPUModelRunner._sample_from_logits: an eligible step's calls after the forward
    pass run as one program (fusion.run), and upstream's code then runs with its
    device calls answered from that program's results (fusion.Replay)."""
    original = upstream["sample_from_logits"]
    bound = upstream["signature"].bind(self, *args, **kwargs)
    bound.apply_defaults()
    seam = state.of(self)
    if seam.unfused or not eligible(self, bound.arguments):
        STEPS["fallback"] += 1
        return original(*bound.args, **bound.kwargs)
    try:
        replay = fusion.run(self, bound.arguments)
    except Exception:  # traced or compiled wrong: upstream's calls from now on
        if any(getattr(c, "is_deleted", lambda: False)() for c in self.kv_caches):
            raise  # the caches were donated: nothing to fall back on
        _logger().exception("tpu-models: EAGLE-3 steps could not be fused; "
                            "running tpu-inference's calls")
        seam.unfused = True
        STEPS["failed"] += 1
        return original(*bound.args, **bound.kwargs)
    with replay.standing_in():
        output = original(*bound.args, **bound.kwargs)
    if STEPS["fused"] == 0 and not replay.redrafted:
        _logger().info("tpu-models: EAGLE-3 verification and drafting fused "
                       "(one program per step)")
    if STEPS["redrafted"] == 0 and replay.redrafted:
        _logger().warning("tpu-models: our EAGLE-3 draft inputs differ from tpu-inference's "
                          "(fusion.draft_host_inputs); its own calls draft instead")
    STEPS["redrafted" if replay.redrafted else "fused"] += 1
    return output


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
