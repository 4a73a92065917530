"""Offline conversions that end in an HF checkpoint directory."""

import json
from pathlib import Path

from loaders.hf import CheckpointError, HfCheckpoint
from loaders.hf_writer import HfWriter
from loaders.lora import LoraAdapter
from loaders.tables import table_for

# Files that travel with the weights (config, generation defaults, tokenizer).
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "tokenizer.model", "special_tokens_map.json", "chat_template.jinja",
              "chat_template.json", "added_tokens.json", "vocab.json", "merges.txt")


def copy_side_files(source: Path, writer: HfWriter) -> None:
    for name in SIDE_FILES:
        if (source / name).exists():
            writer.copy_file(source / name)


def lora_merge(base: str | Path, adapter_dir: str | Path, out: str | Path, *,
               overwrite: bool = False) -> Path:
    """Writes base + LoRA adapter, merged, as a new HF checkpoint at `out`."""
    base = Path(base)
    config_path = base / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"{base}: no config.json")
    table, optional = table_for(json.loads(config_path.read_text()))
    checkpoint = HfCheckpoint(base)
    checkpoint.check(table, optional=optional)
    adapter = LoraAdapter(adapter_dir)
    adapter.check_base(table)
    with HfWriter(out, overwrite=overwrite) as writer:
        writer.add_all(adapter.merge(checkpoint.iter_tensors()))
        copy_side_files(base, writer)
    return Path(out)


# Where multimodal Gemma 3 checkpoints keep the language model: as released,
# and as transformers >= 5 saves it.
GEMMA3_TEXT_PREFIXES = ("language_model.model.", "model.language_model.")
GEMMA3_VISION_PREFIXES = ("vision_tower.", "model.vision_tower.", "multi_modal_projector.",
                          "model.multi_modal_projector.")


def gemma3_text(source: str | Path, out: str | Path, text_config: dict, *,
                overwrite: bool = False) -> Path:
    """Extracts the language model of a Gemma3ForConditionalGeneration checkpoint
    as a text-only Gemma3ForCausalLM checkpoint (same weights, renamed).

    `text_config` is the complete text config (defaults filled in by the caller).
    """
    from loaders.tables import gemma3_table

    source = Path(source)
    checkpoint = HfCheckpoint(source)
    renames, unknown = {}, []
    for name in checkpoint.tensors:
        prefix = next((p for p in GEMMA3_TEXT_PREFIXES if name.startswith(p)), None)
        if prefix is not None:
            renames[name] = "model." + name[len(prefix):]
        elif not name.startswith(GEMMA3_VISION_PREFIXES) and name not in (
                "lm_head.weight", "language_model.lm_head.weight"):  # tied to the embedding
            unknown.append(name)
    if unknown:
        raise CheckpointError(f"{source}: tensors outside the language model and vision tower: "
                              f"{unknown[:5]}")
    config = {**text_config, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text"}
    from loaders.hf import check_tensors
    check_tensors({new: (checkpoint.tensors[old].shape, checkpoint.tensors[old].file.name)
                   for old, new in renames.items()}, gemma3_table(config), where=str(source))
    with HfWriter(out, overwrite=overwrite) as writer:
        writer.add_all((renames[name], t) for name, t in checkpoint.iter_tensors() if name in renames)
        writer.write_json("config.json", config)
        for name in SIDE_FILES:
            if name != "config.json" and (source / name).exists():
                writer.copy_file(source / name)
    return Path(out)
