# pytest --nbval-lax must not run the exercise notebooks here: the solutions are run and graded
# by tests/test_exercises.py (`flashedu check`). The solved course notebooks in notebooks/ are
# run (a glob's * would match them too, so the files are named one by one).
from pathlib import Path

collect_ignore = [path.name for path in Path(__file__).parent.glob("*.ipynb")]
