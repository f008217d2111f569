"""The wheel stands alone: installed in a fresh venv outside the checkout, it runs.

``make test-dist`` builds the sdist and the wheel (``make dist``) and runs this module with
``AIOCOLLECT_DIST`` naming that folder; without it every test here is skipped (``make
test`` does not install torch into a new venv). The venv, in a temporary folder, gets the
wheel, its dependencies, pytest with pytest-asyncio and ``torch==2.13.0`` (pinned: pip
takes the CPU build from local disk where there is one; an unpinned torch could download
gigabytes). Every command runs from that venv in a folder outside the checkout, with no
``PYTHONPATH``, and checks that the aiocollect it imported is the venv's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import aiocollect

REPO = Path(__file__).resolve().parents[2]
DIST = os.environ.get("AIOCOLLECT_DIST")
#: What the venv gets besides the wheel (and the wheel's own dependencies).
EXTRA_PACKAGES = ("torch==2.13.0", "pytest", "pytest-asyncio")
INSTALL_TIMEOUT = 900.0

pytestmark = [
    pytest.mark.skipif(
        not DIST, reason="make test-dist runs it (AIOCOLLECT_DIST: make dist's folder)"
    ),
    pytest.mark.xdist_group("packaging"),
    pytest.mark.timeout(INSTALL_TIMEOUT + 120),
]


@dataclass(frozen=True)
class Venv:
    """A venv with the wheel installed, and a working folder outside the checkout."""

    root: Path
    work: Path
    env: dict[str, str]

    def run(self, *argv: str | Path, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` (a command of the venv's bin/ by name) in the working folder."""
        exe = self.root / "bin" / str(argv[0])
        command = [str(exe if exe.exists() else argv[0]), *map(str, argv[1:])]
        return subprocess.run(
            command,
            cwd=self.work,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def site_packages(self) -> Path:
        """The venv's site-packages folder."""
        return next((self.root / "lib").glob("python3*/site-packages"))


def _isolated_env(root: Path) -> dict[str, str]:
    """This process's environment without what would reach back into the checkout."""
    drop = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "PYTEST_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env = {k: v for k, v in env.items() if not k.startswith("AIOCOLLECT_")}
    env["VIRTUAL_ENV"] = str(root)
    env["PATH"] = f"{root / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def _wheel() -> Path:
    assert DIST is not None
    wheels = sorted(Path(DIST).glob(f"aiocollect-{aiocollect.__version__}-*.whl"))
    assert len(wheels) == 1, f"want one aiocollect {aiocollect.__version__} wheel in {DIST}"
    return wheels[0]


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Venv:
    root = tmp_path_factory.mktemp("wheel-venv")
    work = tmp_path_factory.mktemp("wheel-work")
    for folder in (root, work):
        assert not folder.resolve().is_relative_to(REPO), f"{folder} is inside the checkout"
    # No pip of its own in the venv: this interpreter's pip installs into it (--python).
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", root], check=True)
    env = _isolated_env(root)
    python = root / "bin" / "python"
    install = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            python,
            "install",
            "-q",
            _wheel(),
            *EXTRA_PACKAGES,
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT,
        check=False,
    )
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    return Venv(root, work, env)


def _from_venv(venv: Venv, path: str) -> None:
    here = Path(path).resolve()
    assert here.is_relative_to(venv.site_packages()), f"aiocollect imported from {here}"
    assert not here.is_relative_to(REPO)


def test_the_venv_imports_its_own_aiocollect(venv: Venv) -> None:
    probe = (
        "import json, importlib.metadata as m, aiocollect as a;"
        "print(json.dumps([a.__file__, a.__version__, m.version('aiocollect')]))"
    )
    done = venv.run("python", "-c", probe)
    assert done.returncode == 0, done.stderr
    path, version, dist_version = json.loads(done.stdout)
    _from_venv(venv, path)
    assert version == dist_version == aiocollect.__version__


def test_version_and_info(venv: Venv) -> None:
    done = venv.run("aiocollect", "--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"aiocollect {aiocollect.__version__}"
    done = venv.run("aiocollect", "info", "--json")
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["aiocollect"] == aiocollect.__version__
    assert Path(info["python"]["executable"]).parent == venv.root / "bin"
    assert info["extras"]["torch"].startswith("2.13.0")
    assert info["transports"]["tcp"] == "available"


RANKS_SCRIPT = """
import asyncio, json
import numpy as np
import aiocollect as ac

async def main():
    async with ac.open_group() as group:
        x = np.full(3, group.rank + 1.0)
        await group.allreduce(x)
        print("RESULT", json.dumps([group.rank, group.world_size, x.tolist(), ac.__file__]))

asyncio.run(main())
"""


def _results(stdout: str) -> dict[int, list[object]]:
    rows = [json.loads(row) for row in re.findall(r"^\[rank \d+\] RESULT (.*)$", stdout, re.M)]
    return {int(row[0]): row for row in rows}


def test_run_two_ranks(venv: Venv) -> None:
    (venv.work / "ranks.py").write_text(RANKS_SCRIPT)
    done = venv.run("aiocollect", "run", "-n", "2", "ranks.py", timeout=90)
    assert done.returncode == 0, done.stdout + done.stderr
    results = _results(done.stdout)
    assert sorted(results) == [0, 1], done.stdout
    for _, world_size, values, path in results.values():
        assert world_size == 2
        assert values == [3.0, 3.0, 3.0]
        _from_venv(venv, str(path))


PLUGIN_TEST = """
import sys
import numpy as np
import pytest
import aiocollect

async def allreduce(group):
    x = np.full(2, float(group.rank))
    await group.allreduce(x)
    return x.tolist()

@pytest.mark.asyncio
async def test_ranks_fixture(ranks):
    assert aiocollect.__file__.startswith(sys.prefix)
    assert await ranks(3, allreduce) == [[3.0, 3.0]] * 3

@pytest.mark.asyncio
async def test_spawned_fixture(spawned):
    assert await spawned(2, allreduce) == [[1.0, 1.0]] * 2
"""


def test_pytest_plugin(venv: Venv) -> None:
    (venv.work / "test_tiny.py").write_text(PLUGIN_TEST)
    done = venv.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_tiny.py")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout, done.stdout


TORCH_SCRIPT = """
import json
import torch
import torch.distributed as dist
import aiocollect

# No `import aiocollect.torch`: the torch.backends entry point registered the backend.
dist.init_process_group("aiocollect")
t = torch.full((4,), float(dist.get_rank() + 1))
dist.all_reduce(t)
print("RESULT", json.dumps([dist.get_rank(), dist.get_world_size(), t.tolist(),
                            aiocollect.__file__, dist.get_backend()]), flush=True)
dist.destroy_process_group()
"""


def test_torch_backend_allreduce(venv: Venv) -> None:
    (venv.work / "torch_ranks.py").write_text(TORCH_SCRIPT)
    done = venv.run("aiocollect", "run", "-n", "2", "torch_ranks.py", timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    results = _results(done.stdout)
    assert sorted(results) == [0, 1], done.stdout
    for _, world_size, values, path, backend in results.values():
        assert (world_size, values, backend) == (2, [3.0] * 4, "aiocollect")
        _from_venv(venv, str(path))
