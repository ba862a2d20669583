"""Pins, release sdists, the mods and the vLLM trees they make (unpatched, patched), and
vLLM's own test suites run on those trees."""
