"""Domains from hostnames (`domain.learn_ranks_per_host`): where the launcher does not say how many
ranks a host has (srun, mpirun: no ``LOCAL_WORLD_SIZE``/``LOCAL_SIZE``), `deepspeed_feplb.initialize`
learns it from every rank's hostname, so "auto" domains stay on one host and a domain that would
span hosts is refused there, naming the key, not at the first balanced micro-batch."""
from deepspeed_feplb.testing import run_distributed


def _learn(hosts: list) -> dict:
    import os
    import socket

    import torch.distributed as dist

    from deepspeed_feplb.config import FEPLBConfigError, load_config
    from deepspeed_feplb.domain import domain_size, learn_ranks_per_host, validate_domain_size
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):  # as under srun or mpirun
        os.environ.pop(key, None)
    socket.gethostname = lambda: hosts[dist.get_rank()]
    try:
        per_host = learn_ranks_per_host()
    except FEPLBConfigError as error:
        return {"error": str(error)}
    out = {"per_host": per_host, "auto": domain_size(load_config({"feplb": {}}), 4)}
    for size in (2, 4):
        try:
            validate_domain_size(load_config({"feplb": {"nvlink_domain_size": size}}), 4)
            out[size] = "ok"
        except FEPLBConfigError as error:
            out[size] = str(error)
    return out


def test_ranks_per_host_come_from_hostnames():
    hosts = ["node-a", "node-a", "node-b", "node-b"]
    for r in run_distributed(_learn, 4, hosts, timeout=120):
        assert r["per_host"] == 2 and r["auto"] == 2 and r[2] == "ok", r
        assert r[4].startswith("feplb.nvlink_domain_size: 4 ranks per domain, but there are 2 ranks per host"), r


def test_ranks_not_placed_host_by_host_are_refused():
    hosts = ["node-a", "node-b", "node-a", "node-b"]  # round-robin: consecutive ranks on different hosts
    for r in run_distributed(_learn, 4, hosts, timeout=120):
        assert r["error"].startswith("feplb.nvlink_domain_size: the ranks are not placed host by host"), r
        assert "node-a x1, node-b x1, node-a x1, node-b x1" in r["error"]


def test_one_host_keeps_every_rank_in_one_domain():
    for r in run_distributed(_learn, 4, ["node-a"] * 4, timeout=120):
        assert r["per_host"] == 4 and r["auto"] == 4 and r[2] == r[4] == "ok", r
