"""Where a compiled program's bytes go: `tpu-models compile --explain PROGRAM`.

An estimate from the compiler's optimized HLO, never a measurement. libtpu's cost
analysis gives one figure for a whole program, the bytes it accesses (the report's
"MB accessed" and "est. ms"). That figure is counted again here instruction by
instruction from the optimized HLO text, the way XLA's cost analysis counts:
each instruction's operands and result at their tiled (padded) sizes, an operand
that a fusion only slices or gathers at the slices' size, a DMA's completion
(`copy-done`, `slice-done`) by its result, a `slice-start` by its slice read and
written, a conditional's largest branch, a while loop's body once a trip (once
where the HLO gives no trip count), a custom call (a Pallas kernel's) as nothing.
Each count goes to a group:

- weights: the reads of the program's parameters that hold model weights, told by
  their shape on a chip (the accounting's live weight buffers);
- KV cache: reads of the KV-cache parameters outside the attention kernel, and
  writes into them;
- collectives: all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute;
- copies and pads: copy, copy-start/-done and slice-start/-done (prefetches into
  VMEM), pad, transpose, reshape, slice, concatenate, bitcast-convert, fusions of
  nothing else, and the reads of what a copy wrote (a weight prefetched counts once
  as weights); of them, the bytes of arrays in VMEM (memory space 1, `S(1)` in their
  layout): a prefetch's destination and its reader's reads, on-chip, no HBM bytes;
- activations: everything else (step inputs, temporaries, outputs).

What the compiler counted beyond these (or these beyond it) is "other": little
for the backbone, the sampler and the logits (under 2% on a 0.6B shape), most of
a program of a few MB, where libtpu counts more than operands and results. The
attention kernel is a Pallas call the compiler does not see into (it counts
nothing for it): its paged KV-cache reads are given beside the compiler's figure,
from the kernel's arithmetic (compile_report.KvReads).
"""

import collections
import dataclasses
import functools
import math
import re

from tpu_models.server.tools.compile_report import COLLECTIVES
from tpu_models.topology import costs as program_costs
from tpu_models.topology.accounting import (
    DRAFT_WEIGHTS, KV_CACHE, PROGRAMS, WEIGHTS, shard_shapes)

WEIGHTS_GROUP, KV_GROUP, ACTIVATIONS, COLLECTIVES_GROUP, COPIES = (
    "weights", "KV cache", "activations", "collectives", "copies and pads")
GROUPS = (WEIGHTS_GROUP, KV_GROUP, ACTIVATIONS, COLLECTIVES_GROUP, COPIES)
_MOVES = {"copy", "copy-start", "copy-done", "pad", "transpose", "reshape", "slice",
          "slice-start", "slice-done", "concatenate", "bitcast-convert"}
_FUSED_MOVES = _MOVES | {"parameter", "constant", "bitcast", "broadcast", "tuple",
                         "get-tuple-element"}
# Counted as nothing by the compiler: no data moves, or (custom calls) it cannot tell.
_UNCOUNTED = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "partition-id",
              "replica-id", "after-all", "custom-call"}
_SLICING = {"slice", "dynamic-slice", "gather"}
_PREFETCHES = {"copy", "copy-start", "copy-done", "slice-start", "slice-done"}  # DMAs' results
_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "f16": 16,
         "bf16": 16, "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64,
         "c64": 64, "c128": 128}
_ARRAY = re.compile(r"([a-z]\w*)\[([\d,]*)\](?:\{([^}]*)\})?")
_HEADER = re.compile(r"^(ENTRY )?%([\w.-]+) .*\{$")
_CALLED = re.compile(r"(?:to_apply|true_computation|false_computation)=(%[\w.-]+)"
                     r"|branch_computations=\{([^}]*)\}")
_OP = re.compile(r"^\s*(?:ROOT )?%([\w.-]+) = (.*?) ([a-z][\w-]*)\((.*?)\)(.*)$")


class ProgramNotFound(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]  # names; a parameter's number
    attributes: str


def parse(hlo: str) -> tuple[dict[str, list[Op]], str]:
    """(each computation's instructions, the entry computation's name)."""
    computations: dict[str, list[Op]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        if current is None:
            if header := _HEADER.match(line):
                current = computations.setdefault(header.group(2), [])
                entry = header.group(2) if header.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif op := _OP.match(line):
            name, shape, opcode, operands, attributes = op.groups()
            names = (operands.strip(),) if opcode == "parameter" else tuple(
                re.findall(r"%([\w.-]+)", operands))
            current.append(Op(name, shape, opcode, names, attributes))
    return computations, entry


@functools.lru_cache(maxsize=4096)
def shape_bytes(shape: str) -> int:
    """Bytes of a shape (a tuple's arrays added) as the TPU lays it out."""
    return sum(_array_bytes(*array) for array in _ARRAY.findall(shape))


@functools.lru_cache(maxsize=4096)
def vmem_share(shape: str) -> float:
    """The share of a shape's bytes in arrays placed in VMEM (memory space 1)."""
    arrays = _ARRAY.findall(shape)
    total = sum(_array_bytes(*a) for a in arrays)
    vmem = sum(_array_bytes(*a) for a in arrays if "S(1)" in a[2])
    return vmem / total if total else 0.0


def _array_bytes(dtype: str, dims: str, layout: str) -> int:
    """An array's bytes, its minor dimensions padded to its tile (T(8,128): 8 rows of
    128 lanes). A DMA's sync flag (memory space 2) counts 4 KiB: libtpu's totals
    for a lone weight prefetch match with it."""
    shape = [int(d) for d in dims.split(",") if d]
    order, _, tiling = layout.partition(":")
    tile = re.match(r"T\(([\d,]+)\)", tiling)
    if tile and shape and len(order.split(",")) == len(shape):
        shape = [shape[int(i)] for i in reversed(order.split(","))]  # major to minor
        for j, t in enumerate(reversed([int(t) for t in tile.group(1).split(",")][-len(shape):])):
            shape[-1 - j] = -(-shape[-1 - j] // t) * t
    bits = _BITS.get(dtype, 8 if dtype.startswith("f8") else 0)
    size = math.prod(shape) * bits // 8
    return max(size, 4096) if "S(2)" in tiling else size


class Count:
    """The compiler's count of one program's bytes, instruction by instruction, in groups.

    `classes` says what an entry parameter holds, by its HLO shape on a chip
    (WEIGHTS_GROUP or KV_GROUP); any other parameter is a step input."""

    def __init__(self, hlo: str, classes: dict[str, str]):
        self.computations, self.entry = parse(hlo)
        self.producers = {op.name: op for ops in self.computations.values() for op in ops}
        self.classes = classes
        self.inputs = {op.name for op in self.computations[self.entry]
                       if op.opcode == "parameter"}
        self.bytes = collections.Counter()
        self.ops: dict[str, dict[str, list]] = {g: {} for g in GROUPS}  # op -> [kind, bytes, what]
        self._fused_reads: dict[str, dict[int, int]] = {}
        self.kernel_calls = 0  # Pallas calls: nothing in the compiler's count
        self.vmem_copies = 0.0  # of the copies' bytes, those of arrays in VMEM
        self._count(self.entry, 1)

    def _count(self, computation: str, times: int) -> None:
        for op in self.computations.get(computation, ()):
            if op.opcode in _UNCOUNTED:
                self.kernel_calls += 'custom_call_target="tpu_custom_call"' in op.attributes
                continue
            if op.opcode == "while":  # without a known trip count, once (as XLA's count)
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', op.attributes)
                for key in ("body", "condition"):
                    called = re.search(rf"{key}=%([\w.-]+)", op.attributes)
                    self._count(called.group(1), times * (int(trips.group(1)) if trips else 1))
            elif op.opcode in ("call", "conditional"):  # the largest branch, as XLA's count
                called = [name for found in _CALLED.finditer(op.attributes)
                          for name in re.findall(r"%([\w.-]+)", found.group(1) or found.group(2))]
                if called:
                    self._count(max(called, key=self._size_of), times)
            else:
                self._add(op, times)

    def _size_of(self, computation: str) -> int:
        """A computation's bytes, counted apart (nothing credited)."""
        kept = self.bytes, self.ops, self.kernel_calls, self.vmem_copies
        self.bytes, self.ops = collections.Counter(), {g: {} for g in GROUPS}
        self._count(computation, 1)
        size = sum(self.bytes.values())
        self.bytes, self.ops, self.kernel_calls, self.vmem_copies = kept
        return size

    def _add(self, op: Op, times: int) -> None:
        group = self._group_of(op)
        out_group, out_shape = group, op.shape
        if op.opcode == "slice-start":  # ((operand), slice, context): the slice read, written
            out_shape = "{}[{}]{{{}}}".format(*_ARRAY.findall(op.shape)[1])
        if not op.opcode.endswith("-done"):  # a DMA's completion: its result only
            fused = self._fused_reads_of(op) if op.opcode == "fusion" else {}
            for i, operand in enumerate(op.operands):
                source = self.producers.get(operand)
                n = shape_bytes(source.shape) if source else 0
                n = shape_bytes(out_shape) if out_shape != op.shape else min(n, fused.get(i, n))
                origin = self._origin(operand)
                self._credit(origin or group, op, n * times,
                             vmem_share(source.shape) if source else 0.0)
                if origin == KV_GROUP and source and source.shape == op.shape:
                    out_group = KV_GROUP  # the cache, updated in place
        self._credit(out_group, op, shape_bytes(out_shape) * times, vmem_share(out_shape))

    def _origin(self, name: str) -> str | None:
        """What a value is when a parameter's (weights, KV cache) or a copy's, through bitcasts,
        tuples and ConcatBitcast (DMA'd slices joined in place); None if computed here."""
        op = self.producers.get(name)
        while op is not None and (op.opcode in ("bitcast", "get-tuple-element")
                                  or '"ConcatBitcast"' in op.attributes):
            op = self.producers.get(op.operands[0]) if op.operands else None
        if op is None:
            return None
        if op.opcode == "parameter":
            held = self.classes.get(re.sub(r"\{.*", "", op.shape))
            return held if op.name in self.inputs else None
        return COPIES if op.opcode in _PREFETCHES else None

    def _group_of(self, op: Op) -> str:
        if re.sub(r"-(start|done)$", "", op.opcode) in COLLECTIVES:
            return COLLECTIVES_GROUP
        if op.opcode in _MOVES:
            return COPIES
        if op.opcode == "fusion" and all(
                inner.opcode in _FUSED_MOVES for inner in self.computations[_called(op)]):
            return COPIES
        return ACTIVATIONS

    def _fused_reads_of(self, op: Op) -> dict[int, int]:
        """Bytes a fusion reads of each operand it only slices or gathers (the slices)."""
        called = _called(op)
        if called not in self._fused_reads:
            body = self.computations[called]
            users = collections.defaultdict(list)
            for inner in body:
                for j, operand in enumerate(inner.operands):
                    users[operand].append((inner, j))
            reads = {}
            for inner in body:
                uses = users.get(inner.name, [])
                if inner.opcode == "parameter" and uses and all(
                        user.opcode in _SLICING and j == 0 for user, j in uses):
                    reads[int(inner.operands[0])] = sum(shape_bytes(u.shape) for u, _ in uses)
            self._fused_reads[called] = reads
        return self._fused_reads[called]

    def _credit(self, group: str, op: Op, n: int, in_vmem: float = 0.0) -> None:
        if not n:
            return
        self.bytes[group] += n
        if group == COPIES:
            self.vmem_copies += n * in_vmem
        entry = self.ops[group].setdefault(op.name, [_kind(op), 0, _what(op)])
        entry[1] += n


def _called(op: Op) -> str:
    return re.search(r"calls=%([\w.-]+)", op.attributes).group(1)


def _kind(op: Op) -> str:
    """An instruction's kind: its opcode, or a fusion's name as XLA made it from its ops."""
    if op.opcode != "fusion":
        return op.opcode
    stem = op.name.split(".")[0]
    kind = re.search(r"kind=(k\w+)", op.attributes)
    return f"{stem} ({kind.group(1)})" if stem == "fusion" and kind else stem


def _what(op: Op) -> str:
    """The JAX operation it came from (its metadata), without the jit wrappers."""
    name = re.search(r'op_name="([^"]*)"', op.attributes)
    return re.sub(r"^(jit\([^)]*\)/)+", "", name.group(1)) if name else ""


BASED_ON = ("libtpu's optimized HLO, each instruction's operand and result bytes as its "
            "cost analysis counts them; the compiler's estimate, not a measurement")


def parameter_classes(chip) -> dict[str, str]:
    """HLO shape on a chip -> what a parameter of that shape holds (weights, KV cache)."""
    classes = {}
    for holds, group in ((WEIGHTS, WEIGHTS_GROUP), (DRAFT_WEIGHTS, WEIGHTS_GROUP),
                         (KV_CACHE, KV_GROUP)):
        for key in shard_shapes(chip, holds):
            classes[program_costs.hlo_shape(*key)] = group
    return classes


def breakdown(count: Count, entry: dict, bandwidth: float, full_cache_ratio: float) -> dict:
    """A program's `explain`: its compiler bytes in groups, and its kernels' KV reads."""
    total = entry["bytes_accessed"]
    groups = {}
    for group in GROUPS:
        ops = sorted(count.ops[group].items(), key=lambda item: -item[1][1])
        groups[group] = {
            "bytes": count.bytes[group], "share": count.bytes[group] / total if total else 0.0,
            "estimated_seconds": count.bytes[group] / bandwidth,
            "ops": dict(collections.Counter(kind for _, (kind, _, _) in ops).most_common()),
            "largest": [{"op": name, "kind": kind, "bytes": n, "from": what}
                        for name, (kind, n, what) in ops[:3]]}
    groups[COPIES]["in_vmem_bytes"] = count.vmem_copies
    kv = entry["kv_read_bytes"]
    return {"based_on": BASED_ON, "groups": groups,
            "other_bytes": total - sum(count.bytes.values()),
            "kernel_calls": count.kernel_calls,
            "kv_reads": {"one_request_at_max_model_len_bytes": kv,
                         "full_cache_bytes": kv * full_cache_ratio,
                         "estimated_seconds": kv / bandwidth}}


def select(programs: list[dict], spec: str) -> list[int]:
    """Indices of the programs `spec` names: a program's name, then optionally its
    variant ("backbone tokens 16", or as the report labels it, "backbone (tokens 16,
    requests 256)")."""
    names = list(dict.fromkeys(p["name"] for p in programs))
    spec = spec.strip()
    name = max((n for n in names if spec == n or spec.startswith(n + " ")), key=len, default=None)
    if name is None:
        raise ProgramNotFound(f"--explain {spec!r}: no such program; the programs: "
                              f"{', '.join(names)}")
    wanted = {k: int(v) for k, v in re.findall(r"(tokens|requests)\s+(\d+)", spec[len(name):])}
    chosen = [i for i, p in enumerate(programs) if p["name"] == name
              and all(p.get(k) == v for k, v in wanted.items())]
    if not chosen:
        variants = sorted({_variant(p) for p in programs if p["name"] == name})
        raise ProgramNotFound(f"--explain {spec!r}: {name} has no such variant; its variants: "
                              f"{'; '.join(variants)}")
    return chosen


def _variant(program: dict) -> str:
    return ", ".join(f"{k} {program[k]}" for k in ("tokens", "requests") if program.get(k)) or "one"


def attach(report: dict, chip, spec: str) -> list[int]:
    """The `explain` of each program `spec` names, in the report; their indices.
    Raises ProgramNotFound (naming the programs there are)."""
    chosen = select(report["programs"], spec)
    classes = parameter_classes(chip)
    roof = report["decode_roofline"]
    one_request = roof["kv_read_bytes_one_request"]
    ratio = report["per_chip"]["kv_cache_bytes"] / one_request if one_request else 0.0
    for i in chosen:
        entry, program = report["programs"][i], PROGRAMS[i]
        text = program.costs.hlo_text if program.costs is not None else None
        if "error" not in entry and text is not None:
            entry["explain"] = breakdown(Count(text, classes), entry,
                                         roof["bandwidth_bytes_per_second"], ratio)
    return chosen


def show(report: dict, indices: list[int]) -> None:
    """Each explained program's groups, as a table, and each group's largest ops (stdout)."""
    import sys

    from rich.console import Console
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    bandwidth = report["decode_roofline"]["bandwidth_bytes_per_second"]
    for i in indices:
        entry = report["programs"][i]
        label = f"{entry['name']} ({_variant(entry)})"
        if "explain" not in entry:
            console.print(f"{label}: not compiled ({entry.get('error', '')[:200]})")
            continue
        console.print(_table(entry, label, bandwidth))
        vmem = entry["explain"]["groups"][COPIES]["in_vmem_bytes"]
        hbm = entry["bytes_accessed"] - vmem
        weights = report["per_chip"]["weights_bytes"]
        console.print(
            f"  of the copies and pads, {vmem / 1e6:,.3f} MB are arrays in VMEM (memory space "
            f"1): prefetches' destinations and their readers' reads, on-chip, no HBM bytes. "
            f"The rest, {hbm / 1e6:,.2f} MB ({hbm / bandwidth * 1e3:.3f} ms), is "
            f"{hbm / weights:.2f}x the {weights / 1e6:,.2f} MB of weights a chip holds")
        for name, group in entry["explain"]["groups"].items():
            if group["largest"]:
                console.print(f"  largest, {name}: " + "; ".join(
                    f"{op['op']} {op['bytes'] / 1e6:,.3f} MB"
                    + (f" ({op['from']})" if op["from"] else "") for op in group["largest"]))
        kv = entry["explain"]["kv_reads"]
        full = kv["full_cache_bytes"]
        if entry["explain"]["kernel_calls"]:
            console.print(
                f"  + the attention kernel's KV-cache reads, which the compiler cannot see "
                f"({entry['explain']['kernel_calls']} Pallas calls): one request at "
                f"--max-model-len {report['max_model_len']:,} reads its pages of every layer, "
                f"{kv['one_request_at_max_model_len_bytes'] / 1e6:,.2f} MB "
                f"({kv['estimated_seconds'] * 1e3:.3f} ms); the cache full, "
                f"{full / 1e6:,.1f} MB ({full / bandwidth * 1e3:.3f} ms)")


def _table(entry: dict, label: str, bandwidth: float):
    from rich.table import Table
    explain, total = entry["explain"], entry["bytes_accessed"]
    table = Table(title=f"Where {label}'s bytes go: {total / 1e6:,.2f} MB accessed, "
                        f"{total / bandwidth * 1e3:.3f} ms at {bandwidth / 1e9:,.0f} GB/s. From "
                        f"{BASED_ON}.", title_justify="left")
    for column in ("group", "MB", "share", "est. ms", "HLO ops (instructions)"):
        table.add_column(column, justify="left" if column in ("group", "HLO ops (instructions)")
                         else "right")
    for name, group in explain["groups"].items():
        kinds = list(group["ops"].items())
        ops = ", ".join(f"{kind} {n}" for kind, n in kinds[:5])
        table.add_row(name, f"{group['bytes'] / 1e6:,.3f}", f"{group['share']:.1%}",
                      f"{group['estimated_seconds'] * 1e3:.3f}",
                      ops + (f", {len(kinds) - 5} more kinds" if len(kinds) > 5 else ""))
    other = explain["other_bytes"]
    table.add_row("other", f"{other / 1e6:,.3f}", f"{other / total if total else 0:.1%}",
                  f"{other / bandwidth * 1e3:.3f}",
                  "the compiler's count less this one's (either sign)")
    return table
