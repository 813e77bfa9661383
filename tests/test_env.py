"""environment.yml (conda) and pyproject.toml (pip) ask for the same packages and versions."""

import pathlib
import re
import tomllib

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONDA_NAMES = {"pytorch": "torch"}  # conda-forge's name -> PyPI's


def _split(req: str):
    name, spec = re.match(r"([A-Za-z0-9_.\-]+)\s*(.*)", req).groups()
    return CONDA_NAMES.get(name.lower(), name.lower()), spec.replace(" ", "")


def test_environment_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = dict(_split(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"])
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    got = {}
    for dep in env["dependencies"]:
        reqs = dep["pip"] if isinstance(dep, dict) else [dep]
        for r in reqs:
            if r.startswith("-e") or r.split("=")[0] in ("python", "pip"):
                continue
            got.update([_split(r)])
    assert got == wanted
