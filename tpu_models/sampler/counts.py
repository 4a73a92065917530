"""What each request has seen, kept on the device: the counts the penalties and bad
words read (`TokenCounts`), and `record`, which adds a step's tokens to them.

Under tpu-inference's asynchronous scheduling the host learns a step's tokens a
step late, so the counts live on the device and the sampling program that draws
the tokens adds them (programs.sample_extended).
"""

import functools

IN_PROMPT = 1 << 24  # a count's flag bit: the token is in the prompt
RECENT = 32  # the output tokens kept a request, for bad words' prefixes
NO_TOKEN, ANY_TOKEN = -1, -2  # a recent position not yet generated; a prefix position unused


def bucket(n: int) -> int:
    """Padded width of per-row id lists: powers of two, so few compiled shapes."""
    return max(8, 1 << (n - 1).bit_length())


def record(counts, recent, slot, own, tokens, n):
    """TokenCounts' arrays with each row's first `n` `tokens` added to its slot
    (`slot` out of range: nothing added); `own` is its recent ids before them."""
    import jax.numpy as jnp
    added = jnp.where(jnp.arange(tokens.shape[1]) < n[:, None], tokens, counts.shape[1])
    counts = counts.at[slot[:, None], added].add(1, mode="drop")
    ids = jnp.concatenate([own, tokens.astype(own.dtype)], axis=1)
    last = jnp.take_along_axis(ids, n[:, None] + jnp.arange(RECENT), axis=1)
    return counts, recent.at[slot].set(last, mode="drop")


class TokenCounts:
    """What each request has seen, on the device: a row of `vocab` int32 counts (its
    output tokens, IN_PROMPT added for a prompt token) and its last RECENT output ids.
    4 * (vocab + RECENT) bytes a slot and max_num_seqs slots: 1.0 MiB a slot at
    Gemma 3's 262,144 ids (256 MiB at 256 sequences), 0.6 MiB at Qwen3's 151,936;
    allocated at start-up, before the KV cache is sized (`allocate`), so that
    the cache leaves them their room.

    A request keeps its slot until it finishes, through preemption and chunked
    prefill, since only the device knows its latest tokens. A slot is given to a new
    request only when none is free, taken from one not in the batch (preempted), which
    is rebuilt from the host's ids when it returns: by then the host has them all."""

    def __init__(self, mesh, slots: int, vocab: int):
        import numpy as np
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P
        from tpu_inference.utils import device_array
        replicated = NamedSharding(mesh, P())
        self.mesh, self.slots, self.vocab = mesh, slots, vocab
        self.counts = device_array(mesh, np.zeros((slots, vocab), np.int32), sharding=replicated)
        self.recent = device_array(mesh, np.full((slots, RECENT), NO_TOKEN, np.int32),
                                   sharding=replicated)
        self.owner: dict[str, int] = {}  # request id -> slot
        self.free = list(range(slots - 1, -1, -1))
        self.pending: list[tuple[int, list[int], list[int]]] = []  # (slot, prompt, output)

    def slot_of(self, req_id: str, request, in_batch: set[str]) -> int:
        if req_id in self.owner:
            return self.owner[req_id]
        if self.free:
            free = self.free.pop()
        else:  # a preempted request's: rebuilt when it returns
            evicted = next(r for r in self.owner if r not in in_batch)
            free = self.owner.pop(evicted)
        self.owner[req_id] = free
        output = [t for t in (request.output_token_ids or []) if t >= 0]
        self.pending.append((free, list(request.prompt_token_ids or []), output))
        return free

    def forget(self, live) -> None:
        for req_id in [r for r in self.owner if r not in live]:
            self.free.append(self.owner.pop(req_id))

    def rebuild(self) -> None:
        """Writes the new slots' rows from the host's ids (one program per size)."""
        if not self.pending:
            return
        import numpy as np
        from tpu_inference.utils import device_array
        k = bucket(len(self.pending))
        prompt_width = bucket(max(len(p) for _, p, _ in self.pending))
        output_width = bucket(max(len(o) for *_, o in self.pending))
        slots = np.full(k, self.slots, np.int32)
        prompt = np.full((k, prompt_width), self.vocab, np.int32)
        output = np.full((k, output_width), self.vocab, np.int32)
        recent = np.full((k, RECENT), NO_TOKEN, np.int32)
        for i, (slot, p, o) in enumerate(self.pending):
            slots[i], prompt[i, :len(p)], output[i, :len(o)] = slot, p, o
            if o:
                tail = o[-RECENT:]
                recent[i, RECENT - len(tail):] = tail
        self.pending.clear()
        self.counts, self.recent = _rebuild()(
            self.counts, self.recent,
            *(device_array(self.mesh, a) for a in (slots, prompt, output, recent)))


@functools.cache
def _rebuild():
    import jax

    def rebuild(counts, recent, slots, prompt, output, last):
        counts = counts.at[slots].set(0, mode="drop")
        rows = slots[:, None]
        counts = counts.at[rows, prompt].set(IN_PROMPT, mode="drop")
        counts = counts.at[rows, output].add(1, mode="drop")
        return counts, recent.at[slots].set(last, mode="drop")
    return jax.jit(rebuild, donate_argnums=(0, 1))


_COUNTS: list[TokenCounts] = []  # the runner's, once a request asks (one engine a process)


def bytes_a_chip(slots: int, vocab: int) -> int:
    """What TokenCounts holds on each chip (replicated)."""
    return 4 * slots * (vocab + RECENT)


def allocated_bytes_a_chip() -> int:
    """What this process's TokenCounts hold on each chip (0: none allocated yet)."""
    return bytes_a_chip(_COUNTS[0].slots, _COUNTS[0].vocab) if _COUNTS else 0


def allocate(mesh, slots: int, vocab: int) -> TokenCounts:
    """A starting engine's TokenCounts, in place of an earlier engine's."""
    _COUNTS[:] = []  # the earlier one's buffers freed first
    _COUNTS.append(TokenCounts(mesh, slots, vocab))
    return _COUNTS[0]


def token_counts(mesh=None, slots: int = 0, vocab: int = 0) -> TokenCounts:
    """The engine's TokenCounts; made here (with these sizes) if start-up made none."""
    if not _COUNTS:
        _COUNTS.append(TokenCounts(mesh, slots, vocab))
    return _COUNTS[0]
