"""tightfit: train and fine-tune PyTorch models on GPUs with little memory, as fast as the card allows.

In your own loop: ``plan = tightfit.plan(model, sample_batch, effective_batch=64, budget="4GiB")``,
``step = tightfit.TrainStep(plan, model, optimizer)``, then ``step(batch)`` per optimizer step
(:mod:`tightfit.loop`); catch ``tightfit.TightfitError`` (bad input, nothing fits) and its
subclasses ``tightfit.NonFiniteTrainingError`` and ``tightfit.PartialUpdateError``. ``tightfit.plan`` is that function; the :class:`Plan` class lives in the
module ``tightfit.plan`` (``from tightfit.plan import Plan``, or ``tightfit.Plan``).
"""

__version__ = "0.2.0"

from .errors import TightfitError  # noqa: E402
from .plan import Plan  # noqa: E402
from .units import format_bytes, parse_size  # noqa: E402

del plan  # the submodule's attribute; ``tightfit.plan`` is the planning function (loaded on first use)

__all__ = ["NonFiniteTrainingError", "PartialUpdateError", "Plan", "StepOutcome", "TightfitError", "TrainStep",
           "format_bytes", "parse_size", "plan", "__version__"]

_LOOP = ("plan", "TrainStep", "StepOutcome")
# what a training loop may catch besides TightfitError (both are TightfitErrors)
_ERRORS = ("NonFiniteTrainingError", "PartialUpdateError")


def __getattr__(name):
    # the own-loop API and the runtime's errors import torch: loaded on first use, so that
    # `import tightfit` stays light
    if name in _LOOP:
        from . import loop

        globals().update({n: getattr(loop, n) for n in _LOOP})
        return globals()[name]
    if name in _ERRORS:
        from .runtime import trainer

        globals().update({n: getattr(trainer, n) for n in _ERRORS})
        return globals()[name]
    raise AttributeError(f"module 'tightfit' has no attribute {name!r}")


def __dir__():
    # the attributes loaded on first use are listed too
    return sorted(set(globals()) | set(__all__))
