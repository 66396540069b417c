"""`weight_watch.content_hash` on CUDA: the CPU's values (a home on one device compares with a
holder on another), without a host sync of its own."""
import pytest
import torch

pytestmark = pytest.mark.gpu


def test_the_content_hash_on_cuda_is_the_cpus():
    from deepspeed_feplb.weight_watch import content_hash
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        params = [torch.randn(96, 40).to(dtype), torch.randn(40).to(dtype)]
        on_gpu = content_hash([p.cuda() for p in params])
        assert on_gpu.is_cuda
        assert torch.equal(on_gpu.cpu(), content_hash(params)), dtype
