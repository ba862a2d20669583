"""Pin tooling: resolving what pins.toml, models.lock and the hash locks under locks/ leave
open (`make lock`, `make lock-deps`). The pins' reader, kit/vllm_tree/pins.py, stays below:
every layer from vllm_tree up reads pins, while this tooling also resolves models.lock's
revisions through kit/weights, so it sits above both."""
