"""Offline conversions that end in an HF checkpoint directory (or gs:// prefix).

Each takes the architecture's registry entry (`arch`: its HF table, MaxText and
Tunix mappings; see tpu_models/registry.py), looked up by the caller: loaders
know checkpoint formats, not architectures. MaxText and Tunix checkpoints are
read from a local directory or gs://; every other input is a local directory.
"""

import json
from pathlib import Path

import numpy as np

from tpu_models.loaders.hf import CheckpointError, HfCheckpoint, check_tensors
from tpu_models.loaders.exporter.hf_writer import HfWriter, check_out
from tpu_models.loaders.peft import LoraAdapter
from tpu_models.loaders.conversion_rules import Rule
from tpu_models.loaders.tables import check_checkpoint, check_config, read_config

# Files that travel with the weights (config, generation defaults, tokenizer).
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "tokenizer.model", "special_tokens_map.json", "chat_template.jinja",
              "chat_template.json", "added_tokens.json", "vocab.json", "merges.txt")


def copy_side_files(source: Path, writer: HfWriter, skip: tuple[str, ...] = ()) -> None:
    """The SIDE_FILES `source` has, but `skip` (files the writer writes itself)."""
    for name in SIDE_FILES:
        if name not in skip and (source / name).exists():
            writer.copy_file(source / name)


def _local(path: str | Path, what: str) -> Path:
    if "://" in str(path):
        raise CheckpointError(f"{path}: {what} is read from a local directory (from gs://: "
                              "MaxText and Tunix checkpoints only, so far)")
    return Path(path)


def _written(out: str | Path) -> Path | str:
    """What an export returns: the local path, or the gs:// URI."""
    return str(out).rstrip("/") if "://" in str(out) else Path(out)


def lora_merge(base: str | Path, adapter_dir: str | Path, out: str | Path, *, arch,
               overwrite: bool = False) -> Path | str:
    """Writes base + LoRA adapter, merged, as a new HF checkpoint at `out`."""
    check_out(out, overwrite)
    base = _local(base, "the base checkpoint")
    adapter_dir = _local(adapter_dir, "the adapter")
    if not (base / "config.json").exists():
        raise CheckpointError(f"{base}: no config.json")
    config, _ = read_config(base)
    table, optional = arch.hf_table(config)
    checkpoint = HfCheckpoint(base)
    check_checkpoint(checkpoint, config, table, optional=optional)
    adapter = LoraAdapter(adapter_dir)
    adapter.check_base(table)
    with HfWriter(out, overwrite=overwrite, source=f"{base} + {adapter_dir}") as writer:
        writer.add_all(adapter.merge(checkpoint.iter_tensors()))
        copy_side_files(base, writer)
    return _written(out)


def text_only(source: str | Path, out: str | Path, *, arch, overwrite: bool = False
              ) -> Path | str:
    """Extracts the language model of a multimodal checkpoint (`arch.multimodal`: where
    its tensors are, its text config) as a text-only `arch` checkpoint, same weights."""
    check_out(out, overwrite)
    source, multimodal = _local(source, "a multimodal checkpoint"), arch.multimodal
    checkpoint = HfCheckpoint(source)
    renames, unknown = {}, []
    for name in checkpoint.tensors:
        prefix = next((p for p in multimodal.text_prefixes if name.startswith(p)), None)
        if prefix is not None:
            renames[name] = "model." + name[len(prefix):]
        elif not name.startswith(multimodal.dropped_prefixes) and name not in multimodal.dropped:
            unknown.append(name)
    if unknown:
        raise CheckpointError(f"{source}: tensors outside the language model and the parts "
                              f"left out: {unknown[:5]}")
    config = {**multimodal.text_config(str(source)), "architectures": [arch.hf_name]}
    check_tensors({new: (checkpoint.tensors[old].shape, checkpoint.tensors[old].file.name)
                   for old, new in renames.items()}, arch.hf_table(config)[0], where=str(source))
    with HfWriter(out, overwrite=overwrite, source=str(source)) as writer:
        writer.add_all((renames[name], t) for name, t in checkpoint.iter_tensors() if name in renames)
        writer.write_json("config.json", config)
        copy_side_files(source, writer, skip=("config.json", ))
    return _written(out)


def plan_export(shape_of, leaves: set[str], rules: dict, table: dict, *, where: str,
                optional: tuple = ()) -> list[tuple[str, Rule]]:
    """Checks, from metadata alone, that `rules` turn the source leaves into exactly
    the HF tensors of `table`: returns [(hf_name, rule)] or raises naming the fault."""
    import jax
    import numpy as np

    plan, used, problems = [], set(), []
    for name, want in table.items():
        rule = rules.get(name)
        if rule is None:
            if name not in optional:
                problems.append(f"no source for HF tensor {name}")
            continue
        if rule.source not in leaves:
            problems.append(f"missing tensor {rule.source} (for {name})")
            continue
        used.add(rule.source)
        source = jax.ShapeDtypeStruct(shape_of(rule.source), np.float32)
        try:
            got = tuple(jax.eval_shape(rule.to_hf_array, source).shape)
        except Exception as e:  # einops/indexing refuse an impossible layout
            problems.append(f"tensor {rule.source} {list(source.shape)} cannot become {name} ({e})")
            continue
        if got != tuple(want):
            problems.append(f"tensor {rule.source} {list(source.shape)} gives {name} of shape "
                            f"{list(got)}, config.json implies {list(want)}")
            continue
        plan.append((name, rule))
    if unexpected := sorted(leaves - used):
        problems.append(f"unexpected tensors (more layers than config.json says? another "
                        f"model?): {unexpected[:6]}{' ...' if len(unexpected) > 6 else ''}")
    if problems:
        more = f"; ... and {len(problems) - 8} more" if len(problems) > 8 else ""
        raise CheckpointError(f"{where}: " + "; ".join(problems[:8]) + more)
    return plan


def _planned(source, plan, table, dtype: str | None):
    """Each HF tensor's dtype (its source leaf's, unless cast to `dtype`) and the
    writer's plan: [(name, bytes)] in `plan`'s order, known before a byte is read."""
    dtypes = {name: _dtype(dtype) if dtype else source.orbax.leaves[source.leaves[rule.source]][1]
              for name, rule in plan}
    return dtypes, [(name, int(np.prod(table[name])) * dtypes[name].itemsize) for name, _ in plan]


def _dtype(name: str) -> np.dtype:
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)




def _config_with_dtype(config: dict, dtype: str | None) -> dict:
    return config if dtype is None else {**config, "dtype": dtype, "torch_dtype": dtype}


def tunix(checkpoint: str | Path, base: str | Path, out: str | Path, *, arch,
          lora_alpha: float | None = None, adapter_only: bool = False,
          dtype: str | None = None, overwrite: bool = False, progress=None) -> Path | str:
    """A Tunix checkpoint (local or gs://) as an HF checkpoint (config and tokenizer
    from `base`).

    Full weights are converted; LoRA-only states are merged into `base` with
    alpha / rank, or written as a PEFT adapter with `adapter_only`.
    """
    check_out(out, overwrite)
    from tpu_models.loaders.tunix import TunixCheckpoint

    base = _local(base, "--base")
    config = json.loads((base / "config.json").read_text()) if (base / "config.json").exists() \
        else None
    if config is None:
        raise CheckpointError(f"{base}: no config.json (the HF checkpoint the run started from)")
    check_config(config, base / "config.json")
    if arch.tunix is None:
        raise CheckpointError(f"{base}/config.json: {arch.hf_name} has no Tunix layout")
    table, optional = arch.hf_table(config)
    source = TunixCheckpoint(checkpoint)
    source.check_family(arch.tunix, arch.hf_name)
    where = str(source.orbax.item)

    if not source.is_lora:
        if adapter_only:
            raise CheckpointError(f"{where}: --adapter-only needs a LoRA checkpoint; this one "
                                  "holds full weights")
        _tunix_weights(source, checkpoint, base, out, arch=arch, config=config, table=table,
                       optional=optional, dtype=dtype, overwrite=overwrite, progress=progress)
        return _written(out)

    alpha = lora_alpha if lora_alpha is not None else _alpha_from_metadata(source)
    adapter = _tunix_adapter(source, base, arch, alpha, where)
    adapter.check_base(table)
    if adapter_only:
        adapter.save(out, overwrite=overwrite)
        return _written(out)
    checkpoint_base = HfCheckpoint(base)
    check_checkpoint(checkpoint_base, config, table, optional=optional)
    with HfWriter(out, overwrite=overwrite, source=f"{checkpoint} + {base}") as writer:
        writer.add_all(adapter.merge(checkpoint_base.iter_tensors()))
        copy_side_files(base, writer)
    return _written(out)


def _tunix_weights(source, checkpoint, base: Path, out, *, arch, config: dict, table: dict,
                   optional: tuple, dtype: str | None, overwrite: bool, progress) -> None:
    """A Tunix checkpoint of full weights, converted tensor by tensor (planned from
    its metadata first, so that a wrong one is refused before a byte is written)."""
    from tpu_models.loaders.conversion_rules import expand

    where = str(source.orbax.item)
    rules = expand(source.weight_table(arch.tunix), config["num_hidden_layers"])
    plan = plan_export(source.shape, set(source.leaves), rules, table, where=where,
                       optional=optional)
    dtypes, sizes = _planned(source, plan, table, dtype)
    with HfWriter(out, overwrite=overwrite, source=str(checkpoint), planned=sizes) as writer:
        for name, rule in _progress(plan, progress, "tensors"):
            writer.add(name, np.ascontiguousarray(rule.to_hf_array(source.read(rule.source)),
                                                  dtypes[name]))
        copy_side_files(base, writer)
        writer.write_json("config.json", _config_with_dtype(config, dtype))


def _tunix_adapter(source, base: Path, arch, alpha: float, where: str) -> LoraAdapter:
    """A LoRA-only Tunix checkpoint's A and B as a PEFT adapter on `base`."""
    import torch

    pairs = source.lora_pairs(arch.tunix)
    rank = next(iter(pairs.values()))[0].shape[0]
    peft_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
                   "use_rslora": False, "bias": "none", "base_model_name_or_path": str(base),
                   "target_modules": sorted({n.split(".")[-2] for n in pairs})}
    tensors = {}
    for name, (a, b) in pairs.items():
        module = name.removesuffix(".weight")
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.from_numpy(np.ascontiguousarray(a))
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.from_numpy(np.ascontiguousarray(b))
    return LoraAdapter.from_tensors(peft_config, tensors, where)


def _alpha_from_metadata(source) -> float:
    meta = source.orbax.custom_metadata
    for key in ("lora_alpha", "alpha"):
        if key in meta:
            return float(meta[key])
    raise CheckpointError(f"{source.orbax.item}: a LoRA checkpoint stores no alpha; pass "
                          "--lora-alpha (the alpha of the run's qwix.LoraProvider)")


def _progress(items, progress, unit):
    if progress is None:
        return items
    from tqdm import tqdm
    return tqdm(items, desc=progress, unit=unit, disable=None)  # silent when not a terminal


def _token_ids(tokenizer: Path) -> dict:
    """bos/eos ids named by tokenizer_config.json, looked up in tokenizer.json."""
    try:
        names = json.loads((tokenizer / "tokenizer_config.json").read_text())
        vocab = json.loads((tokenizer / "tokenizer.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    ids = {t["content"]: t["id"] for t in vocab.get("added_tokens", [])}
    ids.update(vocab.get("model", {}).get("vocab", {}) if isinstance(
        vocab.get("model", {}).get("vocab"), dict) else {})
    out = {}
    for key in ("bos_token", "eos_token", "pad_token"):
        token = names.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        if token in ids:
            out[f"{key}_id"] = ids[token]
    return out


def maxtext(checkpoint: str | Path, arch, out: str | Path, *,
            tokenizer: str | Path | None = None, dtype: str | None = None,
            overrides: dict | None = None, scan: str = "auto", scan_axis: int = 1,
            overwrite: bool = False, max_shard_bytes: int = 2**30, progress=None) -> Path | str:
    """A MaxText checkpoint (local or gs://; scanned or not, training state or parameters
    only) as an HF checkpoint: sharded safetensors + index, config.json,
    generation_config.json, tokenizer files. Reads one tensor at a time; writes into a
    temporary directory renamed into place at the end (gs://: see HfWriter)."""
    check_out(out, overwrite)
    tokenizer = None if tokenizer is None else _local(tokenizer, "--tokenizer")
    from tpu_models.loaders.maxtext import MaxTextCheckpoint

    if arch.maxtext is None:
        raise ValueError(f"{arch.hf_name} has no MaxText layout")
    source = MaxTextCheckpoint(checkpoint, scan=scan, scan_axis=scan_axis)
    where = str(source.orbax.item)
    config = arch.maxtext.config(source.dims())
    if tokenizer is not None:
        config.update(_token_ids(tokenizer))
    config.update(overrides or {})
    if config["num_hidden_layers"] != source.layout.num_layers:
        raise CheckpointError(f"{where}: num_hidden_layers={config['num_hidden_layers']} but the "
                              f"checkpoint holds {source.layout.describe()}")
    rules = source.rules(arch.maxtext)
    table, optional = arch.hf_table(config)
    plan = plan_export(source.shape, set(source.leaves), rules, table, where=where,
                       optional=optional)
    # Grouped by source leaf: a scanned leaf is read once for all its layers.
    plan.sort(key=lambda item: (item[1].source, item[1].index or 0))
    dtypes, sizes = _planned(source, plan, table, dtype)
    config["dtype"] = config["torch_dtype"] = str(dtypes[plan[0][0]])
    cached_name, cached = None, None
    with HfWriter(out, overwrite=overwrite, max_shard_bytes=max_shard_bytes,
                  source=str(checkpoint), planned=sizes) as writer:
        for name, rule in _progress(plan, progress, "tensors"):
            if rule.source != cached_name:
                cached_name, cached = rule.source, None
                cached = source.read(rule.source)
            writer.add(name, np.ascontiguousarray(rule.to_hf_array(cached), dtypes[name]))
        cached = None
        writer.write_json("config.json", config)
        writer.write_json("generation_config.json", {
            k: v for k, v in config.items() if k in ("bos_token_id", "eos_token_id", "pad_token_id")})
        if tokenizer is not None:
            copy_side_files(tokenizer, writer, skip=("config.json", "generation_config.json"))
    return _written(out)
