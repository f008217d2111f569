"""A store in a directory of a (shared) filesystem: one file per key.

Layout of the directory:

- ``k_<escaped key>``: a key's value. Bytes outside ``[A-Za-z0-9_-]`` of the UTF-8 key are
  written ``%XX``, so the mapping is injective and no name is ``.``/``..`` or holds ``/``;
  keys whose escaped form is too long for a file name become ``h_<sha256 of the key>``.
- ``l_<same>``: the lock file serialising ``set``/``add``/``delete`` of that key (``fcntl.lockf``,
  which NFS honours, plus a process-wide thread lock because POSIX locks do not exclude
  threads of one process).
- ``t_<pid>_<random>``: a value being written; ``os.replace`` publishes it atomically.

Filesystems do not notify, so ``get``/``wait`` poll with a backoff from 5 ms to 50 ms. The file
operations are tiny and run inline on the event loop thread: that keeps each operation atomic
with respect to cancellation (an ``add`` is either applied or not, never left running in a
thread after its caller gave up).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import string
import threading
from collections.abc import Hashable, Iterator, Sequence
from pathlib import Path

from aiocollect._deadline import Deadline
from aiocollect.errors import StoreError
from aiocollect.store._util import (
    POLL_MIN,
    Lifecycle,
    backoff,
    check_amount,
    check_key,
    check_keys,
    check_value,
    parse_counter,
    timeout_error,
    unique,
)
from aiocollect.store.base import DEFAULT_TIMEOUT, Store

_SAFE = frozenset((string.ascii_letters + string.digits + "_-").encode())
_MAX_NAME = 200  # file names are limited to 255 bytes on most filesystems
_thread_lock = threading.Lock()


def escape_key(key: str) -> str:
    """The file-name stem for ``key`` (injective; see the module docstring)."""
    raw = key.encode("utf-8", "surrogatepass")
    escaped = "".join(chr(b) if b in _SAFE else f"%{b:02X}" for b in raw)
    if len(escaped) > _MAX_NAME:
        return "h_" + hashlib.sha256(raw).hexdigest()
    return "k_" + escaped


class FileStore(Store):
    """A store backed by the directory ``path``, shared by every rank that can see it.

    Args:
        path: the directory; created (with parents) if missing. Every rank must use the
            same directory; use a fresh one per job (old keys are not cleaned up).
        timeout: default timeout in seconds for ``get``/``wait``.

    Raises:
        StoreError: the directory cannot be created or is not a directory.
    """

    def __init__(self, path: str | os.PathLike[str], *, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.path = Path(path)
        self.timeout = timeout
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create the file store directory {self.path}: {exc}") from exc
        self._life = Lifecycle(repr(self))

    def __repr__(self) -> str:
        return f"FileStore({str(self.path)!r})"

    @property
    def shared_reads(self) -> Hashable:
        """The directory (:attr:`Store.shared_reads`)."""
        return ("file", os.path.realpath(self.path))

    def _file(self, key: str) -> Path:
        return self.path / escape_key(key)

    def _read(self, key: str) -> bytes | None:
        try:
            return self._file(key).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreError(f"{self!r}: cannot read key {key!r}: {exc}") from exc

    def _write(self, key: str, value: bytes) -> None:
        tmp = self.path / f"t_{os.getpid()}_{os.urandom(8).hex()}"
        try:
            with open(tmp, "wb") as f:
                f.write(value)
            os.replace(tmp, self._file(key))
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise StoreError(f"{self!r}: cannot write key {key!r}: {exc}") from exc

    @contextlib.contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        lock_path = self.path / ("l_" + escape_key(key)[2:])
        with _thread_lock:
            try:
                fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise StoreError(f"{self!r}: cannot open lock for {key!r}: {exc}") from exc
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # releases the lock

    async def set(self, key: str, value: bytes) -> None:
        """Publish ``value`` under ``key`` atomically (temp file + ``os.replace``).

        Raises:
            UsageError: bad key or value type.
            StoreError: I/O error, or the store is closed.
        """
        self._life.ensure_open()
        value = check_value(value)
        with self._locked(check_key(key)):  # so a concurrent add cannot resurrect the old value
            self._write(key, value)

    async def get(self, key: str, *, timeout: float | None = None) -> bytes:
        """Return the value of ``key``, polling until it appears.

        Raises:
            StoreTimeout: the key did not appear within ``timeout`` seconds.
            StoreError: I/O error, or the store is closed (also while waiting).
        """
        self._life.ensure_open()
        check_key(key)
        t = self._timeout(timeout)
        deadline = Deadline.after(t)
        delay = POLL_MIN
        while True:
            value = self._read(key)
            if value is not None:
                return value
            if not await self._pause(deadline, delay):
                raise timeout_error(repr(self), [key], t)
            delay = backoff(delay)

    async def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the counter ``key`` under a file lock.

        Raises:
            StoreError: the existing value is not an integer, I/O error, or closed store.
        """
        self._life.ensure_open()
        check_key(key)
        check_amount(amount)
        with self._locked(key):
            total = parse_counter(key, self._read(key)) + amount
            self._write(key, str(total).encode("ascii"))
        return total

    async def wait(self, keys: Sequence[str], *, timeout: float | None = None) -> None:
        """Wait until every key exists, polling.

        Raises:
            StoreTimeout: some keys did not appear in time (``.keys`` lists them).
            StoreError: I/O error, or the store is closed (also while waiting).
        """
        self._life.ensure_open()
        missing = unique(check_keys(keys))
        t = self._timeout(timeout)
        deadline = Deadline.after(t)
        delay = POLL_MIN
        while True:
            missing = [k for k in missing if not self._file(k).exists()]
            if not missing:
                return
            if not await self._pause(deadline, delay):
                raise timeout_error(repr(self), missing, t)
            delay = backoff(delay)

    async def multi_get(self, keys: Sequence[str], *, timeout: float | None = None) -> list[bytes]:
        """The values of ``keys`` in order, polling until every one exists (each file is
        read once it is there; the ones still missing are polled again).

        Raises:
            StoreTimeout: some keys did not appear in time (``.keys`` lists them).
            StoreError: I/O error, or the store is closed (also while waiting).
            UsageError: ``keys`` is a ``str`` or holds a non-``str`` item.
        """
        self._life.ensure_open()
        names = check_keys(keys)
        t = self._timeout(timeout)
        deadline = Deadline.after(t)
        found: dict[str, bytes] = {}
        missing = unique(names)
        delay = POLL_MIN
        while True:
            still = []
            for key in missing:
                value = self._read(key)
                if value is None:
                    still.append(key)
                else:
                    found[key] = value
            missing = still
            if not missing:
                return [found[k] for k in names]
            if not await self._pause(deadline, delay):
                raise timeout_error(repr(self), missing, t)
            delay = backoff(delay)

    async def check(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key exists now."""
        self._life.ensure_open()
        return [self._file(k).exists() for k in check_keys(keys)]

    async def delete(self, key: str) -> bool:
        """Remove ``key``; return whether it existed.

        Raises:
            StoreError: I/O error, or the store is closed.
        """
        self._life.ensure_open()
        check_key(key)
        with self._locked(key):
            try:
                self._file(key).unlink()
            except FileNotFoundError:
                return False
            except OSError as exc:
                raise StoreError(f"{self!r}: cannot delete key {key!r}: {exc}") from exc
        return True

    async def close(self) -> None:
        """Fail pending waits with ``StoreError``; the directory stays. Idempotent."""
        self._life.close()

    async def _pause(self, deadline: Deadline, delay: float) -> bool:
        """Sleep before the next poll; False if the deadline has passed."""
        remaining = deadline.remaining()
        if remaining is not None and remaining <= 0:
            return False
        await self._life.sleep(delay if remaining is None else min(delay, remaining))
        return True


__all__ = ["FileStore", "escape_key"]
