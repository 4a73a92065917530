"""Speculative steps: EAGLE-3 verification and drafting in one program per step, where allowed."""

from tpu_models import features
from tpu_models.adapt import state
from tpu_models.features import SPEC_FUSION
from tpu_models.patching import Patch, Target
from tpu_models.speculative import steps, warm_up

RUNNER = "tpu_inference.runner.tpu_runner"
PROPOSER = "tpu_inference.spec_decode.jax.eagle3.Eagle3Proposer"
MANAGER = "tpu_inference.runner.speculative_decoding_manager"


def fuses(runner) -> bool:
    """Whether the runner's EAGLE-3 steps run as one program: this patch not refused."""
    return SPEC_FUSION.name not in features.refused() and steps.fusible(runner)


def sample_from_logits_fused(original, self, *args, **kwargs):
    """TPUModelRunner._sample_from_logits: an eligible step as one program, others not."""
    return steps.sample_from_logits(original, self, args, kwargs, state.of(self))


def warmed_up_before_ready(original, self, vllm_config, *args, **kwargs):
    """EngineCore.__init__: an EAGLE-3 engine serves its warm-up requests before its
    start-up handshake ends (speculative.warm_up)."""
    original(self, vllm_config, *args, **kwargs)
    if warm_up.wanted(vllm_config):
        warm_up.serve(self)


def buckets_from_a_decode_step(original, self):
    """CompilationManager.capture_model: an EAGLE-3 engine's token buckets start at a
    decode step's (speculative.warm_up), before any is compiled."""
    warm_up.buckets_from_a_decode_step(self.runner)
    return original(self)


_SAMPLE_FROM_LOGITS = (
    "self scheduler_output attn_metadata tpu_sampling_metadata input_ids hidden_states logits "
    "aux_hidden_states spec_decode_metadata kv_connector_output logits_indices_selector "
    "padded_num_reqs expert_indices full_hidden_states full_logits req_ids_dp "
    "padded_num_scheduled_tokens_per_dp_rank")
PATCHES = [
    Patch("EAGLE-3 verification and drafting fused", SPEC_FUSION, (
        Target(f"{RUNNER}.TPUModelRunner._sample_from_logits", _SAMPLE_FROM_LOGITS,
               sample_from_logits_fused),
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
        speed="tpu-models bench spec-calls"),
    Patch("EAGLE-3's first steps served before ready", SPEC_FUSION, (
        Target("vllm.v1.engine.core.EngineCore.__init__", "self vllm_config executor_class "
               "log_stats executor_fail_callback include_finished_set", warmed_up_before_ready),
        Target("tpu_inference.runner.compilation_manager.CompilationManager.capture_model",
               "self", buckets_from_a_decode_step)),
        "the fused step compiled at each shape's first step: a user's first request took 5-10 s",
        "tests/test_spec_fusion.py::test_fused_eagle3_steps_give_the_text_of_plain_decoding"),
]
