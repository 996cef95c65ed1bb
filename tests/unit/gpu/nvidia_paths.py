"""Where the real NVIDIA tool outputs live, and how to spoil them (imported by name: conftest is not a module)."""

from __future__ import annotations

from pathlib import Path

# The CI clone keeps shared/ beside the repository: <repo>/../shared/fixtures/nvidia.
NVIDIA_FIXTURES = Path(__file__).resolve().parents[3] / ".." / "shared" / "fixtures" / "nvidia"


# captures this project made on real GPU hosts (tests/fixtures/nvidia/SOURCES.md)
OWN_FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "nvidia"


def nvidia_samples(kind: str, pattern: str = "*") -> list[Path]:
    """Every sample of one kind (smi-xml, smi-csv, smi-list, proc), shared and our own, so a new file is
    picked up automatically."""
    return sorted(
        p for root in (NVIDIA_FIXTURES, OWN_FIXTURES) for p in (root / kind).glob(pattern) if p.is_file()
    )


def cut_mid_line(text: str) -> str:
    """The text cut in half, inside a line (not at a line break), as a killed or timed-out tool leaves it."""
    lines = text.splitlines(keepends=True)
    pos, start = len(text) // 2, 0
    for line in lines:
        if start + len(line) > pos and len(line.strip()) > 2:
            return text[: start + max(len(line.rstrip()) // 2, 1)]
        start += len(line)
    return text[: len(text) // 2]
