"""Name/shape tables of HF decoder checkpoints, and the checks made against them.

A table is literal, `{i}` standing for the layer index and symbolic dimensions
resolved from config.json. Each architecture composes its table from the
pieces here (tpu_models/<arch>/checkpoints.py). The loader checks a checkpoint
against its table before reading a weight; the exporters write exactly these
names.
"""

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tpu_models.loaders.hf import CheckpointError, tensor_problems

# The HF decoder tensors our architectures share, `{i}` the layer (HF Linear
# weights are [out, in]); each architecture's table (tpu_models/<arch>/checkpoints.py)
# is these plus its own.
EMBEDDING_AND_NORM = {
    "model.embed_tokens.weight": ("vocab", "hidden"),
    "model.norm.weight": ("hidden",),
}
ATTENTION = {
    "model.layers.{i}.self_attn.q_proj.weight": ("q_size", "hidden"),
    "model.layers.{i}.self_attn.k_proj.weight": ("kv_size", "hidden"),
    "model.layers.{i}.self_attn.v_proj.weight": ("kv_size", "hidden"),
    "model.layers.{i}.self_attn.o_proj.weight": ("hidden", "q_size"),
    "model.layers.{i}.self_attn.q_norm.weight": ("head_dim",),
    "model.layers.{i}.self_attn.k_norm.weight": ("head_dim",),
}
ATTENTION_BIAS = {
    "model.layers.{i}.self_attn.q_proj.bias": ("q_size",),
    "model.layers.{i}.self_attn.k_proj.bias": ("kv_size",),
    "model.layers.{i}.self_attn.v_proj.bias": ("kv_size",),
    "model.layers.{i}.self_attn.o_proj.bias": ("hidden",),
}
MLP = {
    "model.layers.{i}.mlp.gate_proj.weight": ("intermediate", "hidden"),
    "model.layers.{i}.mlp.up_proj.weight": ("intermediate", "hidden"),
    "model.layers.{i}.mlp.down_proj.weight": ("hidden", "intermediate"),
}
UNTIED_HEAD = {"lm_head.weight": ("vocab", "hidden")}

# LoRA can target these projections; the merge looks them up here.
PROJECTIONS = {
    "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
    "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
}


def dims(config: Any) -> dict[str, int]:
    """Symbolic dimensions of a decoder config (HF config object or config.json dict)."""
    get = config.get if isinstance(config, Mapping) else lambda k, d=None: getattr(config, k, d)
    heads, hidden = get("num_attention_heads"), get("hidden_size")
    head_dim = get("head_dim") or hidden // heads
    return {
        "vocab": get("vocab_size"),
        "hidden": hidden,
        "intermediate": get("intermediate_size"),
        "head_dim": head_dim,
        "q_size": heads * head_dim,
        "kv_size": get("num_key_value_heads", heads) * head_dim,
    }


def resolve(table: Mapping[str, tuple], num_layers: int | None, sizes: Mapping[str, int]
            ) -> dict[str, tuple[int, ...]]:
    """Expands `{i}` over layers and symbolic dimensions into concrete shapes."""
    out = {}
    for name, shape in table.items():
        concrete = tuple(sizes[d] for d in shape)
        if "{i}" in name:
            out.update({name.format(i=i): concrete for i in range(num_layers)})
        else:
            out[name] = concrete
    return out


def _get(config, key, default=None):
    return config.get(key, default) if isinstance(config, Mapping) else getattr(config, key, default)


def decoder_table(config: Any, layer: Mapping[str, tuple], *, tied: bool | None = None,
                  extra: Mapping[str, tuple] | None = None
                  ) -> tuple[dict[str, tuple[int, ...]], tuple[str, ...]]:
    """(name -> shape, optional names) of a decoder checkpoint: embedding and final
    norm, `layer` per layer (biases when config.json says so), lm_head unless
    tied (then an lm_head copy may be present), and `extra` tensors. `tied`
    None: config.json's tie_word_embeddings."""
    if tied is None:
        tied = bool(_get(config, "tie_word_embeddings", False))
    table = {**EMBEDDING_AND_NORM, **layer, **(extra or {})}
    if _get(config, "attention_bias", False):
        table.update(ATTENTION_BIAS)
    if not tied:
        table.update(UNTIED_HEAD)
    optional = ("lm_head.weight", ) if tied else ()
    return resolve(table, _get(config, "num_hidden_layers"), dims(config)), optional


# config.json fields that size the tensors. transformers fills a missing one with
# its own default (32 layers, hidden 4096, ...), so each must be there.
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                   "num_attention_heads")
SIZE_FIELDS = (*REQUIRED_FIELDS, "num_key_value_heads", "head_dim")


def read_config(directory: str | Path) -> tuple[dict, Path]:
    """(config.json as written, its path), checked by `check_config`."""
    path = Path(directory) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e})") from e
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    check_config(raw, path)
    return raw, path


def check_config(raw: Any, path: str | Path) -> None:
    """Refuses a config.json whose size fields are missing or not positive integers."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    fields = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    problems = []
    for field in SIZE_FIELDS:
        value = fields.get(field)
        if value is None:
            if field in REQUIRED_FIELDS:
                problems.append(f"no {field!r} field")
        elif not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            problems.append(f"{field}={json.dumps(value)} is not a positive integer")
    heads, kv_heads = fields.get("num_attention_heads"), fields.get("num_key_value_heads")
    if not problems and kv_heads and heads % kv_heads:
        problems.append(f"num_attention_heads={heads} is not a multiple of "
                        f"num_key_value_heads={kv_heads}")
    if problems:
        raise CheckpointError(f"{path}: " + "; ".join(problems))


def config_disagreements(config: Any, raw: Mapping, found: Mapping[str, tuple[tuple, str]]
                         ) -> list[str]:
    """The size fields of `config` that the tensors contradict, each naming a tensor that does.

    found: name -> (shape, file); raw: config.json as written (to tell defaults apart)."""
    sizes = dims(config)
    out = []

    def said(field):
        default = "" if field in raw else " (not in config.json: transformers' default)"
        return f"{field}={_get(config, field)}{default}"

    def compare(field, want, tensor, axis, unit):
        if tensor not in found or len(found[tensor][0]) <= axis:
            return None
        got = found[tensor][0][axis]
        if got != want:
            out.append(f"{said(field)} but {tensor} in {found[tensor][1]} has {got} {unit}")
        return got

    compare("vocab_size", sizes["vocab"], "model.embed_tokens.weight", 0, "rows")
    compare("hidden_size", sizes["hidden"], "model.embed_tokens.weight", 1, "columns")
    compare("intermediate_size", sizes["intermediate"], "model.layers.0.mlp.gate_proj.weight", 0,
            "rows")
    head_dim = compare("head_dim", sizes["head_dim"], "model.layers.0.self_attn.q_norm.weight",
                       0, "entries") or sizes["head_dim"]
    heads = _get(config, "num_attention_heads")
    for field, proj, want in (("num_attention_heads", "q_proj", heads),
                              ("num_key_value_heads", "k_proj",
                               _get(config, "num_key_value_heads") or heads)):
        tensor = f"model.layers.0.self_attn.{proj}.weight"
        if tensor in found and head_dim and found[tensor][0][0] != want * head_dim:
            rows = found[tensor][0][0]
            out.append(f"{said(field)} but {tensor} in {found[tensor][1]} has {rows} rows "
                       f"({rows / head_dim:g} heads of head_dim {head_dim})")
    layers = {int(m[1]) for name in found if (m := re.match(r"model\.layers\.(\d+)\.", name))}
    if layers and max(layers) + 1 != _get(config, "num_hidden_layers"):
        out.append(f"{said('num_hidden_layers')} but the checkpoint holds model.layers.0 .. "
                   f"model.layers.{max(layers)}")
    return out


def check_checkpoint(checkpoint, config: Any, table: Mapping[str, tuple[int, ...]], *,
                     optional=()) -> None:
    """Checks an HfCheckpoint against config.json and the name/shape table.

    A missing or mistyped size field names config.json and the field; tensors
    that contradict config.json name both the field and the tensor, then list
    the tensor problems that follow from it."""
    raw, path = read_config(checkpoint.directory)
    source = checkpoint.source  # object storage: config.json was pulled into `directory`
    if source != checkpoint.directory:
        path = f"{source}/config.json"
    found = {n: (i.shape, i.file.name) for n, i in checkpoint.tensors.items()}
    problems = tensor_problems(found, table, optional=optional)
    if not problems:
        return
    blame = config_disagreements(config, raw.get("text_config") or raw, found)
    if not blame:
        raise CheckpointError(f"{source}: " + "; ".join(problems))
    more = f"; ... and {len(problems) - 6} more" if len(problems) > 6 else ""
    raise CheckpointError(f"{path} disagrees with the tensors: " + "; ".join(blame) +
                          ". Hence: " + "; ".join(problems[:6]) + more)
