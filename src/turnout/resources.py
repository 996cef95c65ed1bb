"""Quantities and resource requirements: parse once at the edge, compare everywhere else.

A requirement is what one variant (or one task) needs: CPU cores, memory, and optionally GPUs.
GPU demand comes in three shapes, decided here once so every other module can just look at the kind:
whole GPUs (`gpu >= 1`, exclusive), a share of one GPU (`gpu_memory` alone, or `0 < gpu < 1`), or none.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from turnout.errors import InvalidInput

_UNITS: dict[str, int] = {
    "": 1,
    "k": 1000, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4, "P": 1000**5,
    "Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "Ti": 1024**4, "Pi": 1024**5,
    "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4,
    "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4,
}  # fmt: skip
_QUANTITY = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")
_CC = re.compile(r"^\s*([0-9]+)\.([0-9]+)\s*$")


def parse_bytes(value: Any, field_name: str) -> int:
    """`"512Mi"`, `"4Gi"`, `"1G"`, `"1.5Gi"` or a plain byte count -> bytes (int >= 0)."""
    if isinstance(value, bool):
        raise InvalidInput(
            f"{field_name}: expected a quantity like '512Mi' or a byte count, got {value!r}", field=field_name
        )
    if isinstance(value, int | float):
        if not math.isfinite(value) or value < 0:
            raise InvalidInput(
                f"{field_name}: must be a non-negative quantity, got {value!r}", field=field_name
            )
        if not value < 2**63:  # the most bytes any store column or allocation sum can hold
            raise InvalidInput(f"{field_name}: {value!r} bytes is too large", field=field_name)
        return int(value)
    if not isinstance(value, str):
        raise InvalidInput(
            f"{field_name}: expected a quantity like '512Mi', got {type(value).__name__}", field=field_name
        )
    match = _QUANTITY.match(value)
    if not match or match.group(2) not in _UNITS:
        raise InvalidInput(
            f"{field_name}: {value!r} is not a quantity (use e.g. '512Mi', '4Gi', '1G' or a byte count)",
            field=field_name,
        )
    number = float(match.group(1)) * _UNITS[match.group(2)]
    if not number < 2**63:  # also catches an overflow to infinity: "999...9Gi" is a 422, not a crash
        raise InvalidInput(f"{field_name}: {value!r} is too large", field=field_name)
    return int(number)


def format_bytes(n: int) -> str:
    """Bytes -> the shortest exact binary quantity ("80Gi", "512Mi"), else the byte count."""
    for suffix, size in (("Ti", 1024**4), ("Gi", 1024**3), ("Mi", 1024**2), ("Ki", 1024)):
        if n and n % size == 0:
            return f"{n // size}{suffix}"
    return str(n)


def parse_compute_capability(value: Any, field_name: str) -> tuple[int, int]:
    """`"8.0"` (or 8.0) -> (8, 0)."""
    text = str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value
    match = _CC.match(text) if isinstance(text, str) else None
    if not match:
        raise InvalidInput(
            f"{field_name}: expected a compute capability like '8.0', got {value!r}", field=field_name
        )
    return int(match.group(1)), int(match.group(2))


@dataclass(frozen=True)
class Resources:
    """What one variant or task needs. `gpu` is 0 (none), an int >= 1 (whole GPUs) or 0 < x < 1 (a share)."""

    cpu: float = 1.0
    memory_bytes: int = 0
    gpu: float = 0
    gpu_memory_bytes: int | None = None
    gpu_models: tuple[str, ...] = ()
    min_compute_capability: tuple[int, int] | None = None

    @property
    def wants_gpu(self) -> bool:
        return self.gpu > 0 or self.gpu_memory_bytes is not None

    @property
    def whole_gpus(self) -> int:
        """Whole, exclusive GPUs wanted (0 for a shared or CPU task)."""
        return int(self.gpu) if self.gpu >= 1 else 0

    @property
    def is_shared_gpu(self) -> bool:
        return self.wants_gpu and self.whole_gpus == 0

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"cpu": self.cpu, "memory": self.memory_bytes}
        if self.gpu:
            out["gpu"] = int(self.gpu) if self.gpu >= 1 else self.gpu
        if self.gpu_memory_bytes is not None:
            out["gpu_memory"] = self.gpu_memory_bytes
        if self.gpu_models:
            out["gpu_model"] = list(self.gpu_models)
        if self.min_compute_capability:
            out["min_compute_capability"] = "{}.{}".format(*self.min_compute_capability)
        return out

    def merged(self, overrides: Resources | None, keys: frozenset[str] = frozenset()) -> Resources:
        """This requirement with the named keys taken from `overrides` (a task's own `resources`)."""
        if overrides is None or not keys:
            return self
        attr = {"cpu": "cpu", "memory": "memory_bytes", "gpu": "gpu", "gpu_memory": "gpu_memory_bytes",
                "gpu_model": "gpu_models", "min_compute_capability": "min_compute_capability"}  # fmt: skip
        return replace(self, **{attr[k]: getattr(overrides, attr[k]) for k in keys})


RESOURCE_KEYS = frozenset({"cpu", "memory", "gpu", "gpu_memory", "gpu_model", "min_compute_capability"})


def parse_resources(spec: Mapping[str, Any] | None, prefix: str = "resources") -> Resources:
    """Validate a resources mapping; every error names `prefix.key`."""
    spec = dict(spec or {})
    unknown = sorted(set(spec) - RESOURCE_KEYS)
    if unknown:
        raise InvalidInput(
            f"{prefix}.{unknown[0]}: unknown resource (known: {', '.join(sorted(RESOURCE_KEYS))})",
            field=f"{prefix}.{unknown[0]}",
        )
    cpu = spec.get("cpu", 1.0)
    if isinstance(cpu, bool) or not isinstance(cpu, int | float) or not math.isfinite(cpu) or cpu < 0:
        raise InvalidInput(
            f"{prefix}.cpu: must be a number of cores >= 0, got {cpu!r}", field=f"{prefix}.cpu"
        )
    memory = parse_bytes(spec["memory"], f"{prefix}.memory") if "memory" in spec else 0
    gpu = _parse_gpu(spec.get("gpu", 0), f"{prefix}.gpu")
    gpu_memory = (
        parse_bytes(spec["gpu_memory"], f"{prefix}.gpu_memory")
        if spec.get("gpu_memory") is not None
        else None
    )
    if gpu_memory is not None and gpu_memory <= 0:
        raise InvalidInput(f"{prefix}.gpu_memory: must be more than 0", field=f"{prefix}.gpu_memory")
    models = _parse_models(spec.get("gpu_model"), f"{prefix}.gpu_model")
    cc = spec.get("min_compute_capability")
    min_cc = parse_compute_capability(cc, f"{prefix}.min_compute_capability") if cc is not None else None
    return Resources(float(cpu), memory, gpu, gpu_memory, models, min_cc)


def _parse_gpu(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidInput(
            f"{name}: expected a GPU count (1, 2, ...) or a share (0 < x < 1), got {value!r}", field=name
        )
    if value < 0:
        raise InvalidInput(f"{name}: must not be negative, got {value!r}", field=name)
    if value >= 1 and value != int(value):
        raise InvalidInput(
            f"{name}: whole GPUs must be an integer (or a share below 1), got {value!r}", field=name
        )
    return int(value) if value >= 1 else float(value)


def _parse_models(value: Any, name: str) -> tuple[str, ...]:
    if value is None:
        return ()
    items: Sequence[Any] = [value] if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(m, str) and m.strip() for m in items):
        raise InvalidInput(f"{name}: expected a model name or a list of names, got {value!r}", field=name)
    return tuple(m.strip() for m in items)


def model_matches(wanted: tuple[str, ...], model_name: str) -> int | None:
    """Rank of the first wanted model that is a substring of `model_name` (0 = most preferred), else None."""
    if not wanted:
        return 0
    lowered = model_name.lower()
    for rank, want in enumerate(wanted):
        if want.lower() in lowered:
            return rank
    return None
