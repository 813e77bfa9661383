# pytest --nbval-lax must not run these notebooks: the exercises raise NotImplementedError by
# design, and the solutions are run and graded by tests/test_exercises.py (`flashedu check`).
collect_ignore_glob = ["*.ipynb"]
