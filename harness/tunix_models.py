"""Tunix Gemma 3 trainers of a given shape, with decisive random weights, and the HF
directory vLLM reads for one (its weights come from the trainer): what the tests and
the benchmark of tpu_models.tunix roll out. Needs google-tunix (the [tunix] extra)."""

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from tpu_models.harness.random_checkpoints import word_tokenizer

SHAPES = {
    # Two KV heads, a window of 8 (shorter than the prompts), five local layers and a global one.
    "tiny": dict(num_layers=6, num_embed=384, embed_dim=64, hidden_dim=128, num_heads=4,
                 head_dim=32, num_kv_heads=2, sliding_window_size=8),
    # Tunix's ModelConfig.gemma3_1b(): 26 layers, one KV head, window 512, vocabulary 262,144.
    "gemma3-1b": dict(num_layers=26, num_embed=262_144, embed_dim=1152, hidden_dim=6912,
                      num_heads=4, head_dim=256, num_kv_heads=1, sliding_window_size=512),
}
LORA_TARGETS = ".*q_einsum|.*kv_einsum|.*attn_vec_einsum|.*gate_proj|.*up_proj|.*down_proj"


def config(shape: str, dtype=jnp.float32, **overrides):
    from tunix.models.gemma3 import model as gemma3_lib
    return gemma3_lib.ModelConfig(**{**SHAPES[shape], **overrides}, local_base_frequency=10_000,
                                  global_base_frequency=1_000_000, param_dtype=dtype)


def mesh(tensor_parallel: int = 1):
    """The trainer's mesh, as Tunix's models name its axes: (fsdp 1, tp N), axes Auto."""
    import jax
    devices = np.array(jax.devices()[:tensor_parallel]).reshape(1, tensor_parallel)
    return jax.sharding.Mesh(devices, ("fsdp", "tp"),
                             axis_types=(jax.sharding.AxisType.Auto, ) * 2)


def hf_config(cfg, eos: int) -> dict:
    """The HF config.json of a Tunix Gemma 3 (Tunix's conventions are HF's: Tunix
    layouts in tpu_models/gemma3/checkpoints.py)."""
    rope = {"sliding_attention": float(cfg.local_base_frequency),
            "full_attention": float(cfg.global_base_frequency)}
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "dtype": str(jnp.dtype(cfg.param_dtype)), "vocab_size": cfg.num_embed,
        "hidden_size": cfg.embed_dim, "intermediate_size": cfg.hidden_dim,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "query_pre_attn_scalar": cfg.head_dim, "sliding_window": cfg.sliding_window_size,
        "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 32768, "tie_word_embeddings": True,
        "final_logit_softcapping": None, "attn_logit_softcapping": None,
        "eos_token_id": eos, "pad_token_id": eos,
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                        for i in range(cfg.num_layers)],
        "rope_parameters": {kind: {"rope_type": "default", "rope_theta": theta}
                            for kind, theta in rope.items()}}


def model_directory(cfg, directory: Path):
    """config.json and a word tokenizer (t2, t3, ... ; </s> ends) for `cfg`; the tokenizer."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = word_tokenizer(cfg.num_embed)
    tokenizer.save_pretrained(directory)
    (directory / "config.json").write_text(json.dumps(hf_config(cfg, tokenizer.eos_token_id)))
    return tokenizer


def build(cfg, seed: int = 0, mesh=None):
    """A Tunix Gemma 3 with decisive random weights (Tunix zero-initialises MLPs and
    norms): embeddings small beside the blocks' outputs, so that replies are not the
    last token repeated. On `mesh`, sharded by its own partition specs (as Tunix's
    trainers place it; qwix LoRA then shards A and B alike)."""
    import jax
    from tunix.models.gemma3 import model as gemma3_lib
    model = gemma3_lib.Gemma3(cfg, rngs=nnx.Rngs(params=seed))
    randomize(model, seed + 1)
    if mesh is not None:
        state = nnx.state(model)
        nnx.update(model, jax.tree.map(
            lambda x, spec: jax.device_put(x, jax.sharding.NamedSharding(mesh, spec)),
            state, nnx.get_partition_spec(state)))
    return model


def randomize(model, seed: int, kind=nnx.Param) -> None:
    rng = np.random.default_rng(seed)
    for path, var in nnx.to_flat_state(nnx.state(model, kind)):
        name, shape = "/".join(map(str, path)), var.get_value().shape
        std = (0.05 if "embedding" in name else 0.2 if name.endswith("scale") else
               0.1 if "_lora_" in name else 1 / np.sqrt(shape[-2] if len(shape) > 1 else 64))
        var.set_value(jnp.asarray(rng.normal(0, std, shape), var.get_value().dtype))


def with_lora(model, rank: int, alpha: float, seed: int = 2):
    """qwix LoRA on every projection, as Tunix's LoRA examples apply it, A and B random."""
    import qwix

    import tpu_models.tunix  # noqa: F401  (its seam: qwix LoRA keeps Tunix's pytree mode)
    provider = qwix.LoraProvider(module_path=LORA_TARGETS, rank=rank, alpha=alpha)
    lora = qwix.apply_lora_to_model(model, provider, **model.get_model_input())
    randomize(lora, seed, nnx.LoRAParam)
    return lora


def perturb(model, seed: int, kind=nnx.Param) -> None:
    """One 'optimizer step': every weight of `kind` moved by noise."""
    rng = np.random.default_rng(seed)
    for _, var in nnx.to_flat_state(nnx.state(model, kind)):
        value = var.get_value()
        var.set_value(value + jnp.asarray(rng.normal(0, 0.05, value.shape), value.dtype))


def prompts(lengths, vocab_size: int, seed: int = 0) -> list[str]:
    """Prompts of the word tokenizer, `lengths` words each (no special token)."""
    rng = np.random.default_rng(seed)
    return [" ".join(f"t{i}" for i in rng.integers(2, vocab_size, n)) for n in lengths]

