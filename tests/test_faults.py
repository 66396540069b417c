"""Faults a long training job meets: signals, a dead rank, a dead or stalled scheduler process."""
import os
import signal
import subprocess
import sys
import time

import pytest

from deepspeed_feplb.segments import leftover_segments, process_alive
from deepspeed_feplb.testing import free_port, run_distributed

import moe_cases

WORKER = os.path.join(os.path.dirname(__file__), "fault_worker.py")


def start_job(scenario: str):
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "LOCAL_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "PYTHONUNBUFFERED": "1"}
    return [subprocess.Popen([sys.executable, WORKER, scenario], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]


def read_until(proc, prefix: str, timeout: float = 120.0) -> str:
    deadline = time.monotonic() + timeout
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith(prefix):
            return line.strip()
    raise AssertionError(f"no {prefix!r} line; output:\n{''.join(lines)}")


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not process_alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_removes_segments_and_stops_the_scheduler(signum):
    procs = start_job("loop")
    try:
        _, prefix, scheduler_pid = read_until(procs[0], "READY").split()
        assert int(scheduler_pid) > 0
        read_until(procs[1], "READY")
        assert leftover_segments(prefix), "the job runs but owns no segment: nothing would be tested"
        assert process_alive(int(scheduler_pid))
        for p in procs:
            p.send_signal(signum)
        for p in procs:
            p.wait(timeout=120)  # generous: CI machines are shared and slow
        assert leftover_segments(prefix) == []
        assert wait_gone(int(scheduler_pid)), "feplb-sched outlived its job"
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.parametrize("scenario", ["die-early", "die-late"])
def test_dead_rank_stops_the_others_with_an_error_naming_it(scenario):
    procs = start_job(scenario)
    try:
        _, prefix, scheduler_pid = read_until(procs[0], "READY").split()
        started = time.monotonic()
        error = read_until(procs[0], "ERROR", timeout=60)
        assert time.monotonic() - started < 15, "not faster than peer_timeout_s: the watch did not fire"
        assert "rank 1 " in error or "rank(s) [1]" in error, error
        assert procs[0].wait(timeout=30) == 1
        assert procs[1].wait(timeout=30) == -signal.SIGKILL
        # rank 0 owned the domain: its exit removed everything, the dead rank's segments included
        assert leftover_segments(prefix) == []
        assert wait_gone(int(scheduler_pid))
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_dead_owner_rank_is_named_by_the_survivor_even_outside_feplb_and_its_segments_removed():
    procs = start_job("owner-dies")
    try:
        _, prefix, _ = read_until(procs[1], "READY").split()
        out, _ = procs[1].communicate(timeout=120)
        assert procs[1].returncode not in (0, None)
        assert "rank 0 (pid" in out and "died" in out, out[-3000:]  # named, not only gloo's "connection reset"
        assert procs[0].wait(timeout=30) == -signal.SIGKILL
        # the owner died with the domain's segments: the survivor removed them as it exited
        assert leftover_segments(prefix) == []
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_scheduler_killed_or_stalled_falls_back_and_recovers():
    results = run_distributed(moe_cases.scheduler_fault_case, 2, timeout=300)
    for rank, case in enumerate(results):
        worst = max(case["errors"].items(), key=lambda item: item[1])
        assert worst[1] <= 1e-5, f"rank {rank}: {worst[0]} differs by {worst[1]:.2e} during the faults"
        assert case["fallback_after_kill"], "the step after the kill did not plan in-process"
        assert case["fallback_when_stalled"]
        assert case["migrated"] > 0
        assert case["warnings"] == [], f"rank {rank}: {case['warnings']}"
    # the process's owner says what happened to it, once per event; a late plan alone says nothing
    leader, other = results[0]["said"], results[1]["said"]
    assert other == [], other
    assert len(leader) == 2, leader
    assert "exited (signal 9); restarted it as pid" in leader[0], leader
    assert "missed 3 plans in a row (feplb.scheduler.plan_timeout_ms=" in leader[1], leader
    assert "and was stopped; restarted it as pid" in leader[1], leader
    leader = results[0]
    assert leader["restarted_after_kill"] and leader["restarted_after_stall"]
    assert leader["recovered"], "the restarted scheduler never served a plan again"


def test_cleanup_keeps_the_segments_of_a_running_job(tmp_path):
    """`python -m deepspeed_feplb cleanup` removes what killed jobs left, never what a live process maps."""
    import secrets

    from deepspeed_feplb.segments import open_segment, unlink_quietly
    prefix = f"feplb-test-{secrets.token_hex(4)}-"
    live = open_segment(prefix + "live", 4096, create=True)  # mapped by this (running) process
    orphan = open_segment(prefix + "orphan", 4096, create=True)
    orphan.close()  # unmapped, as a SIGKILLed job leaves it
    try:
        run = subprocess.run([sys.executable, "-m", "deepspeed_feplb", "cleanup", "--prefix", prefix],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        assert leftover_segments(prefix) == [prefix + "live"], run.stdout
        assert "kept 1 segment(s) a running process maps" in run.stdout and f"pid {os.getpid()}" in run.stdout
    finally:
        live.close()
        unlink_quietly(live)
        unlink_quietly(orphan)
