"""Settings, read once at the edge (CLI flags, the config file) into frozen objects."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from turnout.errors import InvalidInput
from turnout.tenancy import LimitsTable, parse_limits

DEFAULT_PORT = 8750


@dataclass(frozen=True)
class Prices:
    """USD per second of run time by device class; `gpu:MODEL` entries price one GPU model."""

    cpu: float | None = None
    gpu: float | None = None
    gpu_models: dict[str, float] = field(default_factory=dict)

    def per_second(self, device: str, gpu_model: str | None) -> float | None:
        if device == "gpu":
            if gpu_model:
                for model, price in self.gpu_models.items():
                    if model.lower() in gpu_model.lower():
                        return price
            return self.gpu
        return self.cpu


@dataclass(frozen=True)
class ControllerSettings:
    heartbeat_s: float = 5.0
    reap_interval_s: float = 0.5
    lease_window: int = 200  # queued tasks looked at per lease request
    max_lease_wait_s: float = 30.0
    placement_policy: str = "fgd"  # which GPU worker a task goes to: fgd, bestfit, random
    prices: Prices = field(default_factory=Prices)
    tenant_limits: LimitsTable = field(default_factory=LimitsTable)  # `limits:`, per tenant
    raw_config: dict[str, Any] = field(default_factory=dict)


def load_config_file(path: Path | None) -> dict[str, Any]:
    """The `--config` YAML as a mapping; errors name the file."""
    if path is None:
        return {}
    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise InvalidInput(f"{path}: no such config file", field="config") from None
    except yaml.YAMLError as exc:
        raise InvalidInput(f"{path}: not valid YAML: {exc}", field="config") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise InvalidInput(f"{path}: expected a mapping at the top level", field="config")
    return data


def parse_prices(raw: Any, source: str = "prices") -> Prices:
    if raw is None:
        return Prices()
    if not isinstance(raw, dict):
        raise InvalidInput(f"{source}: expected a mapping of device class to USD per second", field=source)
    cpu = gpu = None
    models: dict[str, float] = {}
    for key, value in raw.items():
        name = f"{source}.{key}"
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise InvalidInput(f"{name}: expected a price >= 0 in USD per second, got {value!r}", field=name)
        if key == "cpu":
            cpu = float(value)
        elif key == "gpu":
            gpu = float(value)
        elif isinstance(key, str) and key.startswith("gpu:") and len(key) > 4:
            models[key[4:]] = float(value)
        else:
            raise InvalidInput(f"{name}: unknown price key (use cpu, gpu or gpu:MODEL)", field=name)
    return Prices(cpu, gpu, models)


def controller_settings(config_path: Path | None = None, **overrides: Any) -> ControllerSettings:
    raw = load_config_file(config_path)
    prices = parse_prices(raw.get("prices"), f"{config_path}: prices" if config_path else "prices")
    limits = parse_limits(raw.get("limits"), str(config_path) if config_path else None)
    return ControllerSettings(prices=prices, tenant_limits=limits, raw_config=raw, **overrides)
