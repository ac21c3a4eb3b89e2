"""The micro-batch schedule of one pipeline stage: 1F1B (one forward, one backward) over plain send/recv.

megatron-core's own schedules allocate their token counter with `device="cuda"` (and time with CUDA
events), so they cannot run on a CPU trainer; this is the same non-interleaved 1F1B schedule, the same on
every device, with one pipeline stage the plain forward → loss → backward loop. Stage s of P holds at most
P − s micro-batches' activations: it runs P − s − 1 warm-up forwards, then alternates one forward and one
backward, then drains the backwards.

Stages exchange activations forward and their gradients backward, paired as megatron pairs them (a send and
a receive in one batch: NCCL cannot have both ends of a link send first). No shapes travel: every rank
knows every micro-batch's shape from the plan (`shape_of`). Routing replay needs to know when a micro-batch's
backward starts (recomputation re-runs its routers): `before_backward(i)` is called then.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from legorl.trainer.models import compat

with compat.silence_import_warnings():
    from megatron.core import parallel_state as ps

__all__ = ["run"]

Forward = Callable[[int], torch.Tensor]
"""Run micro-batch i's forward on this stage (its input already set); the stage's output."""
Loss = Callable[[int, torch.Tensor], torch.Tensor | None]
"""Last stage: micro-batch i's loss from the stage's output (None in a forward-only pass)."""


class _Links:
    """Sends and receives between this stage and its neighbours (global ranks of the pipeline group)."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.size = ps.get_pipeline_model_parallel_world_size()
        self.first = ps.is_pipeline_first_stage()
        self.last = ps.is_pipeline_last_stage()
        self.prev = None if self.first else ps.get_pipeline_model_parallel_prev_rank()
        self.next = None if self.last else ps.get_pipeline_model_parallel_next_rank()
        self.dtype, self.device = dtype, device
        self.group = ps.get_pipeline_model_parallel_group()
        self.batched = dist.get_backend() == "nccl"
        self._pending: list[Any] = []

    def exchange(
        self,
        send: list[tuple[torch.Tensor, int]],
        recv: list[tuple[tuple[int, ...], int]],
    ) -> list[torch.Tensor]:
        """Send each (tensor, peer) and receive each (shape, peer) as one batch; the received tensors."""
        buffers = [torch.empty(shape, dtype=self.dtype, device=self.device) for shape, _ in recv]
        if not send and not recv:
            return []
        if self.batched:
            ops = [dist.P2POp(dist.isend, t.contiguous(), peer, self.group) for t, peer in send]
            ops += [
                dist.P2POp(dist.irecv, b, peer, self.group)
                for b, (_, peer) in zip(buffers, recv, strict=True)
            ]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            return buffers
        for tensor, peer in send:
            payload = tensor.detach().contiguous()
            # Kept until the end of the schedule: gloo reads the buffer after isend returns.
            self._pending.append((dist.isend(payload, peer), payload))
        for buffer, (_, peer) in zip(buffers, recv, strict=True):
            received = dist.irecv(buffer, peer)
            assert received is not None
            received.wait()
        return buffers

    def finish(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()


class _Schedule:
    """One pass of micro-batches through this stage (see `run`)."""

    def __init__(
        self,
        model: torch.nn.Module,
        links: _Links,
        *,
        shape_of: Callable[[int], tuple[int, ...]],
        forward: Forward,
        loss: Loss,
        train: bool,
        before_backward: Callable[[int], None] | None,
    ) -> None:
        inner: Any = model
        self.set_input = inner.set_input_tensor
        self.links = links
        self.shape_of, self.forward, self.loss = shape_of, forward, loss
        self.train, self.before_backward = train, before_backward
        self.inputs: deque[torch.Tensor | None] = deque()
        self.outputs: deque[torch.Tensor | None] = deque()

    def recv_forward(self, i: int) -> torch.Tensor | None:
        if self.links.prev is None:
            return None
        (x,) = self.links.exchange([], [(self.shape_of(i), self.links.prev)])
        return x

    def step_forward(self, i: int, x: torch.Tensor | None) -> torch.Tensor | None:
        """Micro-batch i's forward from input `x`: its loss on the last stage, its activations elsewhere."""
        if x is not None and self.train:
            x.requires_grad_(True)
        self.set_input(x)
        y = self.forward(i)
        if self.links.last:
            return self.loss(i, y)
        return y

    def send_forward(self, y: torch.Tensor | None) -> None:
        if self.links.next is not None:
            assert y is not None
            self.links.exchange([(y, self.links.next)], [])

    def step_backward(self, k: int, grad: torch.Tensor | None) -> torch.Tensor | None:
        """Micro-batch k's backward (`grad`: its output's gradient from the next stage); its input's grad."""
        x, out = self.inputs.popleft(), self.outputs.popleft()
        if self.before_backward is not None:
            self.before_backward(k)
        if out is not None:
            torch.autograd.backward(out, grad_tensors=None if self.links.last else grad)
        return None if x is None else x.grad

    def forward_only(self, count: int) -> None:
        with torch.no_grad():
            for i in range(count):
                self.send_forward(self.step_forward(i, self.recv_forward(i)))

    def one_forward_one_backward(self, count: int) -> None:
        links = self.links
        warmup = min(links.size - ps.get_pipeline_model_parallel_rank() - 1, count)
        for i in range(warmup):
            x = self.recv_forward(i)
            y = self.step_forward(i, x)
            self.inputs.append(x)
            self.outputs.append(y)
            self.send_forward(y)
        steady = count - warmup
        x = self.recv_forward(warmup) if steady > 0 else None
        for k in range(steady):
            i = warmup + k
            y = self.step_forward(i, x)
            self.inputs.append(x)
            self.outputs.append(y)
            grad = None
            if links.next is not None:
                assert y is not None
                # The gradient coming back is of the oldest micro-batch in flight (k), not of the one sent.
                (grad,) = links.exchange([(y, links.next)], [(self.shape_of(k), links.next)])
            gx = self.step_backward(k, grad)
            x = None
            if links.prev is not None:
                assert gx is not None
                if k == steady - 1:
                    links.exchange([(gx, links.prev)], [])
                else:
                    (x,) = links.exchange([(gx, links.prev)], [(self.shape_of(i + 1), links.prev)])
        for k in range(steady, count):
            grad = None
            if links.next is not None:
                (grad,) = links.exchange([], [(self.shape_of(k), links.next)])
            gx = self.step_backward(k, grad)
            if links.prev is not None:
                assert gx is not None
                links.exchange([(gx, links.prev)], [])


def run(
    model: torch.nn.Module,
    count: int,
    *,
    shape_of: Callable[[int], tuple[int, ...]],
    forward: Forward,
    loss: Loss,
    train: bool,
    before_backward: Callable[[int], None] | None = None,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Run `count` micro-batches through this stage (forward and backward with `train`, else forward only).

    `shape_of(i)`: the shape of micro-batch i's activations between stages. The model's input on a later
    stage is set with megatron's `set_input_tensor`. Gradients accumulate into the parameters' `.grad`.
    """
    links = _Links(dtype, device)
    schedule = _Schedule(
        model,
        links,
        shape_of=shape_of,
        forward=forward,
        loss=loss,
        train=train,
        before_backward=before_backward,
    )
    try:
        if train:
            schedule.one_forward_one_backward(count)
        else:
            schedule.forward_only(count)
        links.finish()
    finally:
        schedule.set_input(None)
