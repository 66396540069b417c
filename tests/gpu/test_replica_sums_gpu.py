"""A replicated expert's home on a GPU (`integration.replicas.ReplicaSlots.sums_here`): the
replicas' sums of a step's last micro-batch arrive on the relay stream (`relay_stream`), and the
home's compute stream waits for them in stream order (no host wait) before it adds them to the
expert's gradient; a rank that is no home leaves its wait to the end of the backward.

On one GPU and one process: the sums are "arriving" buffers written on the relay stream behind a
long spin kernel, as a relay from another node would write them; a missing stream wait would read
them before they are written (they start as NaN)."""
import contextlib

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu


class _Placement:
    """The placement as `ReplicaSlots` sees it: no group (this process is rank 0), rank 1 holds a
    replica of expert 0, whose home is rank 0's local expert 0."""
    ep_group = None
    ranks_per_node = 1
    replica_at = np.array([[-1], [0]])

    @staticmethod
    def home_of(expert: int) -> tuple[int, int]:
        return 0, expert

    @staticmethod
    def timing_replicas():
        return contextlib.nullcontext()


def _arriving_late(device: torch.device) -> tuple[torch.Tensor, torch.cuda.Event]:
    from deepspeed_feplb.integration.replicas import relay_stream

    stream = relay_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        late = torch.full((64, 64), float("nan"), device=device)
        torch.cuda._sleep(200_000_000)  # a relay from another node, long after the caller's own work
        late.fill_(0.25)
        done = torch.cuda.Event()
        done.record(stream)
    return late, done


def test_a_home_adds_sums_that_arrive_late_in_stream_order():
    from deepspeed_feplb.integration.replicas import ReplicaSlots, _LastSums, with_sum

    device = torch.device("cuda", torch.cuda.current_device())
    slots = ReplicaSlots(_Placement(), [torch.zeros(64, 64, dtype=torch.bfloat16, device=device)], 1)
    late, done = _arriving_late(device)
    # as `_send_last` leaves it on the home: one replica's fp32 sum arriving for local expert 0
    slots._last = _LastSums(None, [(1, 0, 0, 0, [late])], {}, done, {(1, 0, 0)})
    own = torch.randn(64, 64, device=device).to(torch.bfloat16)
    (local, sums), = slots.sums_here()
    summed = with_sum([own], sums)[0]  # on the compute stream, right away
    torch.cuda.synchronize()
    assert local == 0 and slots._last is None
    assert torch.isfinite(summed.float()).all(), "the sums were read before their relay wrote them"
    assert torch.equal(summed, (own.float() + 0.25).to(torch.bfloat16))
