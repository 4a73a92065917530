"""Speculative decoding on tpu-inference's JAX EAGLE-3 draft: `fusion` runs a
step's verification and drafting as one program (and counts how steps ran);
`steps` decides which steps run so and runs each; `draft` runs the draft in the
served dtype and, off-TPU (for speed: bench spec, benchmarks/README.md), its heads
at their size, its passes on the rows that draft and its logits placed in the
target's vocabulary by a gather; `draft_checkpoint` finds a draft's class by its
published name and copies a draft from object storage. The seam (adapt.spec_fusion,
adapt.speculative) installs them."""
