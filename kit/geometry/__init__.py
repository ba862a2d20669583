"""The geometry model: which hit, chunk end and Mamba state each request gets, predicted
in plain Python (no vLLM)."""
