"""The README's program, exactly as written there, launched with the `deepspeed` CLI on 2 CPU ranks:
it starts without compiling DeepSpeed's C++ ops, leaves nothing in /dev/shm, and a bad "feplb"
section or a Ctrl-C ends the job with one line instead of a traceback per rank."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from deepspeed_feplb.testing import free_port

README = Path(__file__).resolve().parent.parent / "README.md"
LAUNCHER = os.path.join(os.path.dirname(sys.executable), "deepspeed")
pytestmark = pytest.mark.skipif(not os.path.exists(LAUNCHER), reason="needs the deepspeed launcher of this environment")


def readme_block(language: str, after: str) -> str:
    """The first ```language block of README.md after the line ``after``."""
    text = README.read_text()
    section = text[text.index(after):]
    return re.search(rf"```{language}\n(.*?)```", section, re.S).group(1)


def shm_names() -> set:
    return {n for n in os.listdir("/dev/shm") if n.startswith(("feplb-", "deepspeed"))}


def launch(tmp_path, program: str, ds_config: dict, **popen) -> subprocess.Popen:
    (tmp_path / "train.py").write_text(program)
    (tmp_path / "ds_config.json").write_text(json.dumps(ds_config))
    command = readme_block("bash", "and launch with `deepspeed` as usual").strip()
    assert command == ("OMP_NUM_THREADS=1 deepspeed --num_gpus 2 --master_port 29600 train.py "
                       "--deepspeed_config ds_config.json")
    argv = [LAUNCHER, "--num_gpus", "2", "--master_port", str(free_port()), "train.py", "--deepspeed_config",
            "ds_config.json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    return subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            **popen)


@pytest.fixture
def program():
    return readme_block("python", "## Use it in your model")


@pytest.fixture
def ds_config():
    return json.loads(readme_block("json", "with a `\"feplb\"` section in `ds_config.json`"))


def test_the_readme_program_runs_as_written(tmp_path, program, ds_config):
    assert ds_config["optimizer"] == {"type": "Adam", "params": {"lr": 0.001}}  # plain Adam, as users write it
    before = shm_names()
    proc = launch(tmp_path, program, ds_config)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    assert out.count("tokens per rank") == 2, out[-4000:]
    assert "built successfully" not in out and "Building extension" not in out, out[-4000:]  # no C++ op compiled
    assert out.count("uses torch's implementation") == 1, out[-4000:]  # said once, on rank 0
    assert shm_names() - before == set(), "left in /dev/shm"


def test_a_bad_feplb_section_is_one_line(tmp_path, program, ds_config):
    ds_config["feplb"]["dynamic_expert_per_rank"] = 2
    proc = launch(tmp_path, program, ds_config)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert out.count("feplb.dynamic_expert_per_rank: unknown key, did you mean 'dynamic_experts_per_rank'?") == 1, out
    assert "Traceback" not in out, out[-4000:]


def test_ctrl_c_says_interrupted_without_tracebacks(tmp_path, program, ds_config):
    endless = program.replace("for step in range(10):",
                              "for step in __import__('itertools').count():  # until interrupted\n"
                              "    print('STEP', step, flush=True) if step == 2 else None")
    assert endless != program
    before = shm_names()
    # SIGINT with its default action in the launched job, as a terminal's foreground job has it: a suite started
    # in the background by a non-interactive shell (as CI may be) inherits SIGINT ignored, and so would the
    # launcher and the ranks (FEPLB then leaves SIGINT ignored, and DeepSpeed's launch.py turns it into SIGTERMs)
    proc = launch(tmp_path, endless, ds_config, start_new_session=True,
                  preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines: list = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + 240
    while not any("STEP" in line for line in lines) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    try:
        assert any("STEP" in line for line in lines), "".join(lines)[-4000:]
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the launcher and both ranks
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # our own launch (its session), never a foreign process
            proc.wait()
    reader.join(timeout=10)
    out = "".join(lines)
    assert out.count("interrupted (Ctrl-C)") == 1, out[-4000:]  # once, on local rank 0
    # the `deepspeed` launcher process itself prints a KeyboardInterrupt traceback (DeepSpeed's runner,
    # not a rank); the ranks print none
    ranks_out = re.sub(r"Traceback \(most recent call last\):\n(  .*\n)*?.*deepspeed/launcher/runner\.py(.*\n)*?"
                       r"KeyboardInterrupt\n", "", out)
    assert "Traceback" not in ranks_out and "Exception ignored" not in ranks_out, ranks_out[-4000:]
    # the ranks unlink their segments as they exit, which on a loaded machine may come a little
    # after the launcher's own exit; a segment still there after 30 s is a leak
    deadline = time.monotonic() + 30
    while {n for n in shm_names() - before if n.startswith("feplb-")} and time.monotonic() < deadline:
        time.sleep(0.5)
    assert {n for n in shm_names() - before if n.startswith("feplb-")} == set()
