"""`resident.Fingerprints` on CUDA: taken before later work is queued, read without waiting for it."""
import pytest
import torch

pytestmark = pytest.mark.gpu


def test_fingerprints_are_read_without_a_sync_on_the_work_queued_after_them():
    from deepspeed_feplb.migrate.resident import Fingerprints, fingerprint

    params = [[torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)] for _ in range(4)]
    want = {i: tuple(fingerprint([p[0].cpu()]).tolist()) for i, p in enumerate(params)}
    torch.cuda.set_sync_debug_mode("error")
    try:
        prints = Fingerprints(params)
        a = torch.randn(4096, 4096, device="cuda")
        for _ in range(20):  # work queued after the fingerprints: reading them must not wait for it
            a = a @ a / 64
        got = prints.of([0, 3])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got == {0: want[0], 3: want[3]}
