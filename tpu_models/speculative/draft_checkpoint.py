"""An EAGLE-3 draft's checkpoint as vLLM and tpu-inference find it.

Its class (`architecture`): drafts are published as LlamaForCausalLMEagle3, and
tpu-inference registers its JAX draft only as Eagle3LlamaForCausalLM, so such a
draft fell back to vLLM's PyTorch class, which the JAX speculative path cannot drive.

Its weights: vLLM pulls only a gs:// draft's config and tokenizer, leaving its
weights to --load-format runai_streamer, which the target's checkpoint may not use.
A draft is small: `copy_from_object_storage` copies it whole, with vLLM's own helper,
into vLLM's assets cache (<VLLM_ASSETS_CACHE>/model_streamer/<hash>, refreshed at
each start, removed on SIGINT/SIGTERM with VLLM_ASSETS_CACHE_MODEL_CLEAN=1), before
the draft's config is read. Under --load-format runai_streamer, tpu-inference streams
a draft from its model_weights, which only an object-storage model has set: a local
draft was looked up as the Hugging Face repository "" (`weights_named`).
"""

PUBLISHED, REGISTERED = "LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"


def architecture(get_architecture, config):
    """tpu-inference's model class for `config` (`get_architecture`: its
    _get_model_architecture), its JAX draft for a draft by the published name."""
    from tpu_inference.models.common import model_loader
    try:
        return get_architecture(config)
    except model_loader.UnsupportedArchitectureError:
        if PUBLISHED in (getattr(config, "architectures", None) or ()):
            return model_loader._MODEL_REGISTRY[REGISTERED]
        raise


def copy_from_object_storage(engine_args) -> None:
    """EngineArgs whose draft is in object storage name a local copy of it instead."""
    from vllm.transformers_utils.runai_utils import ObjectStorageModel

    from tpu_models.loaders.object_storage import is_object_storage, local_draft

    spec = engine_args.speculative_config
    if isinstance(spec, dict) and is_object_storage(str(spec.get("model", ""))):
        engine_args.speculative_config = {
            **spec, "model": local_draft(spec["model"], ObjectStorageModel)}
    if engine_args.spec_model is not None and is_object_storage(engine_args.spec_model):
        engine_args.spec_model = local_draft(engine_args.spec_model, ObjectStorageModel)


def weights_named(speculative_config) -> None:
    """A draft's model_weights, where unset, are its model (a local directory)."""
    draft_config = getattr(speculative_config, "draft_model_config", None)
    if draft_config is not None and not draft_config.model_weights:
        draft_config.model_weights = draft_config.model
