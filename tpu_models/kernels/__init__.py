"""The TPU attention kernel (tpu-inference's RPA v3) off-TPU: the Pallas kernel in
JAX's TPU interpreter (`rpa_interpret`) or tpu-inference's reference of it on the
host (`rpa_reference`), chosen by TPU_MODELS_ATTENTION (`in_the_kernels_place`,
which adapt.rpa_kernel installs).

On a TPU our models call tpu-inference's RPA backend: its KV-cache layout, its
shard_map over heads, and the Pallas kernel (`ragged_paged_attention`, or its
head_dim-64 twin). Off-TPU they call the portable kernel (tpu_models.attention),
unless TPU_MODELS_ATTENTION asks for the TPU path: then everything around the
kernel is what a TPU runs, and the kernel is
- rpa-interpret: the Pallas kernel itself, in JAX's TPU interpreter
  (`rpa_interpret`, whose callbacks read the refs the kernel reshapes and
  bitcasts): its block sizes, DMAs and double buffering too;
- rpa-reference: tpu-inference's own reference of it, on the host
  (`rpa_reference`).
Either runs its programs inline (`programs_run_inline`); `rpa_kernels` gives both
kernels (head_dim 64 and others) of a mode.
"""

import importlib

INTERFACE = "tpu_inference.layers.common.attention_interface"
INTERPRETER = "jax._src.pallas.mosaic.interpret.interpret_pallas_call"


def programs_run_inline(mode: str) -> None:
    """Before JAX opens its CPU backend: programs dispatched synchronously. The
    reference (and the interpreter) dispatches JAX work of its own from inside the
    step's callbacks. XLA:CPU admits a bounded number of programs in flight per
    device, and with asynchronous dispatch the engine queues the next steps'
    programs behind the one held in the callback (speculative decoding queues
    dozens): the reference's own programs then wait for a slot forever."""
    import jax
    from jax._src import xla_bridge
    if xla_bridge.backends_are_initialized():  # the flag is read when the client is made
        raise RuntimeError(f"TPU_MODELS_ATTENTION={mode} must be set up before JAX "
                           "opens its CPU backend")
    jax.config.update("jax_cpu_enable_async_dispatch", False)


def rpa_kernels(mode: str):
    """(ragged_paged_attention, ragged_paged_attention_hd64) of TPU_MODELS_ATTENTION=
    `mode` (rpa-interpret or rpa-reference), with the Pallas kernels' signatures."""
    from tpu_models.kernels import rpa_interpret, rpa_reference
    programs_run_inline(mode)
    kernels = "tpu_inference.kernels.ragged_paged_attention.v3"
    v3 = importlib.import_module(f"{kernels}.kernel")
    hd64 = importlib.import_module(f"{kernels}.kernel_hd64")
    if mode == "rpa-interpret":
        return (rpa_interpret.interpreted(v3, "ragged_paged_attention"),
                rpa_interpret.interpreted(hd64, "ragged_paged_attention_hd64"))
    return (rpa_reference.by_reference(v3.ref_ragged_paged_attention),
            rpa_reference.by_reference(hd64.ref_ragged_paged_attention_hd64))


def in_the_kernels_place() -> None:
    """Under TPU_MODELS_ATTENTION=rpa-reference or rpa-interpret, that mode's kernels
    where tpu-inference's attention interface calls the Pallas ones. Not a replacement
    by the guard: chosen by the mode, and set up before JAX opens its CPU backend
    (`programs_run_inline`)."""
    from tpu_models.host import attention_mode
    if (mode := attention_mode()) in ("rpa-reference", "rpa-interpret"):
        interface = importlib.import_module(INTERFACE)
        (interface.ragged_paged_attention,
         interface.ragged_paged_attention_hd64) = rpa_kernels(mode)


def interpreted_with_transformed_refs() -> None:
    """Under TPU_MODELS_ATTENTION=rpa-interpret, the interpreter reads transformed refs."""
    from tpu_models.host import attention_mode
    if attention_mode() == "rpa-interpret":
        interpreter_reads_transformed_refs()


def interpreter_reads_transformed_refs() -> None:
    """The interpreter's get/store/swap read reshaped and bitcast refs. Not a
    replacement by the guard: the interpreter reaches their `__wrapped__` too
    (rpa_interpret.wrapped_callbacks)."""
    from tpu_models.kernels import rpa_interpret
    ipc = importlib.import_module(INTERPRETER)
    if ipc.get.__module__ != rpa_interpret.__name__:  # not installed yet
        ipc.get, ipc.store, ipc.swap = rpa_interpret.wrapped_callbacks(ipc)
