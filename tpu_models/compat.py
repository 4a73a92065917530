"""Everything tpu-inference 0.32.0 needs adapted, in one place.

Three kinds of adaptation, all written against TPU_INFERENCE_VERSION:

Host set-up (`setup_host`): before any vLLM or tpu-inference import, point JAX
at the host (JAX_PLATFORMS) and give tpu-inference a TPU identity, so it never
asks the cloud metadata server who it is. `tpu-models serve`, `bench` and the
tests all call it.

Host portability (`install`, off-TPU only). libtpu ships with tpu-inference, so
vLLM picks its TPU platform on any host; with JAX_PLATFORMS=cpu (or cuda) the
engine then runs on that JAX backend until one of tpu-inference's TPU-only
assumptions stops it (1-4), or, worse, lets it run and return wrong tokens (5):

1. the mesh sorts devices by `.coords`, which only TPU devices have;
2. memory sizing asks for TPU HBM (`hbm_usage_bytes`, `TpuPlatform.mem_get_info`,
   `get_device_name` raise "Expected TPU devices");
3. `xla_tpu_*` compiler options are baked into jitted functions, and XLA:CPU
   refuses unknown options;
4. tpu-inference's own models hard-code the Pallas TPU kernel (RPA v3): its
   backend is redirected to the portable kernel (our models pick the portable
   backend themselves, see `attention_backend`);
5. host->device transfers copy: the runner refills its host buffers while the
   previous step may still run, which on CPU (zero-copy) it would read.

It also lowers the smallest token bucket from 16 to 1 (tpu-inference's
MIN_TOKEN_BUCKET, unless set): a TPU computes a 16-row step for the price of
one, a CPU computes every padded row, so a lone decode paid 16x its matmuls.
For the same reason EAGLE-3's draft passes run on the step's possible live
requests rather than on every request slot (`_draft_passes_on_live_rows`).

Upstream fixes (`install`, every platform, TPU included): tpu-inference (and
vLLM-on-tpu-inference) bugs that give wrong results or errors.

Serving features (`install`, every platform): what tpu-inference's flax_nnx
path lacks for our models: a hybrid KV cache for sliding-window layers, guided
decoding beside speculative decoding, EAGLE-3 drafts under their published name
and in the served dtype, per-request LoRA adapters (--enable-lora).

tpu-inference's only extension points here are for models and attention
(register_model, register_attention_backend, used by tpu_models.plugin);
everything else is a patch, each in one function below, applied only to
TPU_INFERENCE_VERSION.
"""

import dataclasses
import glob
import importlib.metadata
import os
import sys

# The tpu-inference release every adaptation below was written against (and the
# bugs fixed were found in). On another version nothing is patched: off-TPU
# start-up refuses it, on TPU the fixes are skipped with a warning.
TPU_INFERENCE_VERSION = "0.32.0"
# tpu-inference reads these to describe the TPU slice; unset, it asks the cloud
# metadata server, which must never be contacted from a non-TPU host.
TPU_IDENTITY = {"TPU_ACCELERATOR_TYPE": "v6e-1", "TPU_NAME": "local", "TPU_WORKER_ID": "0"}
# Default KV-cache budget off-TPU, as a share of the host's available memory.
KV_CACHE_SHARE = 0.2
# --device values and the JAX platform each runs on (None: JAX's default, the TPU).
DEVICES = {"tpu": None, "cpu": "cpu", "gpu": "cuda"}

_installed = False


def _logger():
    # vLLM's logger, imported late: importing vllm before setup_host would pick
    # the platform (and query TPU metadata) too early.
    # tpu-inference's init_logger names it under "vllm.", whose handler prints it.
    from tpu_inference.logger import init_logger
    return init_logger("tpu_models.compat")


def has_tpu() -> bool:
    return bool(glob.glob("/dev/accel*")) or os.path.exists("/dev/vfio")


def jax_platform(device: str = "auto", env=os.environ) -> str | None:
    """The JAX_PLATFORMS value to run with; None keeps JAX's TPU default."""
    if device == "auto":
        if env.get("JAX_PLATFORMS"):
            return env["JAX_PLATFORMS"]
        return None if has_tpu() else "cpu"
    return DEVICES[device]


def setup_host(device: str = "auto", env=None) -> str | None:
    """Prepares `env` (default: this process's environment) to run the stack on
    `device`: JAX_PLATFORMS and, off-TPU, a TPU identity. Returns the platform
    (None on TPU). Call it before anything imports vllm or tpu_inference."""
    env = os.environ if env is None else env
    platform = jax_platform(device, env)
    if platform is not None:
        env["JAX_PLATFORMS"] = platform
        _set_tpu_identity(env)
        # vLLM's CLI spawns the engine core, which then imports vLLM, torch and
        # tpu-inference all over again (about 10 s here). Off-TPU the API server
        # never starts a JAX backend, so forking it is safe; tpu-inference also
        # needs fork for attention backends registered by plugins. On TPU the
        # API server may open the TPU, which a forked child could not reopen.
        env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "fork")
        # tpu-inference compiles its precompiled shapes one at a time (a TPU
        # host's CPUs are busy feeding it); XLA:CPU compiles are the start-up
        # here, and run in parallel on the host's cores (-15% cold on 2 cores).
        env.setdefault("NUM_PRECOMPILE_WORKERS", str(min(os.cpu_count() or 1, 8)))
    # tpu-inference keeps compilations in JAX's persistent cache (VLLM_XLA_CACHE_PATH),
    # which by default skips any that took under 1 s: most of ours off-TPU, and the
    # small ones on TPU, so a restart compiled them all again.
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    return platform


def _set_tpu_identity(env) -> None:
    for key, value in TPU_IDENTITY.items():
        env.setdefault(key, value)


def host_platform() -> str | None:
    """The non-TPU JAX platform requested via JAX_PLATFORMS, else None (TPU or default)."""
    platforms = [p.strip() for p in os.environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if not platforms or "tpu" in platforms:
        return None
    return platforms[0]


def install() -> None:
    """Applies the adaptations this host needs; run by tpu_models.plugin in every vLLM process."""
    global _installed
    if _installed:
        return
    version = importlib.metadata.version("tpu-inference")
    platform = host_platform()
    if version != TPU_INFERENCE_VERSION:
        if platform is not None:
            raise RuntimeError(
                f"tpu-models' compatibility layer was written for tpu-inference "
                f"{TPU_INFERENCE_VERSION}, found {version}; install "
                f"tpu-inference=={TPU_INFERENCE_VERSION} or run on a TPU host.")
        _logger().warning("tpu-models: tpu-inference %s, not %s: its fixes are not applied",
                          version, TPU_INFERENCE_VERSION)
        _installed = True
        return
    from tpu_models import logs
    logs.quiet()  # again, for plain `vllm serve` (tpu-models serve has them from the start)
    _grammar_rows_per_logits_row()
    _weight_loading_timed()
    _sliding_window_kv_cache_groups()
    _eagle3_drafts_by_their_published_name()
    _drafts_on_the_host()
    _engine_cleanup_of_torch_models_only()
    _drafts_in_the_served_dtype()
    _adapter_slots_for_our_models()
    _adapters_checked_before_loading()
    if platform is not None:
        _set_tpu_identity(os.environ)
        os.environ.setdefault("MIN_TOKEN_BUCKET", "1")
        _mesh_without_coords()
        _memory_from_host(platform)
        _no_tpu_compiler_options()
        _copy_host_inputs()
        _portable_default_attention()
        _draft_passes_on_live_rows()
        _draft_logits_gathered()
        _logger().info("tpu-models: running tpu-inference on JAX platform %r (compatibility "
                       "layer)", platform)
    _installed = True


def attention_backend(vllm_config):
    """The attention backend our models build: the one the engine is configured
    with on TPU, the portable kernel elsewhere (RPA's Pallas kernel needs a TPU)."""
    from tpu_inference.layers.common.attention_backend import (attention_backend_name,
                                                               create_attention_backend)
    name = attention_backend_name(vllm_config)
    if host_platform() is not None:
        from tpu_models.attention import PortableAttentionBackend
        name = PortableAttentionBackend.name
    return create_attention_backend(name)


# --- host portability (off-TPU) ---------------------------------------------


def _rebind(module_name: str, name: str, replacement) -> None:
    """Replaces module_name.name, and every tpu_inference module that imported it by name."""
    module = importlib.import_module(module_name)
    original = getattr(module, name)
    for mod_name, mod in list(sys.modules.items()):
        if mod_name.startswith("tpu_inference") and getattr(mod, name, None) is original:
            setattr(mod, name, replacement)


def _mesh_without_coords() -> None:
    """1. CPU/GPU devices have no `.coords`: lay them out in id order."""
    import numpy as np
    from jax.sharding import Mesh

    def make_mesh(axis_shapes, axis_names, *, devices=None):
        import jax
        devices = sorted(devices if devices is not None else jax.devices(), key=lambda d: d.id)
        return Mesh(np.asarray(devices).reshape(axis_shapes), axis_names)

    _rebind("tpu_inference.utils", "make_optimized_mesh", make_mesh)


def kv_cache_budget(cache_config) -> int:
    """Bytes for the KV cache: --kv-cache-memory-bytes, else a share of available memory."""
    if cache_config.kv_cache_memory_bytes:
        return int(cache_config.kv_cache_memory_bytes)
    import psutil
    return int(psutil.virtual_memory().available * KV_CACHE_SHARE)


def _memory_from_host(platform: str) -> None:
    """2. Size memory from host RAM; the KV cache gets an explicit budget."""
    import jax
    import psutil
    from tpu_inference.platforms.tpu_platform import TpuPlatform
    from tpu_inference.worker.tpu_worker import TPUWorker

    def usage(devices):
        # Live arrays per device against the host's RAM (devices share it).
        used = {}
        for array in jax.live_arrays():
            for shard in array.addressable_shards:
                used[shard.device] = used.get(shard.device, 0) + shard.data.nbytes
        total = psutil.virtual_memory().total
        return [(used.get(d, 0), total) for d in devices]

    def determine_available_memory(self) -> int:
        budget = kv_cache_budget(self.cache_config)
        if self.cache_config.kv_cache_memory_bytes:
            _logger().info("tpu-models: KV cache budget on this %s host: %.2f GiB", platform,
                           budget / 2**30)
        else:  # a guess: say how to choose
            _logger().warning("tpu-models: KV cache budget on this %s host: %.2f GiB, %d%% of "
                              "available memory (set it with --kv-cache-memory-bytes)", platform,
                              budget / 2**30, KV_CACHE_SHARE * 100)
        return budget

    def mem_get_info(cls):
        memory = psutil.virtual_memory()
        return memory.available, memory.total

    _rebind("tpu_inference.utils", "hbm_usage_bytes", usage)
    TPUWorker.determine_available_memory = determine_available_memory
    TpuPlatform.mem_get_info = classmethod(mem_get_info)
    TpuPlatform.get_device_name = classmethod(lambda cls, device_id=0: platform.upper())


def _no_tpu_compiler_options() -> None:
    """3. XLA off-TPU rejects xla_tpu_* options: compile without them."""
    import jax

    module = "tpu_inference.models.common.compiler_options"
    _rebind(module, "get_step_fn_compiler_options", lambda: {})
    _rebind(module, "get_sampling_compiler_options", lambda: {})
    # The sampler took its options when it was decorated, at import (before
    # plugins load): jit it again without them, with its own static arguments.
    sampling = importlib.import_module("tpu_inference.layers.jax.sample.sampling")
    _rebind(sampling.__name__, "sample",
            jax.jit(sampling.sample.__wrapped__,
                    static_argnames=["mesh", "allow_distributed_sampling"]))
    # So did the EAGLE-3 proposer's draft loop, with literal options: its
    # replacement (_draft_passes_on_live_rows) is jitted without them.


def _copy_host_inputs() -> None:
    """5. On CPU, device_put may alias a numpy buffer instead of copying it.

    The runner refills the same host buffers (positions, page tables, ...) for
    step N+1 while step N may still be running asynchronously; on TPU the
    transfer copies them to HBM, on CPU the step would read the new values.
    So every host array is copied first, and the copy is what the device reads.

    The copies then go over with the call jit hands its own numpy arguments to
    (shard_args), not jax.device_put: device_put's Python path costs about
    250 us for a tuple of 4 small arrays, shard_args 30 us, and a step puts
    8 to 18 arrays (served demo: off +24%, EAGLE-3 +12% output tok/s).
    shard_args is jaxlib's, not public API: the jax pinned by tpu-inference
    TPU_INFERENCE_VERSION has it; anything it does not take goes by device_put.
    """
    import jax
    import numpy as np
    from jax._src.lib import _jax
    from jax.sharding import NamedSharding, PartitionSpec, Sharding
    from tpu_inference import envs

    module = importlib.import_module("tpu_inference.layers.common.utils")
    original = module.general_device_put
    reuse = _jax.ArrayCopySemantics.REUSE_INPUT  # the copy below is ours alone

    def put_each(shardings, _layouts, _semantics, arrays):
        return [jax.device_put(x, s) for x, s in zip(arrays, shardings)]

    def copy(x):
        return np.array(x, dtype=jax.dtypes.canonicalize_dtype(x.dtype)) if isinstance(
            x, np.ndarray) else x

    def general_device_put(tensor, sharding, *, layout=None, source_mesh=None):
        leaves, tree = jax.tree.flatten(tensor)
        copies = [copy(x) for x in leaves]
        if layout is not None or envs.TPU_MULTIHOST_BACKEND == "ray":
            return original(jax.tree.unflatten(tree, copies), sharding, layout=layout,
                            source_mesh=source_mesh)
        if isinstance(sharding, PartitionSpec) and not (mesh := jax.sharding.get_mesh()).empty:
            sharding = NamedSharding(mesh, sharding)  # the mesh device_put reads a bare spec in
        if isinstance(sharding, Sharding):
            if all(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
                   and x.committed and x.sharding == sharding for x in leaves):
                return tensor  # already there: device_put's answer, without its Python path
            if all(isinstance(x, np.ndarray) for x in copies):
                n = len(copies)
                return jax.tree.unflatten(tree, _jax.shard_args(
                    [sharding] * n, [None] * n, [reuse] * n, copies, fallback=put_each))
        return jax.device_put(jax.tree.unflatten(tree, copies), sharding)

    _rebind(module.__name__, "general_device_put", general_device_put)


def _portable_default_attention() -> None:
    """4. tpu-inference's own models hard-code the default (RPA) backend, whose
    Pallas TPU kernel cannot run here: it runs the portable one instead."""
    from tpu_inference.layers.common.attention_backend import RPAAttentionBackend

    from tpu_models.attention import PortableAttentionBackend

    portable = PortableAttentionBackend()
    RPAAttentionBackend.get_kv_cache_shape = lambda self, *a: portable.get_kv_cache_shape(*a)
    RPAAttentionBackend.attention = lambda self, *a, **kw: portable.attention(*a, **kw)


def _draft_passes_on_live_rows() -> None:
    """EAGLE-3's draft runs its passes after the first on max_num_seqs rows.

    Each pass after the first drafts one token per request, but on every row
    of the batch's request padding (64 off-TPU, 256 by default): here each
    row costs its projections and logits, 4.5 ms a step at 64 rows against
    1.6 ms at 8, for one live request. Each request has at least one token in
    the step, so the step's token bucket bounds its live requests: the passes
    run on min(max_num_seqs, tokens) rows (one compiled program per token
    bucket, as before) and the drafts are padded back to every row. Jitted
    without the original's xla_tpu_* options (3).
    """
    import dataclasses as dc

    import jax
    import jax.numpy as jnp
    from tpu_inference.spec_decode.jax.eagle3 import Eagle3Proposer

    every_row = Eagle3Proposer._propose.__wrapped__

    def propose(self, state_leaves, kv_caches, input_ids, attn_metadata, last_token_indices,
                target_hidden_states, num_speculative_tokens, layer_name_to_kvcache_index):
        rows = last_token_indices.shape[0]
        live = min(rows, input_ids.shape[0])
        if (live == rows or num_speculative_tokens == 1 or self.method != "eagle3"
                or self.constant_draft_positions or self.runner.dp_size > 1):
            return every_row(self, state_leaves, kv_caches, input_ids, attn_metadata,
                             last_token_indices, target_hidden_states, num_speculative_tokens,
                             layer_name_to_kvcache_index)
        kv_caches, hidden, residual, _ = self.model_fn(
            state_leaves, kv_caches, input_ids, target_hidden_states, attn_metadata,
            layer_name_to_kvcache_index, spec_step_idx=0)
        positions, hidden, draft = self._select_inputs_for_loop_speculation(
            state_leaves, attn_metadata.input_positions, residual[0], hidden,
            last_token_indices[:live])
        pages = attn_metadata.block_tables.shape[0] // rows  # block_tables: [rows * pages]
        seq_lens, block_tables = attn_metadata.seq_lens[:live], attn_metadata.block_tables[:live * pages]
        drafts = [draft]  # each [live]
        for step in range(1, num_speculative_tokens):
            positions, clamped, seq_lens, starts, block_tables = (
                self._update_inputs_for_loop_speculation(positions, seq_lens, block_tables))
            attn_metadata = dc.replace(attn_metadata, input_positions=clamped, seq_lens=seq_lens,
                                       query_start_loc=starts, block_tables=block_tables)
            kv_caches, out, residual, _ = self.model_fn(
                state_leaves, kv_caches, drafts[-1], hidden, attn_metadata,
                layer_name_to_kvcache_index, spec_step_idx=step)
            hidden = residual[0]
            drafts.append(self._get_draft_token_ids(state_leaves, out))
        drafts = jnp.stack(drafts, axis=1)  # [live, k]
        return kv_caches, jnp.pad(drafts, ((0, rows - live), (0, 0)))

    Eagle3Proposer._propose = jax.jit(propose, donate_argnames=("kv_caches", ),
                                      out_shardings=(None, None), static_argnums=(0, 7, 8))


def _draft_logits_gathered() -> None:
    """EAGLE-3's draft places its logits into the target vocabulary with a scatter.

    Fed to that scatter, XLA:CPU computes the draft's lm_head transposed, in a
    naive loop: 0.3 ms a pass for 4 rows of the demo's 192x512 head, a third
    of the draft's time. The same placement as a gather (each target id reads
    its draft id's logit, or -inf) keeps the head a plain matmul.
    """
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


# --- upstream fixes (every platform) -------------------------------------------


def _grammar_rows_per_logits_row() -> None:
    """Guided decoding: give every logits row its own request's grammar bitmask row.

    vLLM sends one bitmask row per structured request and sampled position
    (1 + its draft tokens under speculative decoding), in
    GrammarOutput.structured_output_request_ids order. tpu-inference 0.32.0
    takes one row per request, walking the ids *sorted*: two concurrent guided
    requests could be masked by each other's grammar, and with draft tokens
    every request after the first got another request's rows (the scheduler
    then rejects the token and aborts the request: HTTP 500).

    Here each request's rows go to its logits rows: request i of the batch
    owns rows i + (draft tokens of the requests before it), drafts then the
    bonus token, as the runner lays out its spec-decode logits. The runner
    drops the scheduler output before masking, so sample_tokens hands the
    draft counts over first. With attention data parallelism the runner
    reorders rows per rank: tpu-inference's own mapping is kept there.
    """
    import numpy as np
    from tpu_inference.runner.structured_decoding_manager import StructuredDecodingManager
    from tpu_inference.runner.tpu_runner import TPUModelRunner
    from tpu_inference.utils import device_array

    original_sample = TPUModelRunner.sample_tokens
    original_prepare = StructuredDecodingManager.prepare_structured_decoding_input

    def sample_tokens(self, grammar_output):
        if grammar_output is not None and self.execute_model_state is not None:
            scheduled = self.execute_model_state.scheduler_output
            self.structured_decoding_manager.draft_tokens = {
                req_id: len(tokens)
                for req_id, tokens in scheduled.scheduled_spec_decode_tokens.items()}
        return original_sample(self, grammar_output)

    def prepare_structured_decoding_input(self, logits, grammar_output):
        if self.runner.vllm_config.sharding_config.total_dp_size > 1:
            return original_prepare(self, logits, grammar_output)
        drafts = getattr(self, "draft_tokens", {})
        first_row, row = {}, 0
        for req_id in self.runner.input_batch.req_ids:
            first_row[req_id] = row
            row += 1 + drafts.get(req_id, 0)
        rows = logits.shape[0]
        bitmask = np.zeros((rows, grammar_output.grammar_bitmask.shape[1]), np.int32)
        required = np.zeros((rows, 1), np.bool_)
        sent = 0  # rows of grammar_output.grammar_bitmask used so far
        for req_id in grammar_output.structured_output_request_ids:
            n = 1 + drafts.get(req_id, 0)
            if (first := first_row.get(req_id)) is not None:
                bitmask[first:first + n] = grammar_output.grammar_bitmask[sent:sent + n]
                required[first:first + n] = True
            sent += n
        return device_array(self.runner.mesh,
                            (required, bitmask, self.runner.structured_decode_arange))

    TPUModelRunner.sample_tokens = sample_tokens
    StructuredDecodingManager.prepare_structured_decoding_input = prepare_structured_decoding_input


def _drafts_on_the_host() -> None:
    """Guided decoding beside a JAX draft (EAGLE-3) under async scheduling.

    vLLM then checks each request's draft tokens against its grammar on the
    host, trimming the request's list in place
    (Scheduler.update_draft_token_ids_in_output); tpu-inference 0.32.0 hands
    them over as one device array, so the engine core died on the first
    guided request (AttributeError: __delitem__). vLLM asks for them only on
    that path, where it needs them on the host anyway.
    """
    import numpy as np
    from tpu_inference.runner.speculative_decoding_manager import SpeculativeDecodingManager

    original = SpeculativeDecodingManager.take_draft_token_ids

    def take_draft_token_ids(self):
        drafts = original(self)
        if drafts is None:
            return None
        ids = drafts.draft_token_ids  # a device array, or a list of its rows (and empty lists)
        ids = (np.asarray(ids).tolist() if hasattr(ids, "shape") else
               [row if isinstance(row, list) else np.asarray(row).tolist() for row in ids])
        return dataclasses.replace(drafts, draft_token_ids=ids)

    SpeculativeDecodingManager.take_draft_token_ids = take_draft_token_ids


def _drafts_in_the_served_dtype() -> None:
    """An EAGLE-3 draft computes in the served --dtype, as its target does.

    tpu-inference 0.32.0 builds its JAX EAGLE-3 draft with every layer computing
    in bfloat16, whatever --dtype says (its weights keep the checkpoint's
    dtype). Served in float32 off-TPU, the draft's matmuls ran in bfloat16,
    which XLA:CPU runs about 12x slower: most of the demo draft's time.
    """
    import jax.numpy as jnp
    from flax import nnx
    from tpu_inference.models.jax.llama_eagle3 import EagleLlama3ForCausalLM
    from tpu_inference.utils import to_jax_dtype

    original = EagleLlama3ForCausalLM.__init__

    def __init__(self, vllm_config, rng_key, mesh):
        original(self, vllm_config, rng_key, mesh)
        served = jnp.dtype(to_jax_dtype(vllm_config.model_config.dtype))
        for _, node in nnx.iter_graph(self):
            # the modules' computation dtype; param_dtype only shapes the
            # placeholders the checkpoint's tensors replace
            if isinstance(node, nnx.Module) and getattr(node, "dtype", None) == jnp.bfloat16:
                node.dtype = served

    EagleLlama3ForCausalLM.__init__ = __init__


def _eagle3_drafts_by_their_published_name() -> None:
    """EAGLE-3 drafts are published as `LlamaForCausalLMEagle3` (vLLM keeps the
    name); tpu-inference 0.32.0 registers its JAX draft only as
    `Eagle3LlamaForCausalLM`, so such a draft fell back to vLLM's PyTorch
    definition, which the JAX speculative-decoding path cannot drive."""
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


def _weight_loading_timed() -> None:
    """"Loading weights took N seconds": vLLM starts that clock when its own
    safetensors iterator is first read, which our models (reading the checkpoint
    themselves, tpu_models.runtime.load_checkpoint) never do, so it logged the
    host's uptime (e.g. 12436 s for 7.8 MB). Start it when loading starts."""
    import time

    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    original = DefaultModelLoader.load_weights

    def load_weights(self, model, model_config):
        if not self.counter_before_loading_weights:
            self.counter_before_loading_weights = time.perf_counter()
        return original(self, model, model_config)

    DefaultModelLoader.load_weights = load_weights


def _engine_cleanup_of_torch_models_only() -> None:
    """vllm.LLM in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) walks the runner's
    model as a torch module when the engine is collected (`model.modules()`, to
    drop torch.compile hooks). tpu-inference's runner holds a flax model, so
    every in-process run ended in an AttributeError traceback. Such a model
    has no torch hooks to drop."""
    from vllm.v1.engine.llm_engine import LLMEngine

    original = LLMEngine._cleanup_instance_caches

    def cleanup(model_ref):
        if hasattr(model_ref(), "modules"):
            original(model_ref)

    LLMEngine._cleanup_instance_caches = staticmethod(cleanup)


# --- serving features (every platform) -------------------------------------------


def _sliding_window_kv_cache_groups() -> None:
    """Sliding-window layers of our models declare their window to vLLM.

    tpu-inference 0.32.0 gives every flax_nnx layer a FullAttentionSpec, so a
    Gemma 3 local layer (window 512) keeps the whole context. With a
    SlidingWindowSpec, vLLM's hybrid KV cache manager puts local and global
    layers in separate groups sharing one page pool, frees pages that left the
    window, and the runner hands each layer its group's block table
    (GroupedAttentionMetadata) and its slot in the shared caches, which
    `Decoder` reads. --disable-hybrid-kv-cache-manager turns the specs back
    into full ones (vLLM's unify_hybrid_kv_cache_specs). tpu-inference's
    built-in models, and our models run through vLLM's PyTorch path, are
    left as they are.

    Allocation: vLLM overlays the groups (layer j of every group at the same
    bytes; block ids are never owned by two groups at once). tpu-inference
    0.32.0 overlays them only when a group has more than one layer; with one
    layer per group (e.g. 5 local + 1 global layers) it would allocate every
    group the whole pool, more memory than vLLM budgeted. So the tensors are
    handed to it as one per overlaid position, which it allocates once.
    """
    from tpu_inference.runner.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    original = KVCacheManager.get_kv_cache_spec
    original_initialize = KVCacheManager.initialize_kv_cache

    def get_kv_cache_spec(self):
        specs = original(self)
        model_class = _our_flax_model(self.runner.vllm_config)
        if model_class is None:
            return specs
        windows = model_class.sliding_windows(self.runner.model_config.hf_text_config)
        for i, window in enumerate(windows):
            spec = specs.get(f"layer.{i}")
            if window is not None and type(spec) is FullAttentionSpec:
                specs[f"layer.{i}"] = self._create_attention_spec(
                    spec.block_size, spec.num_kv_heads, spec.head_size, sliding_window=window)
        return specs

    def initialize_kv_cache(self, kv_cache_config):
        if (len(kv_cache_config.kv_cache_groups) > 1
                and _our_flax_model(self.runner.vllm_config) is not None):
            kv_cache_config = dataclasses.replace(
                kv_cache_config, kv_cache_tensors=_overlaid_tensors(kv_cache_config))
        return original_initialize(self, kv_cache_config)

    KVCacheManager.get_kv_cache_spec = get_kv_cache_spec
    KVCacheManager.initialize_kv_cache = initialize_kv_cache


def _overlaid_tensors(kv_cache_config) -> list:
    """One KVCacheTensor per byte position, listing the layers (one per group)
    vLLM places there: tpu-inference allocates each such tensor once, shared."""
    from vllm.v1.kv_cache_interface import KVCacheTensor

    layers_at: dict[int, list[str]] = {}
    size = {}
    for tensor in kv_cache_config.kv_cache_tensors:
        for j, name in enumerate(tensor.layers):
            position = tensor.offset + j * tensor.layer_stride
            layers_at.setdefault(position, []).append(name)
            size[position] = tensor.size // len(tensor.layers)  # one layer's pages
    return [KVCacheTensor(size=size[position], layers=names, layer_stride=0, block_stride=0)
            for position, names in sorted(layers_at.items())]


def _adapter_slots_for_our_models() -> None:
    """--enable-lora on our models (tpu_models.lora).

    tpu-inference 0.32.0 builds a LoRA manager only for PyTorch models: its
    flax_nnx loader returns none, so the warm-up stopped at "LoRA is not
    enabled", and its LoraUtils reads a torch Punica wrapper. Here the runner
    gets our AdapterSlots as its lora_manager (vLLM's LoRA mixin then loads,
    pins and activates adapters through it), each step's tokens are mapped onto
    slots, and the model is handed the slots (the `lora_metadata` argument).
    compute_logits takes none: the vocab projection is no target, and the
    step's per-token slots would give it a new shape to compile per batch.
    """
    import numpy as np
    from tpu_inference.runner.lora_utils import LoraUtils
    from tpu_inference.runner.tpu_runner import TPUModelRunner

    from tpu_models.lora import AdapterSlots

    original_load = TPUModelRunner.load_model
    original_set_active = LoraUtils.set_active_loras
    original_extract = LoraUtils.extract_lora_metadata

    def load_model(self, *args, **kwargs):
        original_load(self, *args, **kwargs)
        if self.lora_config is not None and _our_flax_model(self.vllm_config) is not None:
            self.lora_manager = self.model.adapter_slots(self.mesh)
            self.compute_logits_fn = _WithoutLora(self.compute_logits_fn)

    def set_active_loras(self, num_scheduled_tokens_per_req, total, padded_total):
        if not isinstance(getattr(self.runner, "lora_manager", None), AdapterSlots):
            return original_set_active(self, num_scheduled_tokens_per_req, total, padded_total)
        counts = np.copy(num_scheduled_tokens_per_req)
        counts[-1] += padded_total - total  # padding rows: the last request's adapter
        prompt, tokens, requests = self.runner.input_batch.make_lora_inputs(counts)
        self.runner._set_active_loras(prompt, tokens, requests)

    def extract_lora_metadata(self):
        manager = getattr(self.runner, "lora_manager", None)
        if isinstance(manager, AdapterSlots):
            return manager.batch()
        return original_extract(self)

    TPUModelRunner.load_model = load_model
    LoraUtils.set_active_loras = set_active_loras
    LoraUtils.extract_lora_metadata = extract_lora_metadata


class _WithoutLora:
    """A jitted compute_logits called without the step's LoRA batch (the runner's
    warm-up lowers it, hence `lower`)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, state, hidden, _lora=None, **kwargs):
        return self.fn(state, hidden, None, **kwargs)

    def lower(self, state, hidden, _lora=None, **kwargs):
        return self.fn.lower(state, hidden, None, **kwargs)


def _adapters_checked_before_loading() -> None:
    """/v1/load_lora_adapter (and each --lora-modules entry) on our models: read
    and check the adapter in the API server first, so a bad one gets a 400
    naming it and the fault. vLLM answers any failure inside the engine with a
    500 InternalServerError."""
    from http import HTTPStatus

    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.entrypoints.serve import create_error_response

    from tpu_models.lora import AdapterError, read_adapter

    original = OpenAIServingModels._check_load_lora_adapter_request

    async def check(self, request):
        refused = await original(self, request)
        if refused is not None:
            return refused
        vllm_config = self.engine_client.vllm_config
        model_class = _our_flax_model(vllm_config)
        if model_class is None or vllm_config.lora_config is None:
            return None
        table = model_class.checkpoint_table(self.model_config.hf_text_config)
        try:
            read_adapter(request.lora_name, request.lora_path, base_table=table,
                         max_rank=vllm_config.lora_config.max_lora_rank)
        except AdapterError as e:
            return create_error_response(message=str(e), err_type="BadRequestError",
                                         status_code=HTTPStatus.BAD_REQUEST)
        return None

    OpenAIServingModels._check_load_lora_adapter_request = check


def _our_flax_model(vllm_config):
    """The tpu_models class the engine runs for this model on the flax_nnx path, else None."""
    if vllm_config.compilation_config.static_forward_context:
        return None  # vLLM's PyTorch model (MODEL_IMPL_TYPE=vllm): its layers declare themselves
    from tpu_inference.models.common.model_loader import _MODEL_REGISTRY

    from tpu_models.decoder import CausalLM
    for name in vllm_config.model_config.architectures or ():
        model_class = _MODEL_REGISTRY.get(name)
        if isinstance(model_class, type) and issubclass(model_class, CausalLM):
            return model_class
    return None
