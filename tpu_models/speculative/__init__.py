"""Speculative decoding on tpu-inference's JAX EAGLE-3 draft: `fusion` runs a
step's verification and drafting as one program (and counts how steps ran);
`draft` runs the draft's passes on the rows that draft and places its logits in
the target's vocabulary. The seam (adapt.spec_fusion, adapt.speculative) installs
them."""
