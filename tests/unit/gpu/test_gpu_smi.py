"""nvidia-smi parsers on every real capture in shared/fixtures/nvidia, and the provider over a fake runner."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from nvidia_paths import NVIDIA_FIXTURES, cut_mid_line, nvidia_samples

from turnout.gpu.health import FELL_OFF_BUS, NOT_ANSWERING
from turnout.gpu.provider import ProviderError, discover
from turnout.gpu.smi import (
    METRIC_FIELDS,
    SmiProvider,
    devices_from_xml,
    metrics_from_csv,
    metrics_from_xml,
    mib_bytes,
    number,
    parse_list,
    parse_query_csv,
    unknown_field,
)

MIB = 1024**2
XML = nvidia_samples("smi-xml", "*.xml")
CSV = nvidia_samples("smi-csv", "*.csv")
LISTS = nvidia_samples("smi-list")
pytestmark = pytest.mark.usefixtures("nvidia_fixtures")

# What each capture shows (first GPU): name, uuid, memory total MiB, minor, driver, cuda, GPU count.
XML_FACTS = {
    "8x-tesla-v100s-pcie-32gb-460.73.01.xml": (
        "Tesla V100S-PCIE-32GB", "GPU-76098dc1-d3bc-9a1b-7ea6-f7b48837829e", 32510, 0, "460.73.01", "11.2", 8),
    "a100-sxm4-80gb-mig-enabled-535.54.03.xml": (
        "NVIDIA A100-SXM4-80GB", "GPU-513536b6-7d19-9063-b049-1e69664bb298", 81920, 1, "535.54.03", "12.2", 1),
    "quadro-p400-418.43.xml": (
        "Quadro P400", "GPU-8f750be4-dfbc-23b9-b33f-da729a536494", 1998, 0, "418.43", "10.1", 1),
    "tesla-t4-515.105.01.xml": (
        "Tesla T4", "GPU-d37e67a5-91dd-3774-a5cb-99096249601a", 15360, 0, "515.105.01", "11.7", 1),
    "geforce-rtx-3060-570.124.04.xml": (
        "NVIDIA GeForce RTX 3060", "GPU-d6889ff6-2523-9142-ca3c-1ca3f396a625", 12288, 0, "570.124.04", "12.8", 1),
    "geforce-rtx-3080-windows-wddm-536.40.xml": (
        "NVIDIA GeForce RTX 3080", "GPU-19d6d965-2acc-f646-00f8-4c76979aabb4", 10240, None, "536.40", "12.2", 1),
    "rtx-4000-sff-ada-595.84-schema-v13.xml": (
        "NVIDIA RTX 4000 SFF Ada Generation", "GPU-37037c3f-65c8-ec4d-24a9-420204ad8026", 20475, 0, "595.84",
        "13.2", 1),
}  # fmt: skip


@pytest.mark.parametrize("sample", XML, ids=lambda p: p.name)
def test_every_xml_capture_parses_to_devices_and_matching_readings(sample: Path) -> None:
    text = sample.read_text()
    devices, readings = devices_from_xml(text), metrics_from_xml(text)
    assert devices and [d.index for d in devices] == list(range(len(devices)))
    assert all(
        d.uuid.startswith("GPU-") and d.memory_total_bytes > 0 and d.provider == "smi" for d in devices
    )
    assert [m.uuid for m in readings] == [d.uuid for d in devices]
    if sample.name in XML_FACTS:
        name, uuid, total_mib, minor, driver, cuda, count = XML_FACTS[sample.name]
        first = devices[0]
        assert (first.name, first.uuid, first.memory_total_bytes, first.minor) == (
            name,
            uuid,
            total_mib * MIB,
            minor,
        )
        assert (first.driver_version, first.cuda_version, len(devices)) == (driver, cuda, count)


@pytest.mark.parametrize("sample", XML, ids=lambda p: p.name)
def test_truncated_xml_is_a_provider_error(sample: Path) -> None:
    with pytest.raises(ProviderError, match="malformed or truncated"):
        devices_from_xml(cut_mid_line(sample.read_text()))


def test_the_eight_v100s_report_load_processes_and_bus_ids() -> None:
    text = (NVIDIA_FIXTURES / "smi-xml" / "8x-tesla-v100s-pcie-32gb-460.73.01.xml").read_text()
    devices, readings = devices_from_xml(text), metrics_from_xml(text)
    assert [d.pci_bus_id for d in devices][::7] == ["00000000:00:0D.0", "00000000:00:14.0"]
    assert [d.minor for d in devices] == list(range(8))
    first = readings[0]
    assert (first.utilization_pct, first.temperature_c, first.power_w, first.ecc_uncorrected) == (
        97,
        66,
        232.8,
        0,
    )
    assert (first.processes[0].pid, first.processes[0].used_memory_bytes) == (37305, 31683 * MIB)


def test_a100_in_mig_mode_lists_four_mig_devices_named_from_nvidia_smi_l() -> None:
    text = (NVIDIA_FIXTURES / "smi-xml" / "a100-sxm4-80gb-mig-enabled-535.54.03.xml").read_text()
    (gpu,) = devices_from_xml(text)  # attached_gpus says 4; the capture holds one <gpu>
    assert gpu.mig_mode and [m.gpu_instance_id for m in gpu.mig_devices] == [3, 4, 5, 6]
    assert all(m.memory_total_bytes == 19968 * MIB and m.compute_instance_id == 0 for m in gpu.mig_devices)
    # Without `nvidia-smi -L` the legacy MIG id form still targets the device.
    assert gpu.mig_devices[0].uuid == "MIG-GPU-513536b6-7d19-9063-b049-1e69664bb298/3/0"
    listing = parse_list(
        "GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-513536b6-7d19-9063-b049-1e69664bb298)\n"
        + "".join(
            f"  MIG 1g.20gb     Device  {i}: (UUID: MIG-0000000{i}-aaaa-bbbb-cccc-dddddddddddd)\n"
            for i in range(4)
        )
    )
    (named,) = devices_from_xml(text, listing)
    assert [(m.profile, m.uuid[:13]) for m in named.mig_devices] == [
        ("1g.20gb", f"MIG-0000000{i}-") for i in range(4)
    ]
    reading = metrics_from_xml(text)[0]
    assert reading.utilization_pct is None and reading.power_w == 67.03  # N/A in MIG mode, not a crash


def test_windows_wddm_has_no_minor_and_still_reads() -> None:
    text = (NVIDIA_FIXTURES / "smi-xml" / "geforce-rtx-3080-windows-wddm-536.40.xml").read_text()
    (gpu,), (reading,) = devices_from_xml(text), metrics_from_xml(text)
    assert gpu.minor is None and reading.ecc_uncorrected is None and reading.power_w == 22.78
    assert len(reading.processes) == 5


def test_schema_v13_power_comes_from_instant_power_draw() -> None:
    text = (NVIDIA_FIXTURES / "smi-xml" / "rtx-4000-sff-ada-595.84-schema-v13.xml").read_text()
    assert metrics_from_xml(text)[0].power_w == 8.44


def test_pre_mig_schema_without_mig_mode_element() -> None:
    (gpu,) = devices_from_xml((NVIDIA_FIXTURES / "smi-xml" / "quadro-p400-418.43.xml").read_text())
    assert not gpu.mig_mode and gpu.mig_devices == ()


def test_xml_that_is_not_nvidia_smi_or_lacks_a_uuid_is_refused() -> None:
    with pytest.raises(ProviderError):
        devices_from_xml("<html></html>")
    with pytest.raises(ProviderError):
        devices_from_xml("<nvidia_smi_log><gpu><product_name>X</product_name></gpu></nvidia_smi_log>")


# -- nvidia-smi -L --------------------------------------------------------------------------------------------

LIST_FACTS = {
    "h100-80gb-hbm3-mig-mixed-crlf.txt": ("NVIDIA H100 80GB HBM3", "GPU-b4895dbf-9350-2524-a89b-98161ddd9fe4",
                                          ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]),
    "h200-mig-mixed-shared-compute-instances-590.48.01.txt": (
        "NVIDIA H200", "GPU-00000000-0000-0000-0000-000000000000",
        ["1c.3g.71gb", "2c.3g.71gb", "2g.35gb", "1g.18gb", "1g.18gb"]),
    "a100-sxm4-40gb-mig-legacy-uuid-format.txt": ("A100-SXM4-40GB", "GPU-4200ccc0-2667-d4cb-9137-f932c716232a",
                                                  ["3g.20gb", "2g.10gb", "1g.5gb"]),
}  # fmt: skip


@pytest.mark.parametrize("sample", LISTS, ids=lambda p: p.name)
def test_every_gpu_listing_parses(sample: Path) -> None:
    gpus = parse_list(sample.read_bytes().decode())
    assert gpus and all(g.uuid.startswith("GPU-") for g in gpus)
    assert all(m.uuid.startswith("MIG-") for g in gpus for m in g.migs)
    if sample.name in LIST_FACTS:
        name, uuid, profiles = LIST_FACTS[sample.name]
        assert (gpus[0].name, gpus[0].uuid, [m.profile for m in gpus[0].migs]) == (name, uuid, profiles)
        assert [m.index for m in gpus[0].migs] == list(range(len(profiles)))


def test_legacy_mig_uuids_keep_instance_ids() -> None:
    (gpu,) = parse_list(
        (NVIDIA_FIXTURES / "smi-list" / "a100-sxm4-40gb-mig-legacy-uuid-format.txt").read_text()
    )
    assert gpu.migs[2].uuid == "MIG-GPU-4200ccc0-2667-d4cb-9137-f932c716232a/9/0"


@pytest.mark.parametrize("sample", LISTS, ids=lambda p: p.name)
def test_truncated_listing_is_a_provider_error(sample: Path) -> None:
    with pytest.raises(ProviderError):
        parse_list(cut_mid_line(sample.read_bytes().decode()))


# -- --query-gpu CSV -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sample", CSV, ids=lambda p: p.name)
def test_every_query_csv_has_one_row_per_gpu_with_the_fields_its_command_asked_for(sample: Path) -> None:
    rows = parse_query_csv(sample.read_text())
    command = Path(f"{sample}.cmd").read_text()
    asked = command.split("--query-gpu=", 1)[1].split()[0].split(",")
    assert rows and all(list(row) == asked for row in rows)
    for field in ("memory.total", "memory.used"):  # the worker's own sample query asks no memory.total
        if field in asked:
            assert all(mib_bytes(row[field]) is not None for row in rows), field
    if "uuid" in asked:
        assert [m.uuid for m in metrics_from_csv(rows)] == [row["uuid"] for row in rows]


@pytest.mark.parametrize("sample", CSV, ids=lambda p: p.name)
def test_truncated_query_csv_is_a_provider_error(sample: Path) -> None:
    with pytest.raises(ProviderError):
        parse_query_csv(cut_mid_line(sample.read_text()))


def test_four_t4s_on_azure_without_units() -> None:
    rows = parse_query_csv(
        (NVIDIA_FIXTURES / "smi-csv" / "4x-tesla-t4-azure-510.108.03-nounits.csv").read_text()
    )
    assert [r["pci.bus_id"] for r in rows] == [f"0000000{i}:00:00.0" for i in range(1, 5)]
    assert {(r["name"], r["memory.total"], r["driver_version"]) for r in rows} == {
        ("Tesla T4", "16384", "510.108.03")
    }
    assert [number(r["temperature.gpu"]) for r in rows] == [48, 51, 53, 53]
    with pytest.raises(ProviderError, match="uuid"):
        metrics_from_csv(rows)  # that query did not ask for uuid


def test_h100_full_query_in_mig_mode_has_na_utilization() -> None:
    rows = parse_query_csv(
        (NVIDIA_FIXTURES / "smi-csv" / "h100-80gb-hbm3-mig-enabled-590.48.01-full-query.csv").read_text()
    )
    (row,) = rows
    assert (row["name"], row["compute_cap"], row["mig.mode.current"]) == (
        "NVIDIA H100 80GB HBM3",
        "9.0",
        "Enabled",
    )
    (reading,) = metrics_from_csv(rows)
    assert (
        reading.utilization_pct is None and reading.memory_used_bytes == 59 * MIB and reading.power_w == 71.15
    )
    assert reading.ecc_uncorrected == 0


def test_windows_full_query_with_units_and_deprecated_fields() -> None:
    (row,) = parse_query_csv(
        (NVIDIA_FIXTURES / "smi-csv" / "geforce-rtx-2080-super-windows-591.86-full-query.csv").read_text()
    )
    assert (row["memory.total"], row["compute_cap"], row["ecc.errors.uncorrected.volatile.total"]) == (
        "8192",
        "7.5",
        None,
    )
    assert row["driver_model.current"] == "WDDM"


def test_a_lost_gpu_in_the_query_reads_as_fallen_off_the_bus() -> None:
    rows = parse_query_csv(
        "uuid, utilization.gpu [%], memory.used [MiB]\nGPU-1, [GPU is lost], [GPU is lost]\n"
    )
    assert metrics_from_csv(rows)[0].health == FELL_OFF_BUS


# -- the provider over a runner ------------------------------------------------------------------------------------


class _Runner:
    """Answers nvidia-smi command lines from canned outputs; a missing answer is a failed command, and an
    answer that is a ProviderError is raised (as `run_command` raises for a non-zero exit)."""

    def __init__(self, answers: dict[str, str | ProviderError]) -> None:
        self.answers = answers
        self.seen: list[str] = []

    def __call__(self, argv: Sequence[str]) -> str:
        key = argv[1].split("=")[0]
        self.seen.append(key)
        answer = self.answers.get(key, ProviderError(f"{argv[1]} failed"))
        if isinstance(answer, ProviderError):
            raise answer
        return answer


def test_provider_merges_xml_listing_and_compute_capability_and_samples_by_csv() -> None:
    xml = (NVIDIA_FIXTURES / "smi-xml" / "a100-sxm4-80gb-mig-enabled-535.54.03.xml").read_text()
    uuid = "GPU-513536b6-7d19-9063-b049-1e69664bb298"
    run = _Runner({
        "-q": xml,
        "-L": f"GPU 0: NVIDIA A100-SXM4-80GB (UUID: {uuid})\n  MIG 1g.20gb Device 0: (UUID: MIG-abc)\n",
        "--query-gpu": f"uuid, compute_cap\n{uuid}, 8.0\n",
        "--query-compute-apps": "gpu_uuid, pid, used_memory [MiB]\n",
    })  # fmt: skip
    provider = SmiProvider(run=run)
    (gpu,) = provider.devices()
    assert gpu.compute_capability == "8.0" and gpu.mig_devices[0].uuid == "MIG-abc"
    assert gpu.mig_devices[1].uuid.startswith("MIG-GPU-")  # not in the listing: legacy form
    run.answers["--query-gpu"] = (
        f"uuid, utilization.gpu, memory.used [MiB], temperature.gpu\n{uuid}, [N/A], 50 MiB, 27\n"
    )
    run.answers["--query-compute-apps"] = f"gpu_uuid, pid, used_memory [MiB]\n{uuid}, 4242, 1024 MiB\n"
    (reading,) = provider.metrics()
    assert (reading.utilization_pct, reading.memory_used_bytes, reading.temperature_c) == (None, 50 * MIB, 27)
    assert [(p.pid, p.used_memory_bytes) for p in reading.processes] == [(4242, 1024 * MIB)]
    run.answers["--query-gpu"] = "uuid, utilization.gpu\n"  # a header and no rows: the CSV cannot be trusted
    assert provider.metrics() == metrics_from_xml(xml)


def test_provider_marks_a_gpu_missing_from_the_sample_as_not_answering() -> None:
    xml = (NVIDIA_FIXTURES / "smi-xml" / "tesla-t4-515.105.01.xml").read_text()
    other = "GPU-11111111-2222-3333-4444-555555555555"
    provider = SmiProvider(run=_Runner({"-q": xml, "--query-gpu": f"uuid\n{other}\n"}))
    provider.devices()
    (reading,) = provider.metrics()
    assert reading.uuid == "GPU-d37e67a5-91dd-3774-a5cb-99096249601a" and reading.health == NOT_ANSWERING


def test_missing_binary_and_truncated_output_make_discovery_move_on(caplog: pytest.LogCaptureFixture) -> None:
    from turnout.gpu.smi import run_command

    xml = (NVIDIA_FIXTURES / "smi-xml" / "tesla-t4-515.105.01.xml").read_text()
    probes = [
        ("smi", lambda: SmiProvider(run=lambda argv: run_command(["/nonexistent/nvidia-smi", *argv[1:]]))),
        ("smi-truncated", lambda: SmiProvider(run=_Runner({"-q": cut_mid_line(xml)}))),
        ("smi-ok", lambda: SmiProvider(run=_Runner({"-q": xml}))),
    ]
    found = discover("auto", probes=probes)
    assert found.provider.name == "smi" and found.devices[0].name == "Tesla T4"
    assert [(name, "not found" in why or "truncated" in why) for name, why in found.tried] == [
        ("smi", True), ("smi-truncated", True)]  # fmt: skip
    assert len([r for r in caplog.records if "smi-truncated" in r.getMessage()]) == 1


# -- a sample query that fails -------------------------------------------------------------------------------------
# Real nvidia-smi, asked for a field its driver does not know, exits 2 with an empty stderr and prints on stdout
# `Field "device_minor" is not a valid field to query.` and a blank line (CoHDI/composable-resource-operator#37);
# a Windows build was quoted with curly quotes (influxdata/telegraf#6573).

V100S = NVIDIA_FIXTURES / "smi-xml" / "8x-tesla-v100s-pcie-32gb-460.73.01.xml"


@pytest.mark.parametrize(
    ("message", "field"),
    [
        ('Field "device_minor" is not a valid field to query.', "device_minor"),
        (
            'nvidia-smi --query-gpu=uuid,power.draw.instant exited 2: Field "power.draw.instant" is not a valid '
            "field to query.",
            "power.draw.instant",
        ),
        (
            "Field \u201cencoder.stats.sessionCount\u201d is not a valid field to query.",
            "encoder.stats.sessionCount",
        ),
        ("Field 'compute_cap' is not a valid field to query.", "compute_cap"),
        ("nvidia-smi --query-gpu=uuid exited 9: NVIDIA-SMI has failed because it couldn't communicate", None),
        ("nvidia-smi query: a row has 2 fields, the header 6", None),
    ],
)
def test_unknown_field_is_read_from_nvidia_smis_refusal(message: str, field: str | None) -> None:
    assert unknown_field(message) == field


FAKE_SMI = """#!{python}
# nvidia-smi of a driver that knows only some --query-gpu fields; each call is appended to calls.log.
import json, sys
from pathlib import Path

here = Path(__file__).parent
conf = json.loads((here / "smi.json").read_text())
with (here / "calls.log").open("a") as log:
    log.write(" ".join(sys.argv[1:]) + "\\n")
if sys.argv[1:3] == ["-q", "-x"]:
    sys.stdout.write(Path(conf["xml"]).read_text())
    sys.exit(0)
kind, _, asked = sys.argv[1].partition("=")
if kind == "--query-compute-apps":
    print("gpu_uuid, pid, used_memory [MiB]")
    sys.exit(0)
fields = asked.split(",")
for name in fields:
    if name not in conf["known"]:
        print(f'Field "{{name}}" is not a valid field to query.')
        print()
        sys.exit(2)
print(", ".join(fields))
for uuid in conf["uuids"]:
    print(", ".join(uuid if name == "uuid" else conf["values"].get(name, "[N/A]") for name in fields))
"""


def test_fields_the_driver_does_not_know_are_dropped_and_the_other_readings_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Given an nvidia-smi (run for real, through run_command) whose driver knows neither power.draw nor ECC
    script = tmp_path / "nvidia-smi"
    script.write_text(FAKE_SMI.format(python=sys.executable))
    script.chmod(0o755)
    uuids = [d.uuid for d in devices_from_xml(V100S.read_text())]
    refused = ["power.draw", "ecc.errors.uncorrected.volatile.total"]
    known = [f for f in METRIC_FIELDS if f not in refused]
    values = {"utilization.gpu": "11", "memory.used": "512", "temperature.gpu": "41"}
    (tmp_path / "smi.json").write_text(json.dumps({"xml": str(V100S), "uuids": uuids, "known": known,
                                                    "values": values}))  # fmt: skip
    provider = SmiProvider(binary=str(script))
    assert [d.uuid for d in provider.devices()] == uuids  # compute_cap refused too: discovery goes on

    # When it is sampled twice
    first, second = provider.metrics(), provider.metrics()

    # Then each sample has all eight GPUs with the CSV's readings (not the XML's 97 %), the refused ones None
    for sample in (first, second):
        assert [m.uuid for m in sample] == uuids
        assert {(m.utilization_pct, m.memory_used_bytes, m.temperature_c, m.power_w, m.ecc_uncorrected,
                 m.health) for m in sample} == {(11, 512 * MIB, 41, None, None, "ok")}  # fmt: skip
    # the first sample asked three times, dropping one refused field each time; the second asked once
    queries = [
        line.split()[0].split("=")[1].split(",")
        for line in (tmp_path / "calls.log").read_text().splitlines()
        if line.startswith("--query-gpu=") and "compute_cap" not in line
    ]
    assert queries == [list(METRIC_FIELDS), [*known, refused[1]], known, known]
    # each dropped field is logged once, by name, and no sample fell back to the XML
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert [w for w in warnings if "cannot query" in w] == [
        f"nvidia-smi cannot query {f} here; sampling without it" for f in refused
    ]
    assert not [w for w in warnings if "-q -x" in w]


CSV_FAILURES = {
    "exit with an unrelated error": ProviderError("nvidia-smi --query-gpu=uuid exited 15: Unknown Error"),
    "uuid itself refused": ProviderError(
        'nvidia-smi --query-gpu=uuid exited 2: Field "uuid" is not a valid field'
    ),
    "no output": "",
    "a header and no rows": "uuid, utilization.gpu [%]\n",
    "garbage": "Segmentation fault (core dumped)\n\x00\x7f",
    "a truncated row": "uuid, utilization.gpu [%], memory.used [MiB]\nGPU-76098dc1-d3bc-9a1b-7ea6-f7b48837829e, 9",
}


@pytest.mark.parametrize("failure", list(CSV_FAILURES.values()), ids=list(CSV_FAILURES))
def test_a_sample_query_that_fails_takes_the_readings_from_the_xml(failure: str | ProviderError) -> None:
    # Given a provider over eight V100s whose CSV sample query fails
    xml = V100S.read_text()
    run = _Runner({"-q": xml, "--query-gpu": failure})
    provider = SmiProvider(run=run)
    provider.devices()
    run.seen.clear()

    # When it is sampled
    readings = provider.metrics()

    # Then the readings are exactly what `-q -x` gives, processes included, read fresh after the CSV failed
    assert readings == metrics_from_xml(xml) and len(readings) == 8
    assert (readings[0].utilization_pct, readings[0].processes[0].pid) == (97, 37305)
    assert run.seen[-1] == "-q" and "--query-gpu" in run.seen


def test_the_xml_fallback_is_logged_once_and_the_csv_is_asked_again_next_sample(
    caplog: pytest.LogCaptureFixture,
) -> None:
    xml = (NVIDIA_FIXTURES / "smi-xml" / "tesla-t4-515.105.01.xml").read_text()
    uuid = "GPU-d37e67a5-91dd-3774-a5cb-99096249601a"
    run = _Runner({"-q": xml, "--query-gpu": "garbage\n"})
    provider = SmiProvider(run=run)
    provider.devices()
    caplog.set_level("DEBUG", logger="turnout.gpu")
    from_xml = [provider.metrics() for _ in range(3)]
    assert from_xml == [metrics_from_xml(xml)] * 3
    fallbacks = [r for r in caplog.records if "readings come from nvidia-smi -q -x" in r.getMessage()]
    assert [r.levelname for r in fallbacks] == ["WARNING", "DEBUG", "DEBUG"]
    assert "expected a header and 1+ rows" in fallbacks[0].getMessage()  # the reason is in the one warning
    run.answers["--query-gpu"] = f"uuid, utilization.gpu [%]\n{uuid}, 3\n"  # the tool recovers
    (reading,) = provider.metrics()
    assert (reading.uuid, reading.utilization_pct) == (uuid, 3)


def test_a_sample_raises_only_when_the_xml_fails_too() -> None:
    xml = (NVIDIA_FIXTURES / "smi-xml" / "tesla-t4-515.105.01.xml").read_text()
    run = _Runner({"-q": xml, "--query-gpu": "garbage\n"})
    provider = SmiProvider(run=run)
    provider.devices()
    run.answers["-q"] = cut_mid_line(xml)
    with pytest.raises(ProviderError, match="truncated"):
        provider.metrics()  # the caller counts a missed sample, as it should when the tool cannot answer
