"""Who holds a rank claim: the job nonce, the launcher's job id and the process's identity,
and whether that process is certainly gone (:mod:`aiocollect.rendezvous.claims`)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import msgpack

from aiocollect.errors import RendezvousError
from aiocollect.transport.host import boot_id

JOB_ID_ENV = "AIOCOLLECT_JOB_ID"


def job_id() -> str:
    """This rank's job id from its launcher (``AIOCOLLECT_JOB_ID``, else torchrun's
    ``TORCHELASTIC_RUN_ID`` unless it is ``none``; see :mod:`aiocollect.rendezvous.claims`),
    or ``""``."""
    value = os.environ.get(JOB_ID_ENV, "")
    if not value:
        value = os.environ.get("TORCHELASTIC_RUN_ID", "")
        if value == "none":
            value = ""
    return value


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot (tells a reused pid apart)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return ""
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else ""


@dataclass(frozen=True)
class Owner:
    """Who holds a claim: the job's nonce and the process's identity."""

    job: bytes
    pid: int
    hostname: str
    boot_id: str
    pidns: str
    start: str
    #: The launcher's job id (``""``: none).
    job_id: str = ""

    @classmethod
    def me(cls, job: bytes) -> Owner:
        pid = os.getpid()
        return cls(
            job, pid, socket.gethostname(), boot_id(), _pid_namespace(), _start_time(pid), job_id()
        )

    def pack(self) -> bytes:
        return bytes(
            msgpack.packb(
                {
                    "job": self.job,
                    "pid": self.pid,
                    "host": self.hostname,
                    "boot_id": self.boot_id,
                    "pidns": self.pidns,
                    "start": self.start,
                    "job_id": self.job_id,
                },
                use_bin_type=True,
            )
        )

    @classmethod
    def unpack(cls, raw: bytes, key: str) -> Owner:
        """Raises: RendezvousError: not an owner record."""
        try:
            d = msgpack.unpackb(raw, raw=False)
            owner = cls(
                d["job"],
                d["pid"],
                d["host"],
                d["boot_id"],
                d["pidns"],
                d["start"],
                d.get("job_id", ""),
            )
            ok = (
                isinstance(owner.job, bytes)
                and isinstance(owner.pid, int)
                and all(
                    isinstance(x, str)
                    for x in (owner.hostname, owner.boot_id, owner.pidns, owner.start, owner.job_id)
                )
            )
        except (ValueError, KeyError, TypeError, msgpack.UnpackException):
            ok = False
        if not ok:
            raise RendezvousError(f"malformed claim record at {key!r} in the store")
        return owner

    def alive(self) -> bool | None:
        """False: certainly gone (this host and pid namespace, and the pid has exited or
        now names a newer process, or the host rebooted); True: running here; None: cannot
        tell (another host or pid namespace)."""
        if self.hostname != socket.gethostname():
            return None
        mine = boot_id()
        if mine and self.boot_id and self.boot_id != mine:
            return False
        if self.pidns != _pid_namespace():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # alive, another user's
        return not (self.start and _start_time(self.pid) != self.start)

    def describe(self) -> str:
        job = f" (job id {self.job_id!r})" if self.job_id else ""
        return f"pid {self.pid} on host {self.hostname}{job}"
