"""A shared-GPU task's memory share reaches torch however its handler imports torch.

The runner cannot wait for `setup` to have imported torch: a handler without setup that imports torch in its
first call would run with the whole GPU. These tests run the runner's hook in a child process over a stand-in
`torch` package (no GPU here) that records what it was told.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

FAKE_TORCH = textwrap.dedent("""
    import json, os
    class _Cuda:
        @staticmethod
        def is_available():
            return os.environ.get("FAKE_CUDA") == "1"
        @staticmethod
        def set_per_process_memory_fraction(fraction, device):
            with open(os.environ["FAKE_TORCH_LOG"], "a") as f:
                f.write(json.dumps([fraction, device]) + "\\n")
    cuda = _Cuda()
""")


def _run(tmp_path: Path, script: str, **env: str) -> list[list[float]]:
    (tmp_path / "torch").mkdir(exist_ok=True)
    (tmp_path / "torch" / "__init__.py").write_text(FAKE_TORCH)
    log = tmp_path / "calls.jsonl"
    log.unlink(missing_ok=True)
    child_env = {"PYTHONPATH": f"{tmp_path}:{Path(__file__).parents[2] / 'src'}", "FAKE_TORCH_LOG": str(log),
                 "FAKE_CUDA": "1", **env}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=child_env, capture_output=True,
                          text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


LIMIT_THEN_IMPORT = """
    from turnout.worker.runner import limit_gpu_memory
    limit_gpu_memory()
    import torch  # the handler's first call imports torch: the share applies before it can allocate
    import torch  # a second import finds the module: nothing more to do
"""


def test_share_applies_when_the_handler_imports_torch_later(tmp_path: Path) -> None:
    assert _run(tmp_path, LIMIT_THEN_IMPORT, TURNOUT_GPU_MEMORY_FRACTION="0.25") == [[0.25, 0]]


def test_share_applies_at_once_when_torch_is_already_loaded(tmp_path: Path) -> None:
    script = """
        import torch
        from turnout.worker.runner import limit_gpu_memory
        limit_gpu_memory()
        limit_gpu_memory()
    """
    assert _run(tmp_path, script, TURNOUT_GPU_MEMORY_FRACTION="0.5") == [[0.5, 0], [0.5, 0]]


@pytest.mark.parametrize("env", [{}, {"FAKE_CUDA": "0", "TURNOUT_GPU_MEMORY_FRACTION": "0.5"}])
def test_no_share_or_no_visible_gpu_leaves_torch_alone(tmp_path: Path, env: dict[str, str]) -> None:
    assert _run(tmp_path, LIMIT_THEN_IMPORT, **env) == []


def test_the_hook_leaves_other_imports_and_itself_out_of_the_way(tmp_path: Path) -> None:
    script = """
        import sys
        from turnout.worker.runner import limit_gpu_memory
        limit_gpu_memory()
        limit_gpu_memory()  # installed once
        hooks = [f for f in sys.meta_path if type(f).__name__ == "_LimitOnTorchImport"]
        assert len(hooks) == 1, hooks
        import json, decimal  # other modules import as ever
        import torch
        assert not [f for f in sys.meta_path if type(f).__name__ == "_LimitOnTorchImport"]
    """
    assert _run(tmp_path, script, TURNOUT_GPU_MEMORY_FRACTION="0.125") == [[0.125, 0]]
