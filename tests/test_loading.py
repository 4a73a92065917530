"""Weights converted in one pass (tpu_models/off_tpu.py, in the loader by
tpu_models/adapt/loading.py) against tpu-inference's own loader: the same values,
dtypes and shapes, bit for bit, for every rearrangement its default loader makes
(linear, attention projections, embeddings, norms), the vocabulary padding it
alone handles, and tensors it must leave to upstream."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import Mesh

from tpu_models import logs, off_tpu
from tpu_models.adapt import loading

CASES = [  # name, checkpoint shape, param shape, reshape_dims, permute_dims
    ("mlp.down_proj.weight", (48, 96), (96, 48), None, None),
    ("self_attn.q_proj.weight", (4 * 8, 24), (24, 4, 8), (4, 8, 24), (2, 0, 1)),
    ("self_attn.k_proj.weight", (2 * 8, 24), (24, 2, 8), (2, 8, 24), (2, 0, 1)),
    ("self_attn.o_proj.weight", (24, 4 * 8), (4, 8, 24), (24, 4, 8), (1, 2, 0)),
    ("embed_tokens.weight", (50, 24), (50, 24), None, (0, 1)),
    ("input_layernorm.weight", (24,), (24,), None, None),
    ("lm_head.weight", (50, 24), (24, 50), None, (1, 0)),
    ("embed_tokens.weight", (50, 24), (64, 24), None, (0, 1)),  # vocabulary padded: upstream's
]


@pytest.fixture
def patched(monkeypatch):
    from tpu_inference.models.jax.utils import weight_utils
    arrange, passes = off_tpu.arranged, []

    def counted(x, shape, perm, dtype):
        passes.append(shape)
        return arrange(x, shape, perm, dtype)

    monkeypatch.setattr(off_tpu, "arranged", counted)
    original = weight_utils.load_nnx_param_from_reshaped_torch
    monkeypatch.setattr(weight_utils, "load_nnx_param_from_reshaped_torch",
                        functools.partial(loading.load_in_one_pass, original))
    monkeypatch.setattr(logs, "WIDENED_BY_LOADER", set())
    with jax.set_mesh(Mesh(np.array(jax.devices()[:1]), ("model",))):
        yield original, weight_utils.load_nnx_param_from_reshaped_torch, passes


def _loaded(load, tensor, param_shape, dtype, reshape, permute, name):
    param = nnx.Param(jnp.zeros(param_shape, dtype))
    load(param, tensor, reshape_dims=reshape, permute_dims=permute, param_name=name)
    return np.asarray(param.get_value()), param.get_value().dtype


@pytest.mark.parametrize("source", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("served", [torch.float32, torch.bfloat16])
def test_one_pass_loading_equals_upstreams(patched, source, served):
    upstream, ours, passes = patched
    generator = torch.Generator().manual_seed(0)
    for name, shape, param_shape, reshape, permute in CASES:
        tensor = torch.randn(shape, generator=generator).to(source)
        dtype = jnp.float32 if served == torch.float32 else jnp.bfloat16
        want, want_dtype = _loaded(upstream, tensor.to(served), param_shape, dtype, reshape,
                                   permute, name)
        got, got_dtype = _loaded(ours, off_tpu.mark(name, tensor.clone(), served), param_shape,
                                 dtype, reshape, permute, name)
        assert got_dtype == want_dtype and got.shape == want.shape == param_shape, name
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg=name)
    assert len(passes) == len(CASES) - 1  # all in one pass but the padded one


def test_unmarked_and_unusual_tensors_take_upstreams_path(patched):
    upstream, ours, passes = patched
    tensor = torch.randn(48, 96)
    for weight in (tensor.clone(),  # not marked: no cast, upstream's conversion
                   off_tpu.mark("w", tensor.t().contiguous().t(), torch.float32),  # not contiguous
                   off_tpu.mark("w", tensor.to(torch.float8_e4m3fn), torch.float32)):  # 8 bits
        marked = hasattr(weight, off_tpu.SERVED_DTYPE_ATTRIBUTE)
        want, want_dtype = _loaded(upstream, weight.to(torch.float32) if marked else weight,
                                   (96, 48), jnp.float32, None, None, "w")
        got, got_dtype = _loaded(ours, weight, (96, 48), jnp.float32, None, None, "w")
        assert got_dtype == want_dtype
        np.testing.assert_array_equal(got, want)
    assert passes == []
