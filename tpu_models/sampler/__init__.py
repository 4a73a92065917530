"""The extended sampler: what tpu-inference's sampler (temperature, top-k, top-p)
lacks of vLLM's: min_p, seeds, logit_bias, allowed ids, min_tokens, the presence,
frequency and repetition penalties and bad words.

`metadata` builds a step's `ExtendedMetadata` on the host from its requests;
`programs` holds the device programs that sample and verify drafts with it;
`counts` keeps what each request has seen on the device (`TokenCounts`). The seam
(adapt.sampling) hands tpu-inference's sampler these in place of its own.
"""
