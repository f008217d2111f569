"""The "aiocollect" torch backend under real torchrun (2 processes).

``c10d_script.py`` runs every c10d collective on aiocollect and on gloo and compares them,
then sub-groups, 20 DDP steps against gloo, and error propagation. The example
``examples/torch_ddp.py`` is run as users run it and checked against a single-process
computation of the same training.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip(
    "torch", reason="torch is not installed (pip install 'aiocollect[torch]')"
)

from tests.torch.launch import ROOT, tail, torchrun  # noqa: E402

SCRIPT = Path(__file__).with_name("c10d_script.py")
EXAMPLE = ROOT / "examples" / "torch_ddp.py"


@pytest.mark.timeout(120)
def test_every_collective_matches_gloo_and_errors_propagate() -> None:
    run = torchrun(SCRIPT, timeout=100)
    assert run.returncode == 0, tail(run.output)
    for rank in (0, 1):
        assert f"ALL OK rank {rank}" in run.output, tail(run.output)
    passed = re.findall(r"^PASS (.+)$", run.output, re.M)
    for name in (
        "all_reduce sum torch.float32",
        "all_reduce premul_sum",
        "reduce max root 1",
        "reduce_scatter_single",
        "all_gather uneven refused as by gloo",
        "gather root 1",
        "scatter root 0",
        "object collectives",
        "all_to_all uneven",
        "all_to_all_single splits",
        "barrier",
        "recv any source",
        "batch_isend_irecv",
        "new_group [1]",
        "new_group [0] non-member",
        "future failed with the error",
        "next call raises GroupBrokenError",
        "ddp: check() reports the failed allreduce",
    ):
        assert name in passed, f"{name!r} did not run\n{tail(run.output)}"
    assert any(p.startswith("ddp 20 steps") for p in passed)
    assert any(p.startswith("ddp: the next backward raises") for p in passed)
    # PeerDisconnected, or GroupBrokenError from it when the loss was seen first
    assert any(p.startswith("peer death: wait() raises ") for p in passed), tail(run.output)


def _reference(steps: int, world: int) -> list[torch.Tensor]:  # type: ignore[name-defined]
    """The example's training computed in one process: DDP averages the ranks' gradients."""
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import torch_ddp  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    model = torch_ddp.make_model()
    params = list(model.parameters())
    momentum: list[torch.Tensor] = []  # type: ignore[name-defined]
    for step in range(steps):
        grads = [torch.zeros_like(p) for p in params]
        for rank in range(world):
            x, y = torch_ddp.batch(rank, step)
            loss = torch.nn.functional.mse_loss(model(x), y)
            for g, d in zip(grads, torch.autograd.grad(loss, params), strict=True):
                g += d / world
        # torch.optim.SGD(lr=0.05, momentum=0.9), written out (its first step is slow to load)
        momentum = (
            grads if not momentum else [0.9 * m + g for m, g in zip(momentum, grads, strict=True)]
        )
        with torch.no_grad():
            for p, m in zip(params, momentum, strict=True):
                p -= 0.05 * m
    return [p.detach() for p in params]


@pytest.mark.timeout(90)
def test_ddp_example(tmp_path: Path) -> None:
    saved = tmp_path / "params.pt"
    run = torchrun(EXAMPLE, "--backend", "aiocollect", "--save", str(saved), timeout=80)
    assert run.returncode == 0, tail(run.output)
    assert "backend=aiocollect world_size=2 steps=20" in run.output, tail(run.output)
    assert re.search(r"final parameter checksum: -?\d+\.\d+", run.output), tail(run.output)
    got = torch.load(saved)
    want = _reference(20, 2)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
