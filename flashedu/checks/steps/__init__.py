"""The checks of the notebooks' steps: one module per topic, each a list ``STEPS`` of
:class:`~flashedu.checks.engine.Exercise`, graded by the engine that grades the exercises.

A notebook's step cell names its check in its metadata (``flashedu.exercise``, see
:mod:`flashedu.course`); ``flashedu.checks.check(name, fn)`` runs it. Steps are practice, not
graded exercises: ``flashedu check`` never grades them and they carry no points in a class.
"""

from __future__ import annotations

import importlib
import pkgutil


def collect() -> list:
    found = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        found += module.STEPS
    return found
