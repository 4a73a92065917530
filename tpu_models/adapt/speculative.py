"""Speculative decoding: tpu-inference's JAX EAGLE-3 draft, with our targets.

Its name and dtype apply everywhere; the last three are off-TPU speed (their
device code: speculative.draft), the figures in benchmarks/README.md (bench spec).
"""

import functools

from tpu_models.adapt.guard import EAGLE3, OFF_TPU, Patch, Target
from tpu_models.speculative import draft

PROPOSER = "tpu_inference.spec_decode.jax.eagle3.Eagle3Proposer"
DRAFT = "tpu_inference.models.jax.llama_eagle3.EagleLlama3ForCausalLM"
LAYER = "tpu_inference.models.jax.llama_eagle3.Eagle3LlamaDecoderLayer"


def eagle3_drafts_by_their_published_name() -> None:
    # Drafts are published as LlamaForCausalLMEagle3; tpu-inference registers its
    # JAX draft only as Eagle3LlamaForCausalLM, so such a draft fell back to
    # vLLM's PyTorch class, which the JAX speculative path cannot drive.
    from tpu_inference.models.common import model_loader

    original = model_loader._get_model_architecture

    def _get_model_architecture(config):
        try:
            return original(config)
        except model_loader.UnsupportedArchitectureError:
            if "LlamaForCausalLMEagle3" in (getattr(config, "architectures", None) or ()):
                return model_loader._MODEL_REGISTRY["Eagle3LlamaForCausalLM"]
            raise

    model_loader._get_model_architecture = _get_model_architecture


def drafts_from_object_storage() -> None:
    # vLLM pulls only a gs:// draft's config and tokenizer, leaving its weights to
    # --load-format runai_streamer, which the target's checkpoint may not use. A draft
    # is small: copied whole, with vLLM's own helper, into vLLM's assets cache
    # (<VLLM_ASSETS_CACHE>/model_streamer/<hash>, refreshed at each start, removed on
    # SIGINT/SIGTERM with VLLM_ASSETS_CACHE_MODEL_CLEAN=1), before the draft's config.
    from vllm.engine.arg_utils import EngineArgs
    from vllm.transformers_utils.runai_utils import ObjectStorageModel

    from tpu_models.loaders.object_storage import is_object_storage, local_draft

    original = EngineArgs.create_speculative_config

    def create_speculative_config(self, target_model_config, target_parallel_config):
        if isinstance(self.speculative_config, dict) and \
                is_object_storage(str(self.speculative_config.get("model", ""))):
            self.speculative_config = {
                **self.speculative_config,
                "model": local_draft(self.speculative_config["model"], ObjectStorageModel)}
        if self.spec_model is not None and is_object_storage(self.spec_model):
            self.spec_model = local_draft(self.spec_model, ObjectStorageModel)
        config = original(self, target_model_config, target_parallel_config)
        draft_config = getattr(config, "draft_model_config", None)
        if draft_config is not None and not draft_config.model_weights:
            # Under --load-format runai_streamer, tpu-inference streams a draft from
            # its model_weights, which only an object-storage model has set: a local
            # draft was looked up as the Hugging Face repository "".
            draft_config.model_weights = draft_config.model
        return config

    EngineArgs.create_speculative_config = create_speculative_config


def drafts_in_the_served_dtype() -> None:
    # tpu-inference computes every draft layer in bfloat16 whatever --dtype says.
    from tpu_inference.models.jax.llama_eagle3 import EagleLlama3ForCausalLM

    upstream["draft_init"] = EagleLlama3ForCausalLM.__init__
    EagleLlama3ForCausalLM.__init__ = draft_init


def draft_init(self, vllm_config, rng_key, mesh):
    """EagleLlama3ForCausalLM.__init__, the draft computing in the served dtype."""
    from tpu_inference.utils import to_jax_dtype
    upstream["draft_init"](self, vllm_config, rng_key, mesh)
    draft.computing_in(self, to_jax_dtype(vllm_config.model_config.dtype))


def draft_heads_at_their_size() -> None:
    # tpu-inference pads a draft's head_dim to 128 lanes for the TPU kernel: the
    # demo draft's 32-wide heads made its attention projections 4x their size, and
    # computed so, every pass. The portable attention pads only the cache, as it
    # does for our models; the cache keeps its padded shape (sized elsewhere).
    from tpu_inference import utils
    from tpu_inference.models.jax.llama_eagle3 import EagleLlama3ForCausalLM

    def unpadded(method):
        @functools.wraps(method)
        def run(*args, **kwargs):
            padded = utils.get_padded_head_dim
            utils.get_padded_head_dim = lambda head_dim: head_dim
            try:
                return method(*args, **kwargs)
            finally:
                utils.get_padded_head_dim = padded
        return run

    EagleLlama3ForCausalLM.__init__ = unpadded(EagleLlama3ForCausalLM.__init__)
    EagleLlama3ForCausalLM.load_weights = unpadded(EagleLlama3ForCausalLM.load_weights)


def draft_passes_on_live_rows() -> None:
    # Jitted without the original's xla_tpu_* options. Static both by position (the
    # runner's calls) and by name (upstream's precompilation): given both, JAX maps
    # neither to the other.
    import jax
    from tpu_inference.spec_decode.jax.eagle3 import Eagle3Proposer

    upstream["propose"] = Eagle3Proposer._propose.__wrapped__
    Eagle3Proposer._propose = jax.jit(propose, donate_argnames=("kv_caches", ),
                                      out_shardings=(None, None), static_argnums=(0, 7, 8),
                                      static_argnames=("num_speculative_tokens",
                                                       "layer_name_to_kvcache_index", "live_rows"))


upstream: dict = {}  # tpu-inference's draft passes on every row


def propose(self, state_leaves, kv_caches, input_ids, attn_metadata, last_token_indices,
            target_hidden_states, num_speculative_tokens, layer_name_to_kvcache_index,
            live_rows=None):
    """Eagle3Proposer._propose: the passes on the live rows (speculative.draft), where
    a caller (speculative.fusion) may name how many."""
    live = draft.on_live_rows(self, last_token_indices.shape[0], input_ids.shape[0],
                              live_rows, num_speculative_tokens)
    if not live:
        return upstream["propose"](self, state_leaves, kv_caches, input_ids, attn_metadata,
                                   last_token_indices, target_hidden_states,
                                   num_speculative_tokens, layer_name_to_kvcache_index)
    return draft.propose_on_live_rows(self, state_leaves, kv_caches, input_ids, attn_metadata,
                                      last_token_indices, target_hidden_states,
                                      num_speculative_tokens, layer_name_to_kvcache_index, live)


def draft_logits_gathered() -> None:
    from tpu_inference.models.jax.llama_eagle3 import EagleLlama3ForCausalLM

    EagleLlama3ForCausalLM.compute_logits = compute_logits


def compute_logits(self, hidden_states):
    """EagleLlama3ForCausalLM.compute_logits, placed by a gather (speculative.draft)."""
    return draft.logits_in_target_vocabulary(self, hidden_states)


_PROPOSE = ("self state_leaves kv_caches input_ids attn_metadata last_token_indices "
            "target_hidden_states num_speculative_tokens layer_name_to_kvcache_index")
PATCHES = [
    Patch("EAGLE-3 drafts by their published name", EAGLE3, (
        Target("tpu_inference.models.common.model_loader._get_model_architecture", "config"), ),
        "a LlamaForCausalLMEagle3 draft fell back to vLLM's PyTorch class",
        "tests/test_spec_decode.py::test_eagle3_draft_on_gemma3_matches_transformers",
        eagle3_drafts_by_their_published_name),
    Patch("speculative drafts from object storage", EAGLE3, (
        Target("vllm.engine.arg_utils.EngineArgs.create_speculative_config",
               "self target_model_config target_parallel_config"), ),
        "a gs:// draft had no weights; under runai_streamer any draft was looked up on the "
        "HF hub as ''",
        "tests/test_object_storage.py::test_plain_vllm_serve_streams_gemma3_from_gs",
        drafts_from_object_storage),
    Patch("EAGLE-3 drafts in the served dtype", EAGLE3, (
        Target(f"{DRAFT}.__init__", "self vllm_config rng_key mesh"), ),
        "the draft computed in bfloat16 under --dtype float32 (12x slower on XLA:CPU)",
        "tests/test_spec_decode.py::test_the_eagle3_draft_computes_in_the_served_dtype",
        drafts_in_the_served_dtype),
    Patch("EAGLE-3 draft heads at their size", EAGLE3, (
        Target(f"{DRAFT}.__init__", "self vllm_config rng_key mesh"),
        Target(f"{DRAFT}.load_weights", "self rng_key"),
        Target("tpu_inference.utils.get_padded_head_dim", "head_dim")),
        "a draft's heads were padded to 128 lanes off-TPU too (4x the demo draft's attention)",
        "tests/test_spec_decode.py::test_speculative_demo_gives_the_text_of_plain_decoding",
        draft_heads_at_their_size, platform=OFF_TPU, speed="tpu-models bench spec"),
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
        draft_passes_on_live_rows, platform=OFF_TPU, speed="tpu-models bench spec"),
    Patch("EAGLE-3 draft logits gathered", EAGLE3, (
        Target(f"{DRAFT}.compute_logits", "self hidden_states"), ),
        "XLA:CPU ran the draft's lm_head transposed in a naive loop before the scatter",
        "tests/test_spec_decode.py::test_the_eagle3_draft_places_its_logits_in_the_target_vocabulary",
        draft_logits_gathered, platform=OFF_TPU, speed="tpu-models bench spec"),
]
