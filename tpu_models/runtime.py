"""What our models take from the running engine: settings and checkpoint loading."""

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from jax.sharding import Mesh
from tpu_inference.layers.common.attention_backend import AttentionBackend
from tpu_inference.layers.common.sharding import ShardingAxisName
from tpu_inference.logger import init_logger
from tpu_inference.models.jax.utils.weight_utils import BaseWeightLoader, LoadableWithIterator
from tpu_inference.utils import get_mesh_shape_product, to_torch_dtype
from vllm.config import VllmConfig

from tpu_models.loaders.hf import CheckpointError, HfCheckpoint, check_finite
from tpu_models.loaders.peft import LoraAdapter
from tpu_models.loaders.object_storage import (ObjectStorageCheckpoint, checked_stream,
                                               is_object_storage)
from tpu_models.loaders.tables import check_checkpoint
from tpu_models.quant import checkpoint as prequantized

logger = init_logger(__name__)

# --additional-config key naming a PEFT adapter directory to merge while loading.
LORA_KEY = "merge_lora"
# --additional-config key: refuse weights holding NaN or infinities (one extra pass).
CHECK_WEIGHTS_KEY = "check_weights"
# --kv-cache-dtype values our attention stores: one element type, per-tensor
# scale 1.0 (quantize_kv), so no per-token-head or packed 4-bit layouts.
KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
# vLLM's --load-format that streams safetensors (from object storage, or a local directory).
STREAMED = "runai_streamer"
# The streamer's read buffer; its default (40 GB, capped at the checkpoint's size) held
# a whole copy of the weights beside them. "0": the largest tensor, as a local load.
STREAMER_MEMORY_LIMIT = "RUNAI_STREAMER_MEMORY_LIMIT"


@dataclasses.dataclass
class Seam:
    """What the adaptations (tpu_models.adapt) add to building and loading our models.
    The plugin fills it in: the core imports no patch."""
    # (vllm_config, model class) -> None, raising to refuse: features the seam could
    # not adapt here, server defaults it refuses.
    build_checks: list[Callable[[VllmConfig, type], None]] = dataclasses.field(
        default_factory=list)
    # (name, tensor, served torch dtype) -> the tensor, marked for the loader to cast in
    # its own pass; None: cast here.
    cast_by_loader: Callable | None = None


SEAM = Seam()


def check_before_build(vllm_config: VllmConfig, model_class: type) -> None:
    for check in SEAM.build_checks:
        check(vllm_config, model_class)


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """The engine settings a model is built for."""
    dtype: Any  # jax dtype the engine serves in (--dtype)
    quant_config: Any  # tpu-inference quantization config, or None
    kv_cache_dtype: str  # "auto" or e.g. "fp8"
    attention_backend: AttentionBackend
    vocab_shards: int  # devices the vocabulary is split over
    head_shards: int  # devices the attention heads are split over (tensor parallelism)

    @classmethod
    def from_vllm_config(cls, vllm_config: VllmConfig, mesh: Mesh) -> "EngineSettings":
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise NotImplementedError("tpu-models: pipeline parallelism is not supported; "
                                      "use --tensor-parallel-size")
        kv_cache_dtype = vllm_config.cache_config.cache_dtype
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"tpu-models: --kv-cache-dtype {kv_cache_dtype} is not supported "
                             f"by our attention (supported: {', '.join(KV_CACHE_DTYPES)})")
        check_prequantized(vllm_config)
        return cls(
            dtype=vllm_config.model_config.dtype,
            quant_config=getattr(vllm_config, "quant_config", None),
            kv_cache_dtype=kv_cache_dtype,
            attention_backend=attention_backend(vllm_config),
            vocab_shards=get_mesh_shape_product(mesh, ShardingAxisName.VOCAB),
            head_shards=get_mesh_shape_product(mesh, ShardingAxisName.ATTN_HEAD))


def attention_backend(vllm_config: VllmConfig) -> AttentionBackend:
    """The engine's configured backend (RPA on TPU, and off-TPU under
    TPU_MODELS_ATTENTION=rpa-reference); the portable kernel off-TPU by default."""
    from tpu_inference.layers.common.attention_backend import (attention_backend_name,
                                                               create_attention_backend)

    from tpu_models import host
    name = attention_backend_name(vllm_config)
    if host.attention_mode() == "portable":
        from tpu_models.attention import PortableAttentionBackend
        name = PortableAttentionBackend.name
    return create_attention_backend(name)


def check_prequantized(vllm_config: VllmConfig) -> None:
    """A checkpoint's own quantization_config: refused before the model is built
    unless tpu-inference's methods load it (quant/checkpoint.py), and never
    stacked with Qwix rules or a LoRA merge."""
    scheme = getattr(vllm_config.model_config.hf_config, "quantization_config", None)
    if not scheme:
        return
    extra = vllm_config.additional_config or {}
    where = os.path.join(model_directory(vllm_config), "config.json")
    prequantized.check_scheme(scheme, where)
    for key, flag in (("quantization", "--quant / Qwix rules"), (LORA_KEY, "--lora")):
        if extra.get(key):
            raise prequantized.UnsupportedQuantization(
                f"{where}: the checkpoint is already quantized ({scheme.get('quant_method')}); "
                f"{flag} cannot be applied on top of it")


def mask_padded_vocab(logits, vocab_size: int):
    """Padding columns (vocabularies rounded up to the shard count) can never be sampled."""
    import jax.numpy as jnp
    if logits.shape[-1] == vocab_size:
        return logits
    return jnp.where(jnp.arange(logits.shape[-1]) < vocab_size, logits, jnp.finfo(logits.dtype).min)


def model_directory(vllm_config: VllmConfig) -> str:
    """The local directory of the served checkpoint (downloading it if vLLM was given a hub id)."""
    model_config = vllm_config.model_config
    path = getattr(model_config, "model_weights", None) or model_config.model
    if os.path.isdir(path):
        return path
    if is_object_storage(path):  # vLLM pulled config.json and the tokenizer here
        return model_config.model
    from huggingface_hub import snapshot_download
    return snapshot_download(path, revision=model_config.revision,
                             allow_patterns=["*.safetensors", "*.json"])


class StreamedWeights(BaseWeightLoader):
    """Marks our models as taking vLLM's weight stream (--load-format runai_streamer):
    under MODEL_IMPL_TYPE=auto tpu-inference sends a model class without a
    `WeightLoader` of this base to vLLM's PyTorch path. Never built:
    `load_checkpoint` consumes the stream vLLM's loader hands to `load_weights`."""


def open_checkpoint(vllm_config: VllmConfig) -> HfCheckpoint | ObjectStorageCheckpoint:
    """The served checkpoint's tensors, from its safetensors headers (no weight read)."""
    model_config = vllm_config.model_config
    uri = getattr(model_config, "model_weights", None) or ""
    if is_object_storage(uri):
        if vllm_config.load_config.load_format != STREAMED:
            raise CheckpointError(f"{uri} is in object storage: serve it with --load-format "
                                  f"{STREAMED} (tpu-models serve adds it)")
        return ObjectStorageCheckpoint(uri, model_config.model)
    return HfCheckpoint(model_directory(vllm_config))


def weight_stream(vllm_config: VllmConfig, checkpoint, weights, check_weights: bool):
    """(name, tensor) one at a time: vLLM's stream under --load-format runai_streamer,
    else read from the local files."""
    if vllm_config.load_config.load_format != STREAMED:
        return checkpoint.iter_tensors(check_finite=check_weights)
    if weights is None:
        raise ValueError(f"--load-format {STREAMED}: the engine's loader passed no weights")
    os.environ.setdefault(STREAMER_MEMORY_LIMIT, "0")  # read by the stream's first step
    logger.info("tpu-models: streaming weights from %s (%s=%s)", checkpoint.source,
                STREAMER_MEMORY_LIMIT, os.environ[STREAMER_MEMORY_LIMIT])
    weights = checked_stream(weights, checkpoint)
    return check_finite(weights, str(checkpoint.source)) if check_weights else weights


def load_checkpoint(model: LoadableWithIterator, table: dict, *, optional=(),
                    extra_linear=(), weights=None) -> set[str]:
    """Checks the checkpoint (and LoRA adapter, if any) against `table`, then
    streams it into `model`, merging the adapter on the way. `weights`: the
    engine loader's (name, tensor) stream, used under --load-format runai_streamer.

    tpu-inference's loader maps HF names onto our HF-named modules, shards each
    tensor onto the mesh and runs quantization hooks. Checking first (from the
    headers, in object storage too) means a bad checkpoint fails in
    milliseconds, naming its tensors, with nothing loaded.
    """
    vllm_config = model.vllm_config
    extra = vllm_config.additional_config or {}
    checkpoint = open_checkpoint(vllm_config)
    config = vllm_config.model_config.hf_text_config
    scheme = getattr(vllm_config.model_config.hf_config, "quantization_config", None)
    floating = set(table)  # cast to --dtype; not the scales added next
    if scheme:  # per-channel scales next to the quantized weights
        table = prequantized.checkpoint_table(table, scheme, str(checkpoint.directory),
                                              extra_linear=extra_linear)
    check_checkpoint(checkpoint, config, table, optional=optional)
    check_tokenizer(vllm_config, config.vocab_size)
    check_weights = bool(extra.get(CHECK_WEIGHTS_KEY))
    if check_weights:
        logger.info("tpu-models: checking every weight for NaN and infinities (%s)",
                    CHECK_WEIGHTS_KEY)
    adapter_dir = extra.get(LORA_KEY)
    tensors = in_dtype(weight_stream(vllm_config, checkpoint, weights, check_weights),
                       to_torch_dtype(vllm_config.model_config.dtype), names=floating,
                       in_loader=set() if adapter_dir else default_loaded(model))
    if adapter_dir:
        adapter = LoraAdapter(adapter_dir)
        adapter.check_base(table)
        if check_weights:
            list(check_finite(adapter.peft_tensors().items(),
                              f"LoRA adapter {adapter_dir}/adapter_model.safetensors"))
        logger.info("tpu-models: merging LoRA %s (rank %d, scale %.4g) into %d weights",
                    adapter_dir, adapter.rank, adapter.scale, len(adapter.targets))
        tensors = adapter.merge(tensors)
    logger.info("tpu-models: loading %d tensors from %s", len(checkpoint.tensors),
                checkpoint.source)
    loaded = LoadableWithIterator.load_weights(model, tensors)
    _return_freed_memory()
    return loaded


def _return_freed_memory() -> None:
    """Hands the conversion buffers freed while loading back to the OS. glibc keeps
    large freed blocks for reuse: a 1B model served in float32 went on holding
    1.2 GiB (its embedding's conversion) beside its 3.7 GiB of weights."""
    import ctypes
    import ctypes.util
    libc = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(libc).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # not glibc: nothing to trim
        pass


def default_loaded(model) -> set[str]:
    """Names of the parameters tpu-inference's default loader will fill (no
    quantization hook), where the one-pass conversion is installed (adapt.loading)."""
    if SEAM.cast_by_loader is None:
        return set()
    return {name for name, param in model.named_parameters()
            if not hasattr(param, "weight_loader")}


def in_dtype(tensors, dtype, *, names: set[str], in_loader: set[str] = frozenset()):
    """Streams (name, tensor) through, floating-point weights of `names` cast to
    the served dtype (--dtype). tpu-inference's loader keeps each tensor's own
    dtype, so a bf16 checkpoint served in float32 kept bf16 weights: every step
    then converted each weight to float32 before its matmul (a second pass over
    all weights per token, the largest cost of a CPU decode at 1B). Quantized
    weights (8 bits and fewer) and the scales beside them (not in `names`) keep
    theirs. Those `in_loader` are marked instead, and cast in the loader's own
    pass (adapt.loading)."""
    for name, tensor in tensors:
        if name in names and tensor.is_floating_point() and tensor.element_size() >= 2:
            if name in in_loader:
                tensor = SEAM.cast_by_loader(name, tensor, dtype)
            elif tensor.dtype != dtype:
                tensor = tensor.to(dtype)
        yield name, tensor


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def check_tokenizer(vllm_config: VllmConfig, vocab_size: int) -> None:
    """Refuses a tokenizer with ids past the embedding: vLLM would pass them to the
    model, whose embedding lookup has no row for them."""
    model_config = vllm_config.model_config
    if model_config.skip_tokenizer_init:
        return
    try:
        from vllm.tokenizers.registry import cached_tokenizer_from_config
        tokenizer = cached_tokenizer_from_config(model_config)
        size = max(len(tokenizer), tokenizer.max_token_id + 1)
    except Exception as e:  # vLLM's own start-up reports a tokenizer it cannot load
        logger.warning("tpu-models: tokenizer size not checked (%s)", e)
        return
    if size <= vocab_size:
        return
    where = model_config.tokenizer
    if os.path.isdir(where):
        where = next((os.path.join(where, f) for f in TOKENIZER_FILES
                      if os.path.exists(os.path.join(where, f))), where)
    raise CheckpointError(
        f"tokenizer {where} has {size} tokens (ids 0..{size - 1}) but the model's embedding has "
        f"{vocab_size} rows (config.json vocab_size={vocab_size}): ids {vocab_size}..{size - 1} "
        "would have no embedding. Use the tokenizer the model was trained with.")
