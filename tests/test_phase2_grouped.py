"""Phase 2's receive buffers (`migrate.phase2`): a helper receives the weights of a message's chunks
stacked per parameter in one buffer (and their rows into another) and computes from them
without another copy; weights that do not lie back to back are not grouped (a stacked copy would
live from forward to backward). The home receives its helpers' outputs and input-gradients straight
into its output and ``grad_x``."""
import os

import torch

from deepspeed_feplb.migrate import messages
from deepspeed_feplb.migrate.phase2 import _flags_tensor, _stacked_weights, stacked_view


def _descriptions(carries: list[bool]) -> list:
    """A forward-rows message's (shape, dtype) list: flags, then per chunk its weights (two, when
    it carries them), no buffers and its rows."""
    like = torch.zeros(0)
    out = [(list(_flags_tensor(carries, like).shape), torch.float32)]
    for k, carry in enumerate(carries):
        if carry:
            out += [([6, 4], torch.bfloat16), ([4, 6], torch.bfloat16)]
        out.append(([k + 1, 4], torch.float32))
    return out


def test_carried_weights_land_stacked_in_chunk_order_and_are_taken_in_place():
    carries = [True, False, True, True]
    descriptions = _descriptions(carries)
    outs = _stacked_weights(len(carries), 2, 0, torch.device("cpu"))(descriptions)
    assert [(list(t.shape), t.dtype) for t in outs] == descriptions
    parts = messages.rows_to_helper(carries, 2, 0).unpack(outs[1:], "forward rows")
    carried = [part["weights"] for part in parts if part["weights"]]
    for j in range(2):
        stacked = stacked_view([weights[j] for weights in carried])
        assert stacked.shape == (3, *carried[0][j].shape)
        assert stacked.data_ptr() == carried[0][j].data_ptr()  # a view: no copy
        stacked[2].fill_(5)
        assert (carried[2][j] == 5).all()
    rows = stacked_view([part["rows"][0] for part in parts], join=True)  # every chunk's rows, one buffer
    assert rows.shape == (1 + 2 + 3 + 4, 4) and rows.data_ptr() == parts[0]["rows"][0].data_ptr()


def test_a_message_lands_in_one_allocation_per_dtype_and_its_rows_in_their_own():
    """`messages.message_buffers`: one allocator call per dtype for a message (a tensor each took
    one per tensor: the helper's forward, 2 ranks, 32 local experts, went from 6 to 2 of them),
    the weights of each parameter back to back, every group aligned, and the rows apart, so that
    a weight copy a helper keeps for the step does not keep the chunk's rows alive."""
    carries = [True, True, False]
    descriptions = _descriptions(carries)
    outs = _stacked_weights(len(carries), 2, 0, torch.device("cpu"))(descriptions)
    parts = messages.rows_to_helper(carries, 2, 0).unpack(outs[1:], "forward rows")
    weights = [t for part in parts for t in part["weights"]]
    rows = [part["rows"][0] for part in parts]
    assert len({t.untyped_storage().data_ptr() for t in weights}) == 1  # both parameters, one allocation
    assert len({t.untyped_storage().data_ptr() for t in rows}) == 1
    assert rows[0].untyped_storage().data_ptr() != weights[0].untyped_storage().data_ptr()  # the rows apart
    assert all(stacked_view([w[j] for w in (parts[0]["weights"], parts[1]["weights"])]) is not None for j in range(2))
    assert all((t.data_ptr() - t.untyped_storage().data_ptr()) % messages.ALIGN_BYTES == 0
               for t in (parts[0]["weights"][0], parts[0]["weights"][1], rows[0]))
    given = torch.zeros(2, 3)
    plain = messages.message_buffers([([2, 3], torch.float32), ([5], torch.int64), ([1, 1], torch.float32)],
                                     torch.device("cpu"), given=[given])
    assert plain[0] is given and [list(t.shape) for t in plain] == [[2, 3], [5], [1, 1]]
    assert plain[1].dtype == torch.int64 and plain[2].dtype == torch.float32


def test_weights_apart_are_not_taken_as_a_stack():
    w = torch.arange(24.0).view(4, 6)
    assert stacked_view([w[0], w[2]]) is None  # not back to back
    assert stacked_view([w[1], w[0]]) is None  # back to back, but in the other order
    in_place = stacked_view([w[1], w[2], w[3]])
    assert torch.equal(in_place, w[1:]) and in_place.data_ptr() == w[1].data_ptr()
    assert torch.equal(stacked_view([w[:1], w[1:3]], join=True), w[:3])
    assert stacked_view([w[:1], w[2:3]], join=True) is None


def _shm_pair(label: str):
    """This rank's `ShmTransport` of a two-rank domain (rank 0 creates it first)."""
    import torch.distributed as dist

    from deepspeed_feplb.migrate.shm import ShmTransport
    rank, names = dist.get_rank(), [f"feplb-test-{label}-{os.getpid()}"]
    dist.broadcast_object_list(names, 0)
    if rank == 0:
        transport = ShmTransport(names[0], 0, 2, 20, True)
    dist.barrier()
    if rank:
        transport = ShmTransport(names[0], 1, 2, 20, False)
    return transport


def _mixed_message_case() -> dict:
    """Home 0 sends two chunks with weights to helper 1, which may keep one copy only
    (``max_resident_experts: 1``): the kept copy must not pin the message's stacked buffer."""
    import numpy as np
    import torch.distributed as dist

    from deepspeed_feplb.config import FEPLBConfig
    from deepspeed_feplb.experts import ExpertSpec
    from deepspeed_feplb.migrate.phase2 import Phase2MicroBatch
    from deepspeed_feplb.migrate.resident import LayerResidency

    rank = dist.get_rank()
    transport = _shm_pair("grouped")
    torch.manual_seed(0)
    template = torch.nn.Linear(8, 8, bias=False)
    weights = [torch.randn(8, 8) for _ in range(2)]

    def grouped(stacked, x, sizes):  # x @ w.T per expert
        return torch.cat([x_i @ w_i.t() for x_i, w_i in zip(x.split(sizes), stacked[0])])

    spec = ExpertSpec.of(template, grouped)
    residency = LayerResidency.create(2, 2, FEPLBConfig(weight_residency="step", max_resident_experts=1))
    moves = np.array([[0, 0, 1, 3], [0, 1, 1, 2]], np.int64)  # home 0's experts 0 and 1: 3 and 2 rows to helper 1
    dynamic, counts = ([0, 1], [5, 4]) if rank == 0 else ([], [])
    x = torch.randn(sum(counts), 8, generator=torch.Generator().manual_seed(1))
    # a training forward (needs_grad): copies are kept only past forwards that take gradients
    step = Phase2MicroBatch(transport, 1, rank, moves, dynamic, counts, [template, template], spec, True, dynamic,
                            residency=residency, step_ends=False)
    y = step.forward(x, [[weights[e]] for e in dynamic])
    out = {"kept": step.copy_kept.tolist()}
    if rank == 0:
        out["exact"] = torch.equal(y, torch.cat([x[:5] @ weights[0].t(), x[5:] @ weights[1].t()]))
    else:
        held = residency.held[(0, 0)].params[0]
        out.update(held_own=held._base is None, held_equal=torch.equal(held, weights[0]),
                   others=sorted(residency.held))
    dist.barrier()
    transport.close()
    return out


def test_a_kept_copy_from_a_message_with_dropped_copies_owns_its_weights():
    from deepspeed_feplb.testing import run_distributed

    home, helper = run_distributed(_mixed_message_case, 2, timeout=120)
    assert home["kept"] == [True, False] and home["exact"], home
    assert helper["held_own"] and helper["held_equal"] and helper["others"] == [(0, 0)], helper


def _landing_case() -> dict:
    """Home 0 moves 3 of expert 0's rows and 2 of expert 1's to helper 1; forward and backward. The
    helper's outputs and its rows' gradients are received straight into the home's output and
    ``grad_x`` (views of them: no copy after the receive), and both equal the unbalanced result."""
    import numpy as np
    import torch.distributed as dist

    from deepspeed_feplb.experts import ExpertSpec
    from deepspeed_feplb.migrate.phase2 import BWD_RESULTS, FWD_RESULTS, Phase2MicroBatch

    rank = dist.get_rank()
    transport = _shm_pair("landing")
    received = {}
    plain_recv = transport.recv

    def recv(src, message_tag, into=None):
        got = plain_recv(src, message_tag, into)
        received[message_tag & 0xF] = got
        return got
    transport.recv = recv
    torch.manual_seed(0)
    template = torch.nn.Linear(8, 8, bias=False)
    weights = [torch.randn(8, 8, requires_grad=True) for _ in range(2)]
    spec = ExpertSpec.of(template, None)
    moves = np.array([[0, 0, 1, 3], [0, 1, 1, 2]], np.int64)
    dynamic, counts = ([0, 1], [5, 4]) if rank == 0 else ([], [])
    x = torch.randn(sum(counts), 8, generator=torch.Generator().manual_seed(1))
    step = Phase2MicroBatch(transport, 1, rank, moves, dynamic, counts, [template, template], spec, True, dynamic)
    y = step.forward(x, [[weights[e]] for e in dynamic])
    grad_y = torch.randn(y.shape, generator=torch.Generator().manual_seed(2))
    grad_x, grads = step.backward_home(grad_y)
    grad_x, grads = step.backward_rest(grad_x, grads)
    out = {}
    if rank == 0:
        def within(t, whole):
            return whole.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
        xr = x.clone().requires_grad_(True)
        ref = torch.cat([xr[:5] @ weights[0].t(), xr[5:] @ weights[1].t()])
        ref_grads = torch.autograd.grad(ref, [xr, *weights], grad_y)
        out = {"outputs_in_place": all(within(t, y) for t in received[FWD_RESULTS]),
               "grads_in_place": within(received[BWD_RESULTS][0], grad_x),
               "y": torch.allclose(y, ref, atol=1e-6), "grad_x": torch.allclose(grad_x, ref_grads[0], atol=1e-6),
               "grad_w": all(torch.allclose(g[0], r, atol=1e-6) for g, r in zip(grads, ref_grads[1:]))}
    dist.barrier()
    transport.close()
    return out


def test_the_homes_results_land_in_its_output_and_input_gradient():
    from deepspeed_feplb.testing import run_distributed

    home = run_distributed(_landing_case, 2, timeout=120)[0]
    assert home["outputs_in_place"] and home["grads_in_place"], home
    assert home["y"] and home["grad_x"] and home["grad_w"], home


def test_a_place_that_does_not_fit_the_message_gets_a_tensor_of_its_own():
    """`MessageLayout.receive_into`: a part lands in its place only where shape and dtype match (the
    caller then copies the rest itself); other parts get new tensors."""
    layout = messages.grads_to_home([True, False], 1)  # chunk 0: input_grads, a weight-grad; chunk 1: input_grads
    grad_x = torch.zeros(6, 4, dtype=torch.bfloat16)
    places = [[grad_x[:2]], [grad_x[2:6]]]
    descriptions = [([2, 4], torch.float32), ([3, 3], torch.float32), ([4, 4], torch.bfloat16)]
    outs = layout.receive_into("input_grads", places, torch.device("cpu"))(descriptions)
    assert outs[0] is not places[0][0] and outs[0].dtype == torch.float32  # another dtype than its place
    assert outs[1].shape == (3, 3) and outs[2] is places[1][0]


def test_a_homes_chunks_are_cut_into_near_equal_parts_in_chunk_order():
    assert messages.served_parts([10], 1) == [[(0, 0, 10)]]
    assert messages.served_parts([], 1) == []  # a helper that only returns kept copies' gradients
    # a chunk of no rows is a piece of the part where it would start
    assert messages.served_parts([10, 0, 6], 4) == [[(0, 0, 4)], [(0, 4, 4)], [(0, 8, 2), (1, 0, 0), (2, 0, 2)],
                                                    [(2, 2, 4)]]
    assert messages.served_parts([3, 5, 8], 2) == [[(0, 0, 3), (1, 0, 5)], [(2, 0, 8)]]


def _parts_case(grouped: bool) -> dict:
    """Home 0 moves 6 of expert 0's rows and 3 of expert 1's to helper 1, which serves them in 3
    parts of 3 rows (``serve_part_rows`` 3): forward and backward. The helper sends each part's
    results before it computes the next; the home's output, input-gradient and weight-gradients
    equal the unbalanced computation's, and with ``grouped`` a part is one grouped call."""
    import numpy as np
    import torch.distributed as dist

    from deepspeed_feplb.experts import ExpertSpec
    from deepspeed_feplb.migrate.phase2 import BWD_RESULTS, FWD_RESULTS, Phase2MicroBatch

    rank = dist.get_rank()
    transport = _shm_pair(f"parts-{int(grouped)}")
    events = []
    _log_sends(transport, events, (FWD_RESULTS, BWD_RESULTS), lambda message_tag, _: (message_tag >> 4) & 0xF)
    torch.manual_seed(0)
    template = torch.nn.Linear(8, 8, bias=False)
    weights = [torch.randn(8, 8, requires_grad=True) for _ in range(2)]

    def grouped_call(stacked, x, sizes):  # x @ w.T per expert
        events.append(("compute", len(sizes)))
        return torch.cat([x_i @ w_i.t() for x_i, w_i in zip(x.split(sizes), stacked[0])])
    spec = ExpertSpec.of(template, grouped_call if grouped else None)
    moves = np.array([[0, 0, 1, 6], [0, 1, 1, 3]], np.int64)
    dynamic, counts = ([0, 1], [8, 4]) if rank == 0 else ([], [])
    x = torch.randn(sum(counts), 8, generator=torch.Generator().manual_seed(1))
    step = Phase2MicroBatch(transport, 1, rank, moves, dynamic, counts, [template, template], spec, True, dynamic,
                            serve_parts=4, serve_part_rows=3)
    step._compute = _logged(step._compute, events, "pieces")
    step._vjp = _logged(step._vjp, events, "vjp")
    y = step.forward(x, [[weights[e]] for e in dynamic])
    grad_y = torch.randn(y.shape, generator=torch.Generator().manual_seed(2))
    grad_x, grads = step.backward_home(grad_y)
    grad_x, grads = step.backward_rest(grad_x, grads)
    out = {"events": events}
    if rank == 0:
        xr = x.clone().requires_grad_(True)
        ref = torch.cat([xr[:8] @ weights[0].t(), xr[8:] @ weights[1].t()])
        ref_grads = torch.autograd.grad(ref, [xr, *weights], grad_y)
        out.update(y=torch.allclose(y, ref, atol=1e-6), grad_x=torch.allclose(grad_x, ref_grads[0], atol=1e-6),
                   grad_w=all(torch.allclose(g[0], r, atol=1e-6) for g, r in zip(grads, ref_grads[1:])))
    dist.barrier()
    transport.close()
    return out


def _log_sends(transport, events: list, phases: tuple, detail) -> None:
    """Log ``("send", phase, detail(tag, tensors))`` to ``events`` for each message of ``phases``."""
    plain_send = transport.send

    def send(dst, message_tag, tensors, after=None):
        if message_tag & 0xF in phases:
            events.append(("send", message_tag & 0xF, detail(message_tag, tensors)))
        return plain_send(dst, message_tag, tensors, after)
    transport.send = send


def _logged(method, events, name):
    def logged(pieces, *args):
        events.append((name, len(pieces)))
        return method(pieces, *args)
    return logged


def test_a_helper_sends_each_parts_results_before_it_computes_the_next():
    from deepspeed_feplb.migrate.phase2 import BWD_RESULTS, FWD_RESULTS
    from deepspeed_feplb.testing import run_distributed
    for grouped in (False, True):
        home, helper = run_distributed(_parts_case, 2, grouped, timeout=120)
        assert home["y"] and home["grad_x"] and home["grad_w"], (grouped, home)
        served = [e for e in helper["events"] if e[0] == "send" or e[0] != "compute" and e[1]]  # its own: none
        # 9 rows in 3 parts of one piece each: expert 0's first 3 rows, its last 3, expert 1's 3
        assert served == [("pieces", 1), ("send", FWD_RESULTS, 0), ("pieces", 1), ("send", FWD_RESULTS, 1),
                          ("pieces", 1), ("send", FWD_RESULTS, 2),
                          ("vjp", 1), ("send", BWD_RESULTS, 0), ("vjp", 1), ("send", BWD_RESULTS, 1),
                          ("vjp", 1), ("send", BWD_RESULTS, 2)], served
        calls = [e for e in helper["events"] if e[0] == "compute"]
        assert calls == ([("compute", 1)] * 3 if grouped else []), calls


def _step_end_case(last_moves: bool) -> dict:
    """Two micro-batches of one step with kept copies: in the first, home 0 moves 3 rows of expert
    0 and 2 of expert 1 to helper 1, which keeps both copies; in the last, only expert 0 moves
    (3 rows), or (``last_moves`` False) nothing. The helper sends the step gradients of the copies
    no chunk uses as its backward starts, before it serves anything, and expert 0's with that
    chunk's results; the home's gradients over the step equal the unbalanced computation's."""
    import numpy as np
    import torch.distributed as dist

    from deepspeed_feplb.config import FEPLBConfig
    from deepspeed_feplb.experts import ExpertSpec
    from deepspeed_feplb.migrate.phase2 import BWD_RESULTS, FLUSH, Phase2MicroBatch, grad_experts
    from deepspeed_feplb.migrate.resident import LayerResidency

    rank = dist.get_rank()
    transport = _shm_pair(f"step-end-{int(last_moves)}")
    events = []
    _log_sends(transport, events, (BWD_RESULTS, FLUSH), lambda _, tensors: len(tensors))
    torch.manual_seed(0)
    template = torch.nn.Linear(8, 8, bias=False)
    weights = [torch.randn(8, 8, requires_grad=True) for _ in range(2)]
    spec = ExpertSpec.of(template, None)
    residency = LayerResidency.create(2, 2, FEPLBConfig(weight_residency="step", max_resident_experts=2))
    plans = [(np.array([[0, 0, 1, 3], [0, 1, 1, 2]], np.int64), [0, 1], [5, 4], False),
             (np.array([[0, 0, 1, 3]] if last_moves else [], np.int64).reshape(-1, 4), [0], [6], True)]
    totals = [torch.zeros(8, 8) for _ in range(2)]
    reference = [torch.zeros(8, 8) for _ in range(2)]
    for seq, (moves, dynamic, counts, ends) in enumerate(plans, start=1):
        dynamic, counts = (dynamic, counts) if rank == 0 else ([], [])
        with_grads = grad_experts(residency, rank, dynamic, ends, True)
        x = torch.randn(sum(counts), 8, generator=torch.Generator().manual_seed(seq))
        step = Phase2MicroBatch(transport, seq, rank, moves, dynamic, counts, [template, template], spec, True,
                                with_grads, residency=residency, step_ends=ends)
        step._vjp = _logged(step._vjp, events, "vjp")
        y = step.forward(x, [[weights[e]] for e in dynamic])
        grad_y = torch.randn(y.shape, generator=torch.Generator().manual_seed(10 + seq))
        grad_x, grads = step.backward_home(grad_y)
        grad_x, grads = step.backward_rest(grad_x, grads)
        for e, g in zip(with_grads, grads):
            if g is not None:
                totals[e] += g[0]
        if rank == 0:
            xr = x.clone().requires_grad_(True)
            ref = torch.cat([x_e @ weights[e].t() for e, x_e in zip(dynamic, xr.split(counts))])
            for e, g in zip(dynamic, torch.autograd.grad(ref, [weights[e] for e in dynamic], grad_y)):
                reference[e] += g
        events.append(("end", seq))
    dist.barrier()
    transport.close()
    return {"events": events, "grads": [torch.allclose(t, r, atol=1e-5) for t, r in zip(totals, reference)]}


def test_at_the_steps_end_an_unused_kept_copy_goes_home_as_the_backward_starts():
    from deepspeed_feplb.migrate.phase2 import BWD_RESULTS, FLUSH
    from deepspeed_feplb.testing import run_distributed

    for last_moves, expected in ((True, [("send", FLUSH, 1), ("vjp", 1), ("send", BWD_RESULTS, 2)]),
                                 (False, [("send", FLUSH, 2)])):
        home, helper = run_distributed(_step_end_case, 2, last_moves, timeout=120)
        assert home["grads"] == [True, True], home
        last = helper["events"][helper["events"].index(("end", 1)) + 1:]
        served = [e for e in last if e[0] == "send" or e[0] == "vjp" and e[1]]  # its own pieces: none
        # the unused copies' gradients (a tensor each) before the served chunk's backward; expert 0's
        # with its results (input-gradients and a weight-gradient)
        assert served == expected, (last_moves, served)


def _both_roles_case(early: bool) -> dict:
    """Each rank is the home of one dynamic expert and the helper of the other's, over two
    micro-batches of one step with kept copies, served in parts (``serve_part_rows`` 2). With
    ``early`` (``feplb.serve_on_arrival``) a rank serves its home's chunks before it computes its
    own rows; the outputs, input-gradients and the step's weight-gradients equal the unbalanced
    computation's either way."""
    import numpy as np
    import torch.distributed as dist

    from deepspeed_feplb.config import FEPLBConfig
    from deepspeed_feplb.experts import ExpertSpec
    from deepspeed_feplb.migrate.phase2 import Phase2MicroBatch, grad_experts
    from deepspeed_feplb.migrate.resident import LayerResidency

    rank = dist.get_rank()
    transport = _shm_pair(f"both-roles-{int(early)}")
    events = []
    torch.manual_seed(0)
    template = torch.nn.Linear(8, 8, bias=False)
    weight = torch.randn(8, 8, generator=torch.Generator().manual_seed(20 + rank)).requires_grad_(True)
    spec = ExpertSpec.of(template, None)
    residency = LayerResidency.create(2, 1, FEPLBConfig(weight_residency="step", max_resident_experts=1))
    moves = np.array([[0, 0, 1, 5], [1, 0, 0, 4]], np.int64)  # each home's expert 0: rows to the other rank
    total, reference, exact = torch.zeros(8, 8), torch.zeros(8, 8), []
    for seq, ends in ((1, False), (2, True)):
        with_grads = grad_experts(residency, rank, [0], ends, True)
        x = torch.randn(9, 8, generator=torch.Generator().manual_seed(10 * seq + rank))
        step = Phase2MicroBatch(transport, seq, rank, moves, [0], [9], [template], spec, True, with_grads,
                                residency=residency, step_ends=ends, serve_parts=4, serve_part_rows=2,
                                serve_early=early)
        step._compute = _logged(step._compute, events, "pieces")
        step._serve_forward = _marked(step._serve_forward, events, "serve")
        events.append(("forward", seq))
        y = step.forward(x, [[weight]])
        grad_y = torch.randn(y.shape, generator=torch.Generator().manual_seed(30 * seq + rank))
        grad_x, grads = step.backward_home(grad_y)
        grad_x, grads = step.backward_rest(grad_x, grads)
        total += grads[0][0]
        xr = x.clone().requires_grad_(True)
        ref = xr @ weight.t()
        ref_x, ref_w = torch.autograd.grad(ref, [xr, weight], grad_y)
        reference += ref_w
        exact += [torch.allclose(y, ref, atol=1e-6), torch.allclose(grad_x, ref_x, atol=1e-6)]
    dist.barrier()
    transport.close()
    return {"events": events, "exact": exact + [torch.allclose(total, reference, atol=1e-5)]}


def _marked(method, events, name):
    def marked(*args):
        events.append((name, "begins"))
        out = method(*args)
        events.append((name, "ends"))
        return out
    return marked


def test_served_on_arrival_a_rank_serves_before_its_own_rows_and_stays_exact():
    from deepspeed_feplb.testing import run_distributed
    for early in (False, True):
        for rank, result in enumerate(run_distributed(_both_roles_case, 2, early, timeout=120)):
            assert all(result["exact"]), (early, rank, result["exact"])
            events = result["events"]
            for seq in (1, 2):
                forward = events[events.index(("forward", seq)) + 1:][:6]
                # a served part is one piece each (2 of 2 rows, or 3 of 5 rows in 2s), the home rows one
                served = forward.index(("serve", "begins")), forward.index(("serve", "ends"))
                own = [i for i, e in enumerate(forward) if e == ("pieces", 1) and not served[0] < i < served[1]]
                assert len(own) == 1 and (own[0] > served[1] if early else own[0] < served[0]), (early, forward)
