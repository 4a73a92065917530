"""EAGLE-3 draft checkpoints, in the layout vLLM's and tpu-inference's
Eagle3 Llama drafts read (`LlamaForCausalLMEagle3`).

One decoder layer ("midlayer") whose attention reads [norm(embed), norm(h)]
(twice the hidden width), `fc` folding the target's auxiliary hidden states
(three layers, concatenated) into h, and a head over a draft vocabulary that
`d2t` maps back onto the target's: target id = draft id + d2t[draft id]. The
draft has no embedding of its own; the engine lends it the target's.
"""

from pathlib import Path

import numpy as np

from tpu_models.loaders.exporter.convert import copy_side_files
from tpu_models.loaders.exporter.hf_writer import HfWriter

ARCHITECTURE = "LlamaForCausalLMEagle3"
AUX_FIELD = "eagle_aux_hidden_state_layer_ids"

# [out, in] as HF Linear weights; the symbols resolve in `shapes`.
TABLE = {
    "midlayer.input_layernorm.weight": ("hidden",),
    "midlayer.hidden_norm.weight": ("hidden",),
    "midlayer.self_attn.q_proj.weight": ("q_size", "twice_hidden"),
    "midlayer.self_attn.k_proj.weight": ("kv_size", "twice_hidden"),
    "midlayer.self_attn.v_proj.weight": ("kv_size", "twice_hidden"),
    "midlayer.self_attn.o_proj.weight": ("hidden", "q_size"),
    "midlayer.post_attention_layernorm.weight": ("hidden",),
    "midlayer.mlp.gate_proj.weight": ("intermediate", "hidden"),
    "midlayer.mlp.up_proj.weight": ("intermediate", "hidden"),
    "midlayer.mlp.down_proj.weight": ("hidden", "intermediate"),
    "fc.weight": ("hidden", "aux_hidden"),
    "norm.weight": ("hidden",),
    "lm_head.weight": ("draft_vocab", "hidden"),
    "d2t": ("draft_vocab",),
}


def draft_config(target: dict, *, aux_layers: tuple[int, ...], intermediate_size: int,
                 draft_vocab_size: int | None = None, dtype: str = "float32") -> dict:
    """config.json of a draft for the target whose config.json is `target`.
    Its width is the target's (it reads the target's embedding), and so is its
    attention's shape: its KV cache then pages like the target's, which vLLM
    needs to share one page pool between a hybrid target's groups and the draft's."""
    text = target.get("text_config", target)
    num_heads = text["num_attention_heads"]
    num_kv_heads = text.get("num_key_value_heads", num_heads)
    head_dim = text.get("head_dim") or text["hidden_size"] // num_heads
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": text["hidden_size"],
        "target_hidden_size": text["hidden_size"],
        "intermediate_size": intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": text.get("rms_norm_eps", 1e-6),
        "rope_theta": 10000.0,
        "max_position_embeddings": text.get("max_position_embeddings", 4096),
        "vocab_size": text["vocab_size"],
        "draft_vocab_size": draft_vocab_size or text["vocab_size"],
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        AUX_FIELD: list(aux_layers),
    }


def shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """TABLE with its dimensions resolved from a draft's config.json."""
    hidden = config["hidden_size"]
    dims = {
        "hidden": hidden, "twice_hidden": 2 * hidden,
        "aux_hidden": len(config[AUX_FIELD]) * config.get("target_hidden_size", hidden),
        "q_size": config["num_attention_heads"] * config["head_dim"],
        "kv_size": config["num_key_value_heads"] * config["head_dim"],
        "intermediate": config["intermediate_size"],
        "draft_vocab": config["draft_vocab_size"],
    }
    return {name: tuple(dims[d] for d in symbols) for name, symbols in TABLE.items()}


def write_draft(out: str | Path, config: dict, tensors: dict[str, np.ndarray], *,
                tokenizer: str | Path | None = None, overwrite: bool = False) -> Path:
    """Writes the draft checkpoint (safetensors + config.json, and the
    tokenizer files of the directory `tokenizer`), after checking `tensors`
    against TABLE; into a temporary directory renamed at the end."""
    expected = shapes(config)
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(f"EAGLE-3 draft tensors: missing {missing}, unexpected {unexpected}")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"EAGLE-3 draft tensor {name}: shape {tuple(tensors[name].shape)}, "
                             f"expected {shape} from its config")
    with HfWriter(out, overwrite=overwrite) as writer:
        for name in TABLE:
            tensor = np.asarray(tensors[name])
            writer.add(name, tensor.astype(np.int64) if name == "d2t" else tensor)
        writer.write_json("config.json", config)
        if tokenizer is not None:
            copy_side_files(Path(tokenizer), writer, skip=("config.json", "generation_config.json"))
    return writer.out

