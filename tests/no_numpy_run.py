"""Run a script (``python no_numpy_run.py SCRIPT ARGS...``, under torchrun) with numpy unimportable,
as in a fresh virtual environment: tests/test_recipes.py launches recipes/train_gpt.py through it."""

import os
import runpy
import sys

sys.modules["numpy"] = None  # type: ignore[assignment]  # `import numpy` now raises ImportError
script = os.path.abspath(sys.argv[1])
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(script)  # what `python SCRIPT` puts first
runpy.run_path(script, run_name="__main__")
