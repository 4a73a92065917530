"""The TPU attention kernel (tpu-inference's RPA v3) off-TPU: the Pallas kernel in
JAX's TPU interpreter (`rpa_interpret`) or tpu-inference's reference of it on the
host (`rpa_reference`), chosen by TPU_MODELS_ATTENTION (adapt.rpa_kernel puts
them in the kernel's place)."""
