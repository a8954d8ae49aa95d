"""What a tunable kernel may be launched with: a small, closed set of configurations.

A :class:`Space` names one Triton kernel's configurations (tiles, warps, stages). Every
member is compiled for sm_80 ... sm_120 (tests/test_triton_aot.py) and executed under the
interpreter (tests/test_tuning_configs.py), so whichever one a GPU's timing picks has
been tested; a configuration outside the space can never be launched.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Config:
    """One launch configuration: ``params`` are the launcher's own knobs (tile sizes, by
    name), ``num_warps`` and ``num_stages`` Triton's. ``name`` is what caches and the
    shipped table store."""

    name: str
    num_warps: int
    num_stages: int = 3
    params: dict = field(default_factory=dict, hash=False, compare=False)


@dataclass(frozen=True)
class Space:
    """A kernel's configurations; ``configs[0]`` is the default: what runs under the
    interpreter, in the ahead-of-time tests, with ``DFLASH2_AUTOTUNE=0``, and wherever
    no timing can happen (CUDA graph capture, compile tracing)."""

    name: str
    configs: tuple
    # Arguments the kernel reads and writes (accumulates into): restored after each timed
    # trial, so timing leaves them as it found them.
    mutates: tuple = ()

    def __post_init__(self):
        names = [c.name for c in self.configs]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"space {self.name}: configurations need distinct names, got {names}")

    @property
    def default(self) -> Config:
        return self.configs[0]

    def named(self, name: str) -> Config | None:
        for config in self.configs:
            if config.name == name:
                return config
        return None

    @property
    def digest(self) -> str:
        """Names a space's contents: a remembered winner counts only for the same space."""
        members = [[c.name, c.num_warps, c.num_stages, sorted(c.params.items())] for c in self.configs]
        return hashlib.sha256(json.dumps([self.name, members]).encode()).hexdigest()[:16]


def rows_class(rows: int) -> int:
    """A row count's shape class: the next power of two, 64 to 65,536 (timing winners
    change with the grid's fill, not with every row count). A symbolic size (a dynamic-shape
    compile trace) stays as it is: no guard on its class, and the tuner's default runs."""
    if type(rows) is not int:
        return rows
    return min(max(64, 1 << max(0, rows - 1).bit_length()), 65536)
