"""The buffers a forward changes -- BatchNorm's running statistics (mean, variance,
``num_batches_tracked``) above all -- copied before, and written back after, whatever must leave
the model as it found it: an OOM redo, a recomputation in backward, a planner's probe step, a
rank's padding micro-batch, a one-sample trial forward.
"""

from __future__ import annotations

from typing import Iterable

import torch

# The most bytes of buffers :func:`buffer_snapshot` copies before each step. BatchNorm's running
# statistics are KiB to a few MiB (ResNet-50: 0.2 MiB); a model holding more in buffers (a large
# mask or table) would pay a copy of it at every step for a rare OOM redo, so it is not copied.
BUFFER_SNAPSHOT_BYTES = 64 * 2**20


def buffer_snapshot(modules: Iterable[torch.nn.Module]) -> list[tuple[torch.nn.Module, str, torch.Tensor]] | None:
    """Copies of the buffers a forward may change (floating-point and integer ones: BatchNorm's
    running mean and variance and ``num_batches_tracked``; boolean masks are left), so that an
    OOM redo starts from the buffers the failed attempt found (:func:`restore_buffers`), as a run
    at the smaller micro-batch from the start would (DESIGN invariant 2). One clone per buffer,
    queued on the buffers' device (no host sync).

    Args:
        modules: the model's modules (``model.modules()``, or a list of them made once).

    Returns:
        ``[(module, buffer name, copy)]``: of every module's buffers up to
        :data:`BUFFER_SNAPSHOT_BYTES` in all, else of the norms' with running statistics among
        them (one large table elsewhere does not leave BatchNorm's statistics uncopied); None
        when even those are over it (then a redo keeps what the failed attempt wrote to them).
    """
    modules = list(modules)
    for chosen in (modules, [m for m in modules if is_running_stat_norm(m)]):
        found = [(m, name, b) for m in chosen for name, b in m._buffers.items() if _changeable(b)]
        if sum(b.numel() * b.element_size() for _, _, b in found) <= BUFFER_SNAPSHOT_BYTES:
            return [(m, name, b.detach().clone()) for m, name, b in found]
    return None


def _changeable(buffer) -> bool:
    """A buffer a forward may update: floating-point or integer (boolean masks are left)."""
    return buffer is not None and buffer.dtype != torch.bool and not buffer.is_complex()


def buffer_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules in ``module`` that hold buffers a forward may update (:func:`buffer_snapshot`'s
    kind): BatchNorm's running statistics, a moving average or counter of the user's own."""
    return [m for m in module.modules() if any(_changeable(b) for b in m._buffers.values())]


def restore_buffers(snapshot: list[tuple[torch.nn.Module, str, torch.Tensor]] | None,
                    unless: torch.Tensor | None = None) -> None:
    """Write a :func:`buffer_snapshot` back into the buffers, in place (DDP and compiled graphs
    hold the buffer tensors themselves). None: nothing to restore.

    ``unless``: a 0-d boolean device tensor; where it is True the buffers are kept as they are
    (a step's "applied", decided on the device: the choice is made there, with no host sync)."""
    with torch.no_grad():
        for module, name, copy in snapshot or ():
            buffer = module._buffers[name]
            buffer.copy_(copy if unless is None else torch.where(unless, buffer, copy))


def is_running_stat_norm(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a norm layer that updates running statistics in train mode:
    BatchNorm (1-3d, SyncBatchNorm) or InstanceNorm with ``track_running_stats``."""
    return isinstance(module, torch.nn.modules.batchnorm._NormBase) and module.track_running_stats


def running_stat_norms(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The norm layers in ``module`` that update running statistics (:func:`is_running_stat_norm`)."""
    return [m for m in module.modules() if is_running_stat_norm(m)]


class KeptBuffers:
    """Context: the buffers of ``modules`` (each module's own, :func:`buffer_snapshot`) as they
    were on entry, written back in place on exit.
    Re-enterable (a stack), as the recomputation contexts it is entered with.
    """

    def __init__(self, modules: Iterable[torch.nn.Module]):
        self.modules, self.saved = list(modules), []

    def __enter__(self):
        self.saved.append(buffer_snapshot(self.modules))
        return self

    def __exit__(self, *exc):
        restore_buffers(self.saved.pop())
        return False
