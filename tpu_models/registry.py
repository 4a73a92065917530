"""Our architectures, one entry each, looked up by name.

Everything that differs between architectures outside the model's own forward
pass lives in its entry, next to its model (`tpu_models/<arch>/checkpoints.py`):
the HF name/shape table, the MaxText and Tunix mappings, the Linear modules it
adds to the shared decoder, its `tpu-models export --model` name. Shared code
asks the registry, never compares architecture strings.

This module and the entries import no JAX model code: exporting a checkpoint
never loads tpu-inference. The model class is named as "module:Class" and
imported when the engine asks for it.
"""

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

# One module per architecture family, each defining ARCHITECTURES (a tuple of entries).
ENTRY_MODULES = ("tpu_models.qwen3_structural.checkpoints", "tpu_models.gemma3.checkpoints")


@dataclasses.dataclass(frozen=True)
class Multimodal:
    """A multimodal checkpoint whose language model an architecture serves text-only,
    once `tpu-models export NAME` has extracted it."""
    hf_name: str  # its config.json "architectures"[0]
    export_name: str  # `tpu-models export NAME SOURCE --out DIR`
    text_prefixes: tuple[str, ...]  # tensor-name prefixes of the language model
    dropped_prefixes: tuple[str, ...]  # the rest (vision tower, projector)
    dropped: tuple[str, ...]  # single tensors left out (a head tied to the embedding)
    text_config: Callable[[str], dict]  # checkpoint directory -> the complete text config


@dataclasses.dataclass(frozen=True)
class Architecture:
    hf_name: str  # config.json "architectures"[0]
    export_name: str  # `tpu-models export maxtext --model NAME`
    # HF config -> (tensor name -> shape, names that may be absent)
    hf_table: Callable[[Any], tuple[dict[str, tuple[int, ...]], tuple[str, ...]]]
    model: str | None = None  # "module:Class" of our NNX model; None: tpu-inference's own serves it
    new_to_vllm: bool = False  # vLLM has no PyTorch class for it: register a placeholder there too
    maxtext: Any = None  # tpu_models.loaders.maxtext.MaxTextMapping, if MaxText trains it
    tunix: Any = None  # loaders.tunix.TunixMapping, if Tunix trains it
    # Linear modules beyond the shared decoder's projections (the structural head):
    # pre-quantized checkpoints may store them quantized; Qwix presets keep them in full precision.
    extra_linear: tuple[str, ...] = ()
    multimodal: Multimodal | None = None  # a multimodal release it is extracted from

    def model_class(self) -> type:
        module, name = self.model.split(":")
        return getattr(importlib.import_module(module), name)


def architectures() -> tuple[Architecture, ...]:
    return tuple(arch for module in ENTRY_MODULES
                 for arch in importlib.import_module(module).ARCHITECTURES)


def by_hf_name(name: str | None) -> Architecture:
    for arch in architectures():
        if arch.hf_name == name:
            return arch
    raise ValueError(f"architecture {name!r} is not one tpu-models knows (known: "
                     f"{', '.join(a.hf_name for a in architectures())})")


def by_export_name(name: str) -> Architecture:
    for arch in architectures():
        if arch.export_name == name:
            return arch
    raise ValueError(f"--model {name!r}: one of {', '.join(export_names())}")


def for_multimodal(name: str | None) -> Architecture | None:
    """The entry serving the language model of multimodal architecture `name`, if any."""
    return next((a for a in architectures() if a.multimodal and a.multimodal.hf_name == name),
                None)


def export_names(trainer: str = "maxtext") -> list[str]:
    """The `--model` names the exporter from `trainer` ("maxtext" or "tunix") accepts."""
    return [a.export_name for a in architectures() if getattr(a, trainer) is not None]


def for_config(config: Mapping | Any) -> Architecture:
    """The entry of an HF config (config.json as a dict, or a transformers config)."""
    get = config.get if isinstance(config, Mapping) else lambda k: getattr(config, k, None)
    return by_hf_name((get("architectures") or [None])[0])


def for_checkpoint(directory: str | Path) -> Architecture:
    from tpu_models.loaders.tables import read_config
    config, _ = read_config(directory)
    return for_config(config)


def our_model(vllm_config) -> type | None:
    """The tpu_models class the engine runs on the flax_nnx path, else None. Asked by
    the seam of a running engine (tpu-inference imported then, not here)."""
    if vllm_config.compilation_config.static_forward_context:
        return None  # vLLM's PyTorch model (MODEL_IMPL_TYPE=vllm): its layers declare themselves
    from tpu_inference.models.common.model_loader import _MODEL_REGISTRY
    ours = {a.hf_name for a in architectures() if a.model is not None}
    for name in vllm_config.model_config.architectures or ():
        model_class = _MODEL_REGISTRY.get(name)
        if name in ours and isinstance(model_class, type):
            return model_class
    return None
