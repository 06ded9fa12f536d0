"""Triton GPU kernels. Nothing here imports triton at module import time: each kernel module
builds its jitted functions on first use, so a CPU install without triton imports cleanly.
Under ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors (the tests' way to check them
without a GPU)."""
