"""The scheduler process from a rank's side, in one process playing every rank of a domain:
it starts only after ``start_after_steps`` steps, sleeps while nothing happens, answers when the
counts arrive, and planning in-process before it is up is not reported as a fallback."""
import os
import secrets
import time
import warnings

import numpy as np
import pytest

from deepspeed_feplb.plan import cache
from deepspeed_feplb.plan.policy import PlanConstraints, plan_domain
from deepspeed_feplb.scheduler import client as client_module
from deepspeed_feplb.scheduler.client import ProcessScheduler
from deepspeed_feplb.segments import Word, cpu_seconds, futex_wait, leftover_segments, process_alive

RANKS, EXPERTS = 4, 8
CONSTRAINTS = PlanConstraints(dynamic_experts=2, max_helpers=2, chunk_align=1)


def counts(seq: int) -> np.ndarray:
    rng = np.random.default_rng(seq)
    return (rng.pareto(1.0, (RANKS, EXPERTS)) * 50).astype(np.int64)


def step(client: ProcessScheduler, seq: int):
    x = counts(seq)
    for r in range(1, RANKS):
        client.mailbox.publish(r, seq, x[r], CONSTRAINTS)
    client.publish(seq, x[0], CONSTRAINTS)
    return x, client.plan(seq)


@pytest.fixture
def client():
    name = f"feplb-test-{secrets.token_hex(4)}"
    # moves_at_once: the first rank plans until the process is up (measured costs would wait for it)
    c = ProcessScheduler(f"{name}-mbox", 0, RANKS, plan_timeout_s=1.0, peer_timeout_s=10.0, restart=True, create=True,
                         start_after_steps=3, moves_at_once=True)
    yield c
    c.close()
    assert not leftover_segments(name)


def wait_up(client, timeout=60.0) -> int:
    deadline = time.monotonic() + timeout
    while client.scheduler_pid() <= 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.scheduler_pid() > 0, "the scheduler process did not come up"
    return client.scheduler_pid()


def test_starts_after_its_steps_and_its_plans_equal_the_in_process_ones(client):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # planning in-process before the process is up is not a fault
        for seq in range(2):
            x, planned = step(client, seq)
            assert client.process is None and not planned.fallback
            assert np.array_equal(planned.plan.moves, plan_domain(x, CONSTRAINTS).moves)
        step(client, 2)
        assert client.process is not None  # the third step started it
        wait_up(client)
    for seq in range(3, 40):
        x, planned = step(client, seq)
        expected = plan_domain(x, CONSTRAINTS)
        assert np.array_equal(planned.plan.moves, expected.moves)
        assert np.array_equal(planned.plan.rank_rows, expected.rank_rows)  # the Plan crossed intact
    assert not planned.fallback, "the process answered none of the steps"


def test_the_idle_process_sleeps_and_wakes_for_the_next_step(client):
    for seq in range(3):
        step(client, seq)
    pid = wait_up(client)
    step(client, 3)
    before = cpu_seconds(pid)
    time.sleep(1.0)
    idle = cpu_seconds(pid) - before
    assert idle <= 0.05, f"the idle scheduler used {idle:.2f} s of CPU in 1 s"
    x, planned = step(client, 4)  # woken by the counts, not by a timer
    assert not planned.fallback and np.array_equal(planned.plan.moves, plan_domain(x, CONSTRAINTS).moves)


def test_close_stops_a_process_that_is_still_starting():
    name = f"feplb-test-{secrets.token_hex(4)}"
    c = ProcessScheduler(f"{name}-mbox", 0, RANKS, plan_timeout_s=1.0, peer_timeout_s=10.0, restart=True, create=True,
                         start_after_steps=0)
    pid = c.process.pid
    assert pid > 0
    start = time.monotonic()
    c.close()
    assert time.monotonic() - start < 2.0 and not process_alive(pid)
    assert not leftover_segments(name)


def test_a_word_wakes_its_sleeper_and_a_sleep_ends_at_its_timeout():
    import threading

    words = np.zeros(2, dtype=np.int64)
    word = Word(words, 1)
    start = time.monotonic()
    futex_wait(word.address, word.seen(), 0.05)  # nobody writes: ends at the timeout
    assert 0.04 <= time.monotonic() - start < 1.0
    woke = []

    def sleeper():
        seen = word.seen()
        while words[1] == 0:
            futex_wait(word.address, seen, 5.0)
        woke.append(time.monotonic())

    thread = threading.Thread(target=sleeper)
    thread.start()
    time.sleep(0.1)
    words[1] = 7
    rung = time.monotonic()
    word.notify()
    thread.join(5.0)
    assert woke and woke[0] - rung < 1.0


def test_the_first_compile_of_the_planner_is_announced_only_without_a_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setattr(cache, "__file__", str(tmp_path / "plan" / "cache.py"))
    assert not cache.planner_cached()  # a fresh machine: the message is printed, the process compiles
    folder = tmp_path / "plan" / "__pycache__"
    folder.mkdir(parents=True)
    (folder / "passes.plan_pass-321.py311.nbi").touch()
    assert cache.planner_cached()


def _short_run_domain(steps: int) -> dict:
    import sys

    import torch.distributed as dist

    rank, ranks = dist.get_rank(), dist.get_world_size()
    names = [f"feplb-test-{secrets.token_hex(4)}-mbox"]
    dist.broadcast_object_list(names, 0)
    before = "numba" in sys.modules
    if rank == 0:
        client = ProcessScheduler(names[0], 0, ranks, plan_timeout_s=0.02, peer_timeout_s=30.0, restart=True,
                                  create=True, start_after_steps=1000, moves_at_once=True)
    dist.barrier()
    if rank:
        client = ProcessScheduler(names[0], rank, ranks, plan_timeout_s=0.02, peer_timeout_s=30.0, restart=True,
                                  create=False, start_after_steps=1000)
    same = True
    for seq in range(steps):
        x = (np.random.default_rng(seq).pareto(1.0, (ranks, EXPERTS)) * 50).astype(np.int64)
        client.publish(seq, x[rank], CONSTRAINTS)
        planned = client.plan(seq)
        same &= np.array_equal(planned.plan.moves, plan_domain(x, CONSTRAINTS).moves) if rank == 0 else True
        moves = [None] * ranks
        dist.all_gather_object(moves, planned.plan.moves.tolist())
        same &= all(m == moves[0] for m in moves) and not planned.fallback
    loaded = "numba" in sys.modules
    dist.barrier()
    client.close()
    return {"numba_before": before, "numba_after": loaded, "same": bool(same)}


@pytest.mark.parametrize("cached, moves_at_once", [(False, True), (True, False)], ids=["cold cache", "measured costs"])
def test_the_process_starts_with_the_domain_and_plans_move_nothing_until_it_serves(monkeypatch, cached,
                                                                                   moves_at_once):
    """No micro-batch waits for numba. On a machine without the compiled planner the domain starts
    its scheduler process at once (whatever start_after_steps says), which compiles it; with a warm
    cache (about a second to load) the same happens wherever plans need not move from the first
    micro-batch (measured costs). Until the process serves, the domain computes at home and this
    rank never loads the planner."""
    import sys
    monkeypatch.setattr(client_module, "planner_cached", lambda: cached)
    monkeypatch.delitem(sys.modules, "deepspeed_feplb.plan.passes", raising=False)  # as in a fresh rank
    started = []
    monkeypatch.setattr(ProcessScheduler, "_start_process", lambda self: started.append(True))  # still loading
    name = f"feplb-test-{secrets.token_hex(4)}"
    c = ProcessScheduler(f"{name}-mbox", 0, RANKS, plan_timeout_s=0.05, peer_timeout_s=10.0, restart=True,
                         create=True, start_after_steps=1000, moves_at_once=moves_at_once)
    try:
        assert started == [True], "the process was not started with the domain"
        seen = [step(c, seq) for seq in range(3)]
        assert "deepspeed_feplb.plan.passes" not in sys.modules, "the rank loaded the planner itself"
        for x, planned in seen:
            assert planned.plan.moves.shape == (0, 4) and np.array_equal(planned.plan.rank_rows, x.sum(axis=1))
            assert len(plan_domain(x, CONSTRAINTS).moves) > 0, "a plan would move rows: the test shows nothing"
    finally:
        c.close()
    assert not leftover_segments(name)


def test_before_the_process_is_up_only_the_first_rank_plans():
    """A short run never starts the scheduler process: the domain's first rank plans for all and
    writes the plan where the process would, so the other ranks never load numba (~0.4 s each)."""
    from deepspeed_feplb.testing import run_distributed
    results = run_distributed(_short_run_domain, 3, 6, timeout=120)
    assert all(r["same"] for r in results), "the ranks did not all get the planner's plan"
    assert not any(r["numba_before"] for r in results), "numba was loaded before any plan: the test shows nothing"
    assert results[0]["numba_after"]
    assert not any(r["numba_after"] for r in results[1:]), "a rank that only reads plans loaded numba"


def test_a_step_answered_twice_while_the_process_comes_up_keeps_one_plan():
    """While the process comes up, the domain's first rank and the process may both answer a step.
    Whoever publishes first wins: the first rank adopts a plan the process published, and the
    process never plans a step that already has one (the other ranks may have read it)."""
    import threading

    from deepspeed_feplb.plan.policy import Plan
    from deepspeed_feplb.scheduler.mailbox import Mailbox
    from deepspeed_feplb.scheduler.process import serve

    name = f"feplb-test-{secrets.token_hex(4)}"
    c = ProcessScheduler(f"{name}-mbox", 0, RANKS, plan_timeout_s=0.05, peer_timeout_s=10.0, restart=True,
                         create=True, start_after_steps=1000, moves_at_once=False)
    c._start_process = lambda: None  # still loading: the first rank would publish a plan without moves
    c.mailbox.header[client_module.STARTING] = 1
    try:
        x = counts(0)
        theirs = Plan(np.array([[0, 1, 2, 5]], np.int64), x.sum(axis=1))
        for r in range(1, RANKS):
            c.mailbox.publish(r, 0, x[r], CONSTRAINTS)
        c.publish(0, x[0], CONSTRAINTS)
        c.mailbox.write_plan(0, theirs, 7)  # the process came up and answered step 0 first
        assert np.array_equal(c.plan(0).plan.moves, theirs.moves)
        # the other way round: the first rank answered step 1; the process, now serving, leaves it
        x = counts(1)
        for r in range(1, RANKS):
            c.mailbox.publish(r, 1, x[r], CONSTRAINTS)
        c.mailbox.publish(0, 1, x[0], CONSTRAINTS)
        mine = Plan(np.zeros((0, 4), np.int64), x.sum(axis=1))
        c.mailbox.write_plan(1, mine, 11)
        process_side = Mailbox(c.mailbox.name, RANKS, create=False)
        server = threading.Thread(target=serve, args=(process_side, os.getppid()), daemon=True)
        server.start()
        x2 = counts(2)
        for r in range(RANKS):
            c.mailbox.publish(r, 2, x2[r], CONSTRAINTS)
        deadline = time.monotonic() + 30
        while c.mailbox.read_plan(2) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c.mailbox.read_plan(2) is not None, "the process did not serve the next step"
        kept, ns = c.mailbox.read_plan(1)
        assert ns == 11 and kept.moves.shape == (0, 4), "the process replaced a published plan"
        c.mailbox.request_shutdown()
        server.join(timeout=10)
        assert not server.is_alive()
        process_side.close()
    finally:
        c.close()
    assert not leftover_segments(name)


WARM_CHECK = """
import sys

import numba
import numpy as np
from deepspeed_feplb.plan import passes
from deepspeed_feplb.plan.policy import PlanConstraints, plan_domain
from deepspeed_feplb.plan.time_model import TimeModel
from deepspeed_feplb.scheduler.mailbox import Mailbox
from deepspeed_feplb.scheduler.process import warm_planner

def loaded():
    return {name: len(f.signatures) for name in dir(passes)
            if isinstance(f := getattr(passes, name), numba.core.registry.CPUDispatcher)}

warm_planner()
warmed, modules = loaded(), set(sys.modules)
box = Mailbox("{name}", 2, create=True)
try:
    model = TimeModel.measured(0.002, 900, 1 << 20, 512, 450.0)
    seq = 0
    for bound in (0.0, 1.02):
        for budget in (float("inf"), 3e6):
            constraints = PlanConstraints(dynamic_experts=2, max_helpers=1, chunk_align=8, ce_budget_bytes=budget,
                                          expert_bytes=1 << 20, model=model, keep_copies=True,
                                          max_rows_over_mean=bound, mean_rows=600.0)
            for rank, counts in enumerate(([900, 400, 30, 0], [20, 10, 40, 0])):
                box.publish(rank, seq, np.array(counts, np.int64), constraints, np.zeros((4, 1), np.int64))
            ready = box.read_counts(seq)
            assert plan_domain(ready.counts, ready.constraints, ready.resident, ready.dynamic).moves.shape[0] > 0
            seq += 1
finally:
    box.close()
assert loaded() == warmed, (warmed, loaded())
assert set(sys.modules) == modules, sorted(set(sys.modules) - modules)
"""


def test_the_process_warm_up_loads_every_pass_a_published_plan_calls():
    """The scheduler process plans small domains before it says it is up (`process.warm_planner`):
    a first call is slow (numba's typing of the first arrays imports parts of numpy: 10-17 ms
    here), which made the process's first real plan late (the rank then planned itself, loading
    the planner into the training process: a 0.7 s step of `make run`). Plans read from the
    mailbox, with and without a row bound and a copy budget, must import nothing and call no pass
    with a signature the warm-up did not load."""
    import subprocess
    import sys
    code = WARM_CHECK.replace("{name}", f"feplb-test-{secrets.token_hex(4)}-mbox")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_spare_started_early_serves_the_domain_that_opens_and_an_unused_one_is_stopped():
    """`client.start_spare` loads the planner before any domain exists (the engine starts it while
    DeepSpeed builds): the domain that opens takes that very process, which serves its first plan
    without the ~0.7 s start, and no second process is started. A spare that no domain took ends at
    `stop_spare` (the rank's exit), and one whose rank closed its stdin ends by itself."""
    import subprocess
    import sys
    client_module.start_spare()
    spare = client_module._spare
    try:
        client_module.start_spare()  # idempotent while one waits
        assert client_module._spare is spare and spare.pid > 0
        deadline = time.monotonic() + 60
        while cpu_seconds(spare.pid) < 0.3 and time.monotonic() < deadline:  # it loads the planner meanwhile
            time.sleep(0.05)
        name = f"feplb-test-{secrets.token_hex(4)}"
        c = ProcessScheduler(f"{name}-mbox", 0, RANKS, plan_timeout_s=1.0, peer_timeout_s=10.0, restart=True,
                             create=True, start_after_steps=0)
        try:
            assert c.process is spare and client_module._spare is None
            assert wait_up(c, timeout=30) == spare.pid
            x, planned = step(c, 0)
            assert not planned.fallback and np.array_equal(planned.plan.moves, plan_domain(x, CONSTRAINTS).moves)
        finally:
            c.close()
        assert not process_alive(spare.pid) and not leftover_segments(name)
    finally:
        client_module.stop_spare()

    client_module.start_spare()
    unused = client_module._spare
    client_module.stop_spare()
    assert client_module._spare is None and unused.poll() is not None and not process_alive(unused.pid)
    orphan = subprocess.Popen([sys.executable, "-m", "deepspeed_feplb.scheduler.process", "--spare",
                               f"--parent={os.getpid()}"], stdin=subprocess.PIPE)
    orphan.stdin.close()  # as when its rank exits
    assert orphan.wait(timeout=60) == 0


def test_the_engine_starts_the_domain_leaders_planner_while_deepspeed_builds():
    """`deepspeed_feplb.initialize` starts the scheduler process of the domain that rank 0 will
    lead as a spare (the other rank starts none), and that process serves the domain when it opens
    at the first micro-batch: balancing does not wait ~0.7 s for a process started then."""
    from deepspeed_feplb.testing import run_distributed

    import moe_cases
    leader, other = run_distributed(moe_cases.early_planner_case, 2, timeout=180)
    assert leader["spare"] > 0 and other["spare"] == 0
    assert leader["serving"] == leader["spare"], leader
    assert not leader["spare_alive"]
