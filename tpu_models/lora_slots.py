"""Many LoRA adapters on one base, chosen per request (vLLM's --enable-lora).

Adapters sit in stacked device buffers, one slot each. A step hands the model
the buffers and every token's slot (`LoraBatch`), and each targeted projection adds

    y[t] += (x[t] @ A[slot[t]]) @ B[slot[t]]        (the adapter's scale folded into B)

as two batched contractions over all slots, a one-hot of the token's slot keeping
its own (slot -1, a base-model token, keeps none). Ranks are padded with zeros to
--max-lora-rank, so any mix of adapters runs the one compiled program; with LoRA
off the model gets no batch and runs exactly as before.

`AdapterSlots` is the engine's LoRA manager for our models (what vLLM's
LRUCacheWorkerLoRAManager is to its PyTorch models): it reads and checks PEFT
adapters (tpu_models.loaders.peft), keeps up to --max-cpu-loras of them on the host, and
puts the ones a batch uses into the --max-loras slots, least recently used out
first. tpu-inference builds a LoRA manager only for PyTorch models (its flax_nnx
loader returns none, and its LoraUtils reads a torch Punica wrapper): the seam
(tpu_models.adapt.lora) makes the slots the runner's manager (`serve_from_slots`),
maps each step's tokens onto slots (`set_active_loras`), hands the model the slots as
its `lora_metadata` argument (`AdapterSlots.batch`), and has the API server read and
check an adapter before the engine loads it (`load_refusal`).

Shapes: T tokens, S slots, R --max-lora-rank; a projection's input and output
axes as in its kernel (q_proj: in D, out N H; o_proj: in N H, out D).
"""

import contextlib
import dataclasses
import logging
from collections import OrderedDict

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tpu_inference.layers.jax.linear import JaxEinsum
from tpu_inference.utils import device_array

from tpu_models.loaders.hf import CheckpointError
from tpu_models.loaders.peft import LoraAdapter
from tpu_models.loaders.tables import PROJECTIONS

logger = logging.getLogger(__name__)


def _axes(einsum_str: str) -> tuple[str, str]:
    """"TD,DNH->TNH" -> ("D", "NH"): a projection's input and output axes, tokens first."""
    lhs, rest = einsum_str.split(",")
    return lhs[1:], rest.split("->")[1][1:]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoraBatch:
    """One step's adapters: the slot buffers and each token's slot."""
    slots: jax.Array  # [T] int32; -1: the base model
    # Both contract their leading axes, as a plain matrix product: with A as
    # [S, *in, R] (contracting its middle axes) XLA:CPU added 26 ms to a stack of
    # 112 width-1024 projections at one token, against 6 ms this way.
    a: dict[str, jax.Array]  # projection prefix -> [*in, S, R]
    b: dict[str, jax.Array]  # projection prefix -> [S, R, *out], scale folded in

    def add(self, proj: JaxEinsum, x: jax.Array, y: jax.Array) -> jax.Array:
        a = self.a.get(proj.prefix)
        if a is None:
            return y
        ins, outs = _axes(proj.einsum_str)
        pick = jax.nn.one_hot(self.slots, a.shape[-2], dtype=a.dtype)  # [T, S]
        xa = jnp.einsum(f"t{ins},{ins}sr->tsr", x.astype(a.dtype), a)  # [T, S, R]
        delta = jnp.einsum(f"tsr,sr{outs}->t{outs}", xa * pick[:, :, None],
                           self.b[proj.prefix])  # [T, *out]
        return y + delta.astype(y.dtype)


def project(proj: JaxEinsum, x: jax.Array, lora: LoraBatch | None) -> jax.Array:
    """proj(x), plus each token's adapter when the step has LoRA."""
    y = proj(x)
    return y if lora is None else lora.add(proj, x, y)


@dataclasses.dataclass(frozen=True)
class Target:
    """A projection adapters may target, as its kernel lays it out."""
    ins: tuple[int, ...]
    outs: tuple[int, ...]
    in_axes: tuple  # mesh axes of the input dims (the kernel's sharding)
    out_axes: tuple


def targets(model) -> dict[str, Target]:
    """Projection prefix (HF module name) -> Target, for every q/k/v/o/gate/up/down."""
    found = {}
    for _, node in nnx.iter_graph(model):
        if not isinstance(node, JaxEinsum) or node.prefix.rsplit(".", 1)[-1] not in PROJECTIONS:
            continue
        ins, _ = _axes(node.einsum_str)
        kernel = node.einsum_str.split(",")[1].split("->")[0]
        shape = tuple(node.kernel_shape)
        axes = _kernel_axes(node.weight, shape)
        is_in = [letter in ins for letter in kernel]
        found[node.prefix] = Target(
            ins=tuple(n for n, i in zip(shape, is_in) if i),
            outs=tuple(n for n, i in zip(shape, is_in) if not i),
            in_axes=tuple(a for a, i in zip(axes, is_in) if i),
            out_axes=tuple(a for a, i in zip(axes, is_in) if not i))
    return found


def _kernel_axes(weight, shape) -> tuple:
    """The mesh axes a kernel is split along, one per dim."""
    if hasattr(weight, "get_metadata"):  # an nnx.Param: its declared sharding
        axes = weight.get_metadata().get("out_sharding")
    else:  # Qwix's quantized kernel (WithAux): the quantized array keeps the sharding
        leaf = next(x for x in jax.tree.leaves(weight.array) if tuple(x.shape) == shape)
        axes = tuple(getattr(leaf.sharding, "spec", ()))
    return tuple(axes or ()) + (None, ) * (len(shape) - len(axes or ()))


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names it and the fault."""


def read_adapter(name: str, path: str, *, base_table, max_rank: int) -> LoraAdapter:
    """Reads and checks a PEFT adapter for this base: what load_lora_adapter refuses
    with a 400 (the API server) and what the engine refuses before a slot changes."""
    try:
        adapter = LoraAdapter(path)
        if adapter.rank > max_rank:
            raise CheckpointError(f"LoRA adapter {path}: rank r={adapter.rank} is above "
                                  f"--max-lora-rank {max_rank}")
        adapter.check_base(base_table)
    except CheckpointError as e:
        raise AdapterError(f"LoRA adapter {name!r}: {e}") from e
    return adapter


class AdapterSlots:
    """The engine's LoRA manager for our models (the interface vLLM's model-runner
    LoRA mixin calls: add/remove/pin/list adapters, set_active_adapters, the
    warm-up's dummy adapters), over stacked device buffers."""

    def __init__(self, model, lora_config, mesh: Mesh, base_table: dict, dtype):
        self.targets = targets(model)
        self.base_table = base_table
        self.num_slots = lora_config.max_loras
        self.max_rank = lora_config.max_lora_rank
        self.host_capacity = max(lora_config.max_cpu_loras or 0, self.num_slots)
        self.mesh = mesh
        S, R = self.num_slots, self.max_rank
        self.a = {p: self._zeros((*t.ins, S, R), (*t.in_axes, None, None), dtype)
                  for p, t in self.targets.items()}
        self.b = {p: self._zeros((S, R, *t.outs), (None, None, *t.out_axes), dtype)
                  for p, t in self.targets.items()}
        self.host: OrderedDict[int, dict] = OrderedDict()  # lora id -> weights, LRU first
        self.pinned: set[int] = set()
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # lora id -> slot, LRU first
        self.slots = self._replicated(np.full(1, -1, np.int32))
        self._slot_index: dict[int, jax.Array] = {}  # slot -> its index on the device
        # No donation: a step in flight (async scheduling) may still read the old buffers.
        self._write = jax.jit(_write_slot, out_shardings=(
            jax.tree.map(lambda x: x.sharding, self.a), jax.tree.map(lambda x: x.sharding, self.b)))

    def _zeros(self, shape, axes, dtype) -> jax.Array:
        return device_array(self.mesh, np.zeros(shape, dtype), sharding=NamedSharding(self.mesh, P(*axes)))

    def _replicated(self, array: np.ndarray) -> jax.Array:
        return device_array(self.mesh, array, sharding=NamedSharding(self.mesh, P()))

    # --- the host cache ------------------------------------------------------------

    def add_adapter(self, request, keep=()) -> bool:
        """Reads the adapter into the host cache (False: it was there), evicting
        the least recently used one not in `keep` when the cache is full."""
        if request.lora_int_id in self.host:
            self.host.move_to_end(request.lora_int_id)
            return False
        adapter = read_adapter(request.lora_name, request.lora_path,
                               base_table=self.base_table, max_rank=self.max_rank)
        self._cache(request, self._host_weights(adapter), keep)
        logger.info("tpu-models: LoRA adapter %r (rank %d, %d projections) from %s",
                    request.lora_name, adapter.rank, len(adapter.targets), request.lora_path)
        return True

    def _host_weights(self, adapter: LoraAdapter) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """prefix -> (A [*in, R], B [R, *out]): PEFT's A [r, in] and B [out, r]
        transposed, the scale folded into B, zero-padded to R."""
        weights, r, R = {}, adapter.rank, self.max_rank
        for name, (a, b) in adapter.targets.items():
            t = self.targets[name.removesuffix(".weight")]
            A = np.zeros((*t.ins, R), np.float32)
            A[..., :r] = a.float().numpy().T.reshape(*t.ins, r)
            B = np.zeros((R, *t.outs), np.float32)
            B[:r] = (adapter.scale * b.float().numpy().T).reshape(r, *t.outs)
            weights[name.removesuffix(".weight")] = (A, B)
        return weights

    def _cache(self, request, weights: dict, keep=()) -> None:
        self.host[request.lora_int_id] = weights
        while len(self.host) > self.host_capacity:
            victim = next((i for i in self.host
                           if i not in self.pinned and i not in keep and i != request.lora_int_id),
                          None)
            if victim is None:
                raise AdapterError(f"LoRA adapter {request.lora_name!r}: all {self.host_capacity} "
                                   "host slots (--max-cpu-loras) hold pinned adapters or this batch's")
            self.remove_adapter(victim)

    def remove_adapter(self, lora_id: int) -> bool:
        self.pinned.discard(lora_id)
        self.slot_of.pop(lora_id, None)  # its slot is free; stale weights are never picked
        return self.host.pop(lora_id, None) is not None

    def remove_all_adapters(self) -> None:
        for lora_id in list(self.host):
            self.remove_adapter(lora_id)

    def list_adapters(self) -> set[int]:
        return set(self.host)

    def pin_adapter(self, lora_id: int) -> bool:
        if lora_id not in self.host:
            raise AdapterError(f"LoRA adapter id {lora_id} is not loaded; it cannot be pinned")
        self.pinned.add(lora_id)
        return True

    # --- the device slots ----------------------------------------------------------

    def set_active_adapters(self, requests, mapping) -> None:
        """Puts this step's adapters into slots and maps its tokens onto them
        (`mapping.index_mapping`: each token's lora id, 0 for the base)."""
        wanted = {r.lora_int_id: r for r in requests if r is not None and r.lora_int_id > 0}
        if len(wanted) > self.num_slots:
            raise AdapterError(f"{len(wanted)} LoRA adapters in one batch; --max-loras is "
                               f"{self.num_slots}")
        for request in wanted.values():  # on the host first: reading one may evict another
            self.add_adapter(request, keep=wanted)
        for lora_id in wanted:
            self._slot(lora_id, keep=wanted)
        lookup = {0: -1, **{i: self.slot_of[i] for i in wanted}}
        ids = list(mapping.index_mapping)
        if unknown := set(ids) - lookup.keys():  # never served as the base by mistake
            raise AdapterError(f"tokens for LoRA adapter ids {sorted(unknown)}, which no "
                               "request of the batch names")
        self.slots = self._replicated(np.array([lookup[i] for i in ids], np.int32))

    def _slot(self, lora_id: int, keep) -> int:
        if lora_id in self.slot_of:
            self.slot_of.move_to_end(lora_id)
            return self.slot_of[lora_id]
        # Every projection is written (zeros where the adapter has none), so the
        # write compiles once whatever an adapter targets.
        weights, R = self.host[lora_id], self.max_rank
        a = {p: np.asarray(weights[p][0] if p in weights else np.zeros((*t.ins, R)), self.a[p].dtype)
             for p, t in self.targets.items()}
        b = {p: np.asarray(weights[p][1] if p in weights else np.zeros((R, *t.outs)), self.b[p].dtype)
             for p, t in self.targets.items()}
        return self._store(lora_id, self._free_slot(keep), a, b)

    def _free_slot(self, keep) -> int:
        used = set(self.slot_of.values())
        if free := [s for s in range(self.num_slots) if s not in used]:
            return free[0]
        victim = next(i for i in self.slot_of if i not in keep)  # the least recently used
        return self.slot_of.pop(victim)

    def _store(self, lora_id: int, slot: int, a: dict, b: dict) -> int:
        if not _abstract(self.a):  # `tpu-models compile`: shapes only, nothing runs
            if slot not in self._slot_index:  # to the device once (see write_pinned)
                self._slot_index[slot] = self._replicated(np.array(slot, np.int32))
            self.a, self.b = self._write(self.a, self.b, a, b, self._slot_index[slot])
        self.slot_of[lora_id] = slot
        return slot

    def write_pinned(self, lora_id: int, a: dict, b: dict) -> None:
        """Writes an adapter whose A and B are already on the device in the slots'
        layout (every target, padded to R: a trainer's, synced in memory), pinned,
        into the slot it holds or a free one. Nothing crosses from the host: Tunix
        syncs under a guard against host transfers. The host cache keeps the
        arrays, to re-slot it from if another adapter takes its slot."""
        slot = self.slot_of[lora_id] if lora_id in self.slot_of else self._free_slot(keep=())
        self._store(lora_id, slot, a, b)
        self.host[lora_id] = {p: (a[p], b[p]) for p in a}
        self.pinned.add(lora_id)

    def batch(self) -> LoraBatch:
        return LoraBatch(self.slots, self.a, self.b)

    # --- the warm-up's adapters (vLLM's precompilation) ----------------------------

    @contextlib.contextmanager
    def dummy_lora_cache(self):
        yield

    def get_dummy_lora_warmup_rank(self, rank: int) -> int:
        return rank

    def add_dummy_lora(self, request, rank: int) -> bool:
        """A zero adapter: it changes nothing, and compiles the same program."""
        if request.lora_int_id in self.host:
            return False
        self._cache(request, {})
        return True


# --- vLLM's runner and API server, handing the slots its LoRA requests ----------------


def serve_from_slots(runner) -> None:
    """A runner whose model (ours, --enable-lora) is loaded gets its AdapterSlots as
    its lora_manager, and computes logits without the step's LoraBatch."""
    runner.lora_manager = runner.model.adapter_slots(runner.mesh)
    runner.compute_logits_fn = _WithoutLora(runner.compute_logits_fn)


class _WithoutLora:
    """compute_logits without the step's LoRA batch: the vocab projection is no
    target, and per-token slots would give it a new shape to compile per batch.
    The runner's warm-up lowers it, hence `lower`."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, state, hidden, _lora=None, **kwargs):
        return self.fn(state, hidden, None, **kwargs)

    def lower(self, state, hidden, _lora=None, **kwargs):
        return self.fn.lower(state, hidden, None, **kwargs)


def of_runner(runner) -> AdapterSlots | None:
    """The runner's AdapterSlots, where it `serve_from_slots`."""
    manager = getattr(runner, "lora_manager", None)
    return manager if isinstance(manager, AdapterSlots) else None


def set_active_loras(runner, num_scheduled_tokens_per_req, total_num_scheduled_tokens,
                     padded_total_num_scheduled_tokens) -> None:
    """The step's adapters into the runner's slots, each token mapped onto its
    request's (the padding rows onto the last request's)."""
    counts = np.copy(num_scheduled_tokens_per_req)
    counts[-1] += padded_total_num_scheduled_tokens - total_num_scheduled_tokens
    prompt, tokens, requests = runner.input_batch.make_lora_inputs(counts)
    runner._set_active_loras(prompt, tokens, requests)


def load_refusal(request, base_table, max_rank: int):
    """The API server's answer to a load_lora_adapter `request` whose adapter the
    slots cannot take: a 400 naming the fault (vLLM answers any failure inside the
    engine with a 500), or None."""
    from http import HTTPStatus

    from vllm.entrypoints.serve import create_error_response
    try:
        read_adapter(request.lora_name, request.lora_path, base_table=base_table,
                     max_rank=max_rank)
    except AdapterError as e:
        return create_error_response(message=str(e), err_type="BadRequestError",
                                     status_code=HTTPStatus.BAD_REQUEST)
    return None


def _abstract(buffers: dict) -> bool:
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in buffers.values())


def _write_slot(a, b, new_a, new_b, slot):
    """The buffers with `slot` holding the new adapter (A's slot axis is its
    second last, B's its first)."""
    return ({p: buf.at[..., slot, :].set(new_a[p]) for p, buf in a.items()},
            {p: buf.at[slot].set(new_b[p]) for p, buf in b.items()})
