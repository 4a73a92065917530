"""tpu-inference's Llama EAGLE-3 draft as we run it: in the served dtype
(`computing_in`), off-TPU its passes on the rows that draft, and its logits placed
in the target's vocabulary by a gather.

tpu-inference runs every draft pass after the first on every request slot (64
off-TPU). Each request has a token in the step, so the token bucket bounds the
live requests: `propose_on_live_rows` runs the passes on min(slots, tokens) rows
and pads the drafts back. A caller knowing the step's requests (speculative.fusion)
bounds them closer (`live_rows`): a prompt's 64 tokens are one request. The first
pass writes every token's keys and values but finishes the layer on those rows
only (`first_pass_on_rows`). Upstream's `_propose` is a jit; ours (`propose_jitted`)
is one too, without its xla_tpu_* options, so that speculative.fusion can call the
function inside it (its `__wrapped__`) with `live_rows`.

Off-TPU its heads stay at their size (`heads_at_their_size`, `init_at_head_size`):
tpu-inference pads a draft's head_dim to 128 lanes for the TPU kernel, which made the
demo draft's 32-wide heads' attention projections 4x their size, and computed so,
every pass. The
portable attention pads only the cache, as it does for our models; the cache keeps
its padded shape (sized elsewhere).
"""

import contextlib
import dataclasses
import functools


def computing_in(model, dtype) -> None:
    """Every module of the draft that computes in bfloat16 computes in `dtype` (its
    param_dtype only shapes the checkpoint's placeholders)."""
    import jax.numpy as jnp
    from flax import nnx
    served = jnp.dtype(dtype)
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module) and getattr(node, "dtype", None) == jnp.bfloat16:
            node.dtype = served


@contextlib.contextmanager
def heads_at_their_size():
    """Within it, tpu-inference pads no head_dim (`utils.get_padded_head_dim`)."""
    from tpu_inference import utils
    padded = utils.get_padded_head_dim
    utils.get_padded_head_dim = lambda head_dim: head_dim
    try:
        yield
    finally:
        utils.get_padded_head_dim = padded


def with_heads_at_their_size(method):
    """`method`, run `heads_at_their_size`."""
    @functools.wraps(method)
    def run(*args, **kwargs):
        with heads_at_their_size():
            return method(*args, **kwargs)
    return run


def init_at_head_size() -> None:
    """The draft's __init__, its heads unpadded: wrapped around the replacement the
    seam installed (in the served dtype), not a replacement of its own."""
    from tpu_inference.models.jax.llama_eagle3 import EagleLlama3ForCausalLM
    EagleLlama3ForCausalLM.__init__ = with_heads_at_their_size(EagleLlama3ForCausalLM.__init__)


def propose(upstream, self, state_leaves, kv_caches, input_ids, attn_metadata,
            last_token_indices, target_hidden_states, num_speculative_tokens,
            layer_name_to_kvcache_index, live_rows=None):
    """Eagle3Proposer._propose: the passes on the live rows, where a caller
    (speculative.fusion) may name how many; else `upstream`'s (its function, unjitted)."""
    live = on_live_rows(self, last_token_indices.shape[0], input_ids.shape[0], live_rows,
                        num_speculative_tokens)
    if not live:
        return upstream(self, state_leaves, kv_caches, input_ids, attn_metadata,
                        last_token_indices, target_hidden_states, num_speculative_tokens,
                        layer_name_to_kvcache_index)
    return propose_on_live_rows(self, state_leaves, kv_caches, input_ids, attn_metadata,
                                last_token_indices, target_hidden_states,
                                num_speculative_tokens, layer_name_to_kvcache_index, live)


def propose_jitted(upstream):
    """`propose` over `upstream`, jitted as Eagle3Proposer._propose is, without its
    xla_tpu_* options. Static both by position (the runner's calls) and by name
    (upstream's precompilation): given both, JAX maps neither to the other."""
    import jax
    return jax.jit(functools.partial(propose, upstream), donate_argnames=("kv_caches", ),
                   out_shardings=(None, None), static_argnums=(0, 7, 8),
                   static_argnames=("num_speculative_tokens", "layer_name_to_kvcache_index",
                                    "live_rows"))


def passes_on_live_rows() -> None:
    """Eagle3Proposer._propose is a jit, whose function speculative.fusion calls: ours
    is a jit too (`propose_jitted`), not a wrapper of the seam's."""
    from tpu_inference.spec_decode.jax.eagle3 import Eagle3Proposer
    Eagle3Proposer._propose = propose_jitted(Eagle3Proposer._propose.__wrapped__)


def on_live_rows(proposer, rows: int, tokens: int, live_rows, num_speculative_tokens) -> int:
    """The rows the draft's passes run on, or 0 where they run on every row (all are
    live, one draft token, another method, fixed draft positions, data parallelism)."""
    live = min(rows, tokens, live_rows or rows)
    if (live == rows or num_speculative_tokens == 1 or proposer.method != "eagle3"
            or proposer.constant_draft_positions or proposer.runner.dp_size > 1):
        return 0
    return live


def propose_on_live_rows(proposer, state_leaves, kv_caches, input_ids, attn_metadata,
                         last_token_indices, target_hidden_states, num_speculative_tokens,
                         layer_name_to_kvcache_index, live: int):
    """Eagle3Proposer._propose's passes on `live` rows: (kv_caches, drafts [rows, k])."""
    import jax.numpy as jnp

    self = proposer
    rows = last_token_indices.shape[0]
    last = last_token_indices[:live]
    if first_pass_on_rows_applies(self, attn_metadata):
        kv_caches, out, hidden = first_pass_on_rows(
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


def first_pass_on_rows_applies(proposer, attn_metadata) -> bool:
    """tpu-inference's one-layer Llama EAGLE-3 draft, one device, the portable attention
    (whose cache layout write_kv_cache writes), keys and values not quantized."""
    from tpu_inference.models.jax.llama_eagle3 import EagleLlama3ForCausalLM

    from tpu_models.host import attention_mode

    model = proposer.model
    return (isinstance(model, EagleLlama3ForCausalLM) and len(model.model.layers) == 1
            and proposer.mesh.size == 1 and attention_mode() == "portable"
            and not model.model.layers[0].self_attn.kv_cache_quantized_dtype
            and attn_metadata.input_positions.ndim == 1)


def first_pass_on_rows(proposer, state_leaves, kv_caches, input_ids, target_hidden, md, rows):
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


def logits_in_target_vocabulary(draft, hidden_states):
    """The draft's logits [T, target vocab], each draft id's at its target id and
    -inf elsewhere: tpu-inference's placement, as a gather (fed to its scatter,
    XLA:CPU computed the lm_head transposed in a naive loop)."""
    import jax.numpy as jnp
    logits = draft.lm_head(hidden_states)  # [T, draft vocab]
    draft_vocab = logits.shape[1]
    targets = jnp.arange(draft_vocab, dtype=jnp.int32) + draft.draft_id_to_target_id.value
    vocab = draft.vllm_config.model_config.get_vocab_size()
    draft_of = jnp.full((vocab, ), draft_vocab, jnp.int32).at[targets].set(
        jnp.arange(draft_vocab, dtype=jnp.int32))  # [vocab]; draft_vocab: none
    logits = jnp.pad(logits, ((0, 0), (0, 1)), constant_values=-jnp.inf)
    return logits[:, draft_of]  # [T, vocab]
