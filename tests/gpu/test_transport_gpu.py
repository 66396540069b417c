"""CudaCETransport and PeerArena on real CUDA IPC (2 processes; on one GPU they share it)."""
import pytest
import torch
import torch.distributed as dist

from deepspeed_feplb.testing import run_distributed

pytestmark = pytest.mark.gpu


def _transport(capacity):
    from deepspeed_feplb.migrate.backend import CudaBackend
    from deepspeed_feplb.migrate.cuda_ce import CudaCETransport
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    names = [f"feplb-gputest-{torch.randint(1 << 30, ()).item()}"]
    dist.broadcast_object_list(names, 0)
    rank = dist.get_rank()
    if rank == 0:
        t = CudaCETransport(names[0], 0, 2, 30.0, True, backend=CudaBackend(), slot_bytes=capacity)
    dist.barrier()
    if rank:
        t = CudaCETransport(names[0], 1, 2, 30.0, False, backend=CudaBackend(), slot_bytes=capacity)
    return t


def roundtrips(capacity: int) -> dict:
    t = _transport(capacity)
    rank, dev = dist.get_rank(), torch.device("cuda", torch.cuda.current_device())
    ok = True
    for r in range(6):
        g = torch.Generator(device=dev).manual_seed(r * 10 + rank)
        x = torch.randn(1000 * (r + 1), 512, device=dev, generator=g).to(torch.bfloat16)
        w = torch.randn(512, 512, device=dev, generator=g)
        y = x.float() @ w  # compute stream work the copy must wait for
        f = t.send(1 - rank, r, [y, x])
        got = t.recv(1 - rank, r)
        g2 = torch.Generator(device=dev).manual_seed(r * 10 + 1 - rank)
        x2 = torch.randn(1000 * (r + 1), 512, device=dev, generator=g2).to(torch.bfloat16)
        w2 = torch.randn(512, 512, device=dev, generator=g2)
        ok &= torch.equal(got[1], x2) and torch.equal(got[0], x2.float() @ w2)
        f.result(timeout=30)
    caps, parts = t.capacities(), t.extra_parts
    dist.barrier()
    t.close()
    return {"ok": bool(ok), "capacities": caps, "extra_parts": parts}


def test_ce_transport_roundtrips_and_parts_on_cuda():
    # 1 MiB slots; messages of 3-18 MiB travel in parts through them, and the slots never grow
    results = run_distributed(roundtrips, 2, 1 << 20, timeout=300)
    assert all(r["ok"] for r in results)
    assert all(c == 1 << 20 for r in results for c in r["capacities"].values())
    assert all(r["extra_parts"] > 6 for r in results)


def peer_arena() -> list:
    from deepspeed_feplb.migrate.arena import PeerArena
    from deepspeed_feplb.migrate.backend import CudaBackend
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    arena = PeerArena(CudaBackend(), 1 << 20)
    arena.exchange()
    peer = 1 - dist.get_rank()
    arena.tensor(peer, 0, (256, ), torch.float32).copy_(torch.full((256, ), float(dist.get_rank() + 1), device="cuda"))
    torch.cuda.synchronize()
    dist.barrier()
    mine = arena.tensor(dist.get_rank(), 0, (256, ), torch.float32).cpu().tolist()
    arena.close(group=dist.group.WORLD)
    return mine


def test_peer_arena_ipc_views_on_cuda():
    results = run_distributed(peer_arena, 2, timeout=300)
    assert results[0] == [2.0] * 256 and results[1] == [1.0] * 256
