"""Configure PyTorch's CUDA caching allocator before CUDA starts.

With varying batch shapes the default allocator splits fixed-size segments and cannot reuse
blocks of other sizes, so *reserved* memory creeps up over the first steps (fragmentation) and a
micro-batch that fitted the budget in a probe runs out of memory later. Expandable segments
(``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, PyTorch's "CUDA semantics" notes,
"Optimizing memory usage with PYTORCH_CUDA_ALLOC_CONF") grow one segment per stream in place,
which keeps reserved close to allocated.
"""

from __future__ import annotations

import os

from ..memory.allocator import ALLOC_CONF


def configure_allocator() -> str:
    """Ask for expandable segments unless the user configured the allocator already.

    Must run before the first CUDA allocation (the allocator reads the variable once).

    Returns:
        The allocator configuration in force.
    """
    current = os.environ.get(ALLOC_CONF, "")
    if "expandable_segments" not in current:
        os.environ[ALLOC_CONF] = ",".join(filter(None, [current, "expandable_segments:True"]))
    return os.environ[ALLOC_CONF]
