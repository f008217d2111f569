"""The point-to-point and all-to-all methods of the aiocollect process group (send, recv,
recv from any source, all_to_all): messages are matched by (source, tag) in order, on the
group's links; an uneven all_to_all travels as such messages on a reserved tag."""

from __future__ import annotations

from typing import Any

import torch

from aiocollect.torch import _alltoall, _checks, _movement
from aiocollect.torch._runner import PlanRunner
from aiocollect.torch.work import Work


def tensor_list(value: object) -> list[torch.Tensor]:
    """``value`` as a list of tensors.

    Args:
        value: a tensor alone, or a sequence of them.

    Returns:
        The list.
    """
    return [value] if isinstance(value, torch.Tensor) else list(value)  # type: ignore[call-overload]


class PointToPoint(PlanRunner):
    """The base of :class:`~aiocollect.torch.AiocollectProcessGroup` that adds
    point-to-point messages and all-to-all to :class:`~aiocollect.torch._runner.PlanRunner`.

    Args:
        group: the formed aiocollect group (it lives on ``thread``'s loop).
        thread: the loop thread.
        store: the c10d store the group was formed on.
    """

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> Work:
        """Send to group rank ``dstRank``; matched by (source, tag) in order.

        Args:
            tensors: the tensors to send (received in the same order).
            dstRank: the receiver's group rank.
            tag: the message tag (any C int).

        Returns:
            Its :class:`~aiocollect.torch.work.Work`, at once.

        Raises:
            UsageError: a bad rank or tensor.
            GroupBrokenError: an earlier collective of the group failed.
        """
        tensors = tensor_list(tensors)
        return self._launch(
            _movement.send(tensors, dstRank, tag, self._default_timeout),
            self._default_timeout,
            "send",
            tensors,
        )

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> Work:
        """Receive from group rank ``srcRank`` into ``tensors``.

        Args:
            tensors: receive buffers.
            srcRank: the sender's group rank.
            tag: the message tag (any C int).

        Returns:
            Its :class:`~aiocollect.torch.work.Work`, at once.

        Raises:
            UsageError: a bad rank or tensor.
            GroupBrokenError: an earlier collective of the group failed.
        """
        tensors = tensor_list(tensors)
        return self._launch(
            _movement.recv(tensors, srcRank, tag, self._default_timeout),
            self._default_timeout,
            "recv",
            tensors,
        )

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> Work:
        """Receive from any rank; ``work._source_rank()`` tells which.

        Args:
            tensors: receive buffers.
            tag: the message tag (any C int).

        Returns:
            Its :class:`~aiocollect.torch.work.Work`, at once.

        Raises:
            UsageError: a bad tensor.
            GroupBrokenError: an earlier collective of the group failed.
        """
        tensors = tensor_list(tensors)
        return self._launch(
            _movement.recv(tensors, None, tag, self._default_timeout),
            self._default_timeout,
            "recvAnySource",
            tensors,
        )

    def alltoall(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> Work:
        """Send ``input_tensors[i]`` to rank i; receive rank j's into ``output_tensors[j]``.

        Args:
            output_tensors: world-size tensors.
            input_tensors: world-size tensors.
            opts: its c10d options object (None: the defaults).

        Returns:
            Its :class:`~aiocollect.torch.work.Work`, at once.

        Raises:
            UsageError: the sizes or dtypes do not fit.
            GroupBrokenError: an earlier collective of the group failed.
        """
        timeout = self._timeout(opts)
        return self._launch(
            _alltoall.alltoall(
                list(output_tensors), list(input_tensors), self._rank, self._world, timeout
            ),
            timeout,
            "all_to_all",
            list(input_tensors),
        )

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> Work:
        """All-to-all along dim 0, evenly or with the given split sizes (rows per rank).

        Both tensors must be contiguous (as with gloo).

        Args:
            output: receives rank j's rows in block j.
            input: block i goes to rank i.
            output_split_sizes: rows received from each rank (empty: even).
            input_split_sizes: rows sent to each rank (empty: even).
            opts: its c10d options object (None: the defaults).

        Returns:
            Its :class:`~aiocollect.torch.work.Work`, at once.

        Raises:
            GroupBrokenError: an earlier collective of the group failed.
            ArgumentError: the arguments fail gloo's checks (a RuntimeError and a UsageError;
                nothing is sent).
        """
        _checks.contiguous("alltoall_base", input)
        _checks.contiguous("alltoall_base", output)
        timeout = self._timeout(opts)
        return self._launch(
            _alltoall.all_to_all_single(
                output,
                input,
                list(output_split_sizes),
                list(input_split_sizes),
                self._rank,
                self._world,
                timeout,
            ),
            timeout,
            "all_to_all",
            [input],
        )

    alltoall_base = all_to_all_single  # type: ignore[assignment]


__all__ = ["PointToPoint"]
