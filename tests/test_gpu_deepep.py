"""DeepEP phase-1 adapter: its CPU reference of DeepEP's contract, and the adapter vs the torch backend.

`deep_ep` itself cannot be built or imported here (no GPU, no NVSHMEM), so the
adapter runs on `ReferenceBuffer`, which implements the intranode contract of ``deep_ep.Buffer``
over gloo. On 3 ranks: the contract's properties, then `DeepEPDispatcher` against
`TorchDispatcher` (rows, counts, the group's facts, combined output, and gradients of x and gates).
"""
import pytest
import torch
import torch.distributed as dist

from deepspeed_feplb.testing import run_distributed

E_LOCAL, HIDDEN, TOKENS, K = 3, 8, 11, 2


def _inputs(rank: int, world: int):
    g = torch.Generator().manual_seed(50 + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=g)
    experts = world * E_LOCAL
    ids = torch.stack([torch.randperm(experts, generator=g)[:K] for _ in range(TOKENS)])  # [T, K], distinct
    ids[0] = -1  # a token routed nowhere
    ids[1, 1] = -1  # a route not taken
    ids[2] = torch.tensor([0, 1])  # two experts on rank 0: DeepEP sends the token there once
    gates = torch.rand(TOKENS, K, generator=g)
    return x, ids, gates


def contract() -> dict:
    from deepspeed_feplb.dispatch.deepep import ReferenceBuffer
    rank, world = dist.get_rank(), dist.get_world_size()
    buffer = ReferenceBuffer(None)
    x, ids, gates = _inputs(rank, world)
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(ids, world * E_LOCAL)
    recv_x, recv_idx, recv_w, per_local, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=ids,
        topk_weights=gates, expert_alignment=4)
    cached, *rest = buffer.dispatch(x, handle=handle)
    combined, combined_w, _ = buffer.combine(recv_x, handle, topk_weights=recv_w)
    return dict(x=x, ids=ids, gates=gates, per_rank=per_rank, per_rdma=per_rdma, per_expert=per_expert,
                in_rank=in_rank, recv_x=recv_x, recv_idx=recv_idx, recv_w=recv_w, per_local=per_local, cached=cached,
                rest=rest, combined=combined, combined_w=combined_w, recv_src_idx=handle[3])


def adapter_vs_torch() -> dict:
    from deepspeed_feplb.dispatch.deepep import DeepEPDispatcher, ReferenceBuffer
    from deepspeed_feplb.dispatch.torch_a2a import TorchDispatcher
    rank, world = dist.get_rank(), dist.get_world_size()
    x0, ids, gates0 = _inputs(rank, world)
    expert_ids, gates0 = ids.t().contiguous(), gates0.t().contiguous()  # the layer's [k, S] layout
    results = {}
    for name, dispatcher in (("torch", TorchDispatcher(None, world, E_LOCAL)),
                             ("deepep", DeepEPDispatcher(None, world, E_LOCAL, buffer=ReferenceBuffer(None)))):
        x = x0.clone().requires_grad_(True)
        gates = gates0.clone().requires_grad_(True)
        announce = (float(rank), 2.5 * rank)
        rows, counts, handle, facts = dispatcher.dispatch(x, expert_ids, announce)
        g = torch.Generator().manual_seed(7 + rank)
        weight = torch.randn(rows.shape[0], HIDDEN, generator=g)
        out_rows = torch.tanh(rows * weight)  # a row-wise "expert"
        out = dispatcher.combine(out_rows, gates, handle)
        (out * torch.randn(out.shape, generator=g)).sum().backward()
        results[name] = dict(rows=rows.detach(), counts=counts, out=out.detach(), dx=x.grad, dgates=gates.grad,
                             received=facts.received, announced=facts.announced)
    return results


def suite():
    return {"contract": contract(), "adapter": adapter_vs_torch()}


@pytest.fixture(scope="module")
def results():
    return run_distributed(suite, 3, timeout=240)


def test_reference_layout_counts_tokens_once_per_rank(results):
    for r in results:
        c = r["contract"]
        ids = c["ids"]
        expect = torch.zeros(TOKENS, 3, dtype=torch.bool)
        for t in range(TOKENS):
            for e in ids[t].tolist():
                if e >= 0:
                    expect[t, e // E_LOCAL] = True
        assert torch.equal(c["in_rank"], expect)
        assert c["per_rank"].tolist() == expect.sum(0).tolist()
        assert c["per_rdma"] is None  # intranode
        assert c["per_expert"].tolist() == torch.bincount(ids[ids >= 0], minlength=9).tolist()


def test_reference_receives_by_source_rank_with_local_expert_ids(results):
    for me, r in enumerate(results):
        c = r["contract"]
        want_x, want_idx, want_w, want_src = [], [], [], []
        for s in results:  # receive order: source rank, then token
            sc = s["contract"]
            for t in range(TOKENS):
                if sc["in_rank"][t, me]:
                    local = sc["ids"][t] - me * E_LOCAL
                    mine = (sc["ids"][t] >= 0) & (local >= 0) & (local < E_LOCAL)
                    want_x.append(sc["x"][t])
                    want_idx.append(torch.where(mine, local, torch.full_like(local, -1)))
                    want_w.append(torch.where(mine, sc["gates"][t], torch.zeros_like(sc["gates"][t])))
                    want_src.append(t)
        assert torch.equal(c["recv_x"], torch.stack(want_x))
        assert torch.equal(c["recv_idx"], torch.stack(want_idx))
        assert torch.equal(c["recv_w"], torch.stack(want_w))
        assert c["recv_src_idx"].tolist() == want_src
        per_local = torch.bincount(c["recv_idx"][c["recv_idx"] >= 0], minlength=E_LOCAL)
        assert c["per_local"] == [-(-int(n) // 4) * 4 for n in per_local]  # expert_alignment=4
        assert torch.equal(c["cached"], c["recv_x"]) and c["rest"][:4] == [None] * 4


def test_reference_combine_sums_over_ranks_without_weights(results):
    for r in results:
        c = r["contract"]
        copies = c["in_rank"].sum(1, keepdim=True).float()  # ranks each token went to
        assert torch.allclose(c["combined"], c["x"] * copies, rtol=1e-6, atol=1e-6)
        assert torch.allclose(c["combined_w"], torch.where(c["ids"] >= 0, c["gates"], torch.zeros_like(c["gates"])))


def test_adapter_matches_torch_dispatcher_exactly(results):
    for rank, r in enumerate(results):
        a, b = r["adapter"]["torch"], r["adapter"]["deepep"]
        assert (a["counts"] == b["counts"]).all(), (a["counts"], b["counts"])
        assert torch.equal(a["rows"], b["rows"]), f"rank {rank}: rows differ (order within an expert?)"
        assert torch.equal(a["out"], b["out"])
        assert torch.allclose(a["dx"], b["dx"], rtol=1e-6, atol=1e-7)
        assert torch.allclose(a["dgates"], b["dgates"], rtol=1e-6, atol=1e-7)
        assert a["counts"].sum() > 0
        # the group's facts, as the skip rule reads them: every rank's received rows and announced values
        assert (a["received"] == b["received"]).all() and (a["announced"] == b["announced"]).all()
        assert b["announced"].tolist() == [[float(r), 2.5 * r] for r in range(3)]


def test_the_layers_of_a_process_share_one_deepep_buffer(monkeypatch):
    """Each DeepEP buffer holds its own NVLink memory: one per EP group and process, replaced only
    by a larger one; a combine uses the buffer its dispatch used."""
    import sys
    import types

    from deepspeed_feplb.dispatch import deepep

    made = []

    class FakeBuffer:
        def __init__(self, group, nvl_bytes, rdma_bytes):
            assert rdma_bytes == 0  # one host: no RDMA buffer
            made.append(nvl_bytes)

    monkeypatch.setitem(sys.modules, "deep_ep", types.SimpleNamespace(Buffer=FakeBuffer))
    monkeypatch.setattr(deepep, "_SHARED", {})
    monkeypatch.setattr(deepep, "nvl_bytes_hint", lambda module, hidden_bytes, ranks: hidden_bytes * 1000)
    group = object()
    layers = [deepep.DeepEPDispatcher(group, 2, 4) for _ in range(4)]
    rows = torch.zeros(3, 64, dtype=torch.bfloat16)
    buffers = {id(layer._buffer(rows)) for layer in layers}
    assert len(buffers) == 1 and made == [128_000]
    wider = layers[0]._buffer(torch.zeros(3, 128, dtype=torch.bfloat16))  # a layer with a larger hidden size
    assert made == [128_000, 256_000] and all(layer._buffer(rows) is wider for layer in layers)
    assert deepep.DeepEPDispatcher(object(), 2, 4)._buffer(rows) is not wider  # another EP group: its own


class _Config:
    """What DeepEP's ``Config`` tells: buffer-size hints (bytes per hidden byte, as a stand-in)."""

    def __init__(self, num_ranks: int, nvshmem: bool = True):
        self.num_ranks, self.nvshmem = num_ranks, nvshmem

    def get_nvl_buffer_size_hint(self, hidden_bytes, num_ranks):
        return 1000 * hidden_bytes

    def get_rdma_buffer_size_hint(self, hidden_bytes, num_ranks):
        if not self.nvshmem:
            raise RuntimeError("Assertion failed: NVSHMEM is disable during compilation")
        return 0 if num_ranks <= 8 else 3000 * hidden_bytes


def _fake_deep_ep(made: list, nvshmem: bool = True):
    import types

    class FakeBuffer:
        def __init__(self, group, nvl_bytes, rdma_bytes):
            made.append((nvl_bytes, rdma_bytes))

        get_dispatch_config = get_combine_config = staticmethod(lambda num_ranks: _Config(num_ranks, nvshmem))

    return types.SimpleNamespace(Buffer=FakeBuffer)


def test_a_group_across_hosts_gets_deepeps_rdma_buffer(monkeypatch):
    """EP 16 (two hosts of 8): the group's one buffer holds DeepEP's NVLink and RDMA hints; EP 8
    holds no RDMA memory. A deep_ep built without NVSHMEM raises where it sizes an RDMA buffer:
    `internode_missing` says so before any buffer exists."""
    import sys

    from deepspeed_feplb.dispatch import deepep

    made = []
    monkeypatch.setitem(sys.modules, "deep_ep", _fake_deep_ep(made))
    monkeypatch.setattr(deepep, "_SHARED", {})
    rows = torch.zeros(3, 64, dtype=torch.bfloat16)
    deepep.DeepEPDispatcher(object(), 16, 4)._buffer(rows)
    deepep.DeepEPDispatcher(object(), 8, 4)._buffer(rows)
    assert made == [(128_000, 384_000), (128_000, 0)]
    assert deepep.internode_missing() is None
    monkeypatch.setitem(sys.modules, "deep_ep", _fake_deep_ep(made, nvshmem=False))
    assert "no internode kernels (RuntimeError: Assertion failed: NVSHMEM is disable" in deepep.internode_missing()


def test_the_reference_layout_counts_a_token_once_per_host_across_hosts():
    """DeepEP's internode layout: tokens per RDMA rank (a host of 8) count a token once per host
    it goes to; within one host there is none."""
    from deepspeed_feplb.dispatch.deepep import ReferenceBuffer

    buffer = ReferenceBuffer()
    buffer.group_size = 16  # 2 hosts of 8, 1 expert per rank; the layout needs no collective
    topk = torch.tensor([[0, 3], [1, 9], [12, 15], [-1, 8]])
    per_rank, per_host, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, 16)
    assert per_host.tolist() == [2, 3] and per_rank.sum() == 7 and in_rank.shape == (4, 16)
    buffer.group_size = 8
    assert buffer.get_dispatch_layout(topk.clamp(max=7), 8)[1] is None

