"""Testing helpers for users and for our own suite: run code on N CPU ranks with gloo."""
from deepspeed_feplb.testing.launcher import free_port, run_distributed

__all__ = ["free_port", "run_distributed"]
