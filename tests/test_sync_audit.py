"""Device-to-host syncs, found on the CPU (`deepspeed_feplb.testing.sync_audit`): what the audit
counts (host reads of device values, and blocking uploads of host data), and a balanced layer's
forward and backward within the budget of issue "GPU hot path II": one host read per layer forward
(phase 1's count table), none in backward."""
import numpy as np
import pytest
import torch

from deepspeed_feplb.testing import run_distributed
from deepspeed_feplb.testing.sync_audit import audit_syncs

import moe_cases


def test_the_audit_counts_host_reads_of_device_values_only():
    device = torch.arange(8.0, requires_grad=True)
    host = torch.arange(8)  # not given to the audit, not computed from what was: the host's own
    with audit_syncs(device) as audit:
        y = device * 2
        y.sum().item()
        y.tolist()
        y.cpu()
        bool(y[0] > 0)
        y.nonzero()
        y[y > 0]
        torch.repeat_interleave(y.long())
        torch.repeat_interleave(y.long(), output_size=56)  # sized by the caller: no read
        torch.nn.functional.one_hot(y.long() % 3, 3)  # CUDA's checks no index on the host
        host.tolist()
        host.sum().item()
        (y * 0).sum().backward()
        table = np.arange(4)
        torch.from_numpy(table).to(y.device)  # host data to the device, blocking: a sync on a GPU
        uploaded = torch.from_numpy(table).to(y.device, non_blocking=True)  # staged at once: no sync
        torch.as_tensor(table, device=y.device)
        torch.tensor([1, 2], device=y.device)
        host.to(torch.float32)  # no device: stays on the host
        host.to("cpu")  # the host's, by name
        y.to(y.device)  # already the device's
        torch.zeros(3, device=y.device)  # made on the device: nothing uploaded
        uploaded.tolist()  # the device's now: read back
    assert [r.split(" at ")[0] for r in audit.reads] == [
        "_local_scalar_dense", ".tolist()", ".cpu()", "_local_scalar_dense", "nonzero", "index with a boolean mask",
        "repeat_interleave without output_size", "blocking upload .to(device)", "blocking upload torch.as_tensor(..., "
        "device=)", "blocking upload torch.tensor(..., device=)", ".tolist()"], audit.reads
    assert all("test_sync_audit.py" in r for r in audit.reads)


@pytest.mark.parametrize("world, placed, redundant, most", [(2, False, 0, 1), (4, True, 0, 1), (4, True, 1, 2)],
                         ids=["one-domain", "placement", "placement-replicas"])
def test_a_balanced_layer_reads_the_device_once_per_forward_and_never_in_backward(world, placed, redundant, most):
    """With replica slots, the split of a replicated expert's rows reads the group's route counts
    (`integration.placement.ExpertPlacement.route`) before phase 1 reads its own: two."""
    results = run_distributed(moe_cases.sync_audit_case, world, placed, redundant, timeout=600)
    for rank, r in enumerate(results):
        for forward, backward in zip(r["forward"], r["backward"]):
            assert len(forward) <= most, (rank, forward)
            assert backward == [], (rank, backward)
        assert r["forward"] and all(any("torch_a2a.py" in x for x in f) for f in r["forward"]), r["forward"]
        if placed:
            assert r["replicas"] == bool(redundant)
    assert sum(r["migrated"] for r in results) > 0


def _autoep_case() -> dict:
    """A Mixtral-like model on 2 ranks with DeepSpeed AutoEP and FEPLB balancing (`test_autoep`):
    FEPLB's host reads in one forward and backward, after two warm-up steps."""
    from test_autoep import VOCAB, ds_config, tiny_model

    import deepspeed_feplb
    from deepspeed_feplb.integration.autoep import FEPLBGroupedExperts
    model = tiny_model("mixtral")
    engine = deepspeed_feplb.initialize(model=model, model_parameters=model.parameters(),
                                        config=ds_config("mixtral", True))[0]
    g = torch.Generator().manual_seed(5)
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (2, 16), generator=g)
        engine.backward(engine(ids, labels=ids).loss)
        engine.step()
    ids = torch.randint(0, VOCAB, (2, 16), generator=g)
    params = list(engine.module.parameters())
    layer_forward = FEPLBGroupedExperts.forward

    def seam(self, x, num_tokens_per_expert):  # AutoEP builds the counts from host values, on the device
        forward.device_side(x, num_tokens_per_expert)
        return layer_forward(self, x, num_tokens_per_expert)

    FEPLBGroupedExperts.forward = seam
    try:
        with audit_syncs(*params) as forward:
            loss = engine(ids, labels=ids).loss
    finally:
        FEPLBGroupedExperts.forward = layer_forward
    with audit_syncs(loss, *params) as backward:
        engine.backward(loss)
    layers = [m for m in engine.module.modules() if getattr(m, "stage", None) is not None]
    return {"forward": forward.feplb_reads, "backward": backward.feplb_reads, "layers": len(layers),
            "migrated": sum(int(m.stage.stats.get("migrated_tokens", 0)) for m in layers if m.stage.stats)}


def test_an_autoep_layer_reads_the_device_once_per_forward_and_never_in_backward():
    pytest.importorskip("transformers")
    pytest.importorskip("deepspeed.module_inject.auto_ep_layer")
    results = run_distributed(_autoep_case, 2, timeout=300)
    for r in results:
        assert r["layers"] == 2 and len(r["forward"]) == r["layers"], r  # one per layer: the count exchange
        assert all("collectives.py" in x for x in r["forward"]), r["forward"]  # the count exchange (`gather_rows`)
        assert r["backward"] == [], r["backward"]
    assert sum(r["migrated"] for r in results) > 0
