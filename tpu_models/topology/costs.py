"""What the TPU compiler says of one compiled program, read as soon as it compiles.

`tpu-models compile` compiles every program a server would (158 for one chip of
Gemma 3 1B) and runs none. Held until the report was written, the executables
grew the process steadily to 5.4 GB of RSS; their cost analysis, memory analysis
and HLO op counts are what the report needs, so those are kept and the
executable is let go (its HLO text too, unless --dump-hlo asks for it).
"""

import dataclasses
import re

# An HLO instruction's opcode: "%x = bf16[8,1024]{1,0} dot(%a, %b), ..."
_OPCODE = re.compile(r"^\s*(?:ROOT )?%?[\w.-]+ = .*?\s([a-z][\w-]*)\(", re.MULTILINE)


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
    hlo_text: str | None = None


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
                 hlo_ops=hlo_ops(text), hlo_text=text if keep_text else None)


def hlo_ops(hlo: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for opcode in _OPCODE.findall(hlo):
        counts[opcode] = counts.get(opcode, 0) + 1
    return dict(sorted(counts.items()))
