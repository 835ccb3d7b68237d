"""The wheel ships every package of the source tree (pyproject lists them one by one)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_fxflops_package_is_in_the_wheel():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "fxflops").rglob("__init__.py")}
    assert on_disk <= listed, f"packages missing from pyproject.toml: {sorted(on_disk - listed)}"


def test_report_assets_are_package_data():
    """The HTML report reads its CSS and script from fxflops/report/assets: they must be in the wheel."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = data.get("fxflops.report", [])
    assets = sorted((ROOT / "fxflops" / "report" / "assets").iterdir())
    assert assets
    for asset in assets:
        relative = asset.relative_to(ROOT / "fxflops" / "report")
        assert any(relative.match(pattern) for pattern in patterns), f"{relative} is not package data"
