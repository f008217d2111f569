"""World size 8 in real processes: collectives on a strict subset of the ranks, two
sub-groups at once, and the coalescing manager (see tests/torch/world8.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install 'aiocollect[torch]')")

from tests.torch.launch import FOREIGN, ROOT


@pytest.mark.timeout(150)
def test_subgroups_and_coalescing_at_world_size_8(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(FOREIGN)}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.torch.world8", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=140,
        check=False,
        start_new_session=True,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for rank in range(8):
        assert f"RANK {rank} OK" in proc.stdout, out[-4000:]
