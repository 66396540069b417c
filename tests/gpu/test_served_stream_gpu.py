"""Serving on arrival on a GPU (`phase2.served_stream`): 2 processes (on one GPU they share it),
the CE transport, each rank the home of one expert and the helper of the other's, kept copies over
two micro-batches of a step, results in parts, while each rank's compute stream is kept busy by a
spin kernel queued before phase 2: the served work runs on its own stream, and the outputs,
input-gradients and the step's weight-gradients equal the unbalanced computation's."""
import pytest
import torch
import torch.distributed as dist

from deepspeed_feplb.testing import run_distributed

pytestmark = pytest.mark.gpu


def served_both_roles() -> dict:
    import numpy as np

    from deepspeed_feplb.config import FEPLBConfig
    from deepspeed_feplb.experts import ExpertSpec
    from deepspeed_feplb.migrate.backend import CudaBackend
    from deepspeed_feplb.migrate.cuda_ce import CudaCETransport
    from deepspeed_feplb.migrate.phase2 import Phase2MicroBatch, grad_experts, served_stream
    from deepspeed_feplb.migrate.resident import LayerResidency

    rank = dist.get_rank()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.backends.cuda.matmul.allow_tf32 = False
    names = [f"feplb-gputest-served-{torch.randint(1 << 30, ()).item()}"]
    dist.broadcast_object_list(names, 0)
    if rank == 0:
        transport = CudaCETransport(names[0], 0, 2, 30.0, True, backend=CudaBackend(), slot_bytes=1 << 16)
    dist.barrier()
    if rank:
        transport = CudaCETransport(names[0], 1, 2, 30.0, False, backend=CudaBackend(), slot_bytes=1 << 16)
    template = torch.nn.Linear(64, 64, bias=False).to(dev)
    weight = torch.randn(64, 64, generator=torch.Generator().manual_seed(20 + rank)).to(dev).requires_grad_(True)
    spec = ExpertSpec.of(template, None)
    residency = LayerResidency.create(2, 1, FEPLBConfig(weight_residency="step", max_resident_experts=1))
    moves = np.array([[0, 0, 1, 300], [1, 0, 0, 200]], np.int64)  # each home's expert 0: rows to the other rank
    stream = served_stream(dev)
    total, reference, exact = torch.zeros(64, 64, device=dev), torch.zeros(64, 64, device=dev), []
    for seq, ends in ((1, False), (2, True)):
        with_grads = grad_experts(residency, rank, [0], ends, True)
        x = torch.randn(512, 64, generator=torch.Generator().manual_seed(10 * seq + rank)).to(dev)
        ready = transport.mark()  # the rows are ready; the spin below is the rank's own experts
        torch.cuda._sleep(50_000_000)
        step = Phase2MicroBatch(transport, seq, rank, moves, [0], [512], [template], spec, True, with_grads,
                                residency=residency, step_ends=ends, ready=ready, serve_parts=4, serve_part_rows=64,
                                serve_early=True, served_stream=stream)
        y = step.forward(x, [[weight]])
        grad_y = torch.randn(y.shape, generator=torch.Generator().manual_seed(30 * seq + rank)).to(dev)
        torch.cuda._sleep(50_000_000)
        grad_x, grads = step.backward_home(grad_y)
        grad_x, grads = step.backward_rest(grad_x, grads)
        total += grads[0][0]
        xr = x.clone().requires_grad_(True)
        ref = xr @ weight.t()
        ref_x, ref_w = torch.autograd.grad(ref, [xr, weight], grad_y)
        reference += ref_w
        exact += [torch.allclose(y, ref, rtol=1e-5, atol=1e-5), torch.allclose(grad_x, ref_x, rtol=1e-5, atol=1e-5)]
    exact.append(torch.allclose(total, reference, rtol=1e-5, atol=1e-5))
    torch.cuda.synchronize()
    dist.barrier()
    transport.close()
    return {"exact": [bool(e) for e in exact], "served_stream": stream != torch.cuda.current_stream()}


def test_served_on_arrival_on_its_own_stream_stays_exact():
    for rank, result in enumerate(run_distributed(served_both_roles, 2, timeout=300)):
        assert result["served_stream"] and all(result["exact"]), (rank, result)
