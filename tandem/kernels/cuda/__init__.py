"""GPU kernels that are not PyTorch's defaults, each taken per call only where it applies.

* :mod:`~tandem.kernels.cuda.varlen` — flash-attention's variable-length kernel for the
  trainer's packed rows (from the ``flash-attn`` package when installed, else PyTorch's own);
* :mod:`~tandem.kernels.cuda.head` — the rollout head's fp32 logits from bf16/fp16 inputs on
  tensor cores (fp32 sums, no fp32 copy of the weight).
"""
