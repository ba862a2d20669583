"""A self-contained check of vLLM's copy-on-write on aliased hybrid KV views.

``CHECK`` runs in a process whose ``vllm`` is the package under test and prints,
per layer, the fraction of a copied attention block that equals its source.
The views are laid out as vLLM 0.32.0 lays out the kit's tiny model
(``KVCacheTensor``: layer-outer, two layers per allocation, each block one
page): at every layer address a Mamba state view (int8, the unpadded state
bytes) comes first, then the attention view (bf16, the whole page). 1.0
everywhere: the copy is whole (``fix-cow-aliased-kv-copy`` or a release that
fixed it); about 0.516: the Mamba view hid the attention view.
"""

from __future__ import annotations

NUM_BLOCKS = 6
TOKENS = 64  # attention tokens per block
HEAD = 64  # head size; K and V side by side: 2 * HEAD per token row
PAGE = TOKENS * 2 * HEAD * 2  # bytes: tokens x (K|V) x bf16
MAMBA_BYTES = PAGE * 270336 // 524288  # the tiny model's ratio: 51.6 % of the page
LAYERS = 2

# One self-contained check, run in the test process and in a pristine interpreter.
CHECK = f"""
import json, torch
from vllm.v1.worker.utils import copy_kv_cache_blocks_inplace

n, tokens, head = {NUM_BLOCKS}, {TOKENS}, {HEAD}
page, mamba, layers = {PAGE}, {MAMBA_BYTES}, {LAYERS}
raw = torch.zeros(layers * n * page, dtype=torch.int8)
caches, attention = [], []
for layer in range(layers):
    base = layer * n * page
    mamba_view = torch.as_strided(raw, (n, 1, 1, mamba), (page, mamba, mamba, 1), base)
    attn_view = torch.as_strided(
        raw.view(torch.bfloat16), (n, 1, tokens, 2 * head),
        (page // 2, tokens * 2 * head, 2 * head, 1), base // 2,
    )
    caches += [mamba_view, attn_view]
    attention.append(attn_view)
for view in attention:
    view[2].uniform_(-1, 1)
copy_kv_cache_blocks_inplace(caches, n, [(2, 4)])
equal = [float((v[4] == v[2]).float().mean()) for v in attention]
print(json.dumps(equal))
"""
