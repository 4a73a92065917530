"""What a checkpoint directory holds: format, layout, and every tensor."""

from pathlib import Path

from tpu_models.loaders.hf import CheckpointError, HfCheckpoint


def describe(path: str | Path, tunix_families: dict | None = None) -> dict:
    """{"format", "layout", "tensors": [(name, shape, dtype)], "notes"} for HF, MaxText or Tunix.

    tunix_families: name -> loaders.tunix.TunixMapping, to name a Tunix tree's model family."""
    path = Path(path)
    orbax = any((path / p).exists() for p in ("_METADATA", "checkpoints", "items", "model_params"))
    if not orbax and (list(path.glob("*.safetensors")) or (path / "adapter_config.json").exists()):
        if (path / "adapter_config.json").exists():
            from tpu_models.loaders.lora import LoraAdapter
            adapter = LoraAdapter(path)
            tensors = [(f"{n} (A, B)", (tuple(a.shape), tuple(b.shape)), str(a.dtype))
                       for n, (a, b) in sorted(adapter.targets.items())]
            return {"format": "PEFT LoRA adapter", "layout": f"rank {adapter.rank}, alpha "
                    f"{adapter.alpha}{', rsLoRA' if adapter.use_rslora else ''}",
                    "tensors": tensors, "notes": []}
        checkpoint = HfCheckpoint(path)
        tensors = [(n, i.shape, i.dtype) for n, i in sorted(checkpoint.tensors.items())]
        layout = f"{len(checkpoint.files)} safetensors file(s)"
        return {"format": "HF safetensors", "layout": layout, "tensors": tensors, "notes": []}
    from tpu_models.loaders.orbax_io import OrbaxCheckpoint
    orbax = OrbaxCheckpoint(path)
    tensors = [(n, shape, str(dtype)) for n, (shape, dtype) in sorted(orbax.leaves.items())]
    names = set(orbax.leaves)
    if any(n.startswith("params/") for n in names):
        from tpu_models.loaders.maxtext import MaxTextCheckpoint
        maxtext = MaxTextCheckpoint(path)
        return {"format": "MaxText", "layout": maxtext.layout_description(), "tensors": tensors,
                "notes": [f"item directory: {orbax.item}", "opt_state, step and nnx_aux "
                          "entries are ignored by the exporter"]}
    if any("/attn/" in n for n in names):
        from tpu_models.loaders.tunix import TunixCheckpoint
        tunix = TunixCheckpoint(path)
        kind = "LoRA-only (qwix *_lora_a / *_lora_b)" if tunix.is_lora else "full weights"
        family = next((name for name, mapping in (tunix_families or {}).items()
                       if mapping.matches(tunix.leaves)), "unknown family")
        return {"format": "Tunix", "layout": f"{family}, {kind}", "tensors": tensors,
                "notes": [f"item directory: {orbax.item}"]}
    raise CheckpointError(f"{orbax.item}: an Orbax tree neither MaxText nor Tunix lays out")


def print_description(path: str | Path, tunix_families: dict | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    info = describe(path, tunix_families)
    console = Console(width=160)
    console.print(f"[bold]{path}[/bold]: {info['format']} — {info['layout']}")
    for note in info["notes"]:
        console.print(f"  {note}")
    table = Table(show_header=True)
    for column in ("tensor", "shape", "dtype"):
        table.add_column(column)
    for name, shape, dtype in info["tensors"]:
        table.add_row(name, str(list(shape)) if isinstance(shape[0] if shape else 0, int)
                      else str(shape), str(dtype))
    console.print(table)
    console.print(f"{len(info['tensors'])} tensors")
