"""Device-specific kernels. Only :mod:`tandem.kernels.cpu` exists today; GPUs use PyTorch's own."""
