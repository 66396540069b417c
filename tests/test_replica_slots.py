"""Replica slots at runtime (feplb.placement.redundant_experts_per_rank): 4 gloo ranks as 2 nodes of
2 (and 8 as 4 of 2), one expert with most rows, which placement alone cannot balance. A replica on the other
node takes its share of every micro-batch; the replicas' gradients reach the expert before the
optimizer step, so training equals DeepSpeed's MoE; checkpoints hold no replica; and on a replayed
trace the runtime makes the simulator's replica decisions and splits."""
from dataclasses import replace

import numpy as np
import pytest

from deepspeed_feplb.plan.placement import FIRST_REPLICAS_AFTER
from deepspeed_feplb.testing import run_distributed

import moe_cases


def _node_rows(results: list, ranks_per_node: int = 2) -> np.ndarray:
    """float [micro-batches, nodes]: rows per node before balancing, assembled from every rank's
    stats (each reports its own domain)."""
    out = []
    for mb in range(len(results[0]["micro"])):
        per_rank = {}
        for x in results:
            per_rank.update(zip(x["micro"][mb]["ranks"], x["micro"][mb]["tokens_before"]))
        rows = np.array([per_rank[r] for r in range(len(per_rank))], dtype=np.float64)
        out.append(rows.reshape(-1, ranks_per_node).sum(axis=1))
    return np.array(out)


@pytest.mark.parametrize("world,zero_stage,redundant,steps,learn,recompute,moves,bucket",
                         # ZeRO 1 and 2 share DeepSpeed's optimizer: each case of one stands for the other too
                         [(4, 0, 1, 8, False, False, True, None), (4, 2, 0, 8, False, False, True, None),
                          (8, 2, 1, 6, False, False, True, None), (4, 1, 1, 30, True, False, True, None),
                          (4, 2, 1, 6, False, True, True, None), (4, 1, 1, 4, False, False, False, None),
                          (4, 2, 1, 6, True, False, False, 64)],
                         ids=["zero0", "zero2-no-replicas", "zero2-4-nodes", "zero1-learning-30",
                              "zero2-recomputed", "zero1-homes-kept", "zero2-small-bucket"])
def test_replicas_balance_every_micro_batch_and_train_exactly(world, zero_stage, redundant, steps, learn, recompute,
                                                              moves, bucket):
    """2 nodes of 2 ranks, and 4 nodes of 2 (where the hot expert needs a replica on every other
    node: `replicas.choose` may give an expert several). With a frozen router every micro-batch
    after the first decision is balanced; a learning one (30 steps) spreads its rows as it learns,
    so the replicas change with it and follow up to a decision (2 steps) behind. ``recompute``:
    the layer runs again in each backward (activation checkpointing), on the replica weights of
    its first forward and with its split. ``moves`` false: ``feplb.placement.enabled`` false,
    replicas alone, 4 micro-batches per step; no slot's contents change, and the first replicas
    come after the first step's second micro-batch, their gradient sums covering the step's last two.
    On 2 nodes the hot expert's home holds its gradient of each step's last micro-batch back to the
    backward's end, and every rank the expert at the same local index (on 4 nodes, a home of 3
    replicas, none); ``bucket``: ZeRO 2's reduce bucket (elements) far smaller than the model,
    the learning router's and its input layer's gradients among the experts', so the bucket
    flushes at every few hooks: the held-back hooks fire alike on every rank."""
    gas = 2 if moves else 4
    decided = gas if moves else FIRST_REPLICAS_AFTER  # micro-batches before the first decision
    results = run_distributed(moe_cases.replica_slots_case, world, zero_stage, steps, gas, redundant, learn,
                              recompute, moves, bucket=bucket, timeout=900)
    r = results[0]
    if not moves:
        assert all(x["expert_at"] == list(range(len(x["expert_at"]))) and x["moved_experts"] == 0
                   for x in results), "an expert left its home with placement.enabled false"
    assert r["forwards"] == steps * gas * (2 if recompute else 1)
    assert all(x["replica_at"] == r["replica_at"] for x in results), "ranks disagree on the replicas"
    nodes = _node_rows(results)[decided:]  # after the first decision
    ratio = nodes.max(axis=1) / nodes.min(axis=1)
    if redundant:
        assert any(q >= 0 for step in r["replica_at"] for row in step for q in row), "no replica was made"
        balanced = ratio <= 1.05
        # (the learning router of this case: 42 of 58 within 5%, the rest while the replicas catch up)
        # (the small-bucket case is about the hooks' order: its router learns with the homes kept)
        assert bucket is not None or (balanced.mean() >= 0.5 if learn else balanced.all()), \
            f"node rows per micro-batch after the first decision: {nodes.tolist()}"
        if learn:
            assert len({str(step) for step in r["replica_at"]}) > 2, "the replicas did not follow the router"
        # every step's replica gradients went home (each holder once per step), and fresh weights came back;
        # a step holds the replicas of the table the step before left (the review may drop them)
        held = [sum(q >= 0 for row in step for q in row) for step in r["replica_at"][:-1]]
        assert sum(x["grad_sends"] for x in results) >= sum(held)
        assert r["refreshes"] >= sum(n > 0 for n in held)
        # the stepped weights left when the engine's forward began, not in the layer's own forward
        assert r["ahead_refreshes"] >= sum(n > 0 for n in held), (r["ahead_refreshes"], held)
        held_back = [x["held_back"] for x in results]
        assert all(h > 0 for h in held_back) if world == 4 else not any(held_back), held_back
        assert learn or all(held), f"a frozen router's replicas were dropped: {r['replica_at']}"
    else:  # the control: placement alone cannot split the hot expert
        assert ratio.min() > 1.3, f"the case is balanced without replicas, so it shows nothing: {nodes.tolist()}"
    reference, ours = np.array(r["losses"]["reference"]), np.array(r["losses"]["feplb"])
    assert np.allclose(ours, reference, rtol=1e-5, atol=1e-6), f"losses differ: {ours - reference}"
    worst = max(max(x["param_errors"].values()) for x in results)
    assert worst < 1e-5, f"parameters differ from DeepSpeed's MoE by {worst:.2e}"
    assert r["state_dict_keys"] == r["reference_keys"], "replica slots leaked into the state dict"


def test_held_back_gradients_train_exactly_however_the_backward_is_called():
    """A step's last gradients held back to the backward's end must reach DeepSpeed's ZeRO 2 before
    its reduction epilogue, once per parameter. A direct ``loss.backward()`` runs that epilogue in a
    callback queued before FEPLB's, so FEPLB holds nothing back after seeing one and delivers in the
    layer's backward where a forward already held back; a layer used twice in one forward delivers
    both uses' gradients in one backward, so each parameter's hooks run once (before, ZeRO 2 failed
    with "already been reduced" and, after a direct backward, at the optimizer step)."""
    results = run_distributed(moe_cases.replica_backward_cases, 4, 2, timeout=900)
    for name in ("direct", "alternating", "twice"):
        runs = [x[name] for x in results]
        reference, ours = np.array(runs[0]["losses"]["reference"]), np.array(runs[0]["losses"]["feplb"])
        assert np.allclose(ours, reference, rtol=1e-5, atol=1e-6), (name, ours - reference)
        worst = max(max(x["param_errors"].values()) for x in runs)
        assert worst < 1e-5, f"{name}: parameters differ from DeepSpeed's MoE by {worst:.2e}"
        held_back = [x["held_back"] for x in runs]
        assert (not any(held_back)) if name == "direct" else all(h > 0 for h in held_back), (name, held_back)


def test_the_host_cost_of_held_replicas_is_measured_agreed_and_priced():
    """``feplb.fixed_costs: "measured"``: from the first step with replicas held, the ranks agree
    at each step on what their hosts spent on them beyond the modelled exchange (each forward's
    split, the refresh, the relay), and the choice made there prices it, weighed on one rank and
    shared; training stays DeepSpeed's. (Whether a replica then pays depends on the measured cost per row: unit-tested
    in test_replicas.py.)"""
    gas, steps = 2, 4
    results = run_distributed(moe_cases.replica_slots_case, 4, 1, steps, gas, 1, False, False, False, "measured",
                              timeout=900)
    r = results[0]
    assert all(x["replica_at"] == r["replica_at"] and x["replica_fixed_us"] == r["replica_fixed_us"]
               for x in results), "ranks disagree on the replicas or their price"
    # the one layer's reviews are weighed by EP rank 0 alone; the others take its choice
    assert r["reviews_weighed"] > 0 and all(x["reviews_weighed"] == 0 for x in results[1:]), \
        [x["reviews_weighed"] for x in results]
    held = [any(q >= 0 for row in step for q in row) for step in r["replica_at"]]
    fixed = [f for f, _ in r["replica_fixed_us"]]
    assert held[0] and fixed[0] == 0.0, (held, fixed)  # made at the first step's end, nothing measured yet
    assert all(f > 0.0 for f in fixed[1:]), fixed
    assert all(cost >= f for (f, cost), h in zip(r["replica_fixed_us"][1:], held[1:]) if h), r["replica_fixed_us"]
    reference, ours = np.array(r["losses"]["reference"]), np.array(r["losses"]["feplb"])
    assert np.allclose(ours, reference, rtol=1e-5, atol=1e-6), f"losses differ: {ours - reference}"


def test_checkpoints_hold_no_replica_and_load_both_ways(tmp_path):
    results = run_distributed(moe_cases.replica_checkpoint_case, 4, str(tmp_path), 2, timeout=600)
    r = results[0]
    assert any(q >= 0 for row in r["replicas_at_save"] for q in row), "no replica at the save: nothing tested"
    for kind in ("feplb", "deepspeed"):
        assert np.allclose(r["resumed"][kind], r["continued"], rtol=1e-5, atol=1e-6), (kind, r["resumed"][kind],
                                                                                        r["continued"])


@pytest.mark.parametrize("bound,moves", [(None, True), (1.02, True), (None, False)],
                         ids=["time", "row_bound", "homes_kept"])
def test_runtime_replicas_equal_the_simulators(tmp_path, bound, moves):
    """Simulator parity with replica slots: replaying a trace, the runtime chooses the simulator's
    replicas at the same optimizer steps and every rank receives the rows the simulator's split
    gives it, micro-batch by micro-batch. ``row_bound``: over a network so slow that no replica
    pays in time, ``feplb.max_rows_over_mean`` makes them (rows before time) alike on both.
    ``homes_kept``: ``feplb.placement.enabled`` false, replicas alone, 4 micro-batches per step: the
    one decision comes after the first step's second micro-batch, alike, and the replicas are chosen
    again alike at every optimizer step: the hot experts change nodes after it, and the replicas
    follow them."""
    from deepspeed_feplb.plan.cost import PROFILES, ExpertShape, scaled
    from deepspeed_feplb.plan.replicas import route
    from deepspeed_feplb.sim.policies import FEPLB, SimSetup
    from deepspeed_feplb.trace.format import fold_sources, save_trace
    from deepspeed_feplb.trace.generators import skewed_trace
    trace = skewed_trace(micro_batches=24 if moves else 36, layers=1, ranks=4, experts=16, tokens_per_rank=48,
                         top_k=2, skew=1.6, drift=0.3, memory=0.8, seed=4)
    gas, interval, decay = 2, 2, 0.3
    if not moves:  # one decision, then the hot experts change nodes: the replicas must follow
        gas = 4  # the one decision comes before the first step ends, after its second micro-batch
        counts = trace.counts.copy()
        counts[8:] = np.roll(counts[8:], trace.experts // 2, axis=-1)
        trace, interval = replace(trace, counts=counts), 100
    path = tmp_path / "trace.npz"
    save_trace(path, trace)
    network_gbps = 1e6 if bound is None else 1e-6
    results = run_distributed(moe_cases.placement_replay_case, 4, str(path), gas, interval, decay, 1, bound,
                              network_gbps, moves, timeout=600)
    r = results[0]
    assert all(x["replica_at"] == r["replica_at"] for x in results)
    setup = SimSetup(ranks_per_node=2, nodes=2, experts=trace.experts, dynamic_experts=1, chunk_align=1,
                     shape=ExpertShape(hidden=16, ffn_hidden=32, mats=2, dtype_bytes=4),
                     profile=scaled(PROFILES["h100"], net_gbps=network_gbps, ce_gbps=1e6),
                     placement="on" if moves else "off",
                     placement_interval=interval * gas, eplb_decay=decay, expert_state_bytes=r["state_bytes"],
                     micro_batches_per_step=gas, redundant_per_rank=1, max_rows_over_mean=bound)

    def replay(setup):
        policy = FEPLB(setup, 1)
        placer = policy.placers[0]
        placer.weight_bytes = r["weight_bytes"]  # the runtime's expert, not the profile's shape
        placer.grad_bytes = r["grad_bytes"]
        rows, replica_at, held = [], [], []
        for step in range(trace.steps):
            src = fold_sources(trace.counts[step, 0], 4)
            held.append(placer.holds_replicas)
            rows.append(route(src, placer.slots, 2, setup.experts_per_rank).sum(axis=1).tolist())
            # the runtime's time per row as its decision here took it: at a step's end, as the step's last
            # micro-batch left it; a decision between micro-batches, as the next forward began
            placer.us_per_token = r["us_per_token"][step if setup.step_ends(step) else min(step + 1, trace.steps - 1)]
            policy.step(step, 0, src)
            if setup.step_ends(step):
                replica_at.append(placer.replica_at.tolist())
        return rows, replica_at, (placer.replica_drops, placer.replica_changes), held

    rows, replica_at, changes, held = replay(setup)
    if not moves:  # the first replicas balanced the first step's third micro-batch on
        assert held.index(True) == FIRST_REPLICAS_AFTER < gas, held
    assert changes == (r["replica_drops"], r["replica_changes"]), (changes, r)
    if not moves:
        followed = replica_at[-1] != replica_at[0] and any(q >= 0 for row in replica_at[-1] for q in row)
        assert changes[1] >= 1 and followed, "the replicas did not follow the hot experts"
    if not moves:
        assert all(x["placements"][-1] == sorted(x["placements"][-1]) for x in results), "a home moved"
    assert any(q >= 0 for step in replica_at for row in step for q in row), "no replica: parity shows nothing"
    if bound is not None:  # the bound made them: by time alone none pays, and rank 0 says what they cost
        assert not any(q >= 0 for step in replay(replace(setup, max_rows_over_mean=None))[1] for row in step
                       for q in row)
        assert len(r["said"]) == 1 and "feplb.max_rows_over_mean 1.02 keeps" in r["said"][0], r["said"]
    assert all(x["said"] == [] for x in results[1 if bound is not None else 0:]), [x["said"] for x in results]
    assert r["replica_at"] == replica_at
    runtime_rows = [[int(v) for v in row] for row in _node_rows(results, 1)]
    assert runtime_rows == rows


def test_a_held_back_gradient_reaches_its_parameter_with_the_sums_when_the_backward_ends():
    """`ReplicaSlots.at_backward_end` on the home of expert 0 (one process, no group): the layer's
    backward gives autograd nothing for the held-back parameter; when the whole backward ends its
    gradient arrives with the replica's sum added, once, after every other gradient (its hook
    fires last), and the step's held-back count rises. Nothing is held back before a backward
    through the layer ran inside the engine's, nor after one did not; one that does not (a direct
    ``loss.backward()``) gets the gradient in the layer's backward, before the end."""
    import contextlib

    import torch

    from deepspeed_feplb.integration.replicas import ReplicaSlots, _LastSums

    class Home:  # this process is rank 0, the home of expert 0 (local 0); rank 1 holds its replica
        ep_group, ep_size, ranks_per_node = None, 2, 1
        replica_at = np.array([[-1], [0]])
        home_of = staticmethod(lambda expert: (0, expert))
        timing_replicas = staticmethod(contextlib.nullcontext)

    slots = ReplicaSlots(Home(), [torch.zeros(2, 2)], 1)
    assert slots.held_back_locals() == []  # an AutoEP layer's (the default): nothing held back
    slots.holds_back = True
    assert slots.held_back_locals() == []  # until a backward through the layer was the engine's
    slots.backward([[torch.zeros(2, 2)]], later=1)  # (rank 1 holds the replica: nothing to add or send here)
    assert slots.held_back_locals() == [0]
    weight, other = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))
    order = []
    weight.register_hook(lambda g: order.append("held back") or g)
    other.register_hook(lambda g: order.append("other") or g)

    def arriving():  # as `_send_last` leaves it: the replica's fp32 sum for local expert 0
        slots._late = _LastSums(None, [(1, 0, 0, 0, [torch.full((2, 2), 0.25)])], {}, None, {(1, 0, 0)})

    class Hold(torch.autograd.Function):  # what `_ReplicaLink` does for a held-back expert
        @staticmethod
        def forward(ctx, stand_in):
            return stand_in.view_as(stand_in)

        @staticmethod
        def backward(ctx, grad):
            arriving()
            slots.at_backward_end([[weight]], [[grad]], [0])
            return None

    loss = (Hold.apply(weight.detach().requires_grad_()) * 3.0).sum() + (other * 2.0).sum()
    loss.backward()
    assert torch.equal(weight.grad, torch.full((2, 2), 3.25)) and torch.equal(other.grad, torch.full((2,), 2.0))
    assert order == ["other", "held back"] and slots.held_back == 1 and slots._late is None
    # the layer used twice in one forward: both uses' gradients and sums in one delivery, one hook call
    weight.grad, other.grad, order[:] = None, None, []
    loss = sum((Hold.apply(weight.detach().requires_grad_()) * c).sum() for c in (3.0, 5.0)) + (other * 2.0).sum()
    loss.backward()
    assert torch.equal(weight.grad, torch.full((2, 2), 8.5)) and order == ["other", "held back"]
    assert slots.held_back == 2
    # a direct `loss.backward()` (DeepSpeed's epilogue queued first): delivered in the layer's backward,
    # before the backward's end; and no later forward holds back
    slots.in_engine_backward = lambda: False
    weight.grad, order[:] = None, []
    ended = []

    class Ends(torch.autograd.Function):  # marks the backward's end, queued before FEPLB's delivery could be
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            torch.autograd.Variable._execution_engine.queue_callback(lambda: ended.append(list(order)))
            return grad

    loss = Ends.apply((Hold.apply(weight.detach().requires_grad_()) * 3.0).sum())
    loss.backward()
    assert torch.equal(weight.grad, torch.full((2, 2), 3.25)) and ended == [["held back"]]
    slots.backward([[torch.zeros(2, 2)]], later=1)
    assert slots.held_back_locals() == []


def test_a_replica_link_runs_one_backward_per_forward():
    """`ExpertGradOrder` with a replica link (which sends the replicas' sums home in its backward):
    a second backward through the same graph (``retain_graph``) is refused with what to do, not run
    with sums already spent."""
    import torch

    from deepspeed_feplb.integration.deepspeed_moe import ExpertGradOrder

    class Link:  # `_ReplicaLink`'s interface: the gradients through, counting its backwards
        runs = 0

        def backward(self, grads):
            Link.runs += 1
            return list(grads)

    weight = torch.nn.Parameter(torch.ones(3))
    x = torch.ones(3, requires_grad=True)
    rows, alias = ExpertGradOrder.apply(Link(), x, weight)
    loss = (rows * alias).sum()
    torch.autograd.grad(loss, x, retain_graph=True)
    with pytest.raises(RuntimeError, match="back-propagated already"):
        loss.backward()
    assert Link.runs == 1


def test_a_sum_that_missed_its_backward_is_dropped_not_carried_into_the_next_step():
    """The step's last micro-batch ran no backward through the layer (a skipped non-finite loss):
    its replicas' gradient sums never went home; at the optimizer step they are dropped with a
    warning instead of joining the next step's gradients."""
    import torch

    from deepspeed_feplb.integration.replicas import ReplicaSlots

    class OneRank:  # the placement as ReplicaSlots sees it: one rank, no group
        ep_group = None
        replica_at = np.array([[3]])

    slots = ReplicaSlots(OneRank(), [torch.zeros(2, 2)], 1)
    slots.backward([[torch.ones(2, 2, dtype=torch.bfloat16)]], later=2)
    assert slots._sums[0][0].dtype == torch.float32  # summed in fp32, rounded once at the home
    with pytest.warns(RuntimeWarning, match="did not reach their experts"):
        slots.end_step()
    assert slots._sums == [None]


F32, BF16, F16 = ["torch.float32"], ["torch.bfloat16"], ["torch.float16"]
# id: (dtype, ``later`` of each micro-batch, holders, replica slots per rank, end_step, the exchanges'
# dtypes on the wire, early sends per rank)
TWO_HALVES = {"bf16-4": ("bfloat16", [3, 2, 1, 0], 1, 1, False, [F32, BF16], [0, 1, 0]),
              "fp16-2-two-holders": ("float16", [1, 0], 2, 2, False, [F32, F16], [0, 1, 1]),
              "home-over-its-slots": ("float16", [1, 0], 2, 1, False, [F32, F16 + F32], [0, 1, 0]),
              "fp32-3": ("float32", [2, 1, 0], 1, 1, False, [F32], [0, 0, 0]),
              "bf16-1": ("bfloat16", [0], 1, 1, False, [F32], [0, 0, 0]),
              "bf16-unannounced": ("bfloat16", [2, 1, 1, 0], 1, 1, False, [F32, F32, BF16], [0, 2, 0]),
              "last-never-ran": ("bfloat16", [2, 1], 1, 1, True, [F32], [0, 1, 0])}


def _two_halves_cases() -> dict:
    """3 ranks as nodes of 1, per case of `TWO_HALVES`: rank 0 the home of expert 1, ranks 1 ..
    ``holders`` hold a replica of it in their first slot (the others none: they pass the relays
    on). One step's replica gradients (micro-batch i with ``later[i]`` micro-batches after it) go
    home through `ReplicaSlots.backward` (then `end_step` if asked); a wrapped `relay` records
    each exchange's dtypes on the wire. Every rank rebuilds every holder's gradients, so the home
    knows what the holders' sequential fp32 sums are."""
    import contextlib
    import warnings

    import torch
    import torch.distributed as dist

    from deepspeed_feplb.integration import replicas as module

    me, out = dist.get_rank(), {}
    wire = []
    relay = module.relay

    def recorded(transfers, *args, **kwargs):
        wire.append(sorted({str(t.dtype) for _, _, tensors in transfers for t in tensors}))
        return relay(transfers, *args, **kwargs)

    module.relay = recorded
    try:
        for name, (dtype_name, laters, holders, per_rank, end_step, _, _) in TWO_HALVES.items():
            class OneRankNodes:
                ep_group = dist.group.WORLD
                ranks_per_node = 1
                replica_at = np.array([[1 if 1 <= q <= holders and j == 0 else -1 for j in range(per_rank)]
                                       for q in range(dist.get_world_size())])

                @staticmethod
                def home_of(expert: int) -> tuple[int, int]:
                    return expert // 2, expert % 2

                @staticmethod
                def timing_replicas():
                    return contextlib.nullcontext()

            dtype = getattr(torch, dtype_name)

            def gradient(holder: int, i: int, dtype=dtype) -> torch.Tensor:  # scaled 1, 1e3, 1e6: the order shows
                g = torch.Generator().manual_seed(100 * holder + i)
                return torch.randn(3, 5, generator=g).mul_(1000 ** (i % 3)).to(dtype)

            wire.clear()
            slots = module.ReplicaSlots(OneRankNodes(), [torch.zeros(3, 5, dtype=dtype)], per_rank)
            arrived, sends = [], []
            for i, later in enumerate(laters):
                grads = [[gradient(me, i)]] + [[torch.zeros(3, 5, dtype=dtype)]] * (per_rank - 1)
                slots.backward(grads, later=later)
                arrived = slots.arrived()  # what a home's layer takes in that backward
                sends.append(len(wire))
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                if end_step:
                    slots.end_step()
            expected = None  # the holders' sequential fp32 sums, added in holder order
            for holder in range(1, holders + 1):
                one = gradient(holder, 0).float()
                for i in range(1, len(laters)):
                    one = one.add_(gradient(holder, i))
                expected = one if expected is None else expected.add_(one)
            out[name] = {"wire": list(wire), "sends": sends, "early_sends": slots.early_sends,
                         "arrived": [local for local, _ in arrived], "said": [str(w.message) for w in said],
                         "exact": not arrived or torch.equal(arrived[0][1][0], expected),
                         "settled": slots._early is None}
    finally:
        module.relay = relay
    return out


@pytest.fixture(scope="module")
def two_halves() -> list:
    return run_distributed(_two_halves_cases, 3, timeout=180)  # every case in one launch


@pytest.mark.parametrize("case", [name for name in TWO_HALVES if name != "last-never-ran"])
def test_a_replicas_step_gradient_goes_home_in_two_halves_and_sums_bit_for_bit(two_halves, case):
    """bf16/fp16 gradients: the sum of every micro-batch but the last goes home in the backward of
    the one before last (fp32), and the last micro-batch's gradient alone in its own dtype; the
    home's result equals the holders' sequential fp32 sums, added in holder order, bit for bit.
    fp32 gradients (whose last half would be as large as the whole) and a step of one micro-batch
    send the sum once; a home takes early sums from as many holders as it has replica slots (what
    `memory.replica_bytes` counts), the others' whole at the end. A micro-batch after the early
    send (``later`` 1 twice: a schedule the engine did not announce) takes it back and sends again."""
    dtype_name, laters, _, _, _, wire, early_sends = TWO_HALVES[case]
    results = [r[case] for r in two_halves]
    home = results[0]
    assert all(r["wire"] == home["wire"] and r["sends"] == home["sends"] for r in results), "ranks disagree"
    assert home["wire"] == wire and [r["early_sends"] for r in results] == early_sends
    assert home["sends"][-1] == len(wire) and home["sends"][0] == (1 if laters[0] == 1 and dtype_name != "float32"
                                                                     else len(wire) if len(laters) == 1 else 0)
    assert home["arrived"] == [1] and all(r["arrived"] == [] for r in results[1:])
    assert home["exact"], "the home's sum differs from the holders' sequential sums"
    assert all(r["settled"] for r in results), "an early half stayed after the step's end"


def test_an_early_half_whose_last_backward_never_ran_is_dropped_with_a_warning(two_halves):
    results = [r["last-never-ran"] for r in two_halves]
    assert all(r["settled"] for r in results) and [r["early_sends"] for r in results] == [0, 1, 0]
    assert all(r["arrived"] == [] for r in results)
    assert all(any("did not reach their experts" in s for s in r["said"]) for r in results), results


def _relay_case(chunk_bytes: int) -> dict:
    """4 ranks as 2 nodes of 2: transfers between the nodes (relayed over both rails, in pieces of
    ``chunk_bytes``), one inside a node, one too small to fill every shard; the ranks a transfer
    does not touch pass storage-less stand-ins."""
    import torch
    import torch.distributed as dist

    from deepspeed_feplb.integration.replicas import relay

    me = dist.get_rank()

    def data(tag: int, shape, dtype) -> torch.Tensor:
        return (torch.arange(int(np.prod(shape)), dtype=torch.float64) * 10 + tag).to(dtype).reshape(shape)

    wanted = [(0, 2, [data(1, (5, 3), torch.float32), data(2, (4,), torch.float64)]),
              (3, 0, [data(3, (7, 3), torch.float32)]),  # received into a transposed (non-contiguous) buffer
              (1, 2, [data(4, (1,), torch.float32)]),
              (1, 0, [data(5, (2, 2), torch.float32)])]
    transfers, received = [], []
    for src, dst, tensors in wanted:
        if me == src:
            transfers.append((src, dst, tensors))
        elif me == dst:
            buffers = [torch.full(t.shape[::-1], -1, dtype=t.dtype).t() if src == 3 else torch.full_like(t, -1)
                       for t in tensors]
            transfers.append((src, dst, buffers))
            received.append((buffers, tensors))
        else:
            transfers.append((src, dst, [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in tensors]))
    relay(transfers, me, 2, lambda r: r, torch.device("cpu"), chunk_bytes=chunk_bytes)
    return {"exact": all(torch.equal(b, t) for buffers, tensors in received for b, t in zip(buffers, tensors)),
            "received": sum(len(b) for b, _ in received)}


@pytest.mark.parametrize("chunk_bytes", [8, 1 << 20], ids=["pipelined", "one-piece"])
def test_a_relay_delivers_every_tensor_over_both_rails(chunk_bytes):
    results = run_distributed(_relay_case, 4, chunk_bytes, timeout=120)
    assert [r["received"] for r in results] == [2, 0, 3, 0]
    assert all(r["exact"] for r in results), results


@pytest.mark.parametrize("zero_stage", [0, 2], ids=["zero0", "zero2"])
def test_replicas_follow_every_write_of_their_experts_weights(zero_stage):
    """Evaluation with other weights swapped in and out through ``p.data`` between steps (an EMA's;
    a 2x2 block scaled x2 and x1/2, which a row/column-sum fingerprint misses; all x0.98), and
    writes between two micro-batches of a step (in place under ``no_grad``; through ``p.data``,
    declared; ``load_state_dict``): evaluation and training equal DeepSpeed's MoE written alike."""
    results = run_distributed(moe_cases.replica_weight_writes_case, 4, zero_stage, timeout=900)
    r = results[0]
    assert r["held_replicas"] and r["refreshes"] >= 8, "no replica followed the writes: the test shows nothing"
    for evaluation in r["evaluations"]:
        assert evaluation["feplb"] == pytest.approx(evaluation["reference"], rel=1e-5), r["evaluations"]
    reference, ours = np.array(r["losses"]["reference"]), np.array(r["losses"]["feplb"])
    assert np.allclose(ours, reference, rtol=1e-5, atol=1e-6), f"losses differ: {ours - reference}"
    worst = max(max(x["param_errors"].values()) for x in results)
    assert worst < 1e-5, f"parameters differ from DeepSpeed's MoE by {worst:.2e}"
