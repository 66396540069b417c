"""FEPLB's dropless top-1 routes (`gate.top1.dropless_top1`) are DeepSpeed's, without the sync.

* For every gate option (random token selection, RSample and Jitter noise, padding tokens,
  training and eval), its outputs equal DeepSpeed's `TopKGate(k=1, drop_tokens=False)` sparse
  routes bit for bit, and the random state after it is the one DeepSpeed leaves.
* It calls no ``topk`` whose k is a tensor (on a GPU, the host waits there for the gate), and
  neither does a FEPLB top-1 layer's forward; DeepSpeed's own gate does (the check can fail).
* With padding tokens (``used_token``) DeepSpeed's dropless top-1 passes a float tensor as topk's
  k, which torch refuses; FEPLB's routes them (compared here with DeepSpeed's k read as an int).
* The layer test fails on the code before: it ran DeepSpeed's gate, one such topk per forward.
* With an EP group (a DeepSpeed `MOELayer` holding the gate, as `assert_equal_to_unbalanced`'s
  reference does), the gate is DeepSpeed's: its capacity agreed over the group.
"""
import pytest
import torch
from deepspeed.moe.sharded_moe import TopKGate

from deepspeed_feplb.gate.top1 import DroplessTop1Gate, dropless_top1
from deepspeed_feplb.integration import seams

HIDDEN, EXPERTS, TOKENS = 16, 8, 64


class TensorTopKs:
    """Counts ``torch.topk`` calls whose k is a tensor (a device-to-host sync on a GPU), reading
    such a k on the host (torch refuses a float one: DeepSpeed's with padding tokens)."""

    def __init__(self, monkeypatch):
        self.count, topk = 0, torch.topk

        def counted(input, k, *args, **kwargs):
            if isinstance(k, torch.Tensor):
                self.count += 1
                k = int(k)
            return topk(input, k, *args, **kwargs)
        monkeypatch.setattr(torch, "topk", counted)


def _gate(noise, use_rts: bool, training: bool) -> TopKGate:
    torch.manual_seed(0)
    gate = TopKGate(HIDDEN, EXPERTS, k=1, noisy_gate_policy=noise, drop_tokens=False, use_rts=use_rts)
    return gate.train(training)


@pytest.mark.parametrize("noise", [None, "RSample", "Jitter"])
@pytest.mark.parametrize("use_rts", [True, False])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("padded", [False, True])
def test_outputs_and_random_state_equal_deepspeeds(noise, use_rts, training, padded, monkeypatch):
    gate = _gate(noise, use_rts, training)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))
    used = (torch.arange(TOKENS) % 5 != 0).float() if padded else None
    torch.manual_seed(2)
    topks = TensorTopKs(monkeypatch)
    theirs = gate(x, used, True, False)
    assert topks.count == 1  # the check sees DeepSpeed's sync
    their_state = torch.get_rng_state()
    torch.manual_seed(2)
    ours = dropless_top1(gate, x, used)
    assert topks.count == 1
    assert torch.equal(torch.get_rng_state(), their_state)
    l_aux, _, num_experts, ids, locations, gates, counts = ours
    assert num_experts == theirs[2] == EXPERTS
    for name, a, b in [("l_aux", l_aux, theirs[0]), ("ids", ids, theirs[3]), ("locations", locations, theirs[4]),
                       ("gates", gates, theirs[5]), ("exp_counts", counts, theirs[6])]:
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
    assert int(ours[1]) == int(theirs[1]) == int(counts.max())
    if padded:
        assert (ids[0, ::5] == -1).all()


def test_gradients_equal_deepspeeds():
    gate = _gate(None, True, True)
    x = torch.randn(TOKENS, HIDDEN, requires_grad=True)
    grads = []
    for route in (lambda: gate(x, None, True, False), lambda: dropless_top1(gate, x)):
        gate.zero_grad()
        x.grad = None
        torch.manual_seed(3)
        out = route()
        (out[0] + (out[5] * torch.arange(TOKENS)).sum()).backward()
        grads.append((x.grad.clone(), gate.wg.weight.grad.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_a_feplb_top1_layer_forward_makes_no_tensor_k_topk(monkeypatch):
    import deepspeed_feplb
    torch.manual_seed(0)
    expert = torch.nn.Sequential(torch.nn.Linear(HIDDEN, 32), torch.nn.ReLU(), torch.nn.Linear(32, HIDDEN))
    layer = deepspeed_feplb.MoE(HIDDEN, expert, num_experts=EXPERTS, k=1, drop_tokens=False)
    keys = list(layer.state_dict())
    gate_calls = []
    layer.deepspeed_moe.gate.register_forward_hook(lambda *_: gate_calls.append(1))  # profilers' and users' hooks
    topks = TensorTopKs(monkeypatch)
    out, _, counts = layer(torch.randn(2, TOKENS // 2, HIDDEN))
    assert topks.count == 0 and out.shape == (2, TOKENS // 2, HIDDEN) and int(counts.sum()) == TOKENS
    assert type(layer.deepspeed_moe.gate) is DroplessTop1Gate and gate_calls == [1]
    assert list(layer.state_dict()) == keys
    used = (torch.arange(TOKENS) % 5 != 0).float()  # padding tokens: routed nowhere, their output zero
    out, _, counts = layer(torch.randn(TOKENS, HIDDEN), used)
    assert int(counts.sum()) == int(used.sum()) and not out[::5].any() and out[1::5].abs().sum() > 0


def test_too_few_tokens_for_min_capacity_is_refused_as_deepspeed_does():
    gate = TopKGate(HIDDEN, EXPERTS, k=1, min_capacity=TOKENS + 1, drop_tokens=False)
    with pytest.raises(ValueError, match=f"min_capacity={TOKENS + 1}"):
        dropless_top1(gate, torch.randn(TOKENS, HIDDEN))
    with pytest.raises(AssertionError):
        gate(torch.randn(TOKENS, HIDDEN), None, True, False)


def test_the_gate_class_is_made_only_from_a_dropless_top1_gate_and_keeps_deepspeeds_other_calls():
    for gate in (TopKGate(HIDDEN, EXPERTS, k=2, drop_tokens=False), TopKGate(HIDDEN, EXPERTS, k=1)):
        with pytest.raises(ValueError, match="dropless top-1 TopKGate"):
            seams.make_dropless_top1(gate)
    gate = _gate(None, False, True)
    ours = seams.make_dropless_top1(_gate(None, False, True))
    x = torch.randn(TOKENS, HIDDEN)
    dense_theirs, dense_ours = gate(x), ours(x)  # the dense routes DeepSpeed's own MOELayer takes
    assert all(torch.equal(a, b) for a, b in zip(dense_theirs, dense_ours))


def _top1_with_an_ep_group() -> dict:
    """Two ranks: the swapped gate in a DeepSpeed layer's hands (EP group set) agrees on DeepSpeed's
    capacity, and a top-1 FEPLB layer equals DeepSpeed's MoE with no routing override."""
    import torch.distributed as dist

    import deepspeed_feplb
    from deepspeed_feplb.testing import assert_equal_to_unbalanced

    rank = dist.get_rank()
    torch.manual_seed(0)
    gate = TopKGate(HIDDEN, EXPERTS, k=1, min_capacity=0, drop_tokens=False, use_rts=False, ep_group=dist.group.WORLD)
    skew = 3 * rank * gate.wg.weight[0].detach()  # rank 1's tokens favour expert 0: the ranks' counts differ
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(rank)) + skew
    theirs = int(gate(x, None, True)[1])
    ours = int(seams.make_dropless_top1(gate)(x, None, True)[1])
    expert = torch.nn.Sequential(torch.nn.Linear(HIDDEN, 32), torch.nn.ReLU(), torch.nn.Linear(32, HIDDEN))
    layer = deepspeed_feplb.MoE(HIDDEN, expert, num_experts=EXPERTS, ep_size=2, k=1, min_capacity=0, drop_tokens=False,
                                use_rts=False, feplb_config={"nvlink_domain_size": 2, "dynamic_experts_per_rank": 1,
                                                             "chunk_align_tokens": 1, "fixed_costs": "ignore"})
    layer.set_deepspeed_parallelism()
    assert_equal_to_unbalanced(layer, x, against="deepspeed")
    return {"capacities": (theirs, ours), "gate": type(layer.deepspeed_moe.gate).__name__}


def test_with_an_ep_group_the_gate_is_deepspeeds_and_a_top1_layer_equals_deepspeeds_moe():
    from deepspeed_feplb.testing import run_distributed

    results = run_distributed(_top1_with_an_ep_group, 2, timeout=180)
    assert len({c for r in results for c in r["capacities"]}) == 1, results  # one capacity over the group
    assert all(r["gate"] == "DroplessTop1Gate" for r in results)
