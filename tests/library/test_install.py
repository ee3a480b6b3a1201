"""The library's wheel is the library alone; the daemons come from a distribution of their own.

The repository holds two projects over one ``src/``: the library (``pyproject.toml``,
``iop-admission``: ``iop_admission`` with ``py.typed``, needing trio and attrs) and the daemons
(``daemons/pyproject.toml``, ``iop-daemons``: every other package and the five commands, needing
the library). How the library is checked, and why this way: the test builds the wheel offline (``pip wheel --no-deps
--no-build-isolation``, seconds, no network), checks its metadata, then makes a
fresh venv, installs the wheel there with ``--no-deps --no-index`` and gives the
venv exactly the distributions the base requirements resolve to -- the closure
of ``Requires-Dist`` without extras, walked through this environment's metadata
and linked in, dist-info included. ``pip check`` in that venv then proves the
base requirements are satisfied by that closure and nothing more; the import
and ``mypy --strict`` on the examples run in it. No index is contacted, so the
test is as fast and as reliable in CI as on a laptop, and it tests the wheel
users get rather than the editable source tree.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import venv
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
DAEMON_EXTRA = {"cattrs", "trio-websocket", "wsproto", "ruamel.yaml", "h11", "httpx", "httptools", "orjson", "rich"}
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _base_requirements(requires: list[str]) -> list[str]:
    """The requirement names that carry no marker (no extra)."""
    names = []
    for line in requires:
        if ";" in line:
            continue
        match = NAME.match(line.strip())
        assert match is not None, line
        names.append(match.group(0))
    return names


def _clean_copy(tmp: Path) -> Path:
    """The two projects' files alone, copied into ``tmp``: setuptools builds in the project's own
    ``build/``, which a checkout may hold from an older layout (a wheel must come from the tree)."""
    copy = tmp / "repository"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    shutil.copytree(ROOT / "src", copy / "src", ignore=ignore)
    (copy / "daemons").mkdir()
    for name in ("pyproject.toml", "README.md", "daemons/pyproject.toml"):
        shutil.copy(ROOT / name, copy / name)
    return copy


def _wheel(tmp: Path, project: str = ".", name: str = "iop_admission") -> Path:
    """Build the wheel of ``project`` (``.``, the library, or ``daemons``) from a clean copy."""
    out = tmp / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(_clean_copy(tmp) / project),
        ],
        check=True,
        cwd=tmp,
    )
    (wheel,) = out.glob(f"{name}-*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _wheel(tmp_path_factory.mktemp("build"))


@pytest.fixture(scope="module")
def daemons_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _wheel(tmp_path_factory.mktemp("build-daemons"), "daemons", "iop_daemons")


def _wheel_metadata(wheel: Path) -> metadata.PackageMetadata:
    import email

    with zipfile.ZipFile(wheel) as z:
        (name,) = (n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return email.message_from_bytes(z.read(name))  # type: ignore[return-value]


def test_wheel_requires_trio_and_attrs_only_and_holds_the_library_alone(wheel: Path) -> None:
    meta = _wheel_metadata(wheel)
    requires = meta.get_all("Requires-Dist") or []
    assert sorted(_canonical(n) for n in _base_requirements(requires)) == ["attrs", "trio"]
    daemons = {_canonical(NAME.match(r).group(0)) for r in requires if 'extra == "daemons"' in r}  # type: ignore[union-attr]
    assert daemons == {"iop-daemons"}  # pip install "iop-admission[daemons]" brings the daemons' distribution
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    assert "iop_admission/py.typed" in names
    assert {n.split("/")[0] for n in names if not n.startswith("iop_admission-")} == {"iop_admission"}
    assert not any(n.endswith("entry_points.txt") for n in names)  # no commands: they are the daemons'


def test_the_daemons_wheel_holds_every_other_package_and_the_commands(daemons_wheel: Path) -> None:
    meta = _wheel_metadata(daemons_wheel)
    requires = {_canonical(n) for n in _base_requirements(meta.get_all("Requires-Dist") or [])}
    assert "iop-admission" in requires
    assert {_canonical(n) for n in DAEMON_EXTRA} <= requires
    with zipfile.ZipFile(daemons_wheel) as z:
        names = z.namelist()
        (entry_points,) = (n for n in names if n.endswith("entry_points.txt"))
        commands = z.read(entry_points).decode()
    tops = {n.split("/")[0] for n in names if not n.startswith("iop_daemons-")}
    src = {p.name for p in (ROOT / "src").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert tops == src - {"iop_admission"}
    assert {"iop_edge/ui/page.html", "iop_stack/examples/edge.yaml"} <= set(names)
    for command in ("iop-edge", "iop-node", "iop-mock-backend", "iop", "iop-stack"):
        assert f"\n{command} = " in commands


def _closure(roots: list[str]) -> list[metadata.Distribution]:
    """The installed distributions ``roots`` need, transitively (no extras)."""
    seen: dict[str, metadata.Distribution] = {}
    todo = list(roots)
    while todo:
        name = _canonical(todo.pop())
        if name in seen:
            continue
        dist = metadata.distribution(name)
        seen[name] = dist
        todo.extend(_base_requirements(dist.requires or []))
    return list(seen.values())


def _link_into(dist: metadata.Distribution, site: Path) -> None:
    """Make ``dist`` installed in ``site``: link its top-level files and dist-info."""
    base = Path(str(dist.locate_file("")))
    tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
    for top in tops:
        if top == "__pycache__" or top.endswith(".pth"):
            continue
        target = site / top
        if not target.exists():
            os.symlink(base / top, target)


@pytest.fixture(scope="module")
def clean_venv(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Path:
    root = tmp_path_factory.mktemp("clean")
    env = root / "venv"
    venv.EnvBuilder(with_pip=False).create(env)
    python = env / "bin" / "python"
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    requires = _wheel_metadata(wheel).get_all("Requires-Dist") or []
    for dist in _closure(_base_requirements(requires)):
        _link_into(dist, site)
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-deps", "--no-index", wheel],
        check=True,
    )
    return python


def test_clean_venv_base_install_is_complete_and_lean(clean_venv: Path) -> None:
    check = subprocess.run(
        [sys.executable, "-m", "pip", "--python", clean_venv, "check"], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    probe = (
        "import importlib.util, sys, iop_admission\n"
        "print(iop_admission.__version__)\n"
        f"print(sorted(m for m in {sorted(n.replace('-', '_').split('.')[0] for n in DAEMON_EXTRA)!r}"
        " if importlib.util.find_spec(m) is not None))\n"
    )
    out = subprocess.run([clean_venv, "-c", probe], check=True, capture_output=True, text=True, cwd="/").stdout
    version, found = out.splitlines()
    assert version == metadata.version("iop-admission")
    assert found == "[]"


def test_the_library_alone_installs_no_command(clean_venv: Path) -> None:
    assert not (clean_venv.parent / "iop-edge").exists()
    top = subprocess.run(
        [
            clean_venv,
            "-c",
            "import importlib.util as u; print([m for m in ('iop_edge', 'iop_node', 'iop_wire') if u.find_spec(m)])",
        ],
        check=True,
        capture_output=True,
        text=True,
        cwd="/",
    ).stdout.strip()
    assert top == "[]"


def test_mypy_strict_on_the_examples_in_the_clean_venv(clean_venv: Path) -> None:
    # Not the examples that need an extra: fastapi_guard (FastAPI), testing_guard (the testing extra, Hypothesis).
    examples = sorted(str(p) for p in EXAMPLES.glob("*.py") if p.stem not in ("fastapi_guard", "testing_guard"))
    assert examples
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--python-executable", clean_venv, *examples],
        capture_output=True,
        text=True,
        cwd="/",
    )
    assert done.returncode == 0, done.stdout + done.stderr
