"""The kernel checks: the kit's CPU kernels against vLLM's own Triton kernels on the same
seeded cases (under Triton's interpreter in .venv-triton, or compiled on a GPU machine
from the device bundle), and the GPU kernels' in-pass exports against a float64
recurrence."""
