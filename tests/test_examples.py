"""The README's "Use tightfit in your own code" examples: each is a file in examples/, shown verbatim in
the README and run here as a user would run it, so the README cannot drift from code that works."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ["own_loop.py", "hf_trainer.py", "lightning_fit.py"]


def _readme_blocks() -> dict[str, str]:
    """``{example path: the python block after its <!-- example: PATH --> marker}`` in the README."""
    text = (ROOT / "README.md").read_text()
    return dict(re.findall(r"<!-- example: (\S+) -->\n```python\n(.*?)```", text, flags=re.S))


def test_readme_shows_every_example_verbatim():
    blocks = _readme_blocks()
    assert sorted(blocks) == sorted(f"examples/{n}" for n in EXAMPLES)
    for path, block in blocks.items():
        assert block == (ROOT / path).read_text(), f"README's {path} differs from the file"


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs(name, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, str(ROOT / "examples" / name)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "plan:" in run.stdout or "micro-batch" in run.stdout, run.stdout
    # the plan's loss runs outside fit: a training_step that calls self.log would warn here
    assert "self.log" not in run.stderr, run.stderr[-3000:]


def test_examples_take_the_sample_batch_without_drawing_from_the_loaders_shuffle():
    # next(iter(loader)) on a shuffling loader draws from torch's RNG: the run would train in another order
    for name in EXAMPLES:
        assert "next(iter(" not in re.sub(r"#.*", "", (ROOT / "examples" / name).read_text()), name
