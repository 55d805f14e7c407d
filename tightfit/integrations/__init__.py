"""tightfit where you already train: the Hugging Face Trainer (:mod:`.hf`) and Lightning (:mod:`.lightning`).

Each takes a plan from :func:`tightfit.plan` and turns it into the framework's own settings, and adds
a callback for memory and health reporting and tightfit's guards where the framework allows them.
"""

from __future__ import annotations

import importlib

from ..errors import TightfitError


def require(module: str, extra: str = "integrations"):
    """Import ``module``, or fail with one line naming the extra that installs it.

    Raises:
        TightfitError: ``module`` is not installed.
    """
    try:
        return importlib.import_module(module)
    except ImportError:
        raise TightfitError(f"{module} is not installed: pip install 'tightfit[{extra}]'") from None
