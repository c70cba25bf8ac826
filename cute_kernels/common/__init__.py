"""Device functions and kernels shared by several kernel families."""
