"""One-frame operations in one object: no Task, no Op, no step list per call.

An operation whose every message fits in one frame spends most of its time in Python
overhead, not in moving bytes. For those a collective's algorithm gives a *program* (a
:class:`Program`, built once per group, world size, rank and shape): a short tuple of
:class:`Exchange` steps, each "send the operation's buffer to that peer and/or receive
one frame from that peer, then run this function". The group binds it once per shape to
its links' frame headers (:class:`Small`), and each call makes one :class:`Quick`: the
operation's state, its own posted receive (the link calls it back as the frame lands, from
the transport's read path, see :class:`~aiocollect.transport.base.Receiver`) and the
record the group's :class:`~aiocollect.engine.watchdog.Watchdog` reads for its deadline and
progress checks (and to which it reports its end). The handle is a
:class:`~aiocollect.engine.handle.Handle`, an ``asyncio.Future`` that notices its own
cancellation. That saves the Task, the coroutine
frames, the per-receive future, the step objects and one event-loop pass per step
(docs/design.md, *The one-frame path*).

The contract is the Task path's (``aiocollect.group``) but for when the first step runs:
here in the call itself (the group's ``_quick`` runs :meth:`Quick._go` before it returns
the handle), not on the next loop pass, which saves a loop pass per operation
(docs/design.md, *Sent in the call*). So the operation has moved data once the call
returns if its program sends first, and cancelling it then breaks the group; an
operation that only receives first (a recv, a broadcast off the root) moved nothing until
its frame lands, and cancelling it before that leaves the group usable. A failed receive
or an error breaks the group; the deadline names the ranks to blame through the
watchdog's probe; any non-aiocollect exception becomes an
InternalError that breaks the group on every rank.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np

from aiocollect._buffers import Array, byte_castable, byte_view
from aiocollect.engine.handle import Handle
from aiocollect.engine.op import wrap_error
from aiocollect.engine.reduce import FP_SIGNALS
from aiocollect.engine.reduce import divide as divide_array
from aiocollect.errors import GroupBrokenError
from aiocollect.transport.base import Fingerprint, Link, SendMark
from aiocollect.transport.wire import DATA, HEADER, MAGIC, Key
from aiocollect.transport.wire import SEQ as _SEQ
from aiocollect.transport.wire import SEQ_AT as _SEQ_AT

if TYPE_CHECKING:
    from aiocollect.engine.watchdog import Watchdog

_tuple_new = tuple.__new__


# -- programs ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Exchange:
    """One step of a program: send the operation's buffer to group rank ``send_to`` (if
    not -1), receive one frame of slot ``slot`` from group rank ``recv_from`` (if not -1)
    into the scratch buffer (``into_tmp``) or into the operation's buffer, then, once that
    frame landed and every frame sent from the buffer so far has left user memory, call
    ``then(quick)`` (if given; it may rewrite the buffer). A receive into the operation's
    buffer must come before any send in the program (nothing waits for a sent frame before
    it)."""

    send_to: int
    recv_from: int
    slot: int
    into_tmp: bool = False
    then: Callable[[Quick], None] | None = None


@dataclass(frozen=True, slots=True)
class Program:
    """One rank's steps of a one-frame algorithm; ``tmp``: it needs a scratch buffer like
    the operation's; ``finish(quick)``: run after the last step (every frame left)."""

    steps: tuple[Exchange, ...]
    tmp: bool = False
    finish: Callable[[Quick], None] | None = None


@lru_cache(maxsize=256)
def one_way(send_to: int, recv_from: int, slot: int) -> Program:
    """A program of one step: send to ``send_to`` or receive from ``recv_from`` (-1: not)
    with slot ``slot`` (send and recv: the tag)."""
    return Program((Exchange(send_to, recv_from, slot),))


def reduce_mine_first(q: Quick) -> None:
    """``buf = ufunc(buf, tmp)``: this rank is the lower of the pair (reduction order).
    IEEE results whatever numpy's error state (engine/reduce.py: FP_SIGNALS)."""
    one = q.small.one
    if one is None:
        try:  # noqa: SIM105 (per small operation: a try costs nothing, suppress a call)
            q.ufunc(q.buf, q.tmp, out=q.buf)
        except FP_SIGNALS:
            pass
    else:  # (Small.one)
        try:  # noqa: SIM105 (as above)
            q.ufunc(q.buf, q.tmp, out=one[0])
        except FP_SIGNALS:
            pass
        q.bview[:] = one[1]


def reduce_theirs_first(q: Quick) -> None:
    """``buf = ufunc(tmp, buf)``: the peer is the lower of the pair."""
    one = q.small.one
    if one is None:
        try:  # noqa: SIM105 (as above)
            q.ufunc(q.tmp, q.buf, out=q.buf)
        except FP_SIGNALS:
            pass
    else:
        try:  # noqa: SIM105 (as above)
            q.ufunc(q.tmp, q.buf, out=one[0])
        except FP_SIGNALS:
            pass
        q.bview[:] = one[1]


def divide(q: Quick) -> None:
    """``buf /= world size``: the end of an AVG."""
    divide_array(q.buf, len(q.small.ranks))


class Small:
    """A program bound to one group and shape: per step its links and its frame header
    without the sequence number (``ops[i]``: receive link or None, send link or None,
    slot, into_tmp, then, the header's bytes before and after the sequence number, and
    whether a wait for the receive busy-waits).
    Made once per group and (collective, dtype, count, options): a group's links never
    change."""

    __slots__ = (
        "cast",
        "fan",
        "fan_at",
        "fp",
        "frame_kind",
        "gid",
        "kind",
        "last",
        "one",
        "ops",
        "program",
        "ranks",
        "tmp",
    )

    def __init__(
        self,
        kind: str,
        program: Program,
        gid: int,
        fp: Fingerprint,
        ranks: list[int],
        links: Mapping[int, Link],
        nbytes: int,
        buf_dtype: np.dtype[Any] | None = None,
        frame_kind: int = DATA,
        spins: Callable[[Link], bool] | None = None,
    ) -> None:
        """``spins(link)``: whether a receive awaited on ``link`` busy-waits
        (``Fabric.spins``; None: never)."""
        self.kind = kind
        #: DATA (a collective: sequence numbers, fingerprints registered) or P2P (send and
        #: recv: the sequence number is the (peer, tag) message counter, the slot the tag)
        self.frame_kind = frame_kind
        self.program = program
        self.tmp = program.tmp
        #: whether a buffer's bytes are ``buf.data.cast("B")`` (not for bfloat16 & co.)
        self.cast = buf_dtype is None or byte_castable(buf_dtype)
        self.gid = gid
        self.fp = fp
        self.ranks = ranks
        coll, dtype, count, rop, root = fp
        ops = []
        for st in program.steps:
            h = HEADER.pack(
                MAGIC, frame_kind, coll, rop, dtype, gid, 0, 0, st.slot, root, count, nbytes
            )
            rlink = links[ranks[st.recv_from]] if st.recv_from >= 0 else None
            ops.append(
                (
                    rlink,
                    links[ranks[st.send_to]] if st.send_to >= 0 else None,
                    st.slot,
                    st.into_tmp,
                    st.then,
                    h[:_SEQ_AT],
                    h[_SEQ_AT + _SEQ.size :],
                    rlink is not None and spins is not None and spins(rlink),
                )
            )
        self.ops: tuple[_Op, ...] = tuple(ops)
        #: The program's last steps from ``fan_at`` on, when there are two or more, only
        #: send the buffer, each with the same header (the star's root answering its
        #: leaves): Quick._go sends them in one loop, to the links in ``fan``.
        fan_at = len(ops)
        while (
            fan_at > 0
            and ops[fan_at - 1][0] is None
            and ops[fan_at - 1][1] is not None
            and ops[fan_at - 1][4] is None
            and ops[fan_at - 1][5:7] == ops[-1][5:7]
        ):
            fan_at -= 1
        if len(ops) - fan_at < 2:
            fan_at = len(ops)
        self.fan_at = fan_at
        self.fan: tuple[Link, ...] = tuple(op[1] for op in ops[fan_at:] if op[1] is not None)
        #: Where a reducing program's buffer is one element, an element and its bytes:
        #: the reductions (reduce_*) write into it and copy its bytes into the buffer.
        #: numpy's in-place ufunc on a one-element array takes about 2.7 µs here against
        #: 0.8 µs into another array and 0.9 µs in place on two elements (a 4-byte float32
        #: add; ``python -m timeit -s "import numpy as np; b = np.zeros(1, np.float32);
        #: t = np.ones(1, np.float32); o = np.empty(1, np.float32)" "np.add(b, t, out=b)"``,
        #: then with ``out=o``). Used within one call only, so operations in flight share it.
        self.one: tuple[Array, memoryview] | None = None
        if buf_dtype is not None and program.tmp and count == 1:
            one = np.empty(1, buf_dtype)
            self.one = (one, one.data.cast("B") if self.cast else byte_view(one))
        #: the last step's index where it receives and runs nothing after its frame (its
        #: landing ends the operation when nothing sent waits: Quick.landed), else -1
        steps = program.steps
        tail = steps[-1] if steps else None
        plain = tail is not None and tail.recv_from >= 0 and tail.then is None
        self.last = len(steps) - 1 if plain and program.finish is None else -1


#: A bound step (Small.ops): receive link, send link, slot, into_tmp, then, the header's
#: bytes before and after the sequence number, and whether a wait on the receive spins.
_Op = tuple[
    "Link | None",
    "Link | None",
    int,
    bool,
    "Callable[[Quick], None] | None",
    bytes,
    bytes,
    bool,
]


# -- the operation -------------------------------------------------------------------------


class Quick:
    """One call of a one-frame operation: runs ``small``'s steps over ``buf`` (with
    ``ufunc`` and a scratch buffer where the program reduces) and resolves ``handle``
    with ``result``. It is also the receiver it posts (one at a time) and, for the
    group's deadline and progress checks, the record of the operation (``kind``, ``seq``,
    ``ranks``, :meth:`silent_peers`, :meth:`progress`, as :class:`engine.op.Op`)."""

    __slots__ = (
        "_i",
        "_key",
        "_marks",
        "_moved",
        "_released",
        "_seqb",
        "_timing_out",
        "buf",
        "bview",
        "expect",
        "handle",
        "result",
        "seq",
        "small",
        "timeout",
        "tmp",
        "tview",
        "ufunc",
        "view",
        "watchdog",
    )

    def __init__(
        self,
        watchdog: Watchdog,
        small: Small,
        seq: int,
        buf: Array,
        ufunc: Any,
        handle: Handle,
        result: Any,
        timeout: float | None,
    ) -> None:
        self.watchdog = watchdog
        self.small = small
        self.seq = seq
        self._seqb = _SEQ.pack(seq)
        self.buf = buf
        if small.cast:
            self.bview = bview = buf.data.cast("B")
        else:  # dtypes the buffer protocol cannot name (bfloat16)
            self.bview = bview = byte_view(buf)
        if small.tmp:
            self.tmp = tmp = np.empty(buf.size, buf.dtype)
            self.tview = tmp.data.cast("B") if small.cast else byte_view(tmp)
        else:
            self.tmp = buf
            self.tview = bview
        self.ufunc = ufunc
        self.handle = handle
        self.result = result
        self.timeout = timeout
        self.expect: Fingerprint | None = small.fp
        self.view = bview
        self._i = 0
        self._key: Key | None = None  # the receive posted and not landed
        self._marks: list[tuple[Link, SendMark]] | None = None  # sends still referenced
        self._moved = False
        self._timing_out = False
        self._released = False

    @property
    def ranks(self) -> list[int]:
        return self.small.ranks

    @property
    def kind(self) -> int:
        """DATA for a collective (the group's checks ask peers about it by number), P2P
        for send and recv."""
        return self.small.frame_kind

    # -- running ---------------------------------------------------------------------------

    def _go(self, landed: bool = False) -> None:
        """Run steps from the current one until one waits for its frame, then end
        (``landed``: the current step's frame is in, go on with its function)."""
        small = self.small
        ops = small.ops
        i = self._i
        try:
            fan_at = small.fan_at
            while i < fan_at:
                rlink, slink, slot, into_tmp, then, pre, post, spins = ops[i]
                if landed:
                    landed = False
                else:
                    if rlink is not None:
                        self.view = self.tview if into_tmp else self.bview
                        key = _tuple_new(Key, (small.frame_kind, small.gid, self.seq, slot, 0))
                        if rlink.post(key, self):
                            self._moved = True
                        else:
                            self._key = key
                    if slink is not None:
                        mark = slink.send(pre + self._seqb + post, self.bview)
                        self._moved = True
                        if mark is not None:
                            self._keep(slink, mark)
                        if self.handle.done():  # failed meanwhile (its link failed)
                            return
                    if self._key is not None:
                        self._i = i
                        if spins:  # (Fabric.spin's decision, made for the step)
                            self.watchdog.fabric.spinner.wait(self)
                        return  # landed() goes on
                if then is not None:
                    if self._marks is not None and self._unsent():
                        self._i = i  # then() rewrites the buffer still referenced: wait
                        self._spawn(self._drain())
                        return
                    then(self)
                i += 1
            if i < len(ops):  # i == fan_at (``_i`` never points into the fan-out): the
                # fan-out (Small.fan), whole: the same frame to each link
                _, _, _, _, _, pre, post, _ = ops[fan_at]
                header = pre + self._seqb + post
                bview = self.bview
                self._moved = True
                for slink in small.fan:
                    mark = slink.send(header, bview)
                    if mark is not None:
                        self._keep(slink, mark)
                    if self.handle.done():  # failed meanwhile
                        return
                i = len(ops)
            self._i = i
            if self._marks is not None and self._unsent():
                self._spawn(self._drain())
                return
            finish = small.program.finish
            if finish is not None:
                finish(self)
            self._complete()
        except Exception as exc:
            self._fail(exc)

    def _complete(self) -> None:
        """Success: every frame is in and out (nothing posted to withdraw)."""
        small = self.small
        watchdog = self.watchdog
        watchdog.done[small.kind] += 1
        self._released = True
        if small.frame_kind == DATA:
            watchdog.registry.unregister(small.gid, self.seq)
        handle = self.handle
        watchdog.tasks.pop(handle, None)
        if not handle.done():
            handle._quick = None
            handle.set_result(self.result)

    def _keep(self, link: Link, mark: SendMark) -> None:
        """Remember a frame sent on ``link`` that still references the buffer (``mark``:
        what ``Link.send`` returned, not None)."""
        if self._marks is None:
            self._marks = []
        self._marks.append((link, mark))

    def _unsent(self) -> bool:
        """Whether a frame this operation sent still lies in user memory (else forgets
        them all)."""
        marks = self._marks
        assert marks is not None
        for link, mark in marks:
            if not link.released(mark):
                return True
        self._marks = None
        return False

    async def _drain(self) -> None:
        """Wait until this operation's sent frames left user memory, then go on."""
        try:
            for link, mark in self._marks or ():
                if not link.released(mark):
                    await link.wait_released(mark)
            self._marks = None
            if self.handle.done() or self._timing_out:
                return
        except Exception as exc:
            self._fail(exc)
            return
        # stopped before a step's function (its frame is in) or before the end
        self._go(self._i < len(self.small.ops))

    def _spawn(self, coro: Any) -> None:
        self.watchdog.track(asyncio.get_running_loop().create_task(coro))

    # -- as the posted receiver (transport.base.Receiver) ------------------------------------

    def done(self) -> bool:
        """Whether no receive of this operation is waiting for its frame (the busy-wait's
        question, engine/spin.py)."""
        return self._key is None

    def landed(self) -> None:
        self._key = None
        self._moved = True
        if self.handle.done() or self._timing_out:
            return
        if self._i == self.small.last and self._marks is None:
            # the last step's frame, with nothing to run after it and nothing sent still
            # in user memory: done (what _go would conclude, without its loop)
            self._i += 1
            try:
                self._complete()
            except Exception as exc:
                self._fail(exc)
            return
        self._go(True)

    def failed(self, exc: BaseException) -> None:
        self._key = None
        if self.handle.done() or self._timing_out:
            return
        self._fail(exc)

    # -- outcomes --------------------------------------------------------------------------

    def _fail(self, exc: BaseException) -> None:
        # As _run does: anything but an aiocollect error is wrapped, and breaks the group.
        fabric = self.watchdog.fabric
        exc = fabric.cause(wrap_error(self.small.kind, self.seq, self.watchdog.rank, exc))
        self._release()
        handle = self.handle
        self.watchdog.tasks.pop(handle, None)
        if not handle.done():
            handle._quick = None
            handle.set_exception(exc)

    def cancelled(self) -> None:
        """The handle was cancelled: it leaves the group's in-flight set, and a caller's
        cancellation after data moved breaks the group."""
        watchdog = self.watchdog
        watchdog.tasks.pop(self.handle, None)
        if self._timing_out:
            return
        if self._moved:
            watchdog.fabric.fail(
                GroupBrokenError(
                    f"{self.small.kind} (op #{self.seq}) was cancelled on rank {watchdog.rank} "
                    "with data in flight"
                )
            )
        self._release()  # (it started: its first step ran in the call)

    def expire(self) -> None:
        """The deadline passed: find whom to blame (a liveness probe), then fail."""
        if self.handle.done() or self._timing_out:
            return
        self._timing_out = True
        self._spawn(self._timeout())

    async def _timeout(self) -> None:
        watchdog = self.watchdog
        fabric = watchdog.fabric
        if fabric.failure is None:
            err = await watchdog.timeout_error(self.small.kind, self, self.timeout)
            fabric.fail(err)
        assert fabric.failure is not None
        self._release()
        handle = self.handle
        watchdog.tasks.pop(handle, None)
        if not handle.done():
            handle._quick = None
            handle.set_exception(fabric.failure)

    def _release(self) -> None:
        """Withdraw the receive still posted, if any, and unregister the operation, once."""
        if self._released:
            return
        self._released = True
        key = self._key
        if key is not None:
            self._key = None
            link = self.small.ops[self._i][0]
            if link is not None:
                link.unpost(key)
        if self.small.frame_kind == DATA:
            self.watchdog.registry.unregister(self.small.gid, self.seq)

    # -- for the group's checks ------------------------------------------------------------

    def silent_peers(self) -> list[int]:
        """Group ranks this operation still waits for (for timeout messages)."""
        waiting = set()
        steps = self.small.program.steps
        if self._key is not None and self._i < len(steps):
            waiting.add(steps[self._i].recv_from)
        ranks = self.small.ranks
        for link, mark in self._marks or ():
            if not link.released(mark) and link.peer in ranks:
                waiting.add(ranks.index(link.peer))
        return sorted(waiting)

    def progress(self) -> tuple[int, int]:
        """Changes whenever the operation posts or completes a receive (stall warnings)."""
        return self._i, self._key is None
