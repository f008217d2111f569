"""The point-to-point methods of the aiocollect process group (send, recv, recv from any
source): messages are matched by (source, tag) in order, on the group's links."""

from __future__ import annotations

import torch

from aiocollect.torch import _movement
from aiocollect.torch._runner import PlanRunner
from aiocollect.torch.work import Work


def tensor_list(value: object) -> list[torch.Tensor]:
    """``value`` as a list of tensors (a tensor alone, or a sequence of them)."""
    return [value] if isinstance(value, torch.Tensor) else list(value)  # type: ignore[call-overload]


class PointToPoint(PlanRunner):
    """The base of :class:`~aiocollect.torch.AiocollectProcessGroup` that adds
    point-to-point messages to :class:`~aiocollect.torch._runner.PlanRunner`.

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


__all__ = ["PointToPoint"]
