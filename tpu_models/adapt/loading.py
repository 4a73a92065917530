"""tpu-inference's weight loader: each tensor read and converted in one pass.

Which weights, and why: tpu_models.off_tpu (`mark`, through runtime.SEAM).
"""

from tpu_models import off_tpu, patching
from tpu_models.features import STARTUP
from tpu_models.patching import OFF_TPU, Patch, Target

WEIGHTS = "tpu_inference.models.jax.utils.weight_utils"


def installed() -> bool:
    """Whether weights may reach the loader in their checkpoint dtype, marked."""
    return f"{WEIGHTS}.load_nnx_param_from_reshaped_torch" in patching.ORIGINALS


def load_in_one_pass(original, jax_param, torch_weight, _shard_id=-1, *, reshape_dims=None,
                     permute_dims=None, param_name="Unknown"):
    """load_nnx_param_from_reshaped_torch: a marked weight converted in one pass."""
    from tpu_inference.models.jax.utils import weight_utils
    value = off_tpu.converted_in_one_pass(jax_param, torch_weight, reshape_dims, permute_dims)
    if value is None:  # vocabulary padding and anything unusual: upstream's path, cast first
        return original(jax_param, off_tpu.as_marked(torch_weight), _shard_id,
                        reshape_dims=reshape_dims, permute_dims=permute_dims,
                        param_name=param_name)
    weight_utils.assign_and_shard_param(jax_param, value, param_name)


PATCHES = [
    Patch("weights converted in one pass", STARTUP, (
        Target(f"{WEIGHTS}.load_nnx_param_from_reshaped_torch",
               "jax_param torch_weight _shard_id reshape_dims permute_dims param_name",
               load_in_one_pass),
        Target(f"{WEIGHTS}.assign_and_shard_param", "jax_param jax_weight param_name mesh")),
        "each weight was copied three times on its way in (2.6 s of 3.9 s at 0.6B)",
        "tests/test_loading.py::test_one_pass_loading_equals_upstreams",
        platform=OFF_TPU, speed="tpu-models bench startup"),
]
