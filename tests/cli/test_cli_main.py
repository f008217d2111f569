"""The ``aiocollect`` entry point, ``info``, ``bench`` dispatch and argument errors."""

from __future__ import annotations

import json
import signal
import subprocess
from importlib import metadata
from pathlib import Path

import pytest

import aiocollect
from aiocollect.cli.main import main
from aiocollect.transport import registry, unix
from tests.support.cli import RunCli, WriteScript, cli_command

#: Argument errors, ``info``, ``--version`` and dispatch start no rank: once, not per start
#: method (tests/cli/conftest.py).
pytestmark = pytest.mark.no_ranks


@pytest.mark.timeout(60)
def test_info_text(run_cli: RunCli) -> None:
    done = run_cli("info")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"aiocollect   {aiocollect.__version__}\n")
    for word in (
        "python",
        "event loop",
        "numpy",
        "msgpack",
        "auto:",
        "tcp:",
        "tls:",
        "memory:",
        "shm:",
        "torch:",
        "pyverbs:",
        "rdma devices",
    ):
        assert word in done.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("setting", [None, "0"])
def test_info_says_which_socket_same_host_links_use(
    run_cli: RunCli, monkeypatch: pytest.MonkeyPatch, setting: str | None
) -> None:
    """``auto`` and ``shm`` links on one host connect over Unix sockets unless
    AIOCOLLECT_UNIX_SOCKET=0 (inherited by the command): info says which."""
    if setting is None:
        monkeypatch.delenv(unix.UNIX_ENV, raising=False)
    else:
        monkeypatch.setenv(unix.UNIX_ENV, setting)
    info = json.loads(run_cli("info", "--json").stdout)["transports"]
    want = "unix sockets" if setting is None else f"tcp sockets: {unix.UNIX_ENV}=0"
    assert f"(over {want})" in info["auto"], info
    if "unavailable" not in info["shm"]:
        assert f"over {want}" in info["shm"], info


@pytest.mark.timeout(60)
def test_info_json(run_cli: RunCli) -> None:
    done = run_cli("info", "--json")
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["aiocollect"] == aiocollect.__version__
    assert info["transports"]["tcp"] == "available"
    assert info["transports"]["memory"] == "available"
    assert set(info["transports"]) == set(registry.names())  # every one, nothing else
    assert set(info["extras"]) == {"torch", "redis", "ml_dtypes", "matplotlib", "pyverbs"}
    assert isinstance(info["rdma_devices"], list)
    assert info["numpy"] == metadata.version("numpy")


@pytest.mark.timeout(60)
def test_info_says_pure_where_told(run_cli: RunCli, monkeypatch: pytest.MonkeyPatch) -> None:
    """AIOCOLLECT_PURE=1 (inherited by the command) loads every compiled module from its
    source, and info says so and why."""
    monkeypatch.setenv("AIOCOLLECT_PURE", "1")
    core = json.loads(run_cli("info", "--json").stdout)["core"]
    assert core["path"] == "pure"
    assert core["why"] == "AIOCOLLECT_PURE is set"
    assert set(core["modules"].values()) == {"pure"}
    assert "core         pure Python: AIOCOLLECT_PURE is set" in run_cli("info").stdout


@pytest.mark.timeout(60)
def test_console_script_and_version(tmp_path: Path) -> None:
    done = subprocess.run(
        cli_command("--version"), capture_output=True, text=True, timeout=50, check=False
    )
    assert done.returncode == 0
    assert done.stdout.strip() == f"aiocollect {aiocollect.__version__}"


@pytest.mark.timeout(30)
def test_main_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["aiocollect"] == aiocollect.__version__
    assert main(["--help"]) == 0
    assert "run" in capsys.readouterr().out
    assert main(["run", "-n", "0", "x.py"]) == 2
    assert "must be >= 1" in capsys.readouterr().err


BAD_RUN_ARGS = [
    (["-n", "0", "SCRIPT"], "must be >= 1"),
    (["-n", "-2", "SCRIPT"], "must be >= 1"),
    (["-n", "2"], "missing the script"),
    (["-n", "2", "no_such_script.py"], "script not found"),
    (["-n", "two", "SCRIPT"], "invalid int value"),
    (["--nnodes", "2", "SCRIPT"], "--master-addr"),
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1", "SCRIPT"], "--node-rank"),
    (["--master-port", "70000", "SCRIPT"], "--master-port"),
    (["--timeout", "0", "SCRIPT"], "--timeout"),
    (["--transport", "carrier-pigeon", "SCRIPT"], "invalid choice"),
    (["--transport", "rdma", "SCRIPT"], "invalid choice"),  # not a registered transport
    (["--transport", "memory", "SCRIPT"], "invalid choice"),  # links one process only
    (["--no-such-option", "SCRIPT"], "unrecognized arguments"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("args", "message"), BAD_RUN_ARGS)
def test_run_bad_arguments_exit_2(
    args: list[str], message: str, run_cli: RunCli, write_script: WriteScript
) -> None:
    script = write_script("ok_script.py", "print('should not run')\n")
    done = run_cli("run", *[str(script) if a == "SCRIPT" else a for a in args])
    assert done.returncode == 2, done.stderr
    assert "usage: aiocollect run" in done.stderr
    assert message in done.stderr
    assert "should not run" not in done.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args", [[], ["frobnicate"], ["info", "--bogus"]])
def test_bad_command_exits_2(args: list[str], run_cli: RunCli) -> None:
    done = run_cli(*args)
    assert done.returncode == 2, done.stderr
    assert "usage: aiocollect" in done.stderr


@pytest.mark.timeout(60)
def test_bench_dispatch(run_cli: RunCli) -> None:
    """`aiocollect bench` reaches the bench command (its own tests cover the rest)."""
    done = run_cli("bench", "--help")
    assert done.returncode == 0, done.stderr
    assert "usage: aiocollect bench" in done.stdout


@pytest.mark.timeout(60)
def test_store_serves_until_sigterm() -> None:
    server = subprocess.Popen(
        cli_command("store", "--host", "127.0.0.1", "--port", "0"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert server.stdout is not None
        assert "aiocollect store listening on 127.0.0.1:" in server.stdout.readline()
        server.send_signal(signal.SIGTERM)
        _, err = server.communicate(timeout=30)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(30)
    assert server.returncode == 0, err


@pytest.mark.timeout(30)
@pytest.mark.parametrize("transport", ["rdma", "memory", "tls"])
def test_bench_offers_only_registered_process_transports(
    transport: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``bench --transport`` offers what links processes without certificates: never a
    transport every rank would reject (rdma, not registered), nor memory or tls."""
    from aiocollect.cli import bench

    assert bench.bench_main(["allreduce", "-n", "2", "--transport", transport]) == 2
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.timeout(30)
def test_version_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"aiocollect {aiocollect.__version__}\n"
