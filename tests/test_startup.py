"""Start-up: what a restart repeats, and what waits for the first request."""

import types

from tpu_models.adapt import host_portability


def test_the_default_kv_budget_does_not_follow_free_memory_to_the_byte(monkeypatch):
    """The KV cache's size is in every compiled step's shapes: a budget that moved with
    free memory made each restart miss the JAX cache for the whole model."""
    import psutil

    config = types.SimpleNamespace(kv_cache_memory_bytes=None)
    budgets = {}
    for available in (21.0, 21.7, 24.9, 4.3, 1.1):
        monkeypatch.setattr(psutil, "virtual_memory",
                            lambda a=available: types.SimpleNamespace(available=int(a * 2**30)))
        budgets[available] = host_portability.kv_cache_budget(config)
    assert budgets[21.0] == budgets[21.7] == budgets[24.9] == 4 * 2**30  # 20%, whole GiB
    assert budgets[4.3] == 3 * 2**28 and budgets[1.1] == 2**28  # below 1 GiB: 256 MiB steps
    config.kv_cache_memory_bytes = 123_456_789
    assert host_portability.kv_cache_budget(config) == 123_456_789
