"""The pytest plugin's own tests: an inner pytest session (a subprocess) whose tests use ``@pytest.mark.feplb_ranks``.

A passing multi-rank test (fixtures, parameters, a test class), a rank that skips, a failing rank
reported with its assertion message, a hang inside a real FEPLB forward turned into a timeout
failure with the hung ranks' stacks and a clean teardown (processes gone, FEPLB shared memory
removed), the ``feplb_run`` fixture, and registration through the ``pytest11`` entry point.
"""
import os
import subprocess
import sys
import textwrap
import time

import pytest

PLUGIN = "deepspeed_feplb.testing.plugin"
ENTRY_POINT = f"{PLUGIN} = {PLUGIN}"  # the line for setup.py: entry_points={"pytest11": [ENTRY_POINT]}

INNER = textwrap.dedent('''
    import os
    import time

    import pytest
    import torch
    import torch.distributed as dist


    @pytest.fixture
    def factor():
        return 2


    @pytest.mark.feplb_ranks(2)
    @pytest.mark.parametrize("offset", [5])
    def test_all_reduce_on_two_ranks(factor, offset, tmp_path):
        t = torch.tensor([float(dist.get_rank() + 1)]) * factor
        dist.all_reduce(t)
        assert t.item() == 3 * factor and dist.get_world_size() == 2
        (tmp_path / f"rank{dist.get_rank()}").write_text(str(offset + os.getpid()))


    class TestGroup:
        @pytest.mark.feplb_ranks(2)
        def test_rank_one_skips(self):
            if dist.get_rank() == 1:
                pytest.skip("needs a GPU on this rank")
            dist.barrier()


    @pytest.mark.feplb_ranks(2)
    def test_rank_one_fails():
        value = dist.get_rank() * 10
        if dist.get_rank() == 1:
            assert value == 7, "rank-specific message"
        dist.barrier()  # rank 0 waits here until it is torn down


    def hang_in_feplb(path):
        import deepspeed_feplb
        from deepspeed_feplb.testing import one_hot_expert_routing, override_routing
        moe = deepspeed_feplb.MoE(8, torch.nn.Linear(8, 8), num_experts=4, ep_size=2, k=1, drop_tokens=False,
                                  use_rts=False, feplb_config={"nvlink_domain_size": 2, "dynamic_experts_per_rank": 1,
                                                               "chunk_align_tokens": 1, "fixed_costs": "ignore",
                                                               "scheduler": {"start_after_steps": 0}})
        moe.set_deepspeed_parallelism()
        override_routing(moe, one_hot_expert_routing(expert=0, fraction=1.0))
        moe(torch.randn(16, 8))[0].sum().backward()
        assert moe.feplb_stats["migrated_tokens"] > 0
        with open("/proc/self/maps") as f:
            segments = sorted({line.split()[-1] for line in f if "/dev/shm/feplb-" in line})
        scheduler = moe.deepspeed_moe.stage.domain.scheduler.process
        pids = [os.getpid()] + ([scheduler.pid] if scheduler is not None else [])
        (path / f"rank{dist.get_rank()}").write_text(" ".join(segments) + "\\n" + " ".join(map(str, pids)))
        if dist.get_rank() == 1:
            time.sleep(600)
        dist.barrier()


    @pytest.mark.feplb_ranks(2, timeout=10)
    def test_hangs(tmp_path):
        hang_in_feplb(tmp_path)


    def fails_on_rank_one():
        assert dist.get_rank() != 1, "fixture run failed"
        return dist.get_rank()


    def test_feplb_run_fixture(feplb_run):
        feplb_run(fails_on_rank_one, 2)
''')


@pytest.fixture(scope="module")
def inner_session(tmp_path_factory):
    """Run the inner test file once (in its own pytest process) and keep its report."""
    path = tmp_path_factory.mktemp("inner")
    (path / "test_inner.py").write_text(INNER)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", PLUGIN, "-p", "no:cacheprovider", "-rA",
                           "--basetemp", str(path / "tmp"), "test_inner.py"], cwd=path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return {"out": proc.stdout + proc.stderr, "rc": proc.returncode, "seconds": time.monotonic() - start,
            "tmp": path / "tmp"}


def section(out, test):
    """The failure report of one inner test."""
    start = out.index(f"_ {test} _")
    end = out.find("\n_____", start + 1)
    return out[start:end if end > 0 else None]


def test_inner_session_outcomes(inner_session):
    out = inner_session["out"]
    assert "3 failed, 1 passed, 1 skipped" in out, out
    assert "PASSED test_inner.py::test_all_reduce_on_two_ranks[5]" in out
    assert "SKIPPED [1]" in out and "rank 1: needs a GPU on this rank" in out
    ranks_ran = sorted((inner_session["tmp"]).glob("test_all_reduce_on_two_ranks_*[0-9]/rank*"))
    assert [p.name for p in ranks_ran] == ["rank0", "rank1"]  # both ranks got the tmp_path fixture
    assert len({p.read_text() for p in ranks_ran}) == 2  # and ran in two different processes


def test_failing_rank_is_reported_with_its_assertion(inner_session):
    report = section(inner_session["out"], "test_rank_one_fails")
    assert "rank 1 of 2 failed: AssertionError: rank-specific message" in report
    assert "assert 10 == 7" in report  # the test module's asserts are rewritten on the ranks too
    line = next(i for i, text in enumerate(INNER.splitlines(), 1) if "assert value == 7" in text)
    assert f'test_inner.py", line {line}, in test_rank_one_fails' in report  # the rank's own traceback
    fixture = section(inner_session["out"], "test_feplb_run_fixture")
    assert "rank 1 of 2 failed: AssertionError: fixture run failed" in fixture


def test_hang_becomes_a_timeout_failure_and_teardown_is_clean(inner_session):
    report = section(inner_session["out"], "test_hangs")
    assert "TimeoutError: rank(s) [0, 1] did not finish within 10 s (hang?)" in report
    assert "Python stacks of rank 1" in report and "in hang_in_feplb" in report
    files = sorted(inner_session["tmp"].glob("test_hangs[0-9]*/rank*"))
    assert [p.name for p in files] == ["rank0", "rank1"]
    segments, pids = set(), set()
    for f in files:
        names, numbers = f.read_text().split("\n")
        segments |= set(names.split())
        pids |= {int(n) for n in numbers.split()}
    assert segments and len(pids) >= 3  # two ranks and rank 0's feplb-sched process
    assert not [s for s in segments if os.path.exists(s)], "FEPLB shared memory left behind"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and [p for p in pids if os.path.exists(f"/proc/{p}")]:
        time.sleep(0.2)
    alive = [p for p in pids if os.path.exists(f"/proc/{p}")
             and open(f"/proc/{p}/stat").read().split()[2] != "Z"]
    assert not alive, f"processes left running: {alive}"


def test_whole_inner_session_is_quick(inner_session):
    # 5 launches of 2 ranks, one 10 s timeout; ranks fork from a preloaded server, so start-up is paid once
    assert inner_session["seconds"] < 80, inner_session["seconds"]


def test_entry_point_registers_the_plugin_once(tmp_path):
    """What ``pip install`` of the package does once setup.py has the pytest11 entry point."""
    site, project = tmp_path / "site", tmp_path / "project"
    dist = site / "feplb_entry_point_probe-0.0.dist-info"
    dist.mkdir(parents=True)
    project.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: feplb-entry-point-probe\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text(f"[pytest11]\n{ENTRY_POINT}\n")
    (project / "test_marker.py").write_text("import pytest\n\n@pytest.mark.feplb_ranks(1)\ndef test_x():\n    pass\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    env.pop("PYTEST_DISABLE_PLUGIN_AUTOLOAD", None)
    for extra in ([], ["-p", PLUGIN]):  # autoloaded; and explicitly loaded on top (no double registration)
        proc = subprocess.run([sys.executable, "-m", "pytest", "--markers", "-p", "no:cacheprovider", *extra],
                              cwd=project, capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "@pytest.mark.feplb_ranks(world_size, timeout=None)" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "pytest", "--markers", "-p", "no:cacheprovider"], cwd=project,
                          capture_output=True, text=True, env={**env, "PYTHONPATH": os.environ.get("PYTHONPATH", "")},
                          timeout=120)
    from importlib import metadata
    installed = any(ep.value == PLUGIN for ep in metadata.entry_points(group="pytest11"))
    assert ("feplb_ranks" in proc.stdout) == installed  # without the probe: only if setup.py already has the line
