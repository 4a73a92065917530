"""Drives a model the way tpu-inference's runner does, one ragged step at a time
(parity tests and the decode-step benchmark).

The model comes from tpu-inference's own get_model (the engine's loading path);
this harness only lays out a batch: token rows, positions, page tables, the
paged KV cache. Requests are laid out in the given order, pages at random.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from tpu_inference import envs
from tpu_inference.layers.common.attention_metadata import AttentionMetadata


def load_plugins():
    from vllm.plugins import load_general_plugins
    load_general_plugins()


class Stepper:

    def __init__(self, model_dir, *, dtype="float32", page_size=16, pages_per_seq=24,
                 max_seqs=8, num_devices=1, seed=0, **engine_args):
        load_plugins()
        from tpu_inference.models.common.model_loader import get_model
        from vllm.config import set_current_vllm_config
        from vllm.engine.arg_utils import EngineArgs

        self.vllm_config = EngineArgs(
            model=str(model_dir), dtype=dtype, max_model_len=page_size * pages_per_seq,
            tensor_parallel_size=num_devices, **engine_args).create_engine_config()
        # The worker sets up tpu-inference's (single-stage) pipeline group before
        # building a model; its built-in models ask it which stage they are.
        from tpu_inference.distributed import jax_parallel_state
        jax_parallel_state.init_pp_distributed_environment(
            "127.0.0.1", 0, 1, jax.devices()[0], need_pp=False)
        devices = np.array(jax.devices()[:num_devices]).reshape(1, num_devices)
        self.mesh = Mesh(devices, ("data", "model"))
        with set_current_vllm_config(self.vllm_config):
            self.interface = get_model(self.vllm_config, jax.random.PRNGKey(0), self.mesh)
        hf = self.vllm_config.model_config.hf_config
        self.num_layers = hf.num_hidden_layers
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        from tpu_models.attention import kv_cache_shape
        self.page_size, self.pages_per_seq, self.max_seqs = page_size, pages_per_seq, max_seqs
        num_pages = max_seqs * pages_per_seq + 1
        cache_dtype = jnp.dtype(self.vllm_config.model_config.dtype if dtype == "auto" else dtype)
        if self.vllm_config.cache_config.cache_dtype != "auto":  # e.g. kv_cache_dtype="fp8"
            from tpu_inference.utils import to_jax_dtype
            cache_dtype = to_jax_dtype(self.vllm_config.cache_config.cache_dtype)
        kv_heads = max(hf.num_key_value_heads, num_devices)
        shape = kv_cache_shape(num_pages, page_size, kv_heads, head_dim, cache_dtype)
        from jax.sharding import NamedSharding, PartitionSpec as P
        sharding = NamedSharding(self.mesh, P(None, None, "model", None, None))
        self.kv_caches = [jax.device_put(jnp.zeros(shape, cache_dtype), sharding)
                          for _ in range(self.num_layers)]
        self.page_order = np.random.default_rng(seed).permutation(num_pages - 1) + 1  # 0: padding
        # enable_lora=True: adapters in slots, as the engine keeps them (tpu_models.lora_slots)
        self.lora = None
        if self.vllm_config.lora_config is not None:
            self.lora = self.interface.model.adapter_slots(self.mesh)
        self.requests: dict[str, dict] = {}
        self.reset()

    def reset(self) -> None:
        """Forgets every request and frees their pages."""
        self.requests.clear()
        self.free_pages = list(self.page_order)

    def step(self, chunks: dict[str, list[int]], adapters: dict | None = None
             ) -> dict[str, np.ndarray]:
        """Feeds each request its next tokens in one batch; returns their logits [len, V].
        `adapters`: request -> its vLLM LoRARequest (absent: the base model)."""
        fns = self.interface
        args = self.prepare(chunks)
        if self.lora is not None:
            args = self.with_adapters(args, chunks, adapters or {})
        with jax.set_mesh(self.mesh):  # as the runner: quantized matmuls shard by it
            self.kv_caches, hidden, *_ = fns.model_fn(fns.state_leaves, self.kv_caches, *args)
            logits = np.asarray(fns.compute_logits_fn(fns.state_leaves, hidden), np.float32)
        out, row = {}, 0
        for name, tokens in chunks.items():
            out[name] = logits[row:row + len(tokens)]
            row += len(tokens)
        return out

    def with_adapters(self, args: tuple, chunks: dict[str, list[int]], adapters: dict) -> tuple:
        """`prepare`'s arguments for `chunks`, with the step's adapters in their slots
        as the model's LoRA argument; padding rows take the last request's, as the runner's."""
        from types import SimpleNamespace
        ids = []
        for name, tokens in chunks.items():
            ids += [adapters[name].lora_int_id if name in adapters else 0] * len(tokens)
        ids += ids[-1:] * (len(args[0]) - len(ids))
        wanted = list(dict.fromkeys(adapters[name] for name in chunks if name in adapters))
        self.lora.set_active_adapters(wanted, SimpleNamespace(index_mapping=ids))
        return args[:5] + (self.lora.batch(), ) + args[6:]  # CausalLM.__call__'s `lora`

    def prepare(self, chunks: dict[str, list[int]]) -> tuple:
        """The step function's arguments after the KV caches, for this batch; appends
        the tokens to their requests (allocating pages)."""
        ids, positions, cu, seq_lens, tables = [], [], [0], [], []
        for name, tokens in chunks.items():
            req = self.requests.setdefault(name, {"tokens": [], "pages": []})
            start = len(req["tokens"])
            req["tokens"] += list(tokens)
            while len(req["pages"]) * self.page_size < len(req["tokens"]):
                req["pages"].append(self.free_pages.pop())
            ids += list(tokens)
            positions += list(range(start, len(req["tokens"])))
            cu.append(len(ids))
            seq_lens.append(len(req["tokens"]))
            tables.append(req["pages"] + [0] * (self.pages_per_seq - len(req["pages"])))
        # The runner pads tokens to power-of-two buckets: a few compiled shapes serve all.
        num_tokens = max(envs.MIN_TOKEN_BUCKET, 1 << (len(ids) - 1).bit_length())
        pad = num_tokens - len(ids)
        num_reqs = len(chunks)
        decodes = sum(1 for t in chunks.values() if len(t) == 1)
        md = AttentionMetadata(
            input_positions=jnp.array(positions + [0] * pad, jnp.int32),
            block_tables=jnp.array(
                np.array(tables + [[0] * self.pages_per_seq] * (self.max_seqs - num_reqs)).reshape(-1),
                jnp.int32),
            seq_lens=jnp.array(seq_lens + [0] * (self.max_seqs - num_reqs), jnp.int32),
            query_start_loc=jnp.array(cu + [cu[-1]] * (self.max_seqs - num_reqs), jnp.int32),
            request_distribution=jnp.array([decodes, decodes, num_reqs], jnp.int32),
        )
        layer_map = tuple((f"layer.{i}", i) for i in range(self.num_layers))
        return (jnp.array(ids + [0] * pad, jnp.int32), md, None, None, layer_map, None, None,
                True, True)
