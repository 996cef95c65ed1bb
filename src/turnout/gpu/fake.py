"""Fake GPUs for hosts without them (`--gpus fake:SPEC`), behaving like real ones everywhere but in CUDA.

Spec grammar (groups separated by commas; a group starts with `<count>x`):

    fake:2x80Gi                         two generic 80 GiB GPUs ("Fake GPU 80Gi")
    fake:1xH100-80Gi,1xL4-24Gi          a model name before the memory; a known model may omit it (1xH100)
    fake:1xA100-40Gi-mig:3g.20gb,2g.10gb one A100 in MIG mode with two MIG devices; after `mig:` the commas
                                        list MIG profiles until the next `<count>x` group

UUIDs are deterministic: `GPU-fake-<index>` and `MIG-fake-<index>-<n>`. MIG memory comes from the profile
name (`20gb` -> 20 GiB). Compute capability and naming follow the model (H100 9.0, A100 8.0, L4 8.9, ...).

Live state (what a test or the worker changes) is one JSON object keyed by physical GPU UUID:

    {"GPU-fake-0": {
        "processes": [{"pid": 123, "used_memory_bytes": 1073741824}],   # memory used = their sum
        "utilization_pct": 50, "temperature_c": 70, "power_w": 200,     # readings; defaults are idle
        "xid": [79],                  # Xid errors reported in each sample while listed
        "ecc_uncorrected": 1,         # volatile uncorrected ECC count
        "fell_off_bus": true,         # the device is lost: readings None, health "fell off the bus"
        "unresponsive": true,         # the device does not answer: readings None, health "not answering"
        "canary_ok": false            # force canary checks to fail even with no fault listed
    }}

Processes listed under a MIG UUID count towards its parent GPU. With `state_file` set, the file is the one
truth: `metrics()` re-reads it when its (mtime, size, inode) changes, and the provider's own methods
(`set_process`, `inject`, `clear_faults`, ...) write it atomically, so a test can drive a worker running in
another process with `write_fake_state(path, uuid, ...)`. A file that does not parse keeps the last good state.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from turnout.errors import InvalidInput
from turnout.gpu.devices import GpuDevice, GpuMetrics, GpuProcess, MigDevice
from turnout.gpu.health import FELL_OFF_BUS, HEALTH_OK, NOT_ANSWERING, is_device_fault
from turnout.resources import format_bytes, parse_bytes

_LOG = logging.getLogger("turnout.gpu.fake")
_GIB = 1024**3
_GROUP = re.compile(r"^\s*(\d+)\s*x\s*(.+?)\s*$")
_MIG_PROFILE = re.compile(r"^(?:\d+c\.)?(\d+)g\.(\d+)gb(?:\+me)?$")
_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._ ]*$")
FAKE_DRIVER_VERSION = "550.54.15"
FAKE_CUDA_VERSION = "12.4"


@dataclass(frozen=True)
class _Model:
    key: str  # matched as a substring of the user's model, upper-cased; order matters (L40S before L4)
    cc: str
    default_gib: int
    name_format: str  # {gb}: memory in whole GiB
    tdp_w: float


_MODELS = (
    _Model("H100", "9.0", 80, "NVIDIA H100 {gb}GB HBM3", 700),
    _Model("H200", "9.0", 141, "NVIDIA H200", 700),
    _Model("A100", "8.0", 80, "NVIDIA A100-SXM4-{gb}GB", 400),
    _Model("A10G", "8.6", 24, "NVIDIA A10G", 300),
    _Model("L40S", "8.9", 48, "NVIDIA L40S", 350),
    _Model("L4", "8.9", 24, "NVIDIA L4", 72),
    _Model("T4", "7.5", 16, "Tesla T4", 70),
    _Model("V100", "7.0", 32, "Tesla V100-SXM2-{gb}GB", 300),
    _Model("4090", "8.9", 24, "NVIDIA GeForce RTX 4090", 450),
    _Model("3090", "8.6", 24, "NVIDIA GeForce RTX 3090", 350),
)


def _known(model: str) -> _Model | None:
    return next((m for m in _MODELS if m.key in model.upper()), None)


@dataclass(frozen=True)
class FakeGpuGroup:
    """`count` identical fake GPUs; `str()` gives back the spec text, so specs round-trip."""

    count: int
    memory_bytes: int
    model: str | None = None
    mig_profiles: tuple[str, ...] = ()

    def __str__(self) -> str:
        model = f"{self.model}-" if self.model else ""
        mig = f"-mig:{','.join(self.mig_profiles)}" if self.mig_profiles else ""
        return f"{self.count}x{model}{format_bytes(self.memory_bytes)}{mig}"


def _bad(message: str) -> InvalidInput:
    return InvalidInput(f"gpus: {message}", field="gpus")


def mig_profile_memory_bytes(profile: str) -> int:
    """`3g.20gb` -> 20 GiB; raises InvalidInput for text that is not a MIG profile."""
    match = _MIG_PROFILE.match(profile)
    if not match:
        raise _bad(f"{profile!r} is not a MIG profile (like '3g.20gb' or '1g.10gb')")
    return int(match.group(2)) * _GIB


def _parse_group(count_text: str, rest: str) -> FakeGpuGroup:
    count = int(count_text)
    if not 1 <= count <= 64:
        raise _bad(f"fake GPU count must be 1..64, got {count}")
    head, mig_sep, first_profile = rest.partition("-mig:")
    model: str | None
    try:
        model, memory = None, parse_bytes(head, "gpus")
    except InvalidInput:
        model, _, mem_text = head.rpartition("-")
        try:
            memory = parse_bytes(mem_text, "gpus") if model else -1
        except InvalidInput:
            memory = -1
        if memory < 0:  # no memory given: a known model has a default
            model = head
            known = _known(head)
            if known is None:
                raise _bad(f"fake GPU {head!r}: give its memory, e.g. '{head}-24Gi'") from None
            memory = known.default_gib * _GIB
    if model is not None and not _MODEL_NAME.match(model):
        raise _bad(f"fake GPU model {model!r} may hold only letters, digits, '.', '_' and spaces")
    if memory < 1024**2:
        raise _bad(f"fake GPU memory {format_bytes(memory)} is too small (did you mean '{head}Gi'?)")
    profiles = (first_profile.strip(),) if mig_sep else ()
    return FakeGpuGroup(count, memory, model, profiles)


def parse_fake_spec(text: str) -> tuple[FakeGpuGroup, ...]:
    """Parse the part after `fake:`. A token starting with `<count>x` opens a group; others extend its MIG list."""
    body = text[len("fake:") :] if text.lower().startswith("fake:") else text
    groups: list[FakeGpuGroup] = []
    for token in body.split(","):
        match = _GROUP.match(token)
        if match:
            groups.append(_parse_group(match.group(1), match.group(2)))
        elif groups and groups[-1].mig_profiles and token.strip():
            last = groups[-1]
            groups[-1] = FakeGpuGroup(
                last.count, last.memory_bytes, last.model, (*last.mig_profiles, token.strip())
            )
        else:
            raise _bad(f"fake spec {text!r}: expected '<count>x<memory>' like '2x80Gi' at {token.strip()!r}")
    if not groups:
        raise _bad("fake spec is empty; use e.g. 'fake:2x80Gi'")
    for group in groups:
        if group.mig_profiles:
            for profile in group.mig_profiles:
                mig_profile_memory_bytes(profile)  # validates
            # Nc.* profiles are compute instances sharing one GPU instance: count only plain ones.
            used = sum(mig_profile_memory_bytes(p) for p in group.mig_profiles if "c." not in p)
            if used > group.memory_bytes:
                raise _bad(
                    f"MIG profiles {','.join(group.mig_profiles)} need more than {format_bytes(group.memory_bytes)}"
                )
    return tuple(groups)


def fake_devices(groups: Sequence[FakeGpuGroup]) -> list[GpuDevice]:
    """The GpuDevices a spec describes, indexed in spec order."""
    devices: list[GpuDevice] = []
    for group in groups:
        known = _known(group.model) if group.model else None
        gib = round(group.memory_bytes / _GIB)
        if known:
            name = known.name_format.format(gb=gib)
        else:
            name = f"NVIDIA {group.model}" if group.model else f"Fake GPU {format_bytes(group.memory_bytes)}"
        for _ in range(group.count):
            index = len(devices)
            migs = tuple(
                MigDevice(f"MIG-fake-{index}-{n}", profile, mig_profile_memory_bytes(profile),
                          gpu_instance_id=n + 1, compute_instance_id=0, index=n)
                for n, profile in enumerate(group.mig_profiles)
            )  # fmt: skip
            devices.append(GpuDevice(
                index=index, uuid=f"GPU-fake-{index}", name=name, memory_total_bytes=group.memory_bytes,
                memory_free_bytes=group.memory_bytes, compute_capability=known.cc if known else "8.0",
                pci_bus_id=f"00000000:{index + 1:02X}:00.0", minor=index, driver_version=FAKE_DRIVER_VERSION,
                cuda_version=FAKE_CUDA_VERSION, mig_mode=bool(migs), mig_devices=migs, provider="fake",
            ))  # fmt: skip
    return devices


def _tdp_w(device: GpuDevice) -> float:
    known = _known(device.name)
    return known.tdp_w if known else 300.0


class FakeGpuProvider:
    """A GpuProvider over fake GPUs, with live state settable through methods or a JSON state file."""

    name = "fake"

    def __init__(self, spec: str | Sequence[FakeGpuGroup], state_file: Path | None = None) -> None:
        groups = parse_fake_spec(spec) if isinstance(spec, str) else tuple(spec)
        self._devices = fake_devices(groups)
        self._parent = {m.uuid: d.uuid for d in self._devices for m in d.mig_devices}
        self._parent.update({d.uuid: d.uuid for d in self._devices})
        self.state_file = state_file
        self._state: dict[str, dict[str, Any]] = {}
        self._stamp: tuple[int, int, int] | None = None

    # -- GpuProvider --------------------------------------------------------------------------------------

    def devices(self) -> list[GpuDevice]:
        used = {m.uuid: m.memory_used_bytes or 0 for m in self.metrics()}
        return [_with_free(d, d.memory_total_bytes - used.get(d.uuid, 0)) for d in self._devices]

    def metrics(self) -> list[GpuMetrics]:
        state = self._load()
        return [self._reading(dev, state) for dev in self._devices]

    # -- driving the fakes ----------------------------------------------------------------------------------

    def set_process(self, uuid: str, pid: int, used_memory_bytes: int) -> None:
        """Record that `pid` uses this much memory on a GPU or MIG device (0 removes it)."""
        entry = self._entry(uuid)
        procs = [p for p in entry.get("processes", []) if p.get("pid") != pid]
        if used_memory_bytes > 0:
            procs.append({"pid": pid, "used_memory_bytes": int(used_memory_bytes)})
        self._update(uuid, processes=procs)

    def set_readings(self, uuid: str, **readings: float) -> None:
        """Set `utilization_pct`, `temperature_c` or `power_w`."""
        unknown = set(readings) - {"utilization_pct", "temperature_c", "power_w"}
        if unknown:
            raise ValueError(f"unknown readings: {sorted(unknown)}")
        self._update(uuid, **readings)

    def inject(self, uuid: str, *, xid: Sequence[int] = (), ecc_uncorrected: int | None = None,
               fell_off_bus: bool = False, unresponsive: bool = False, canary_ok: bool | None = None) -> None:  # fmt: skip
        """Inject faults on a GPU (a MIG device's faults land on its parent); they stay until `clear_faults`."""
        uuid = self._physical(uuid)
        entry = self._entry(uuid)
        fields: dict[str, Any] = {"xid": sorted({*entry.get("xid", []), *xid})}
        if ecc_uncorrected is not None:
            fields["ecc_uncorrected"] = ecc_uncorrected
        if fell_off_bus:
            fields["fell_off_bus"] = True
        if unresponsive:
            fields["unresponsive"] = True
        if canary_ok is not None:
            fields["canary_ok"] = canary_ok
        self._update(uuid, **fields)

    def clear_faults(self, uuid: str) -> None:
        """Clear Xids, bus loss, unresponsiveness and a forced canary failure (ECC counts stay, as on real GPUs)."""
        self._update(self._physical(uuid), xid=[], fell_off_bus=False, unresponsive=False, canary_ok=True)

    def canary(self, uuid: str) -> bool | None:
        """The canary answer for a fake GPU: True when no device fault is asserted any more (no CUDA here)."""
        entry = self._load().get(self._parent.get(uuid, uuid), {})
        return not (
            entry.get("fell_off_bus") or entry.get("unresponsive") or entry.get("canary_ok") is False
            or any(is_device_fault(int(x)) for x in entry.get("xid", []))
        )  # fmt: skip

    # -- state ------------------------------------------------------------------------------------------------

    def _physical(self, uuid: str) -> str:
        if uuid not in self._parent:
            raise KeyError(f"no fake GPU or MIG device {uuid!r}")
        return self._parent[uuid]

    def _entry(self, uuid: str) -> dict[str, Any]:
        if uuid not in self._parent:
            raise KeyError(f"no fake GPU or MIG device {uuid!r}")
        return dict(self._load().get(uuid, {}))

    def _update(self, uuid: str, **fields: Any) -> None:
        if self.state_file is not None:
            write_fake_state(self.state_file, uuid, **fields)
        else:
            self._state.setdefault(uuid, {}).update(fields)

    def _load(self) -> dict[str, dict[str, Any]]:
        """The current state; with a file, re-parsed only when the file changed."""
        if self.state_file is None:
            return self._state
        try:
            st = os.stat(self.state_file)
        except FileNotFoundError:
            self._state, self._stamp = {}, None
            return self._state
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp != self._stamp:
            try:
                loaded = json.loads(Path(self.state_file).read_text() or "{}")
                if not isinstance(loaded, dict):
                    raise ValueError("top level must be an object keyed by GPU UUID")
                self._state = {k: v for k, v in loaded.items() if isinstance(v, dict)}
            except (OSError, ValueError) as exc:
                _LOG.warning(
                    "fake GPU state file %s unreadable, keeping the last state: %s", self.state_file, exc
                )
            self._stamp = stamp
        return self._state

    def _reading(self, dev: GpuDevice, state: dict[str, dict[str, Any]]) -> GpuMetrics:
        entry = state.get(dev.uuid, {})
        xids = tuple(int(x) for x in entry.get("xid", []))
        ecc = int(entry.get("ecc_uncorrected", 0))
        if entry.get("fell_off_bus") or entry.get("unresponsive"):
            health = FELL_OFF_BUS if entry.get("fell_off_bus") else NOT_ANSWERING
            return GpuMetrics(dev.uuid, health=health, xid_errors=xids, ecc_uncorrected=ecc)
        procs = [
            GpuProcess(int(p["pid"]), int(p["used_memory_bytes"]))
            for uuid in (dev.uuid, *(m.uuid for m in dev.mig_devices))
            for p in state.get(uuid, {}).get("processes", [])
        ]
        util = float(entry.get("utilization_pct", 0.0))
        idle_w = _tdp_w(dev) * 0.12
        return GpuMetrics(
            dev.uuid,
            utilization_pct=util,
            memory_used_bytes=min(sum(p.used_memory_bytes for p in procs), dev.memory_total_bytes),
            temperature_c=float(entry.get("temperature_c", 30.0 + 0.4 * util)),
            power_w=float(entry.get("power_w", idle_w + (_tdp_w(dev) - idle_w) * util / 100.0)),
            ecc_uncorrected=ecc,
            processes=tuple(procs),
            health=HEALTH_OK,
            xid_errors=xids,
        )


def _with_free(dev: GpuDevice, free: int) -> GpuDevice:
    return replace(dev, memory_free_bytes=max(free, 0))


def write_fake_state(path: Path, uuid: str, **fields: Any) -> None:
    """Merge `fields` into the entry for `uuid` in a fake GPU state file, atomically (write, then rename).

    For tests driving a worker in another process, e.g.
    `write_fake_state(p, "GPU-fake-0", xid=[79])` then `write_fake_state(p, "GPU-fake-0", xid=[])`.
    """
    path = Path(path)
    try:
        current = json.loads(path.read_text() or "{}")
    except FileNotFoundError:
        current = {}
    current.setdefault(uuid, {}).update(fields)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as out:
        json.dump(current, out, indent=1, sort_keys=True)
    os.replace(tmp, path)
