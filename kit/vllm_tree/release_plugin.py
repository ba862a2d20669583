"""A pytest plugin for vLLM's own tests on a release tree from its sdist.

From 0.34.0 vLLM's CPU platform refuses x86 without triton-cpu when a config is
built; the prefix-cache suite runs the scheduler and cache manager only, which
use no kernel. Loaded with ``-p kit.vllm_tree.release_plugin`` by kit/vllm_tree/upstream_suite.py.
"""

from __future__ import annotations

import vllm.triton_utils

vllm.triton_utils.HAS_TRITON = True
