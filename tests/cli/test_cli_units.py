"""Pure pieces of ``aiocollect run``: argument splitting, rank environments, exit statuses,
and the line pump (on a real StreamReader)."""

from __future__ import annotations

import asyncio
import io
import signal
from pathlib import Path

import pytest

from aiocollect.cli.launch import LaunchConfig, parse_run_args, rank_command, rank_env
from aiocollect.cli.supervise import (
    LINE_LIMIT,
    OutputSink,
    describe_exit,
    exit_status,
    pump_lines,
)

pytestmark = pytest.mark.no_ranks  # (units: once, not per start method)


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("")
    return str(path)


@pytest.mark.timeout(10)
def test_script_arguments_are_left_alone(script: str) -> None:
    cfg = parse_run_args(["-n", "4", "--grace", "2", script, "-n", "1", "--", "--grace"])
    assert (cfg.nproc, cfg.grace, cfg.script) == (4, 2.0, script)
    assert cfg.args == ["-n", "1", "--", "--grace"]
    cfg = parse_run_args(["--nproc_per_node=2", "--", script, "x"])
    assert (cfg.nproc, cfg.script, cfg.args) == (2, script, ["x"])
    cfg = parse_run_args(["-n", "2", "-m", "pkg.train", "--lr", "1"])
    assert cfg.module
    assert cfg.script == "pkg.train"
    assert cfg.args == ["--lr", "1"]
    assert rank_command(cfg)[1:] == ["-m", "pkg.train", "--lr", "1"]


@pytest.mark.timeout(10)
def test_single_node_picks_a_port_multi_node_defaults_to_29500(script: str) -> None:
    assert parse_run_args(["-n", "2", script]).master_port > 0
    cfg = parse_run_args(
        ["-n", "2", "--nnodes", "3", "--node-rank", "2", "--master-addr", "10.0.0.1", script]
    )
    assert (cfg.master_addr, cfg.master_port, cfg.world_size) == ("10.0.0.1", 29500, 6)


@pytest.mark.timeout(10)
def test_rank_env_global_ranks() -> None:
    cfg = LaunchConfig(
        nproc=4,
        script="s.py",
        nnodes=3,
        node_rank=2,
        master_addr="::1",
        master_port=1234,
        transport="tcp",
    )
    env = rank_env(cfg, 1, base={"RANK": "99", "KEEP": "me"})
    assert env["AIOCOLLECT_RANK"] == env["RANK"] == "9"
    assert env["AIOCOLLECT_WORLD_SIZE"] == env["WORLD_SIZE"] == "12"
    assert env["AIOCOLLECT_LOCAL_RANK"] == env["LOCAL_RANK"] == "1"
    assert env["LOCAL_WORLD_SIZE"] == "4"
    assert env["GROUP_RANK"] == "2"
    assert env["AIOCOLLECT_STORE"] == "tcp://[::1]:1234"
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("::1", "1234")
    assert env["AIOCOLLECT_TRANSPORT"] == "tcp"
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env["KEEP"] == "me"


@pytest.mark.timeout(10)
def test_exit_descriptions() -> None:
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL (signal 9)"
    assert exit_status(3) == 3
    assert exit_status(-signal.SIGKILL) == 137
    assert exit_status(-signal.SIGTERM) == 143


async def _pump(chunks: list[bytes]) -> bytes:
    reader = asyncio.StreamReader()
    for chunk in chunks:
        reader.feed_data(chunk)
    reader.feed_eof()
    raw = io.BytesIO()
    text = io.TextIOWrapper(raw, write_through=True)
    await pump_lines(reader, b"[rank 7] ", OutputSink(text))
    return raw.getvalue()


@pytest.mark.timeout(10)
async def test_pump_prefixes_every_line_and_keeps_the_partial_last_one() -> None:
    out = await _pump([b"a\nb", b"c\n\n", b"\xff tail"])
    assert out == b"[rank 7] a\n[rank 7] bc\n[rank 7] \n[rank 7] \xff tail\n"


@pytest.mark.timeout(10)
async def test_pump_cuts_overlong_lines() -> None:
    out = await _pump([b"x" * (3 * LINE_LIMIT), b"\nend\n"])
    piece = b"[rank 7] " + b"x" * LINE_LIMIT + b"\n"
    assert out == piece * 3 + b"[rank 7] end\n"


@pytest.mark.timeout(10)
def test_sink_without_binary_buffer_and_after_broken_pipe() -> None:
    text = io.StringIO()
    OutputSink(text).write(b"[rank 0] hi\n")
    assert text.getvalue() == "[rank 0] hi\n"
    closed = io.StringIO()
    closed.close()
    OutputSink(closed).write(b"dropped\n")  # a lost reader never raises
