"""tpu-inference's weight loader: each tensor read and converted in one pass.

Serving a bf16 checkpoint in float32 copied every weight three times: our cast
(runtime.in_dtype, torch), tpu-inference's transposing `contiguous()` (torch,
one thread, across cache lines) and `jnp.asarray` into XLA's memory: 2.6 s of
a 0.6B model's 3.9 s of loading on two cores. Here a weight that reaches the
default loader (`load_nnx_param_from_reshaped_torch`, no quantization hook)
with a served dtype marked on it (`mark`) is read once from the checkpoint into
XLA's memory in its own dtype and rearranged and cast by one compiled
transpose (tiled, every core). Anything else takes upstream's path unchanged.
"""

from tpu_models import off_tpu
from tpu_models.adapt.guard import OFF_TPU, STARTUP, Patch, Target

WEIGHTS = "tpu_inference.models.jax.utils.weight_utils"
_ATTRIBUTE = "_tpu_models_served_dtype"
_installed = False


def installed() -> bool:
    """Whether weights may reach the loader in their checkpoint dtype, marked."""
    return _installed


def mark(name: str, tensor, dtype):
    """Checkpoint tensor `name` to be cast to `dtype` (a torch dtype) by the loader,
    in its pass (vLLM's warning about its dtype is then no news: logs)."""
    from tpu_models import logs
    logs.WIDENED_BY_LOADER.add(name)
    setattr(tensor, _ATTRIBUTE, dtype)
    return tensor


def _host_array(tensor):
    """A numpy view of a contiguous CPU tensor (bf16 through ml_dtypes), or None."""
    import ml_dtypes
    import torch
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if tensor.dtype in (torch.float16, torch.float32):
        return tensor.numpy()
    return None


def one_pass_conversion() -> None:
    global _installed
    import jax
    from jax.sharding import NamedSharding, PartitionSpec
    from tpu_inference.layers.common import utils as common
    from tpu_inference.models.jax.utils import weight_utils
    from tpu_inference.utils import to_jax_dtype

    original = weight_utils.load_nnx_param_from_reshaped_torch

    def load_nnx_param_from_reshaped_torch(jax_param, torch_weight, _shard_id=-1, *,
                                           reshape_dims=None, permute_dims=None,
                                           param_name="Unknown"):
        served = getattr(torch_weight, _ATTRIBUTE, None)
        host = None if served is None else _host_array(torch_weight)
        shape = tuple(reshape_dims or torch_weight.shape)
        if permute_dims is None and len(shape) == 2:
            permute_dims = (1, 0)  # upstream's default: HF linear weights are (out, in)
        perm = None if permute_dims is None else tuple(permute_dims)
        arranged = shape if perm is None else tuple(shape[p] for p in perm)
        if host is None or arranged != tuple(jax_param.get_value().shape):
            # Vocabulary padding and anything unusual: upstream's path, cast first.
            weight = torch_weight if served is None else torch_weight.to(served)
            return original(jax_param, weight, _shard_id, reshape_dims=reshape_dims,
                            permute_dims=permute_dims, param_name=param_name)
        with common.cpu_mesh_context():
            # On the CPU mesh by name: across hosts, sharding it reads its pieces there.
            x = jax.device_put(host, NamedSharding(common.cpu_mesh(), PartitionSpec()))
            value = off_tpu.arranged(x, shape, perm, to_jax_dtype(served))
            value.block_until_ready()  # a streamed tensor's buffer is refilled next
        del x
        weight_utils.assign_and_shard_param(jax_param, value, param_name)

    weight_utils.load_nnx_param_from_reshaped_torch = load_nnx_param_from_reshaped_torch
    _installed = True


PATCHES = [
    Patch("weights converted in one pass", STARTUP, (
        Target(f"{WEIGHTS}.load_nnx_param_from_reshaped_torch",
               "jax_param torch_weight _shard_id reshape_dims permute_dims param_name"),
        Target(f"{WEIGHTS}.assign_and_shard_param", "jax_param jax_weight param_name mesh")),
        "each weight was copied three times on its way in (2.6 s of 3.9 s at 0.6B)",
        "tests/test_loading.py::test_one_pass_loading_equals_upstreams",
        one_pass_conversion, platform=OFF_TPU, speed="tpu-models bench startup"),
]
