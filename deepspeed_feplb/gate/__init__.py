"""The router: DeepSpeed's own `TopKGate` (top-1/2/k softmax, used as is, made dropless) or
`SigmoidTopKGate` (sigmoid top-k scoring with aux-loss-free bias balancing)."""
from deepspeed_feplb.gate.sigmoid import SigmoidTopKGate

__all__ = ["SigmoidTopKGate"]
