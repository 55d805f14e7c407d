"""Faults a careful user of the Python API finds (session 36): the runtime's own settings are
checked like the options, and a max_steps the epochs cut is said where it was asked for."""

import re
import warnings

import pytest

from conftest import SyntheticBatches, tiny_bert
from tightfit.errors import TightfitError
from tightfit.plan import Plan
from tightfit.runtime.trainer import TrainConfig, Trainer
from tightfit.workload import Workload


@pytest.mark.parametrize("field, value, says", [
    ("prefetch", "no", "prefetch must be True or False, not 'no' (a str)"),
    ("background_checkpoints", 3, "background_checkpoints must be True or False"),
    ("cooldown_max_s", -1, "cooldown_max_s must be positive and finite"),
    ("cooldown_max_s", "60", "cooldown_max_s must be a number"),
    ("checkpoint_dir", 5, "checkpoint_dir must be a folder path"),
])
def test_the_runtime_settings_of_a_train_config_are_checked(field, value, says):
    """`TrainConfig(prefetch="no")` was taken as true (a non-empty string), and a number as the
    checkpoint folder failed only at the first checkpoint."""
    with pytest.raises(TightfitError, match=re.escape(says)):
        TrainConfig(**{field: value})


def test_a_max_steps_beyond_the_epochs_is_said_to_a_python_caller():
    """24 samples at effective batch 8 are 3 steps an epoch: max_steps=10 trains 3, and said so."""
    w = Workload(tiny_bert(), SyntheticBatches(24), None, 8)
    with pytest.warns(UserWarning, match=r"max_steps=10 is more than the 3 optimizer steps of 1 epoch\(s\): training 3"):
        t = Trainer(w, Plan("fp32", 8, 8), TrainConfig(epochs=1, max_steps=10), progress=False)
    assert t.total_steps == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # within the epochs: no warning
        Trainer(w, Plan("fp32", 8, 8), TrainConfig(epochs=1, max_steps=2), progress=False)
