"""Deterministic kernels for a run that must reproduce bit for bit (``--deterministic``).

Why a switch: tightfit's resume restores everything a step depends on (DESIGN invariant 5), but
a GPU kernel that adds with atomic operations adds in an order that changes from run to run, so
two uninterrupted runs already differ in the last bits, and a resumed run differs from the
uninterrupted one as much. TorchInductor lowers an embedding's backward (a scatter-add) to such
a kernel when a model with embeddings is compiled as one graph (compile scopes ``model`` and
``model-graphs``): measured on an NVIDIA H100, two uninterrupted runs of a tiny BERT differed by
up to 1.5e-8 in their weights after 4 steps, first in the embeddings, and with deterministic
algorithms both they and the resumed run were equal bit for bit (``bench/results/session-2026-12-07d``).
Eager steps and blocks compiled one by one (embeddings eager) were equal bit for bit without it.

PyTorch's switch (https://pytorch.org/docs/stable/notes/randomness.html) makes TorchInductor
lower scatter-adds to ATen's sorted (deterministic) kernels and ATen pick deterministic kernels.
"""

from __future__ import annotations

import contextlib
import os

import torch

from ..errors import TightfitError

# cuBLAS's deterministic workspace setting; read when the process creates its first cuBLAS handle
CUBLAS_ENV, CUBLAS_DETERMINISTIC = "CUBLAS_WORKSPACE_CONFIG", ":4096:8"
# what PyTorch's error says of an operation without a deterministic kernel (ATen's alertNotDeterministic)
NO_DETERMINISTIC_KERNEL = "does not have a deterministic implementation"


@contextlib.contextmanager
def deterministic_kernels(active: bool = True, asked_by: str = "deterministic kernels"):
    """Within the block, ``torch.use_deterministic_algorithms(True)`` and cuDNN's deterministic
    algorithms without benchmarking; after it, the process's settings as they were. ``active``
    False: nothing changes.

    - Not ``warn_only``: with it, some kernels stay nondeterministic and only warn (seen: the
      memory-efficient attention's backward). An operation without a deterministic
      implementation stops the block instead, in practice in planning's first probe step,
      before training.
    - ``torch.utils.deterministic.fill_uninitialized_memory`` is turned off: filling every new
      tensor with NaN costs a pass over its memory and changes no result of a correct program.
    - :data:`CUBLAS_ENV` is set to :data:`CUBLAS_DETERMINISTIC` unless the user set it; it takes
      effect only if no cuBLAS call ran in the process yet (``tightfit train`` makes none before).

    The settings are the process's: compiled code is lowered, and its guards checked, under them,
    so planning, training and evaluation all run inside.

    Raises:
        TightfitError: an operation without a deterministic implementation ran in the block (one
            line naming it and ``asked_by``, the option that asked; PyTorch's error chained).
    """
    if not active:
        yield
        return
    found = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.utils.deterministic.fill_uninitialized_memory, torch.backends.cudnn.deterministic,
             torch.backends.cudnn.benchmark)
    os.environ.setdefault(CUBLAS_ENV, CUBLAS_DETERMINISTIC)
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    except RuntimeError as e:
        if NO_DETERMINISTIC_KERNEL not in str(e):
            raise
        what = str(e).split(NO_DETERMINISTIC_KERNEL)[0].strip() or "an operation"
        raise TightfitError(f"{asked_by}: {what} has no deterministic implementation in PyTorch "
                            f"(torch.use_deterministic_algorithms); run without {asked_by}") from e
    finally:
        torch.use_deterministic_algorithms(found[0], warn_only=found[1])
        torch.utils.deterministic.fill_uninitialized_memory = found[2]
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = found[3], found[4]
