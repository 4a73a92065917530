"""Speculative decoding's own state and policy, beside the seam's patches
(adapt/speculative.py, adapt/spec_fusion.py) that carry them out."""

import collections

# EAGLE-3 steps by how they ran (adapt/spec_fusion.py): "fused", "fallback" (not
# eligible), "redrafted" (our draft inputs differed from upstream's: its own draft
# computed them), "failed" (no fusion).
STEPS: collections.Counter = collections.Counter()


def live_rows(requests: int, tokens: int) -> int:
    """The rows the draft's later passes run on: a power of two at least the step's
    requests, and at least an eighth of its token bucket, so that steps with a prompt
    chunk (a decode step has 4 tokens a request) share one program per bucket: each
    compiles at its first step, not among the buckets compiled before serving."""
    return max(1 << (requests - 1).bit_length(), tokens // 8)
