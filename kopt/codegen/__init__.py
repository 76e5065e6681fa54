"""Code generation: fused ops as ``torch.library`` custom ops (Triton on the GPU, the PyTorch
reference on the CPU and for verification, a fake implementation for tracing)."""
