"""The torch backend in one process: registration, the store adapter, Work, a world of one."""

from __future__ import annotations

import subprocess
import sys
import warnings
from collections.abc import Iterator
from datetime import timedelta
from importlib.metadata import entry_points

import pytest

torch = pytest.importorskip(
    "torch", reason="torch is not installed (pip install 'aiocollect[torch]')"
)
dist = pytest.importorskip("torch.distributed")

import aiocollect  # noqa: E402
import aiocollect.torch as act  # noqa: E402
from aiocollect.torch._loop import loop_thread  # noqa: E402
from aiocollect.torch.store import TorchStore  # noqa: E402
from aiocollect.torch.work import Work  # noqa: E402
from tests.torch.launch import ROOT  # noqa: E402

# Older torch releases have these only as all_gather_into_tensor and reduce_scatter_tensor.
all_gather_single_fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single_fn = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)


# -- registration -----------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_registered_for_cpu() -> None:
    assert "aiocollect" in dist.Backend.backend_list
    assert dist.Backend.backend_capability["aiocollect"] == ["cpu"]
    assert dist.Backend.default_device_backend_map["cpu"] != "aiocollect"  # not hijacked
    act.register()  # idempotent


@pytest.mark.timeout(10)
def test_entry_point_declared() -> None:
    eps = {ep.name: ep.value for ep in entry_points(group="torch.backends")}
    assert eps.get("aiocollect") == "aiocollect.torch:_autoload"


@pytest.mark.timeout(10)
def test_autoload_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(act, "register", broken)
    with pytest.warns(RuntimeWarning, match="boom"):
        act._autoload()


@pytest.mark.timeout(60)
def test_import_torch_alone_registers_the_backend() -> None:
    code = (
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group('aiocollect', store=dist.HashStore(), rank=0, "
        "world_size=1)\n"
        "t = torch.arange(4.0); dist.all_reduce(t); dist.barrier()\n"
        "print('backend', dist.get_backend(), t.tolist())\n"
        "dist.destroy_process_group()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "backend aiocollect [0.0, 1.0, 2.0, 3.0]" in out.stdout


# -- the store adapter ------------------------------------------------------------------------


async def test_torch_store_adapter() -> None:
    store = TorchStore(dist.PrefixStore("p", dist.HashStore()), timeout=5.0)
    await store.set("a", b"\x00\x01")
    assert await store.get("a") == b"\x00\x01"
    assert await store.add("n", 2) == 2
    assert await store.add("n", 3) == 5
    assert await store.get("n") == b"5"
    assert await store.check(["a", "b", "n"]) == [True, False, True]
    await store.wait(["a", "n"], timeout=1.0)
    with pytest.raises(aiocollect.StoreTimeout) as info:
        await store.wait(["a", "missing"], timeout=0.2)
    assert info.value.keys == ["missing"]
    with pytest.raises(aiocollect.StoreTimeout):
        await store.get("missing", timeout=0)
    assert await store.delete("a") is True
    assert await store.check(["a"]) == [False]


@pytest.mark.timeout(10)
def test_torch_store_rejects_other_objects() -> None:
    with pytest.raises(aiocollect.UsageError):
        TorchStore(object())  # type: ignore[arg-type]


# -- Work -------------------------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_work_states() -> None:
    thread = loop_thread()
    t = torch.ones(2)
    work = Work([t], thread, "test")
    assert not work.is_completed()
    assert not work.get_future().done()
    with pytest.raises(TimeoutError):
        work.wait(timedelta(milliseconds=50))
    err = aiocollect.MismatchError("boom")
    thread.call(lambda: work._complete(err))
    with pytest.raises(aiocollect.MismatchError):
        work.wait()
    assert work.is_completed()
    assert not work.is_success()
    assert work.exception() is err
    with pytest.raises(aiocollect.MismatchError):  # the future fails with the error too
        work.get_future().wait()
    ddp_work = Work([t], thread, "test", fail_future=False)  # DDP's: completed normally
    thread.call(lambda: ddp_work._complete(err))
    with pytest.raises(aiocollect.MismatchError):
        ddp_work.wait()
    assert ddp_work.get_future().wait()[0] is t


# -- a world of one ---------------------------------------------------------------------------


@pytest.fixture
def world() -> Iterator[dist.ProcessGroup]:  # type: ignore[name-defined]
    dist.init_process_group(
        "aiocollect", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=30)
    )
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_world_of_one(world: dist.ProcessGroup) -> None:  # type: ignore[name-defined]
    pg = act.get_process_group()
    assert pg.name() == "aiocollect"
    assert pg.size() == 1
    assert pg.rank() == 0
    t = torch.arange(6.0).reshape(2, 3)
    work = dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)
    assert work is not None
    assert work.wait()
    assert work.is_success()
    assert work.get_future().wait()[0] is t
    assert torch.equal(t, torch.arange(6.0).reshape(2, 3))
    dist.broadcast(t, src=0)
    out = [torch.empty(2, 3)]
    dist.all_gather(out, t)
    assert torch.equal(out[0], t)
    single = torch.empty(2, 3)
    all_gather_single_fn(single, t)
    assert torch.equal(single, t)
    rs = torch.empty(2, 3)
    reduce_scatter_single_fn(rs, t)
    assert torch.equal(rs, t)
    a2a = torch.empty(2, 3)
    dist.all_to_all_single(a2a, t)
    assert torch.equal(a2a, t)
    dist.barrier()
    objs: list[object] = [None]
    dist.all_gather_object(objs, {"x": 1})
    assert objs == [{"x": 1}]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        b = torch.ones(3, dtype=torch.bfloat16)
        dist.all_reduce(b)
    assert b.tolist() == [1.0, 1.0, 1.0]
    act.check()


@pytest.mark.timeout(60)
def test_bad_arguments_raise_at_the_call(world: dist.ProcessGroup) -> None:  # type: ignore[name-defined]
    with pytest.raises(ValueError, match="all_gather"):
        all_gather_single_fn(torch.empty(5), torch.ones(2))
    with pytest.raises(ValueError, match="split sizes"):
        dist.all_to_all_single(torch.empty(4), torch.ones(4), [3], [4])
    with pytest.raises(ValueError, match="CPU tensors"):
        dist.all_reduce(torch.ones(2, device="meta"))
    act.check()  # a usage error does not break the group
    t = torch.ones(2)
    dist.all_reduce(t)
    assert t.tolist() == [1.0, 1.0]
