"""A replicated expert's home on a GPU (`integration.replicas.ReplicaSlots.at_backward_end`): its
gradient of a step's last micro-batch is held back from autograd and delivered when the whole
backward ends, with the replicas' sums, which arrive on the relay stream (`relay_stream`) well
after the backward's own work. The delivery waits for them in stream order (no host wait), adds
them in fp32 and accumulates the result into the parameter once, running its hooks once.

On one GPU and one process: the sums are "arriving" buffers written on the relay stream behind a
long spin kernel, as a relay from another node would write them; a missing stream wait would read
them before they are written (they start as NaN)."""
import contextlib

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu


class _OneRank:
    """The placement as `ReplicaSlots` sees it: one rank, no group."""
    ep_group = None
    ranks_per_node = 1
    replica_at = np.array([[-1]])

    @staticmethod
    def home_of(expert: int) -> tuple[int, int]:
        return 0, expert

    @staticmethod
    def timing_replicas():
        return contextlib.nullcontext()


def test_a_held_back_gradient_joins_its_late_sums_when_the_backward_ends():
    from deepspeed_feplb.integration.replicas import ReplicaSlots, _LastSums, relay_stream, with_sum

    device = torch.device("cuda", torch.cuda.current_device())
    slots = ReplicaSlots(_OneRank(), [torch.zeros(64, 64, dtype=torch.bfloat16, device=device)], 1)
    weight = torch.nn.Parameter(torch.randn(64, 64, device=device).to(torch.bfloat16))
    accumulated = []
    weight.register_post_accumulate_grad_hook(lambda p: accumulated.append(p.grad.clone()))

    stream = relay_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        late = torch.full((64, 64), float("nan"), device=device)
        torch.cuda._sleep(200_000_000)  # a relay from another node, long after the backward's own work
        late.fill_(0.25)
        done = torch.cuda.Event()
        done.record(stream)
    # as `_send_last` leaves it on the home: one replica's fp32 sum arriving for local expert 0
    slots._last = _LastSums(None, [(1, 0, 7, 0, [late])], {}, done)

    class HeldBack(torch.autograd.Function):
        @staticmethod
        def forward(ctx, stand_in):
            return stand_in.view_as(stand_in)

        @staticmethod
        def backward(ctx, grad):
            slots.at_backward_end([weight], [grad], lambda grads, arrived: with_sum(grads, dict(arrived)[0]))
            return None

    x = torch.randn(8, 64, device=device).to(torch.bfloat16)
    out = x @ HeldBack.apply(weight.detach().requires_grad_())
    out.float().sum().backward()
    expected = with_sum([x.t() @ torch.ones_like(out)], [torch.full((64, 64), 0.25, device=device)])[0]
    assert slots.held_back == 1 and len(accumulated) == 1, "delivered more or less than once"
    assert torch.isfinite(weight.grad).all(), "the sums were read before their relay wrote them"
    assert torch.equal(weight.grad, expected)
    assert slots._last is None
