"""`aiocollect run` and protected mode, without root: when it refuses a multi-node job, and
what it passes to its ranks (the namespace tests run it across hosts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from aiocollect.cli.launch import LaunchConfig, parse_run_args, rank_env, run_main, unprotected

pytestmark = pytest.mark.timeout(30)


def _cfg(**kw: object) -> LaunchConfig:
    base: dict[str, object] = {
        "nproc": 2,
        "script": "s.py",
        "nnodes": 2,
        "master_addr": "10.0.0.1",
        "master_port": 29500,
    }
    return LaunchConfig(**{**base, **kw})  # type: ignore[arg-type]


def test_multi_node_without_secret_is_refused_with_the_fix() -> None:
    reason = unprotected(_cfg(), {})
    assert reason is not None
    assert "AIOCOLLECT_SECRET" in reason
    assert "--secret" in reason
    assert "--insecure" in reason
    assert unprotected(_cfg(secret="s"), {}) is None
    assert unprotected(_cfg(insecure=True), {}) is None
    assert unprotected(_cfg(), {"AIOCOLLECT_SECRET": "s"}) is None
    assert unprotected(_cfg(), {"AIOCOLLECT_INSECURE": "1"}) is None
    assert unprotected(_cfg(nnodes=1), {}) is None  # one node: protected mode is fine
    for loopback in ("127.0.0.1", "::1", "localhost"):
        assert unprotected(_cfg(master_addr=loopback), {}) is None


def test_secret_and_insecure_reach_the_ranks() -> None:
    env = rank_env(_cfg(secret="s3"), 1, base={"AIOCOLLECT_INSECURE": "1"})
    assert env["AIOCOLLECT_SECRET"] == "s3"
    env = rank_env(_cfg(insecure=True), 0, base={})
    assert env["AIOCOLLECT_INSECURE"] == "1"
    assert "AIOCOLLECT_SECRET" not in env
    env = rank_env(_cfg(), 0, base={"AIOCOLLECT_SECRET": "inherited"})
    assert env["AIOCOLLECT_SECRET"] == "inherited"


def test_run_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "s.py"
    script.write_text("")
    common = ["--nnodes", "2", "--master-addr", "10.0.0.1", str(script)]
    assert parse_run_args(["--secret", "x", *common]).secret == "x"
    assert parse_run_args(["--insecure", *common]).insecure
    with pytest.raises(SystemExit):
        parse_run_args(["--secret", "x", "--insecure", *common])
    monkeypatch.delenv("AIOCOLLECT_SECRET", raising=False)
    monkeypatch.delenv("AIOCOLLECT_INSECURE", raising=False)
    assert run_main(common) == 2  # refused before any rank starts
    assert "needs a shared secret" in capsys.readouterr().err
