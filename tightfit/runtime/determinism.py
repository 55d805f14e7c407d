"""Deterministic kernels for a run that must reproduce bit for bit (``--deterministic``).

Why a switch: tightfit's resume restores everything a step depends on (DESIGN invariant 5), but
a GPU kernel that adds with atomic operations adds in an order that changes from run to run, so
two uninterrupted runs already differ in the last bits, and a resumed run differs from the
uninterrupted one as much. TorchInductor lowers an embedding's backward (a scatter-add) to such
a kernel when a model with embeddings is compiled as one graph (compile scopes ``model`` and
``model-graphs``): measured on an NVIDIA H100, two uninterrupted runs of a tiny BERT differed by
up to 2.7e-8 in their weights after 4 steps (a run resumed at step 2, first in the embeddings),
and with deterministic algorithms both they and the resumed run were equal bit for bit
(``bench/results/session-2026-12-07d``). Blocks compiled one by one (the embeddings eager) were
equal bit for bit without it.

PyTorch's switch (https://pytorch.org/docs/stable/notes/randomness.html) makes TorchInductor
lower scatter-adds to ATen's sorted (deterministic) kernels and ATen pick deterministic kernels.
"""

from __future__ import annotations

import contextlib
import os

import torch

# cuBLAS's deterministic workspace setting; read when the process creates its first cuBLAS handle
CUBLAS_ENV, CUBLAS_DETERMINISTIC = "CUBLAS_WORKSPACE_CONFIG", ":4096:8"


@contextlib.contextmanager
def deterministic_kernels(active: bool = True):
    """Within the block, ``torch.use_deterministic_algorithms(True, warn_only=True)`` and cuDNN's
    deterministic algorithms without benchmarking; after it, the process's settings as they
    were. ``active`` False: nothing changes.

    - ``warn_only``: an operation without a deterministic kernel warns (PyTorch's warning names
      it) and runs as it would without the switch, rather than stop a run after its planning
      (PyTorch's list has e.g. adaptive average pooling's backward; seen warning on an NVIDIA
      H100: the memory-efficient attention's backward in the main job). Such a run is not
      guaranteed bit for bit. The setting that raises instead was not run on a GPU.
    - ``torch.utils.deterministic.fill_uninitialized_memory`` is turned off: filling every new
      tensor with NaN costs a pass over its memory and changes no result of a correct program.
    - :data:`CUBLAS_ENV` is set to :data:`CUBLAS_DETERMINISTIC` unless the user set it, and removed
      after; it takes effect only if no cuBLAS call ran in the process yet (``tightfit train``
      makes none before).

    The settings are the process's: compiled code is lowered, and its guards checked, under them,
    so planning, training and evaluation all run inside.
    """
    if not active:
        yield
        return
    found = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.utils.deterministic.fill_uninitialized_memory, torch.backends.cudnn.deterministic,
             torch.backends.cudnn.benchmark)
    set_cublas = CUBLAS_ENV not in os.environ
    os.environ.setdefault(CUBLAS_ENV, CUBLAS_DETERMINISTIC)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(found[0], warn_only=found[1])
        torch.utils.deterministic.fill_uninitialized_memory = found[2]
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = found[3], found[4]
        if set_cublas:  # the environment as found too (a later cuBLAS handle of the process is not ours)
            os.environ.pop(CUBLAS_ENV, None)
