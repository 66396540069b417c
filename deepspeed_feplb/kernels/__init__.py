"""Row kernels of the GPU path: permute / pack / unpack / weighted combine.

* `reference`: the specification, in torch (any device); the CPU path runs it.
* `cuda`: the same operations as CuPy ``RawModule`` kernels compiled from ``ops/feplb_kernels.cu``;
  each function falls back to its reference for tensors that are not on CUDA.
"""
