"""Discovery through the `nvidia-smi` tool, for hosts where NVML cannot be loaded from Python.

Parsers are pure functions on the tool's text, tested on real captures:
`nvidia-smi -q -x` (devices and readings; schemas v10 to v13), `--query-gpu=... --format=csv[,nounits]`
(cheap readings for each heartbeat) and `nvidia-smi -L` (the only output naming MIG devices' UUIDs and
profiles). Values nvidia-smi cannot give (`N/A`, `[Not Supported]`, deprecated fields, WDDM on Windows,
MIG children) become None. Output that is truncated or is not what was asked raises ProviderError, so
discovery moves on. Running the tool is separate and injectable (`SmiProvider(run=...)`); how sampling
degrades when a query fails is told on `SmiProvider`.
"""

from __future__ import annotations

import csv
import io
import logging
import re
import subprocess
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from turnout.gpu.devices import GpuDevice, GpuMetrics, GpuProcess, MigDevice
from turnout.gpu.health import FELL_OFF_BUS, HEALTH_OK, NOT_ANSWERING
from turnout.gpu.provider import ProviderError

_LOG = logging.getLogger("turnout.gpu")
_MIB = 1024**2
_MISSING = {"", "n/a", "[n/a]", "not supported", "[not supported]", "unknown error", "[unknown error]",
            "requested functionality has been deprecated", "[requested functionality has been deprecated]",
            "insufficient permissions", "[insufficient permissions]"}  # fmt: skip
_LOST = ("gpu is lost", "gpu requires reset", "unable to determine the device handle")
_NUMBER = re.compile(r"^\s*(-?[0-9]+(?:\.[0-9]+)?)\s*([A-Za-z%]*)\s*$")
_UNIT_BYTES = {"": _MIB, "mib": _MIB, "kib": 1024, "gib": 1024**3, "b": 1}

Runner = Callable[[Sequence[str]], str]
T = TypeVar("T")


def value(text: str | None) -> str | None:
    """nvidia-smi's text for a value, or None where it could not give one."""
    if text is None:
        return None
    stripped = text.strip()
    return None if stripped.lower() in _MISSING else stripped


def number(text: str | None) -> float | None:
    """`"27 C"`, `"67.03 W"`, `"97 %"`, `"42"` -> the number; N/A and anything unparsable -> None."""
    match = _NUMBER.match(value(text) or "")
    return float(match.group(1)) if match else None


def mib_bytes(text: str | None) -> int | None:
    """A memory amount (`"19968 MiB"`, or a bare number of MiB as `nounits` prints it) -> bytes."""
    match = _NUMBER.match(value(text) or "")
    if not match or match.group(2).lower() not in _UNIT_BYTES:
        return None
    return int(float(match.group(1)) * _UNIT_BYTES[match.group(2).lower()])


# -- nvidia-smi -L ----------------------------------------------------------------------------------------------

_LIST_GPU = re.compile(r"^GPU\s+(\d+):\s+(.+?)\s+\(UUID:\s+(GPU-[0-9A-Za-z-]+)\)$")
_LIST_MIG = re.compile(r"^MIG\s+(\S+)\s+Device\s+(\d+):\s+\(UUID:\s+(MIG-[0-9A-Za-z/-]+)\)$")


@dataclass(frozen=True)
class ListedMig:
    index: int
    profile: str
    uuid: str


@dataclass(frozen=True)
class ListedGpu:
    index: int
    name: str
    uuid: str
    migs: tuple[ListedMig, ...] = ()


def parse_list(text: str) -> list[ListedGpu]:
    """Parse `nvidia-smi -L` (LF or CRLF; modern `MIG-<uuid>` and legacy `MIG-GPU-<uuid>/<gi>/<ci>` forms)."""
    gpus: list[ListedGpu] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if gpu := _LIST_GPU.match(line):
            gpus.append(ListedGpu(int(gpu.group(1)), gpu.group(2), gpu.group(3)))
        elif (mig := _LIST_MIG.match(line)) and gpus:
            listed = ListedMig(int(mig.group(2)), mig.group(1), mig.group(3))
            gpus[-1] = replace(gpus[-1], migs=(*gpus[-1].migs, listed))
        else:
            raise ProviderError(f"nvidia-smi -L: unexpected line {line[:80]!r}")
    if not gpus:
        raise ProviderError("nvidia-smi -L listed no GPUs")
    return gpus


# -- nvidia-smi --query-gpu=... --format=csv ----------------------------------------------------------------------


def parse_query_csv(text: str, *, min_rows: int = 1) -> list[dict[str, str | None]]:
    """Rows of a `--query-*` CSV (header included), keyed by field name without its unit.

    Units are stripped from values whatever the format (`"8192 MiB"` and `"8192"` both give `"8192"`).
    `min_rows=0` for queries that may rightly list nothing (`--query-compute-apps` on an idle host).
    """
    rows = list(csv.reader(io.StringIO(text.strip()), skipinitialspace=True))
    if len(rows) < 1 + min_rows:
        raise ProviderError(
            f"nvidia-smi query: expected a header and {min_rows}+ rows, got {len(rows)} lines"
        )
    header = [re.sub(r"\s*\[.*\]\s*$", "", name.strip()) for name in rows[0]]
    out: list[dict[str, str | None]] = []
    for row in rows[1:]:
        if len(row) != len(header):
            if len(row) == 1 and any(s in row[0].lower() for s in _LOST):
                continue  # a lost GPU prints one error line; it shows up as missing from the readings
            raise ProviderError(f"nvidia-smi query: a row has {len(row)} fields, the header {len(header)}")
        out.append({name: _strip_unit(value(cell)) for name, cell in zip(header, row, strict=True)})
    return out


def _strip_unit(text: str | None) -> str | None:
    match = _NUMBER.match(text or "")
    return match.group(1) if match else text


def metrics_from_csv(rows: Sequence[dict[str, str | None]]) -> list[GpuMetrics]:
    """Readings from `--query-gpu` rows with at least `uuid` (others optional; see METRIC_FIELDS)."""
    out = []
    for row in rows:
        uuid = row.get("uuid")
        if not uuid:
            raise ProviderError("nvidia-smi query: a row has no uuid")
        texts = [row.get(k) or "" for k in METRIC_FIELDS]
        lost = any(s in t.lower() for t in texts for s in _LOST)
        ecc = number(row.get("ecc.errors.uncorrected.volatile.total"))
        out.append(GpuMetrics(
            uuid,
            utilization_pct=number(row.get("utilization.gpu")),
            memory_used_bytes=mib_bytes(row.get("memory.used")),
            temperature_c=number(row.get("temperature.gpu")),
            power_w=number(row.get("power.draw")),
            ecc_uncorrected=int(ecc) if ecc is not None else None,
            health=FELL_OFF_BUS if lost else HEALTH_OK,
        ))  # fmt: skip
    return out


METRIC_FIELDS = ("uuid", "utilization.gpu", "memory.used", "temperature.gpu", "power.draw",
                 "ecc.errors.uncorrected.volatile.total")  # fmt: skip

# nvidia-smi refuses a whole query for one field its driver does not know: exit 2, empty stderr, and on stdout
# `Field "device_minor" is not a valid field to query.` (Windows builds print curly quotes).
_UNKNOWN_FIELD = re.compile(
    r"Field\s+[\"'\u201c\u201d]?([^\s\"'\u201c\u201d]+)[\"'\u201c\u201d]?\s+is not a valid field"
)


def unknown_field(message: str) -> str | None:
    """The field nvidia-smi named as not valid to query, or None when the failure was something else."""
    match = _UNKNOWN_FIELD.search(message)
    return match.group(1) if match else None


# -- nvidia-smi -q -x ---------------------------------------------------------------------------------------------


def _gpus(text: str) -> tuple[ET.Element, list[ET.Element]]:
    try:
        root = ET.fromstring(text)
    except ET.ParseError as exc:
        raise ProviderError(f"nvidia-smi -q -x: malformed or truncated XML ({exc})") from None
    if root.tag != "nvidia_smi_log":
        raise ProviderError(f"nvidia-smi -q -x: root element is <{root.tag}>, expected <nvidia_smi_log>")
    gpus = root.findall("gpu")
    for gpu in gpus:
        if not value(gpu.findtext("uuid")) or not value(gpu.findtext("product_name")):
            raise ProviderError("nvidia-smi -q -x: a <gpu> has no uuid or product_name")
    return root, gpus


def _first_number(el: ET.Element, *paths: str) -> float | None:
    """The first path that holds a number: schemas moved readings around between versions."""
    for path in paths:
        found = number(el.findtext(path))
        if found is not None:
            return found
    return None


def _ecc_uncorrected(gpu: ET.Element) -> int | None:
    """Volatile uncorrected ECC count: `double_bit/total` before schema v12, `*uncorrectable*` after."""
    old = number(gpu.findtext("ecc_errors/volatile/double_bit/total"))
    if old is not None:
        return int(old)
    counts = [number(c.text) for c in gpu.findall("ecc_errors/volatile/*") if "uncorrectable" in c.tag]
    known = [c for c in counts if c is not None]
    return int(sum(known)) if known else None


def devices_from_xml(text: str, listing: Sequence[ListedGpu] = (), caps: dict[str, str] | None = None) -> list[GpuDevice]:  # fmt: skip
    """GpuDevices from `nvidia-smi -q -x`. MIG UUIDs and profiles come from `listing` (`nvidia-smi -L`);
    without it they fall back to the legacy `MIG-<gpu uuid>/<gi>/<ci>` form and a memory-only profile.
    `caps` maps UUID to compute capability, which the XML does not carry."""
    root, gpus = _gpus(text)
    listed = {g.uuid: g for g in listing}
    devices = []
    for index, gpu in enumerate(gpus):
        uuid = value(gpu.findtext("uuid")) or ""
        total = mib_bytes(gpu.findtext("fb_memory_usage/total"))
        if total is None:
            raise ProviderError(f"nvidia-smi -q -x: no memory total for {uuid}")
        mig_mode = (value(gpu.findtext("mig_mode/current_mig")) or "").lower() == "enabled"
        minor = number(gpu.findtext("minor_number"))
        devices.append(GpuDevice(
            index=index, uuid=uuid, name=value(gpu.findtext("product_name")) or "", memory_total_bytes=total,
            memory_free_bytes=mib_bytes(gpu.findtext("fb_memory_usage/free")),
            compute_capability=(caps or {}).get(uuid), pci_bus_id=value(gpu.findtext("pci/pci_bus_id")),
            minor=int(minor) if minor is not None else None,
            driver_version=value(root.findtext("driver_version")), cuda_version=value(root.findtext("cuda_version")),
            mig_mode=mig_mode, mig_devices=_migs(gpu, uuid, listed.get(uuid)) if mig_mode else (), provider="smi",
        ))  # fmt: skip
    return devices


def _migs(gpu: ET.Element, uuid: str, listed: ListedGpu | None) -> tuple[MigDevice, ...]:
    by_index = {m.index: m for m in listed.migs} if listed else {}
    migs = []
    for position, mig in enumerate(gpu.findall("mig_devices/mig_device")):
        idx = int(number(mig.findtext("index")) or position)
        gi, ci = number(mig.findtext("gpu_instance_id")), number(mig.findtext("compute_instance_id"))
        total = mib_bytes(mig.findtext("fb_memory_usage/total")) or 0
        named = by_index.get(idx)
        migs.append(MigDevice(
            uuid=named.uuid if named else f"MIG-{uuid}/{int(gi or 0)}/{int(ci or 0)}",
            profile=named.profile if named else f"{round(total / 1024**3)}gb",
            memory_total_bytes=total, gpu_instance_id=int(gi) if gi is not None else None,
            compute_instance_id=int(ci) if ci is not None else None, index=idx,
        ))  # fmt: skip
    return tuple(migs)


def metrics_from_xml(text: str) -> list[GpuMetrics]:
    """Readings from `nvidia-smi -q -x`; power is `power_draw` (v10-v12) or `instant_power_draw` (v13)."""
    _, gpus = _gpus(text)
    out = []
    for gpu in gpus:
        procs = []
        for proc in gpu.findall("processes/process_info"):
            pid, used = number(proc.findtext("pid")), mib_bytes(proc.findtext("used_memory"))
            if pid is not None:
                procs.append(GpuProcess(int(pid), used or 0))
        out.append(GpuMetrics(
            value(gpu.findtext("uuid")) or "",
            utilization_pct=number(gpu.findtext("utilization/gpu_util")),
            memory_used_bytes=mib_bytes(gpu.findtext("fb_memory_usage/used")),
            temperature_c=number(gpu.findtext("temperature/gpu_temp")),
            power_w=_first_number(gpu, "gpu_power_readings/power_draw", "gpu_power_readings/instant_power_draw",
                                  "power_readings/power_draw", "gpu_power_readings/average_power_draw"),
            ecc_uncorrected=_ecc_uncorrected(gpu),
            processes=tuple(procs),
        ))  # fmt: skip
    return out


# -- running the tool -----------------------------------------------------------------------------------------------


def run_command(argv: Sequence[str], timeout_s: float = 15.0) -> str:
    """Run a tool and return its stdout; a missing binary is `absent`, anything else a fault."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, check=False)
    except FileNotFoundError:
        raise ProviderError(f"{argv[0]} not found", absent=True) from None
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ProviderError(f"{argv[0]} failed: {exc}") from None
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip().splitlines()
        raise ProviderError(
            f"{' '.join(argv[:2])} exited {done.returncode}: {detail[0] if detail else ''}"[:300]
        )
    return done.stdout


class SmiProvider:
    """GpuProvider over `nvidia-smi`: `-q -x` (+ `-L` for MIG, + a compute_cap query) once, a CSV query per sample.

    A failing sample query degrades the readings instead of losing them all:

    - A field the driver does not know (fields come and go between driver releases) is dropped for the life of
      the provider and the query is asked again at once, so the other readings are kept and the dropped one
      reads None. One retry per unknown field, once; asking each field in its own process instead would cost
      six processes on every heartbeat to guard against a failure that happens once.
    - Any other failure (garbage, a header with no rows, `uuid` itself refused) takes that sample from a fresh
      `-q -x`, processes included; the CSV is tried again on the next sample. Fresh, not the discovery-time
      XML: a stale reading would keep reporting a GPU that has since fallen off the bus as fine.

    Each reason is logged once (later repeats at debug). `metrics()` raises only when `-q -x` fails too: then
    the tool cannot answer at all, and the caller rightly counts a missed sample.
    """

    name = "smi"

    def __init__(self, run: Runner = run_command, binary: str = "nvidia-smi") -> None:
        self._run = run
        self._bin = binary
        self._uuids: list[str] | None = None
        self._fields: tuple[str, ...] = METRIC_FIELDS  # shrinks when the driver refuses a field
        self._warned: set[str] = set()

    def devices(self) -> list[GpuDevice]:
        text = self._run([self._bin, "-q", "-x"])
        _, gpus = _gpus(text)
        mig = any((value(g.findtext("mig_mode/current_mig")) or "").lower() == "enabled" for g in gpus)
        listing = self._optional(lambda: parse_list(self._run([self._bin, "-L"]))) if mig else None
        caps = self._optional(self._compute_capabilities)
        devices = devices_from_xml(text, listing or (), caps)
        self._uuids = [d.uuid for d in devices]
        return devices

    def _compute_capabilities(self) -> dict[str, str]:
        """UUID -> compute capability; `-q -x` does not carry it, `--query-gpu=compute_cap` does (R510+)."""
        rows = parse_query_csv(self._run([self._bin, "--query-gpu=uuid,compute_cap", "--format=csv,nounits"]))
        return {uuid: cap for row in rows if (uuid := row.get("uuid")) and (cap := row.get("compute_cap"))}

    def canary(self, uuid: str) -> bool | None:
        return None  # a real device answers for itself: the canary runs a step on it

    def metrics(self) -> list[GpuMetrics]:
        try:
            readings = self._csv_metrics()
        except ProviderError as exc:
            self._warn_once(
                "csv", "nvidia-smi sample query failed (%s); readings come from nvidia-smi -q -x", exc
            )
            readings = metrics_from_xml(self._run([self._bin, "-q", "-x"]))
        by_uuid = {m.uuid: m for m in readings}
        known = self._uuids if self._uuids is not None else list(by_uuid)
        return [by_uuid.get(u) or GpuMetrics(u, health=NOT_ANSWERING) for u in known]

    def _csv_metrics(self) -> list[GpuMetrics]:
        readings = metrics_from_csv(parse_query_csv(self._query_gpu()))
        apps = [self._bin, "--query-compute-apps=gpu_uuid,pid,used_memory", "--format=csv,nounits"]
        procs = self._optional(lambda: parse_query_csv(self._run(apps), min_rows=0)) or []
        by_gpu: dict[str, list[GpuProcess]] = {}
        for row in procs:
            pid, gpu = number(row.get("pid")), row.get("gpu_uuid")
            if gpu and pid is not None:
                by_gpu.setdefault(gpu, []).append(
                    GpuProcess(int(pid), mib_bytes(row.get("used_memory")) or 0)
                )
        return [replace(m, processes=tuple(by_gpu.get(m.uuid, ()))) for m in readings]

    def _query_gpu(self) -> str:
        """The sample CSV, asked again without each field the driver refuses. A refused `uuid` is dropped
        too; the rows then fail `metrics_from_csv`, which sends the sample to `-q -x` like any other failure."""
        while True:
            try:
                return self._run([self._bin, f"--query-gpu={','.join(self._fields)}", "--format=csv,nounits"])
            except ProviderError as exc:
                refused = unknown_field(str(exc))
                if refused is None or refused not in self._fields:
                    raise
                self._fields = tuple(f for f in self._fields if f != refused)
                self._warn_once(
                    f"field {refused}", "nvidia-smi cannot query %s here; sampling without it", refused
                )

    def _warn_once(self, key: str, message: str, *args: object) -> None:
        level = logging.DEBUG if key in self._warned else logging.WARNING
        self._warned.add(key)
        _LOG.log(level, message, *args)

    @staticmethod
    def _optional(call: Callable[[], T]) -> T | None:
        """Facts that only enrich the main answer: a failure leaves them out rather than failing discovery."""
        try:
            return call()
        except ProviderError:
            return None
