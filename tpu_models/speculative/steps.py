"""Which EAGLE-3 steps run as one program (speculative.fusion), and each step of the
runner's `_sample_from_logits` run so or by upstream's calls, counted in fusion.STEPS.

A step runs fused where the runner can (`fusible`) and the step allows it
(`eligible`); other steps run upstream's code unchanged. TPU_MODELS_SPEC_FUSION=0
runs every step so, uncounted. A fused step that fails to trace or compile marks
the runner (the seam's `unfused`): its later steps run upstream's calls.
"""

import functools
import inspect
import os

from tpu_models.speculative import fusion
from tpu_models.speculative.fusion import STEPS


def switched_off() -> bool:
    return os.environ.get("TPU_MODELS_SPEC_FUSION") == "0"


def fusible(runner) -> bool:
    """Whether this runner's EAGLE-3 steps can run as one program: not
    TPU_MODELS_SPEC_FUSION=0, EAGLE-3 on one data-parallel rank, compiling allowed at
    run time. Not on a multi-chip TPU: there upstream's sampler and draft jits carry
    collective options (xla_tpu_*, one against a v7x deadlock) that this one program
    would not."""
    from tpu_inference import envs
    from tpu_inference.runner import tpu_runner
    from tpu_inference.spec_decode.jax.eagle3 import Eagle3Proposer

    from tpu_models.host import host_platform

    return (not switched_off()
            and runner.speculative_config.method == "eagle3"
            and isinstance(runner.drafter, Eagle3Proposer) and runner.dp_size == 1
            and runner.is_last_rank and hasattr(tpu_runner.sample, "__wrapped__")
            and (host_platform() is not None or runner.mesh.size == 1)
            and not envs.VLLM_XLA_CHECK_RECOMPILATION)


def eligible(runner, a: dict) -> bool:
    """The steps `fusion.verify_and_draft` covers (`a`: `_sample_from_logits`'s
    arguments): a runner that is `fusible`, no logprobs of either kind, no penalties
    or bad words."""
    from tpu_inference.layers.jax.sample.sampling_metadata import TPUSupportedSamplingMetadata

    spec, sampling = a["spec_decode_metadata"], a["tpu_sampling_metadata"]
    return (spec is not None and isinstance(sampling, TPUSupportedSamplingMetadata)
            and not sampling.logprobs and a["full_logits"] is None
            # Penalties or bad words: verified with the device's counts (adapt.sampling).
            and getattr(sampling, "slot", None) is None
            and a["input_ids"] is not None and len(a["aux_hidden_states"] or ()) > 0
            and fusible(runner))


_signature = functools.cache(inspect.signature)


def sample_from_logits(upstream, runner, args, kwargs, seam):
    """A step of TPUModelRunner._sample_from_logits (`upstream`, with `args` and
    `kwargs`): an eligible step's calls after the forward pass run as one program
    (fusion.run), and upstream's code then runs with its device calls answered from
    that program's results (fusion.Replay). `seam`: the runner's SeamState."""
    if switched_off():
        return upstream(runner, *args, **kwargs)
    bound = _signature(upstream).bind(runner, *args, **kwargs)
    bound.apply_defaults()
    if seam.unfused or not eligible(runner, bound.arguments):
        STEPS["fallback"] += 1
        return upstream(*bound.args, **bound.kwargs)
    try:
        replay = fusion.run(runner, bound.arguments)
    except Exception:  # traced or compiled wrong: upstream's calls from now on
        if any(getattr(c, "is_deleted", lambda: False)() for c in runner.kv_caches):
            raise  # the caches were donated: nothing to fall back on
        _logger().exception("tpu-models: EAGLE-3 steps could not be fused; "
                            "running tpu-inference's calls")
        seam.unfused = True
        STEPS["failed"] += 1
        return upstream(*bound.args, **bound.kwargs)
    with replay.standing_in():
        output = upstream(*bound.args, **bound.kwargs)
    _note(replay)
    return output


def _note(replay) -> None:
    """Counts a step that ran fused; logs the first of each kind."""
    if STEPS["fused"] == 0 and not replay.redrafted:
        _logger().info("tpu-models: EAGLE-3 verification and drafting fused "
                       "(one program per step)")
    if STEPS["redrafted"] == 0 and replay.redrafted:
        _logger().warning("tpu-models: our EAGLE-3 draft inputs differ from tpu-inference's "
                          "(fusion.draft_host_inputs); its own calls draft instead")
    STEPS["redrafted" if replay.redrafted else "fused"] += 1


def _logger():
    from tpu_inference.logger import init_logger
    return init_logger(__name__)
