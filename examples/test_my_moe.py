"""Unit-test your own MoE layer with FEPLB on 4 CPU ranks and simulated, skewed routing.

Copy this file next to your model and adapt `SwiGLUExpert` / `my_moe`. Run it with

    pip install deepspeed_feplb        # brings the pytest plugin (@pytest.mark.feplb_ranks)
    pytest examples/test_my_moe.py

No GPU needed: the ranks are CPU processes talking over gloo, FEPLB's copy engine is a thread
copying through shared memory, and the routing comes from a seeded generator or a recorded trace
instead of your (untrained) gate. See docs/TESTING.md.
"""
import pytest
import torch
import torch.distributed as dist

import deepspeed_feplb
from deepspeed_feplb.testing import (
    TraceRouting,
    assert_equal_to_unbalanced,
    assert_same_on_all_ranks,
    distinct_experts,
    example_trace_path,
    override_routing,
    zipf_routing,
)

HIDDEN, FFN, EXPERTS, RANKS = 16, 32, 8, 4


class SwiGLUExpert(torch.nn.Module):
    """Your expert: any module mapping ``[tokens, hidden] -> [tokens, hidden]`` row by row."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate_up = torch.nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = torch.nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(torch.nn.functional.silu(gate) * up)


def my_moe(k: int = 2) -> deepspeed_feplb.MoE:
    torch.manual_seed(0)  # the gate is replicated: same weights on every rank
    moe = deepspeed_feplb.MoE(HIDDEN, SwiGLUExpert(HIDDEN, FFN), num_experts=EXPERTS, ep_size=RANKS, k=k,
                              min_capacity=0, drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False,
                              feplb_config={"nvlink_domain_size": RANKS, "dynamic_experts_per_rank": 1,
                                            "chunk_align_tokens": 1,
                                            "fixed_costs": "ignore"})  # migrate even at toy sizes
    moe.set_deepspeed_parallelism()  # deepspeed.initialize does this for a real model
    distinct_experts(moe)  # DeepSpeed starts all experts as copies of one: make a wrong expert visible
    return moe


def tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(1000 * seed + dist.get_rank()))


@pytest.mark.feplb_ranks(RANKS, timeout=120)
@pytest.mark.parametrize("k", [1, 2])
def test_balancing_changes_nothing_but_the_balance(k):
    moe = my_moe(k)
    override_routing(moe, zipf_routing(skew=1.5))  # expert 0 hottest: rank 0 is the straggler

    x = tokens(64)
    result = assert_equal_to_unbalanced(moe, x)  # outputs and all gradients == FEPLB without balancing
    assert_equal_to_unbalanced(moe, x, against="deepspeed")  # ... == DeepSpeed's own (dropless) MoE

    stats = result["stats"][0]
    assert stats["migrated_tokens"] > 0, stats
    assert stats["max_over_mean_before"] > 1.5 and stats["max_over_mean_after"] < 1.2, stats
    assert_same_on_all_ranks(stats["tokens_after"], "tokens_after")  # every rank applied the same plan


@pytest.mark.feplb_ranks(RANKS, timeout=120)
def test_training_steps_on_a_replayed_trace():
    moe = my_moe(k=2)
    routing = TraceRouting(example_trace_path())  # 4 steps recorded on 4 ranks, 8 experts, top-2
    override_routing(moe, routing)
    optimizer = torch.optim.SGD(moe.parameters(), lr=0.1)
    wg = moe.deepspeed_moe.gate.wg.weight
    experts = list(moe.deepspeed_moe.experts.deepspeed_experts)
    first = dist.get_rank() * len(experts)  # global id of this rank's first expert

    for step in range(routing.trace.steps):
        x = tokens(routing.tokens_needed(RANKS), seed=step)
        out, l_aux, counts = moe(x)
        assert out.shape == x.shape and torch.isfinite(out).all()
        assert counts.tolist() == routing.counts(step, 0, RANKS)[dist.get_rank()].tolist()

        (out.square().mean() + 0.01 * l_aux).backward()
        routed = counts.clone()
        dist.all_reduce(routed)  # tokens of each expert, from all ranks
        for e, expert in enumerate(experts):  # weight gradients came home from the helpers
            has_grad = sum(p.grad.abs().sum().item() for p in expert.parameters()) > 0
            assert has_grad == (routed[first + e] > 0), (step, first + e, routed.tolist())
        assert wg.grad.abs().sum() > 0  # the gate learns through the forced routes' scores and l_aux
        dist.all_reduce(wg.grad)  # what DeepSpeed's data-parallel reduction does for the replicated gate
        optimizer.step()
        optimizer.zero_grad()
        assert_same_on_all_ranks(wg, "gate weight")

        stats = moe.feplb_stats
        assert sum(stats["tokens_after"]) == sum(stats["tokens_before"]) == routed.sum().item()
        assert stats["token_straggler_after"] <= stats["token_straggler_before"], stats
