"""Local compute kernels, one module per array backend."""
