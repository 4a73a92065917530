"""Speculative decoding: tpu-inference's JAX EAGLE-3 draft, with our targets."""

from tpu_models.features import EAGLE3
from tpu_models.patching import OFF_TPU, Patch, Target
from tpu_models.speculative import draft, draft_checkpoint

PROPOSER = "tpu_inference.spec_decode.jax.eagle3.Eagle3Proposer"
DRAFT = "tpu_inference.models.jax.llama_eagle3.EagleLlama3ForCausalLM"
LAYER = "tpu_inference.models.jax.llama_eagle3.Eagle3LlamaDecoderLayer"


def architecture_of_published_drafts(original, config):
    """model_loader._get_model_architecture: also drafts by their published name."""
    return draft_checkpoint.architecture(original, config)


def speculative_config_of_a_local_draft(original, self, target_model_config,
                                        target_parallel_config):
    """EngineArgs.create_speculative_config: a gs:// draft copied, its weights named."""
    draft_checkpoint.copy_from_object_storage(self)
    config = original(self, target_model_config, target_parallel_config)
    draft_checkpoint.weights_named(config)
    return config


def init_in_the_served_dtype(original, self, vllm_config, rng_key, mesh):
    """EagleLlama3ForCausalLM.__init__: the draft computes in --dtype, not bfloat16."""
    from tpu_inference.utils import to_jax_dtype
    original(self, vllm_config, rng_key, mesh)
    draft.computing_in(self, to_jax_dtype(vllm_config.model_config.dtype))


def load_weights_at_head_size(original, self, rng_key):
    """EagleLlama3ForCausalLM.load_weights, its heads unpadded (speculative.draft)."""
    with draft.heads_at_their_size():
        return original(self, rng_key)


def compute_logits_gathered(original, self, hidden_states):
    """EagleLlama3ForCausalLM.compute_logits, placed by a gather (speculative.draft)."""
    return draft.logits_in_target_vocabulary(self, hidden_states)


_PROPOSE = ("self state_leaves kv_caches input_ids attn_metadata last_token_indices "
            "target_hidden_states num_speculative_tokens layer_name_to_kvcache_index")
PATCHES = [
    Patch("EAGLE-3 drafts by their published name", EAGLE3, (
        Target("tpu_inference.models.common.model_loader._get_model_architecture", "config",
               architecture_of_published_drafts), ),
        "a LlamaForCausalLMEagle3 draft fell back to vLLM's PyTorch class",
        "tests/test_spec_decode.py::test_eagle3_draft_on_gemma3_matches_transformers"),
    Patch("speculative drafts from object storage", EAGLE3, (
        Target("vllm.engine.arg_utils.EngineArgs.create_speculative_config",
               "self target_model_config target_parallel_config",
               speculative_config_of_a_local_draft), ),
        "a gs:// draft had no weights; under runai_streamer any draft was looked up on the "
        "HF hub as ''",
        "tests/test_object_storage.py::test_plain_vllm_serve_streams_gemma3_from_gs"),
    Patch("EAGLE-3 drafts in the served dtype", EAGLE3, (
        Target(f"{DRAFT}.__init__", "self vllm_config rng_key mesh", init_in_the_served_dtype), ),
        "the draft computed in bfloat16 under --dtype float32 (12x slower on XLA:CPU)",
        "tests/test_spec_decode.py::test_the_eagle3_draft_computes_in_the_served_dtype"),
    Patch("EAGLE-3 draft heads at their size", EAGLE3, (
        Target(f"{DRAFT}.__init__", "self vllm_config rng_key mesh"),
        Target(f"{DRAFT}.load_weights", "self rng_key", load_weights_at_head_size),
        Target("tpu_inference.utils.get_padded_head_dim", "head_dim")),
        "a draft's heads were padded to 128 lanes off-TPU too (4x the demo draft's attention)",
        "tests/test_spec_decode.py::test_speculative_demo_gives_the_text_of_plain_decoding",
        draft.init_at_head_size, platform=OFF_TPU, speed="tpu-models bench spec"),
    Patch("EAGLE-3 draft passes on live rows", EAGLE3, (
        Target(f"{PROPOSER}._propose", _PROPOSE),
        Target(f"{PROPOSER}._select_inputs_for_loop_speculation",
               "self state_leaves positions residual hidden_states last_token_indices"),
        Target(f"{PROPOSER}._update_inputs_for_loop_speculation",
               "self positions seq_lens block_tables"),
        Target(f"{PROPOSER}._get_draft_token_ids", "self state_leaves hidden_states"),
        # the first pass, finished on the last rows, forms the layer's inputs as these do
        Target(f"{LAYER}.__call__", "self kv_cache embeds hidden_states attention_metadata"),
        Target(f"{LAYER}._norm_before_residual", "self hidden_states"),
        Target(f"{LAYER}._norm_after_residual", "self hidden_states"),
        Target("tpu_inference.models.jax.llama3.LlamaAttention.__call__",
               "self kv_cache x attention_metadata"),
        Target("tpu_inference.models.jax.llama3.apply_rope",
               "inputs positions head_dim rope_theta rope_scaling rope_input_ordering "
               "rope_proportion")),
        "every draft pass after the first computed all request slots; the first finished "
        "every token",
        "tests/test_spec_fusion.py::"
        "test_the_drafts_first_pass_on_last_rows_is_the_full_pass_at_those_rows",
        draft.passes_on_live_rows, platform=OFF_TPU, speed="tpu-models bench spec"),
    Patch("EAGLE-3 draft logits gathered", EAGLE3, (
        Target(f"{DRAFT}.compute_logits", "self hidden_states", compute_logits_gathered), ),
        "XLA:CPU ran the draft's lm_head transposed in a naive loop before the scatter",
        "tests/test_spec_decode.py::test_the_eagle3_draft_places_its_logits_in_the_target_vocabulary",
        platform=OFF_TPU, speed="tpu-models bench spec"),
]
