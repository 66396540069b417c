"""One rank of a 2-rank FEPLB job that the fault tests start as plain processes and then hurt.

usage: python fault_worker.py SCENARIO   (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set by the test)

Scenarios:
  loop         train steps until signalled (the test sends SIGTERM or SIGINT)
  die-early    rank 1 SIGKILLs itself at the start of step 2 (rank 0 is then in phase 1)
  die-late     rank 1 SIGKILLs itself right after publishing its counts of step 2 (rank 0 is
               then waiting for it in phase 2)
  owner-dies   rank 0 (owner of the domain's segments and scheduler) SIGKILLs itself at step 2,
               right before an all-reduce outside FEPLB (as DeepSpeed's gradient reduction), whose
               error rank 1 does not catch: FEPLB's excepthook must name rank 0
rank 0 must stop with an error naming rank 1, well within feplb.scheduler.peer_timeout_s.
Each rank prints ``READY <segment prefix> <scheduler pid>`` once FEPLB runs, and ``ERROR <message>``
if a step raised.
"""
import importlib
import os
import signal
import sys
import time

import torch


def main(scenario: str) -> int:
    # a job started in the background (as CI starts this suite) inherits SIGINT ignored;
    # restore Ctrl-C's usual KeyboardInterrupt, which is what the SIGINT test is about
    signal.signal(signal.SIGINT, signal.default_int_handler)
    torch.set_num_threads(1)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    import deepspeed
    import torch.distributed as dist

    import deepspeed_feplb

    deepspeed.init_distributed("gloo", auto_mpi_discovery=False)
    rank = dist.get_rank()
    torch.manual_seed(0)
    expert = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    feplb = {"dynamic_experts_per_rank": 1, "chunk_align_tokens": 1, "fixed_costs": "ignore",
             "scheduler": {"peer_timeout_s": 20, "start_after_steps": 0}}
    layer = deepspeed_feplb.MoE(8, expert, num_experts=4, ep_size=2, k=1, min_capacity=0, drop_tokens=False,
                                use_rts=False, feplb_config=feplb)
    with torch.no_grad():
        layer.deepspeed_moe.gate.wg.weight[0] += 2.0  # expert 0 (on rank 0) hot: moves every step
    layer.set_deepspeed_parallelism()
    x = torch.randn(32, 8) + 1.0
    step = 0
    try:
        while True:
            if scenario == "die-early" and rank == 1 and step == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            if scenario == "die-late" and rank == 1 and step == 2:
                scheduler = layer.deepspeed_moe.stage.domain.scheduler
                publish = scheduler.publish

                def publish_and_die(*args, publish=publish):
                    publish(*args)
                    os.kill(os.getpid(), signal.SIGKILL)

                scheduler.publish = publish_and_die
            out, _, _ = layer(x)
            out.sum().backward()
            if scenario == "owner-dies" and step == 2:
                if rank == 0:
                    os.kill(os.getpid(), signal.SIGKILL)
                dist.all_reduce(torch.ones(1))  # fails on rank 1, outside FEPLB, and is not caught
                continue
            if step == 0:
                domain = layer.deepspeed_moe.stage.domain
                deadline = time.monotonic() + 60
                while rank == 0 and domain.scheduler.scheduler_pid() <= 0 and time.monotonic() < deadline:
                    time.sleep(0.05)  # the tests signal this pid: never print -1 (kill -1 hits everything)
                print(f"READY {domain.name}- {domain.scheduler.scheduler_pid()}", flush=True)
            step += 1
    except Exception as error:  # what the user sees instead of a hang
        if scenario == "owner-dies":
            raise  # to the top level: what the user's program does with DeepSpeed's errors
        print(f"ERROR {type(error).__name__}: {error}", flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
