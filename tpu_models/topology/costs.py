"""What the TPU compiler says of one compiled program, read as soon as it compiles.

`tpu-models compile` compiles every program a server would (158 for one chip of
Gemma 3 1B) and runs none. Held until the report was written, the executables
grew the process steadily to 5.4 GB of RSS; their cost analysis, memory analysis
and HLO op counts are what the report needs, so those are kept and the
executable is let go (its HLO text too, unless --dump-hlo or --explain asks for
it: then kept compressed, 374 MB of text for a 0.6B shape's 158 programs).
"""

import dataclasses
import re
import zlib

# An HLO instruction's opcode: "%x = bf16[8,1024]{1,0} dot(%a, %b), ..."
_OPCODE = re.compile(r"^\s*(?:ROOT )?%?[\w.-]+ = .*?\s([a-z][\w-]*)\(", re.MULTILINE)
# A Pallas kernel's call (the attention kernel's, RPA v3), whose cost the compiler
# cannot see: "%RPAd-... = (...) custom-call(%a, %b), custom_call_target="tpu_custom_call"".
_KERNEL_TARGET = 'custom_call_target="tpu_custom_call"'
_KERNEL_OPERANDS = re.compile(r" custom-call\(([^)]*)\), " + re.escape(_KERNEL_TARGET))
_ENTRY = re.compile(r"^ENTRY %[\w.-]+ \((.*)\) -> ", re.MULTILINE)
_SIGNATURE_PARAMETER = re.compile(r"([\w.-]+): ([a-z]\w*\[[\d,]*\])")


@dataclasses.dataclass(frozen=True)
class Costs:
    flops: float
    bytes_accessed: float
    optimal_seconds: float | None  # libtpu's own, not always sane
    argument_bytes: int
    output_bytes: int
    alias_bytes: int  # outputs that are donated inputs (a KV cache updated in place)
    temp_bytes: int
    hlo_ops: dict[str, int]  # instructions by opcode, fusions' bodies included
    # The program's inputs that its Pallas kernel calls take as they are, by their HLO
    # shape on a chip ("bf16[34118,64,1,2,128]": a layer's KV cache), one per input.
    kernel_inputs: tuple[str, ...] = ()
    hlo_compressed: bytes | None = None

    @property
    def hlo_text(self) -> str | None:
        if self.hlo_compressed is None:
            return None
        return zlib.decompress(self.hlo_compressed).decode()


def of(compiled, keep_text: bool = False) -> Costs:
    """A compiled program's (jax.stages.Compiled, or a warm-up's MeshExecutable) costs."""
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
    memory = compiled.memory_analysis()
    text = compiled.as_text()
    return Costs(flops=cost.get("flops", 0.0), bytes_accessed=cost.get("bytes accessed", 0.0),
                 optimal_seconds=cost.get("optimal_seconds"),
                 argument_bytes=memory.argument_size_in_bytes,
                 output_bytes=memory.output_size_in_bytes,
                 alias_bytes=memory.alias_size_in_bytes, temp_bytes=memory.temp_size_in_bytes,
                 hlo_ops=hlo_ops(text), kernel_inputs=kernel_inputs(text),
                 hlo_compressed=zlib.compress(text.encode(), 1) if keep_text else None)


def hlo_ops(hlo: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for opcode in _OPCODE.findall(hlo):
        counts[opcode] = counts.get(opcode, 0) + 1
    return dict(sorted(counts.items()))


def kernel_inputs(hlo: str) -> tuple[str, ...]:
    """The shapes of the entry parameters that Pallas kernel calls take directly (each
    parameter once): the attention kernel's KV cache, a layer each."""
    entry = _ENTRY.search(hlo)
    if entry is None:
        return ()
    shapes = dict(_SIGNATURE_PARAMETER.findall(entry.group(1)))
    taken: dict[str, str] = {}
    at = hlo.find(_KERNEL_TARGET)
    while at >= 0:  # str.find: a regex over every line took 0.2 s of a 46 MB backbone
        line = hlo[hlo.rfind("\n", 0, at) + 1:at + len(_KERNEL_TARGET)]
        if (call := _KERNEL_OPERANDS.search(line)) is not None:
            for operand in re.findall(r"%([\w.-]+)", call.group(1)):
                if operand in shapes:
                    taken[operand] = shapes[operand]
        at = hlo.find(_KERNEL_TARGET, at + 1)
    return tuple(taken.values())


def hlo_shape(dtype: str, shape: tuple[int, ...]) -> str:
    """An array's shape as HLO text writes it: ("bfloat16", (8, 128)) -> "bf16[8,128]"."""
    name = {"bool": "pred", "bfloat16": "bf16"}.get(dtype)
    if name is None:
        name = re.sub(r"^float8_", "f8", dtype)
        name = re.sub(r"^float", "f", re.sub(r"^uint", "u", re.sub(r"^int", "s", name)))
    return f"{name}[{','.join(map(str, shape))}]"
