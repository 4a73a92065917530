"""Speculative decoding: tpu-inference's JAX EAGLE-3 draft, with our targets.

Its name and dtype apply everywhere; the last two are off-TPU speed: the
figures are in benchmarks/README.md (bench spec).
"""

import dataclasses
import functools

from tpu_models.adapt.guard import EAGLE3, OFF_TPU, Patch, Target

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
        draft = getattr(config, "draft_model_config", None)
        if draft is not None and not draft.model_weights:
            # Under --load-format runai_streamer, tpu-inference streams a draft from
            # its model_weights, which only an object-storage model has set: a local
            # draft was looked up as the Hugging Face repository "".
            draft.model_weights = draft.model
        return config

    EngineArgs.create_speculative_config = create_speculative_config


def drafts_in_the_served_dtype() -> None:
    # tpu-inference computes every draft layer in bfloat16 whatever --dtype says.
    import jax.numpy as jnp
    from flax import nnx
    from tpu_inference.models.jax.llama_eagle3 import EagleLlama3ForCausalLM
    from tpu_inference.utils import to_jax_dtype

    original = EagleLlama3ForCausalLM.__init__

    def __init__(self, vllm_config, rng_key, mesh):
        original(self, vllm_config, rng_key, mesh)
        served = jnp.dtype(to_jax_dtype(vllm_config.model_config.dtype))
        for _, node in nnx.iter_graph(self):
            # the computation dtype; param_dtype only shapes the checkpoint's placeholders
            if isinstance(node, nnx.Module) and getattr(node, "dtype", None) == jnp.bfloat16:
                node.dtype = served

    EagleLlama3ForCausalLM.__init__ = __init__


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
    # Passes after the first ran on every request slot (64 off-TPU). Each request
    # has a token in the step, so the token bucket bounds the live requests: the
    # passes run on min(slots, tokens) rows and the drafts are padded back. A
    # caller knowing the step's requests (adapt.spec_fusion) bounds them closer
    # with live_rows: a prompt's 64 tokens are one request. The first pass writes
    # every token's keys and values but finishes the layer on those rows only
    # (_first_pass_on_rows). Jitted without the original's xla_tpu_* options.
    import jax
    import jax.numpy as jnp
    from tpu_inference.spec_decode.jax.eagle3 import Eagle3Proposer

    every_row = Eagle3Proposer._propose.__wrapped__

    def propose(self, state_leaves, kv_caches, input_ids, attn_metadata, last_token_indices,
                target_hidden_states, num_speculative_tokens, layer_name_to_kvcache_index,
                live_rows=None):
        rows = last_token_indices.shape[0]
        live = min(rows, input_ids.shape[0], live_rows or rows)
        if (live == rows or num_speculative_tokens == 1 or self.method != "eagle3"
                or self.constant_draft_positions or self.runner.dp_size > 1):
            return every_row(self, state_leaves, kv_caches, input_ids, attn_metadata,
                             last_token_indices, target_hidden_states, num_speculative_tokens,
                             layer_name_to_kvcache_index)
        last = last_token_indices[:live]
        if _first_pass_on_rows_applies(self, attn_metadata):
            kv_caches, out, hidden = _first_pass_on_rows(
                self, state_leaves, kv_caches, input_ids, target_hidden_states, attn_metadata,
                last)
            positions = attn_metadata.input_positions[last]
            draft = self._get_draft_token_ids(state_leaves, out)
        else:
            kv_caches, hidden, residual, _ = self.model_fn(
                state_leaves, kv_caches, input_ids, target_hidden_states, attn_metadata,
                layer_name_to_kvcache_index, spec_step_idx=0)
            positions, hidden, draft = self._select_inputs_for_loop_speculation(
                state_leaves, attn_metadata.input_positions, residual[0], hidden, last)
        pages = attn_metadata.block_tables.shape[0] // rows  # block_tables: [rows * pages]
        seq_lens, block_tables = attn_metadata.seq_lens[:live], attn_metadata.block_tables[:live * pages]
        drafts = [draft]  # each [live]
        for step in range(1, num_speculative_tokens):
            positions, clamped, seq_lens, starts, block_tables = (
                self._update_inputs_for_loop_speculation(positions, seq_lens, block_tables))
            attn_metadata = dataclasses.replace(
                attn_metadata, input_positions=clamped, seq_lens=seq_lens,
                query_start_loc=starts, block_tables=block_tables)
            kv_caches, out, residual, _ = self.model_fn(
                state_leaves, kv_caches, drafts[-1], hidden, attn_metadata,
                layer_name_to_kvcache_index, spec_step_idx=step)
            hidden = residual[0]
            drafts.append(self._get_draft_token_ids(state_leaves, out))
        drafts = jnp.stack(drafts, axis=1)  # [live, k]
        return kv_caches, jnp.pad(drafts, ((0, rows - live), (0, 0)))

    # Static both by position (the runner's calls) and by name (upstream's
    # precompilation): given both, JAX maps neither to the other.
    Eagle3Proposer._propose = jax.jit(propose, donate_argnames=("kv_caches", ),
                                      out_shardings=(None, None), static_argnums=(0, 7, 8),
                                      static_argnames=("num_speculative_tokens",
                                                       "layer_name_to_kvcache_index", "live_rows"))


def _first_pass_on_rows_applies(proposer, attn_metadata) -> bool:
    """tpu-inference's one-layer Llama EAGLE-3 draft, one device, the portable attention
    (whose cache layout write_kv_cache writes), keys and values not quantized."""
    from tpu_inference.models.jax.llama_eagle3 import EagleLlama3ForCausalLM

    from tpu_models.host import attention_mode

    model = proposer.model
    return (isinstance(model, EagleLlama3ForCausalLM) and len(model.model.layers) == 1
            and proposer.mesh.size == 1 and attention_mode() == "portable"
            and not model.model.layers[0].self_attn.kv_cache_quantized_dtype
            and attn_metadata.input_positions.ndim == 1)


def _first_pass_on_rows(proposer, state_leaves, kv_caches, input_ids, target_hidden, md, rows):
    """The draft's first pass over a step's tokens, finished at `rows` only (each
    request's last token): every token's keys and values go into the draft's cache, for
    the later passes to attend, but queries, attention, o_proj and the MLP run on `rows`.
    A 47-token prompt's pass computed all 64 rows of its bucket through the layer to draft
    from one. Returns (kv_caches, the normed output [rows, D], the residual [rows, D])."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tpu_inference.layers.common.attention_interface import attention
    from tpu_inference.models.jax.llama3 import apply_rope

    from tpu_models.attention import write_kv_cache

    graphdef, state = nnx.split(proposer.model)
    model = nnx.merge(graphdef, jax.tree.unflatten(jax.tree.structure(state), state_leaves))
    body = model.model
    layer = body.layers[0]
    attn = layer.self_attn
    # The layer's inputs, as Eagle3LlamaDecoderLayer.__call__ forms them, for every token.
    embeds = layer.input_layernorm(body.embed_tokens(input_ids))
    norm = (layer._norm_before_residual if getattr(layer.config, "norm_before_residual", False)
            else layer._norm_after_residual)
    hidden, residual = norm(target_hidden)
    x = jnp.concatenate([embeds, hidden], axis=-1)

    def rope(t, positions):
        return apply_rope(t, positions, attn.head_dim_original, attn.rope_theta,
                          attn.rope_scaling)

    positions = md.input_positions
    k, v = rope(attn.k_proj(x), positions), attn.v_proj(x)
    cache = write_kv_cache(kv_caches[-1], k, v, md.seq_lens, md.block_tables,
                           md.query_start_loc, md.request_distribution[2])
    # Row i (request i's) attends its request's keys up to its own place, as it
    # does in the full pass: a request of one query, at that place.
    live = rows.shape[0]
    context = md.seq_lens[:live] - (md.query_start_loc[1:live + 1] - rows) + 1
    pages = md.block_tables.shape[0] // md.seq_lens.shape[0]
    selected = dataclasses.replace(
        md, input_positions=positions[rows], seq_lens=context,
        query_start_loc=jnp.arange(live + 1, dtype=md.query_start_loc.dtype),
        block_tables=md.block_tables[:live * pages])
    q = rope(attn.q_proj(x[rows]), positions[rows])
    cache, out = attention(cache, q, k[rows], v[rows], selected, proposer.mesh,
                           attn.head_dim_original, update_kv_cache=False)
    out = attn.o_proj(out) + residual[rows]
    out = layer.mlp(layer.post_attention_layernorm(out)) + out
    return [*kv_caches[:-1], cache], body.norm(out), out


def draft_logits_gathered() -> None:
    # Fed to tpu-inference's scatter, XLA:CPU computed the draft's lm_head
    # transposed in a naive loop; the same placement as a gather keeps it a matmul.
    import jax.numpy as jnp
    from tpu_inference.models.jax.llama_eagle3 import EagleLlama3ForCausalLM

    def compute_logits(self, hidden_states):
        logits = self.lm_head(hidden_states)  # [T, draft vocab]
        draft_vocab = logits.shape[1]
        targets = jnp.arange(draft_vocab, dtype=jnp.int32) + self.draft_id_to_target_id.value
        vocab = self.vllm_config.model_config.get_vocab_size()
        draft_of = jnp.full((vocab, ), draft_vocab, jnp.int32).at[targets].set(
            jnp.arange(draft_vocab, dtype=jnp.int32))  # [vocab]; draft_vocab: none
        logits = jnp.pad(logits, ((0, 0), (0, 1)), constant_values=-jnp.inf)
        return logits[:, draft_of]  # [T, vocab]

    EagleLlama3ForCausalLM.compute_logits = compute_logits


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
