"""What a server start compiles, and when: the policy the seam (adapt/compilation.py)
carries out and the ready line reports."""


def background_buckets(vllm_config) -> bool:
    """Whether token buckets compile after the server is ready: off-TPU, when it
    precompiles at all, for a plain text model on one rank (LoRA slots, drafts,
    pipeline and data parallel ranks each add programs a bucket depends on). Not across
    hosts: each host would pad a step to the buckets it had compiled by then, and
    hosts running different programs break each other's collectives."""
    from tpu_inference import envs

    from tpu_models.host import host_platform
    from tpu_models.multihost import serving_across_hosts

    parallel = vllm_config.parallel_config
    return (host_platform() is not None and not envs.SKIP_JAX_PRECOMPILE
            and not serving_across_hosts()
            and not vllm_config.model_config.enforce_eager and vllm_config.lora_config is None
            and vllm_config.speculative_config is None
            and not vllm_config.model_config.is_multimodal_model
            and parallel.pipeline_parallel_size == 1 and parallel.data_parallel_size == 1)


def ready_buckets(paddings: list[int]) -> list[int]:
    """Compiled before the server is ready: the smallest bucket (one decode) and the
    largest (any prompt, chunk by chunk). Until the others compile, a step pads to
    the next of these."""
    return sorted({paddings[0], paddings[-1]})
