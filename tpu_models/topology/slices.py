"""TPU slices by the names users give them, as libtpu describes them (standard library only).

`tpu-models compile --topology v6e-8` compiles for one of these on any host:
libtpu, which ships with tpu-inference, builds the slice's devices without the
chips (jax.experimental.topologies). A name is Cloud TPU's accelerator type;
v5e and v6e count chips, v5p counts TensorCores (two a chip, one JAX device).
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Topology:
    name: str  # as a user names the slice: "v6e-8"
    libtpu_name: str  # jax.experimental.topologies' name: "v6e:2x4"
    host_chips: tuple[int, int, int]  # chips per host, as bounds
    chips: int
    hosts: int


def _slice(name: str, libtpu_name: str, chips: int, host_chips: tuple[int, int, int]) -> Topology:
    per_host = host_chips[0] * host_chips[1] * host_chips[2]
    return Topology(name, libtpu_name, host_chips, chips, max(1, chips // per_host))


def _lite(generation: str) -> list[Topology]:
    """v5e and v6e: one host up to 8 chips, hosts of 4 chips (2x2) in larger slices."""
    shapes = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16",
              256: "16x16"}
    hosts = {1: (1, 1, 1), 4: (2, 2, 1), 8: (2, 4, 1)}
    return [_slice(f"{generation}-{chips}", f"{generation}:{shape}", chips,
                   hosts.get(chips, (2, 2, 1))) for chips, shape in shapes.items()]


def _v5p() -> list[Topology]:
    """v5p: named by TensorCores (two a chip), hosts of 4 chips (2x2x1)."""
    shapes = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4"}
    return [_slice(f"v5p-{2 * chips}", f"v5p:{shape}", chips, (2, 2, 1))
            for chips, shape in shapes.items()]


TOPOLOGIES = {t.name: t for t in (*_lite("v5e"), *_lite("v6e"), *_v5p())}
# Cloud TPU's other spelling of v5e slices.
ALIASES = {f"v5litepod-{t.chips}": t.name for t in TOPOLOGIES.values() if t.name.startswith("v5e")}


class UnknownTopology(ValueError):
    pass


def topology(name: str) -> Topology:
    found = TOPOLOGIES.get(ALIASES.get(name, name))
    if found is None:
        raise UnknownTopology(f"unknown TPU topology {name!r}: one of {', '.join(TOPOLOGIES)}")
    return found
