"""Settings, read once at the edge (CLI flags, the config file) into frozen objects."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from turnout.errors import InvalidInput, number, read_user_file
from turnout.resources import parse_bytes
from turnout.tenancy import LimitsTable, parse_limits

if TYPE_CHECKING:
    from turnout.escalation import EscalationSettings
    from turnout.pipelines import Pipeline

DEFAULT_PORT = 8750
MiB = 1024**2
# The top-level keys of turnout.yaml. `limits` (per tenant) is parsed where tenants are; known here so the file
# is validated as one: a misspelt key is an error naming it and the file, before anything starts.
CONFIG_KEYS = (
    "prices",
    "pipelines",
    "escalation",
    "request_limits",
    "limits",
    "file_retention_s",
    "long_poll_recheck_s",
)


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
class RequestLimits:
    """What one request may carry. A body over its limit is refused (413) as it streams in, never read whole,
    so a huge or endless upload costs the controller neither memory nor the event loop its workers need.

    Set in turnout.yaml under `request_limits:` or with `--request-limit NAME=VALUE`; byte limits take
    quantities (`16Mi`). The 413's message names the limit as set, e.g. `limit 8 MiB (max_body_bytes)`.
    """

    max_body_bytes: int = 8 * MiB  # any request body not named below
    max_batch_body_bytes: int = 64 * MiB  # POST /v1/tasks/batch (up to 1000 tasks)
    max_worker_body_bytes: int = 64 * MiB  # a worker's event and result batches
    max_input_bytes: int = 1 * MiB  # one task's input, as compact JSON; larger data goes in files
    max_labels: int = 32  # labels on one task
    max_label_bytes: int = 256  # one label's key, or its value, in UTF-8
    max_events_per_request: int = 10_000  # events in one POST /v1/workers/{id}/events
    max_file_bytes: int = (
        16 * 1024 * MiB
    )  # one file uploaded to POST /v1/files (streamed to disk, never held)

    def describe(self, name: str) -> str:
        """`limit 8 MiB (max_body_bytes)`: what a 413 says, so the user knows which setting to change."""
        value = getattr(self, name)
        shown = describe_bytes(value) if name.endswith("_bytes") else str(value)
        return f"limit {shown} ({name})"


def describe_bytes(n: int) -> str:
    """Bytes for people: `8 MiB`, `1.5 KiB`, `300 bytes`."""
    for unit, size in (("GiB", 1024**3), ("MiB", MiB), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n} bytes"


def parse_request_limits(raw: Any, source: str = "request_limits") -> RequestLimits:
    """`{max_body_bytes: 16Mi, max_labels: 64, ...}` -> RequestLimits; unknown names and bad values name the field."""
    if raw is None:
        return RequestLimits()
    if not isinstance(raw, Mapping):
        raise InvalidInput(f"{source}: expected a mapping of limit name to value", field=source)
    known = {f.name for f in fields(RequestLimits)}
    values: dict[str, int] = {}
    for key, value in raw.items():
        name = f"{source}.{key}"
        if key not in known:
            raise InvalidInput(f"{name}: unknown limit (known: {', '.join(sorted(known))})", field=name)
        if str(key).endswith("_bytes"):
            number = parse_bytes(value, name)
        elif isinstance(value, int) and not isinstance(value, bool):
            number = value
        elif isinstance(value, str) and value.strip().isdigit():
            number = int(value)
        else:
            raise InvalidInput(f"{name}: expected a whole number, got {value!r}", field=name)
        if number < 1:
            raise InvalidInput(f"{name}: must be at least 1, got {value!r}", field=name)
        values[key] = number
    return replace(RequestLimits(), **values)


def parse_limit_flags(flags: list[str] | None) -> dict[str, str]:
    """`--request-limit NAME=VALUE`, repeated -> {NAME: VALUE}, checked later with the config file's."""
    out: dict[str, str] = {}
    for flag in flags or ():
        name, sep, value = flag.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise InvalidInput(f"--request-limit: expected NAME=VALUE, got {flag!r}", field="request-limit")
        out[name.strip()] = value.strip()
    return out


@dataclass(frozen=True)
class ControllerSettings:
    heartbeat_s: float = 5.0
    reap_interval_s: float = 0.5
    lease_window: int = 200  # the most queued tasks a lease looks at (what fits and one more first)
    max_lease_wait_s: float = 30.0
    placement_policy: str = "fgd"  # which GPU worker a task goes to: fgd, bestfit, random
    recheck_s: float = 1.0  # a parked long poll looks again this often unwoken (long_poll_recheck_s)
    storage_dir: Path | None = None  # files' bytes (--storage; $TURNOUT_HOME/files); None: no file routes
    file_retention_s: float = 7 * 86_400.0  # a file is deleted this long after it was made (0: kept for ever)
    prices: Prices = field(default_factory=Prices)
    request_limits: RequestLimits = field(default_factory=RequestLimits)  # `request_limits:`, per request
    tenant_limits: LimitsTable = field(default_factory=LimitsTable)  # `limits:`, per tenant
    pipelines: Mapping[str, Pipeline] = field(default_factory=dict)
    escalation: EscalationSettings | None = None

    def __post_init__(self) -> None:
        """A heartbeat no worker could keep (0, negative, NaN) is refused wherever the settings are made, as the
        worker's own settings refuse theirs (`AgentSettings`)."""
        beat = self.heartbeat_s
        if isinstance(beat, bool) or not isinstance(beat, int | float) or not 0 < beat < math.inf:
            raise InvalidInput(
                f"--heartbeat-s: {beat!r} is not a positive number of seconds", field="heartbeat_s"
            )


def load_config_file(path: Path | None) -> dict[str, Any]:
    """The `--config` YAML as a mapping; errors name the file."""
    if path is None:
        return {}
    text = read_user_file(path, "--config")
    try:
        duplicate = first_duplicate_key(yaml.compose(text, Loader=yaml.SafeLoader))
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InvalidInput(f"{path}: not valid YAML: {exc}", field="config") from None
    if duplicate is not None:
        at, first, second = duplicate
        raise InvalidInput(f"{path}: {at}: defined twice (lines {first} and {second}); keep one", field=at)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise InvalidInput(f"{path}: expected a mapping at the top level", field="config")
    return data


def first_duplicate_key(node: yaml.Node | None, at: str = "") -> tuple[str, int, int] | None:
    """The first key defined twice in one mapping of a composed YAML document: (its dotted path, the lines of
    both). YAML loaders keep the last silently, so a pipeline or a price written twice would vanish unseen."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[tuple[str, str], int] = {}
        for key, value in node.value:
            name = str(key.value) if isinstance(key, yaml.ScalarNode) else "?"
            path = f"{at}.{name}" if at else name
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                line = key.start_mark.line + 1
                if (key.tag, name) in seen:
                    return path, seen[(key.tag, name)], line
                seen[(key.tag, name)] = line
            found = first_duplicate_key(value, path)
            if found is not None:
                return found
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            found = first_duplicate_key(item, f"{at}.{i}" if at else str(i))
            if found is not None:
                return found
    return None


def _price(value: Any, name: str) -> float:
    """A price in USD per second: a finite number >= 0; a string that reads as one (YAML 1.1 reads `2e-4`,
    with no dot, as a string) is taken as that number."""
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            value = float(value.strip())
    return number(value, name, "a price >= 0 in USD per second", lambda v: v >= 0)


def parse_prices(raw: Any, source: str = "prices") -> Prices:
    if raw is None:
        return Prices()
    if not isinstance(raw, dict):
        raise InvalidInput(f"{source}: expected a mapping of device class to USD per second", field=source)
    cpu = gpu = None
    models: dict[str, float] = {}
    for key, value in raw.items():
        name = f"{source}.{key}"
        price = _price(value, name)
        if key == "cpu":
            cpu = price
        elif key == "gpu":
            gpu = price
        elif isinstance(key, str) and key.startswith("gpu:") and len(key) > 4:
            models[key[4:]] = price
        else:
            raise InvalidInput(f"{name}: unknown price key (use cpu, gpu or gpu:MODEL)", field=name)
    return Prices(cpu, gpu, models)


def controller_settings(
    config_path: Path | None = None,
    *,
    limit_flags: Mapping[str, str] | None = None,
    environ: Mapping[str, str] | None = None,
    **overrides: Any,
) -> ControllerSettings:
    """Settings from the config file, then flags: `limit_flags` (from `--request-limit`) win over the file's.

    The whole file is validated before anything starts; every error names the key and the file. `environ`
    holds the variables an escalation endpoint's `api_key_env` names (read here, at the edge, once).
    """
    from turnout.escalation import parse_escalation
    from turnout.pipelines import parse_pipelines

    raw = load_config_file(config_path)
    where = f"{config_path}: " if config_path else ""
    unknown = sorted(str(k) for k in raw if k not in CONFIG_KEYS)
    if unknown:
        raise InvalidInput(
            f"{where}{unknown[0]}: unknown key (known: {', '.join(CONFIG_KEYS)})", field=unknown[0]
        )
    prices = parse_prices(raw.get("prices"), f"{where}prices")
    pipelines = parse_pipelines(raw.get("pipelines"), f"{where}pipelines")
    escalation = parse_escalation(raw.get("escalation"), f"{where}escalation", environ=environ)
    file_limits = raw.get("request_limits")
    source = f"{config_path}: request_limits" if config_path else "request_limits"
    limits = parse_request_limits(file_limits, source)
    if limit_flags:
        limits = replace(
            limits, **_fields_of(parse_request_limits(dict(limit_flags), "--request-limit"), limit_flags)
        )
    recheck = raw.get("long_poll_recheck_s", 1.0)
    if isinstance(recheck, bool) or not isinstance(recheck, int | float) or not 0.05 <= recheck <= 300:
        raise InvalidInput(f"{where}long_poll_recheck_s: expected seconds in 0.05..300, got {recheck!r}",
                           field="long_poll_recheck_s")  # fmt: skip
    retention = raw.get("file_retention_s", ControllerSettings.file_retention_s)
    if isinstance(retention, bool) or not isinstance(retention, int | float) or not 0 <= retention < math.inf:
        raise InvalidInput(f"{where}file_retention_s: expected seconds >= 0 (0: kept for ever), got {retention!r}",
                           field="file_retention_s")  # fmt: skip
    overrides.setdefault(
        "tenant_limits", parse_limits(raw.get("limits"), str(config_path) if config_path else None)
    )
    overrides.setdefault("pipelines", pipelines)
    overrides.setdefault("escalation", escalation)
    return ControllerSettings(prices=prices, request_limits=limits, recheck_s=float(recheck),
                              file_retention_s=float(retention), **overrides)  # fmt: skip


def _fields_of(limits: RequestLimits, names: Mapping[str, str]) -> dict[str, int]:
    return {name: getattr(limits, name) for name in names}
