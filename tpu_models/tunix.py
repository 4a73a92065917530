"""Tunix's vLLM rollouts on our models: the trainer's weights (and LoRA) synced in memory.

    import tpu_models.tunix as tpu_tunix    # prepares the host, adapts Tunix's VllmSampler
    rollout_config = RolloutConfig(
        rollout_vllm_model_version=HF_DIR,      # config.json and tokenizer; weights unread
        rollout_vllm_init_with_random_weights=True,
        rollout_mapping_config=tpu_tunix.mapping_config(model, lora_alpha=ALPHA), ...)

Tunix (google-tunix 0.1.5) runs vLLM in the trainer's process with dummy
weights, then copies the trainer's state into the engine through a
`MappingConfig` at load and after every step. Its own copy maps one trainer
leaf onto one engine leaf; Gemma 3's trainer fuses k and v (`kv_einsum`), so
`RolloutMapping.sync` does the copy instead (the seam routes it there:
tpu_models.adapt.tunix_rollout; what else it changes of Tunix's sampler:
tpu_models.tunix_sampler), from the tables the exporter already uses:

    trainer leaf --Rule (loaders/tunix.py, <arch>/checkpoints.py)--> HF tensor
                 --our kernel's layout (its einsum)--------------> engine leaf

all in one jitted program, device to device, each output placed as the engine
shards it. Before anything is written, every engine weight must have its trainer
leaf and every trainer leaf an engine weight, shapes equal: a partial or wrong
sync is refused by name, never served with weights left random.

LoRA (qwix's `<w>_lora_a` / `<w>_lora_b`, scaled by alpha / rank):
- "slots" (default): the base is written once; each step writes only A and B
  into the engine's LoRA slot (tpu_models.lora_slots), and every rollout runs
  with that adapter (vLLM is started with --enable-lora for it);
- "merged": each step writes W + B A * alpha / rank into the served weights,
  from the base kept (by reference) from the first sync.
"""

import dataclasses
import os
import re
from typing import Any

from tpu_models import host

# Before vLLM or tpu-inference is imported: off-TPU, JAX on the CPU and a TPU
# identity (tpu-inference would ask a metadata server); our flax_nnx models.
host.setup_host()
os.environ.setdefault("MODEL_IMPL_TYPE", "flax_nnx")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from einops import rearrange  # noqa: E402
from flax import nnx  # noqa: E402
from tunix.generate.mappings import MappingConfig  # noqa: E402

from tpu_models import registry  # noqa: E402
from tpu_models.loaders.conversion_rules import expand  # noqa: E402
from tpu_models.tunix_sampler import ADAPTER_ID  # noqa: E402

LORA_MODES = ("slots", "merged")


class SyncError(ValueError):
    """A trainer state that cannot be synced into the engine; names the leaf at fault."""


def mapping_config(model: nnx.Module, *, lora_alpha: float | None = None,
                   lora: str = "slots", async_scheduling: bool | None = None) -> "RolloutMapping":
    """What Tunix takes as `RolloutConfig.rollout_mapping_config` for `model`, a Tunix
    model our engine serves (its full weights, and its qwix LoRA if it has one).
    `async_scheduling`: vLLM's (None: vLLM's default, on; Tunix's config turns it
    off unless it says True)."""
    if lora not in LORA_MODES:
        raise ValueError(f"lora={lora!r}: one of {', '.join(LORA_MODES)}")
    leaves = trainer_leaves(nnx.state(model))
    arch = _architecture(leaves)
    rank = _lora_rank(leaves)
    if rank and lora_alpha is None:
        raise SyncError("the model has qwix LoRA parameters: pass lora_alpha (the alpha of "
                        "its qwix.LoraProvider; the update is B A * alpha / rank)")
    rules = arch.tunix.weight_rules(leaves)
    dtypes = [a.dtype for kind, a in leaves.values() if kind == "param"]
    return RolloutMapping(
        to_hf_mappings={_dotted(rule.source): (_dotted(hf), None)
                        for hf, rule in rules.items() if rule.index is None},
        architecture=arch.hf_name, lora_alpha=lora_alpha, lora_rank=rank,
        lora_mode=lora if rank else None, dtype=str(max(set(dtypes), key=dtypes.count)),
        async_scheduling=async_scheduling)


@dataclasses.dataclass
class RolloutMapping(MappingConfig):
    """A Tunix MappingConfig whose copy is ours (`sync`). `to_hf_mappings` lists the
    one-to-one names, for reading; fused leaves are split by `sync` alone."""
    architecture: str = ""  # the HF architecture the engine serves
    lora_alpha: float | None = None
    lora_rank: int = 0  # the trainer's LoRA rank (0: no LoRA)
    lora_mode: str | None = None  # "slots" | "merged" | None (no LoRA)
    # The engine's --dtype: the trainer's, so that rollout log-probabilities are its
    # (vLLM would serve a float32 checkpoint in bfloat16).
    dtype: str | None = None
    # vLLM's --async-scheduling for the rollouts (None: vLLM's default; Tunix says False).
    async_scheduling: bool | None = None
    _plan: Any = dataclasses.field(default=None, repr=False)

    def sync(self, state: nnx.State, runner) -> dict[str, int]:
        """Writes the trainer's `state` (all of it, or its LoRA parameters only) into
        the engine `runner`'s weights; returns how many leaves of each kind moved."""
        leaves = trainer_leaves(state)
        if self._plan is None:
            self._plan = _Plan(self, runner, leaves)
        return self._plan.sync(leaves)


def trainer_leaves(state: nnx.State) -> dict[str, tuple[str, jax.Array]]:
    """"layers/0/attn/q_einsum/w" -> (kind, array): kind "param" or "lora"; the
    rest (RNG state, caches) is not a weight."""
    out = {}
    for path, var in nnx.to_flat_state(state):
        kind = ("lora" if isinstance(var, nnx.LoRAParam) else
                "param" if isinstance(var, nnx.Param) else None)
        if kind:
            out["/".join(str(p) for p in path)] = (kind, var.get_value())
    return out


def _architecture(leaves) -> registry.Architecture:
    names = [n for n, (kind, _) in leaves.items() if kind == "param"]
    if not names:
        raise SyncError("the model's nnx.state holds no parameter (a qwix LoRA model made "
                        "before `import tpu_models.tunix`, whose seam keeps it a graph? "
                        "import it first)")
    for arch in registry.architectures():
        if arch.tunix is not None and arch.model is not None and arch.tunix.matches(names):
            return arch
    raise SyncError(f"not a Tunix model tpu-models serves (first leaves: {sorted(names)[:4]}; "
                    f"Tunix families: {', '.join(a.hf_name for a in registry.architectures() if a.tunix)})")


def _lora_rank(leaves) -> int:
    ranks = {a.shape[-1] for n, (kind, a) in leaves.items() if kind == "lora" and n.endswith("_lora_a")}
    if len(ranks) > 1:
        raise SyncError(f"LoRA parameters of ranks {sorted(ranks)}: one rank per model")
    return ranks.pop() if ranks else 0


def _dotted(name: str) -> str:
    return name.replace("/", ".").replace("{i}", "*")


def _layer(name: str) -> tuple[int | None, str]:
    """"layers/3/attn/q_einsum/w" -> (3, "layers/{i}/attn/q_einsum/w")."""
    m = re.match(r"^(.*?layers)/(\d+)/(.*)$", name)
    return (int(m.group(2)), f"{m.group(1)}/{{i}}/{m.group(3)}") if m else (None, name)


def _kernel_layout(einsum_str: str) -> str:
    """"TD,DNH->TNH" -> "(N H) D -> D N H": HF's [out, in] weight as the kernel lays it
    out (as tpu-inference's loader reads HF weights into an einsum)."""
    lhs, rest = einsum_str.replace(" ", "").split(",")
    kernel = rest.split("->")[0]
    ins = [a for a in kernel if a in lhs[1:]]
    outs = [a for a in kernel if a not in ins]
    return f"({' '.join(outs)}) ({' '.join(ins)}) -> {' '.join(kernel)}"


def _engine_weights(runner, arch, hf_shapes, rules) -> tuple[dict, dict]:
    """Each engine weight's (Rule, einops layout from HF's or None) and its nnx.Variable,
    by its HF name; a weight outside the HF table or without a trainer leaf is refused."""
    from tpu_inference.layers.jax.linear import JaxEinsum
    einsums = {node.prefix: node.einsum_str for _, node in nnx.iter_graph(runner.model)
               if isinstance(node, JaxEinsum)}
    weights, params = {}, {}
    for path, var in nnx.to_flat_state(runner.state):
        if not isinstance(var, nnx.Param):
            continue
        name = ".".join(str(p) for p in path)
        if name not in hf_shapes:
            raise SyncError(f"engine weight {name} is not in the {arch.hf_name} checkpoint "
                            "table (a quantized or extended model is not synced)")
        if name not in rules:
            raise SyncError(f"engine weight {name} has no trainer leaf in Tunix's "
                            f"{arch.hf_name} layout")
        prefix = name.rsplit(".", 1)[0]
        layout = (_kernel_layout(einsums[prefix])
                  if prefix in einsums and name.endswith(".weight") else None)
        weights[name] = (rules[name], layout)
        params[name] = var
    return weights, params


class _Plan:
    """The engine's weights as functions of the trainer's leaves, checked once."""

    def __init__(self, mapping: RolloutMapping, runner, leaves):
        self.mapping, self.runner = mapping, runner
        arch = registry.by_hf_name(type(runner.model).__name__)
        if arch.hf_name != mapping.architecture:
            raise SyncError(f"the engine serves {arch.hf_name}; the mapping was made for a "
                            f"Tunix {mapping.architecture}")
        hf_config = runner.model_config.hf_text_config
        hf_shapes, _ = arch.hf_table(hf_config)
        base = {n for n, (kind, _) in leaves.items() if kind == "param"}
        if not base:
            raise SyncError("the first sync must hold the trainer's full weights (nnx.Param), "
                            "not its LoRA parameters alone")
        rules = expand(arch.tunix.weight_rules(base), hf_config.num_hidden_layers)
        # By engine path (its HF name): (Rule, einops HF -> ours or None); its nnx.Variable.
        self.weights, self.params = _engine_weights(runner, arch, hf_shapes, rules)
        self._check_every_leaf_used(base)
        self._check_shapes(leaves, base, hf_shapes)
        self.base = {}  # trainer base leaves, kept for LoRA-only syncs (references)
        self.lora = dict(arch.tunix.lora)
        self._find_slots(runner)
        shardings = {n: v.get_value().sharding for n, v in self.params.items()}
        # The engine's previous weights are donated: the new ones take their buffers
        # (no second copy of the model at the peak; nothing reads them between syncs).
        self._weights_jit = jax.jit(lambda _old, sources, lora: self._convert(sources, lora),
                                    donate_argnums=0, out_shardings=shardings)
        self._slots_jit = jax.jit(self._adapter)

    def _check_every_leaf_used(self, base: set[str]) -> None:
        """Every engine weight has its trainer leaf, and every trainer leaf a weight."""
        if missing := [f"{name} (from {rule.source})" for name, (rule, _) in
                       self.weights.items() if rule.source not in base]:
            raise SyncError(f"engine weights with no trainer leaf: {', '.join(missing[:4])}"
                            f"{' ...' if len(missing) > 4 else ''} ({len(missing)})")
        used = {rule.source for rule, _ in self.weights.values()}
        if unused := sorted(base - used):
            raise SyncError(f"trainer leaves with no engine weight: {', '.join(unused[:6])}"
                            f"{' ...' if len(unused) > 6 else ''} ({len(unused)})")

    def _check_shapes(self, leaves, base: set[str], hf_shapes) -> None:
        """The trainer's shapes, converted, are the HF tensors' and the engine's."""
        abstract = {n: jax.ShapeDtypeStruct(leaves[n][1].shape, leaves[n][1].dtype) for n in base}
        hf = jax.eval_shape(lambda s: {n: self._hf(n, s) for n in self.params}, abstract)
        for name in self.params:  # the exporter's check: the HF tensor config.json implies
            got, want = tuple(hf[name].shape), tuple(hf_shapes[name])
            if got != want:
                rule = self.weights[name][0]
                raise SyncError(f"trainer leaf {rule.source} {list(abstract[rule.source].shape)} "
                                f"gives {name} {list(got)}; the engine's config.json implies "
                                f"{list(want)} ({self.runner.model_config.model})")
        shapes = jax.eval_shape(lambda s: self._convert(s, {}), abstract)
        for name, var in self.params.items():  # and our kernels (vocabulary rows padded)
            if tuple(shapes[name].shape) != tuple(var.get_value().shape):
                raise SyncError(f"{name}: {list(shapes[name].shape)} from the trainer, "
                                f"{list(var.get_value().shape)} in the engine")

    def _find_slots(self, runner) -> None:
        """The engine's LoRA slots (lora='slots' writes the adapter there) and their targets."""
        from tpu_models.lora_slots import AdapterSlots, targets
        self.slots = runner.lora_manager if isinstance(
            getattr(runner, "lora_manager", None), AdapterSlots) else None
        if self.mapping.lora_mode == "slots" and self.slots is None:
            raise SyncError("lora='slots' needs the engine started with --enable-lora "
                            "(tpu_models.adapt.tunix_rollout adds it)")
        self.targets = targets(runner.model) if self.slots else {}

    # --- the conversion (traced) ---------------------------------------------------

    def _hf(self, name, sources):
        rule, _ = self.weights[name]
        return rule.to_hf_array(sources[rule.source])

    def _convert(self, sources, lora_leaves):
        """Engine weights from trainer leaves, LoRA merged when `lora_leaves` has some."""
        lora = self._peft(lora_leaves) if lora_leaves else {}
        out = {}
        for name, var in self.params.items():
            x = self._hf(name, sources)
            if name in lora:
                a, b = lora[name]
                x = x + (b.astype(jnp.float32) @ a.astype(jnp.float32)).astype(x.dtype)
            _, layout = self.weights[name]
            if layout:
                x = rearrange(x, layout, **self._sizes(var, layout))
            want = var.get_value().shape
            if x.shape[0] < want[0]:  # vocabulary padding rows: never sampled
                x = jnp.pad(x, [(0, want[0] - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
            out[name] = x.astype(var.get_value().dtype)
        return out

    @staticmethod
    def _sizes(var, layout: str) -> dict[str, int]:
        kernel = layout.split("->")[1].split()
        return dict(zip(kernel, var.get_value().shape))

    def _peft(self, leaves) -> dict[str, tuple]:
        """HF weight name -> (A [r, in], B [out, r] * alpha / rank), from qwix A and B."""
        scale = self.mapping.lora_alpha / self.mapping.lora_rank
        pairs = {}
        for name in sorted({n.rsplit("_lora_", 1)[0] for n in leaves}):
            layer, pattern = _layer(name)
            rules = self.lora.get(pattern)
            if rules is None:
                raise SyncError(f"trainer LoRA on {name}, which has no engine projection")
            a, b = leaves[f"{name}_lora_a"], leaves[f"{name}_lora_b"]
            for rule in rules:
                part = b if rule.index is None else jnp.take(b, rule.index, axis=1)
                pairs[rule.module.format(i=layer) + ".weight"] = (
                    rearrange(a, rule.a), rearrange(part, rule.b) * scale)
        return pairs

    def _adapter(self, lora_leaves):
        """The slot buffers' layout (tpu_models.lora_slots): A [*in, R], B [R, *out],
        zero where the trainer has no LoRA, ranks padded to the slots' R."""
        pairs, R = self._peft(lora_leaves), self.slots.max_rank
        a_out, b_out = {}, {}
        for prefix, t in self.targets.items():
            dtype = self.slots.a[prefix].dtype
            pair = pairs.get(prefix + ".weight")
            if pair is None:
                a_out[prefix] = jnp.zeros((*t.ins, R), dtype)
                b_out[prefix] = jnp.zeros((R, *t.outs), dtype)
                continue
            a, b = pair
            r = a.shape[0]
            a = a.T.reshape(*t.ins, r)
            b = b.T.reshape(r, *t.outs)
            a_out[prefix] = jnp.pad(a, [(0, 0)] * len(t.ins) + [(0, R - r)]).astype(dtype)
            b_out[prefix] = jnp.pad(b, [(0, R - r)] + [(0, 0)] * len(t.outs)).astype(dtype)
        return a_out, b_out

    # --- one sync ----------------------------------------------------------------

    def sync(self, leaves) -> dict[str, int]:
        base = {n: a for n, (kind, a) in leaves.items() if kind == "param"}
        lora = {n: a for n, (kind, a) in leaves.items() if kind == "lora"}
        if base:
            if missing := sorted(set(self.base or base) - set(base)):
                raise SyncError(f"a sync with some base weights and not others: {missing[:4]}")
            self.base = base
        moved = {"weights": 0, "adapter": 0}
        if lora and self.mapping.lora_rank == 0:
            raise SyncError("the trainer now has LoRA parameters; the mapping was made without "
                            "(call mapping_config on the LoRA model)")
        merge = lora and self.mapping.lora_mode == "merged"
        if base or merge:
            new = self._weights_jit({n: v.get_value() for n, v in self.params.items()},
                                    self.base, lora if merge else {})
            for name, var in self.params.items():
                var.set_value(new[name])
            moved["weights"] = len(new)
        if lora and self.mapping.lora_mode == "slots":
            a, b = self._slots_jit(lora)
            self.slots.write_pinned(ADAPTER_ID, a, b)
            moved["adapter"] = len(lora)
        return moved


def _install() -> None:
    from tpu_inference.logger import init_logger

    from tpu_models import features, patching
    from tpu_models.adapt import tunix_rollout  # the seam, wired here as by the plugin
    patching.install(tunix_rollout.PATCHES, init_logger("tpu_models.tunix"))
    if reason := features.refused().get(features.TUNIX_ROLLOUTS.name):
        raise features.AdaptationError(f"tpu-models: {reason}")


_install()
