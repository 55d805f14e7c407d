"""Memory of a training step: estimate it without a GPU, measure it on one.

- :func:`estimate` traces one training step on meta tensors and replays its allocations
  through a model of PyTorch's CUDA caching allocator (:mod:`.allocator`).
- :func:`tightfit.models.build_model` builds the built-in architectures (on the meta device: no memory used).
- :mod:`tightfit.levers.blocks` (a lever shared with the runtime) finds a model's repeated blocks and checkpoints all or some.
- :mod:`tightfit.step` is the one training step that the estimate traces, the GPU measurement
  runs and the runtime trains with.
- :mod:`.fast` is the planner's memory-growth model: peak reserved bytes on lines in the micro-batch.
- :mod:`.ledger` keeps a trace's accounting as events; :mod:`.replay` answers the exact estimate
  at another micro-batch from such events where that is proven to give what a trace would.
"""

import sys as _sys
import types as _types


class _Package(_types.ModuleType):
    """This package: its ``estimate`` is the function (as documented), not the submodule of that
    name, which the import system binds here whenever the submodule is imported."""

    def __setattr__(self, name, value):
        if name == "estimate" and isinstance(value, _types.ModuleType):
            return  # the submodule stays reachable as sys.modules["tightfit.memory.estimate"]
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package


def __getattr__(name):  # lazy: importing this package needs no estimator
    if name in ("MemoryEstimate", "estimate"):
        import importlib

        module = importlib.import_module(f"{__name__}.estimate")
        globals().update(estimate=module.estimate, MemoryEstimate=module.MemoryEstimate)
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["MemoryEstimate", "estimate"]
