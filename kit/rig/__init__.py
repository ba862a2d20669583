"""The scheduler-level science: vLLM's real scheduler and KV-cache manager driven with
simulated model outputs (the grid, release tables, stress, loss sweep)."""
