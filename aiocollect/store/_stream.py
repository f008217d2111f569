"""Framed stream I/O of the TCP store, in chunks: neither end copies, scans or writes a
large value in one go, so a 64 MiB value never holds up the event loop it runs on.

Reading (:func:`read_body`): a large frame's body is gathered into one buffer a chunk at
a time (each chunk one copy of what the stream had buffered, at most :data:`CHUNK`);
:func:`aiocollect.store._wire.decode` then takes large values as views of that buffer.

Writing (:class:`FrameWriter`): a large value goes out a chunk at a time, with the loop
running between chunks and the transport's flow control respected; frames from several
tasks never interleave.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from aiocollect.errors import ProtocolError
from aiocollect.store import _wire

#: Bytes of a large frame copied or written at a time.
CHUNK = 256 * 1024


async def read_body(
    reader: asyncio.StreamReader,
    size: int,
    idle_timeout: float | None = None,
    *,
    check: bool = False,
) -> bytearray:
    """Read a frame body of ``size`` bytes a chunk at a time.

    The buffer grows as data arrives (never zeroed or copied whole); each step copies
    what the stream has buffered, which its flow control bounds (a few hundred KiB), and
    the loop runs while more arrives.

    Args:
        idle_timeout: seconds the stream may pause between chunks (None: no limit).
        check: refuse a hostile frame on its first chunk, before buffering the rest
            (:func:`aiocollect.store._wire.check_shape` with ``partial``).

    Raises:
        TimeoutError: the sender paused longer than ``idle_timeout``.
        asyncio.IncompleteReadError: the stream ended first.
        ProtocolError: ``check`` refused the beginning of the frame.
    """
    body = bytearray()
    while len(body) < size:
        async with asyncio.timeout(idle_timeout):
            chunk = await reader.read(min(size - len(body), CHUNK))
        if not chunk:
            raise asyncio.IncompleteReadError(bytes(body), size)
        if check and not body:
            _wire.check_shape(chunk, partial=True)
        body += chunk
    return body


async def read_frame(reader: asyncio.StreamReader, limit: int) -> Any:
    """Read and decode one frame; a large one in chunks, its large values as views.

    Raises:
        ProtocolError: the announced length exceeds ``limit`` or the body is malformed.
        asyncio.IncompleteReadError: the stream ended (the peer closed the connection).
        ConnectionError: the connection failed.
    """
    (size,) = _wire.HEADER.unpack(await reader.readexactly(_wire.HEADER.size))
    if size > limit:
        raise ProtocolError(f"store message of {size} bytes exceeds the limit of {limit}")
    if size <= _wire.VIEW_MIN:
        return _wire.decode(await reader.readexactly(size))
    return _wire.decode(await read_body(reader, size, check=True))


class FrameWriter:
    """Writes whole frames to one stream, from any number of tasks.

    A frame is a head and a blob (:func:`aiocollect.store._wire.encode_frame`). One with
    a blob of at most :data:`CHUNK` bytes is written at once; a larger one is written by a
    task of this writer, a chunk at a time with ``drain()`` and a turn of the loop between
    chunks. Frames sent meanwhile queue behind it, so frames never interleave; a caller
    cancelled while its large frame is being written does not stop it (half a frame would
    corrupt the stream). A failed large write aborts the connection.
    """

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._lock = asyncio.Lock()  # held while a large frame is being written
        self._queued: list[_wire.Buffer] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def send(self, head: bytes, blob: _wire.Buffer = b"") -> None:
        """Write the frame ``head + blob`` and wait until the transport takes more.

        Raises:
            ConnectionError: the connection failed or was closed.
        """
        if len(blob) <= CHUNK:
            self.send_nowait(head, blob)
            await self._writer.drain()
            return
        task = asyncio.ensure_future(self._send_large(head, blob))
        self._tasks.add(task)
        task.add_done_callback(self._forget)
        await asyncio.shield(task)

    def send_nowait(self, head: bytes, blob: _wire.Buffer = b"") -> None:
        """Write a small frame now, or right after the large frame being written."""
        if self._lock.locked():
            self._queued += (head, blob)
        else:
            self._writer.writelines([head, blob])

    async def _send_large(self, head: bytes, blob: _wire.Buffer) -> None:
        writer = self._writer
        async with self._lock:
            try:
                writer.write(head)
                view = memoryview(blob)
                for start in range(0, len(view), CHUNK):
                    if writer.transport.is_closing():
                        raise ConnectionResetError("the store connection was closed")
                    writer.write(view[start : start + CHUNK])
                    await writer.drain()
                    await asyncio.sleep(0)  # drain() returns at once while under the mark
            except BaseException:
                self._queued.clear()
                writer.transport.abort()
                raise
            queued, self._queued = self._queued, []
            if queued:
                writer.writelines(queued)

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: the caller (if still there) got it from shield

    async def aclose(self) -> None:
        """Stop large frames being written (aborting the connection if one was)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
