"""Memory-efficient attention backward (PyTorch's AttentionBackwardKernel) in the CuTe DSL."""
