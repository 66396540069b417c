"""The router: DeepSpeed's own `TopKGate` (top-1/2/k softmax, made dropless; top-1's routes
computed by `top1.dropless_top1`, DeepSpeed's without its device-to-host sync) or
`SigmoidTopKGate` (sigmoid top-k scoring with aux-loss-free bias balancing)."""
from deepspeed_feplb.gate.sigmoid import SigmoidTopKGate

__all__ = ["SigmoidTopKGate"]
