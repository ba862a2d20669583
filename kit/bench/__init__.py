"""The end-to-end bench: real `vllm serve` processes on loopback, TTFT and cached tokens,
the answer oracle, turn cost, and the report over a bundle."""
