"""The deployment examples in ``deploy/systemd`` say what the daemons really do.

Each unit starts its daemon's console script with ``--config``, reloads with SIGHUP (both
daemons re-read their config on it), restarts on failure but not on the exit codes that
a restart cannot fix, and takes its secrets from an ``EnvironmentFile``. The README points
at them.
"""

from __future__ import annotations

import configparser
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNITS = {"iop-edge": "2", "iop-node": "2 3"}


def unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # systemd keys are case-sensitive
    parser.read_string((ROOT / "deploy" / "systemd" / f"{name}.service").read_text(encoding="utf-8"))
    return parser


@pytest.mark.parametrize(("name", "no_restart_codes"), UNITS.items())
def test_unit_starts_reloads_restarts_and_reads_secrets(name: str, no_restart_codes: str) -> None:
    service = unit(name)["Service"]
    scripts = tomllib.loads((ROOT / "daemons" / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]
    assert name in scripts
    executable, *args = service["ExecStart"].split()
    assert executable.endswith(f"/bin/{name}") and args[0] == "--config"
    assert service["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert service["Restart"] == "on-failure"
    assert service["RestartPreventExitStatus"] == no_restart_codes
    assert service["EnvironmentFile"].startswith("/etc/iop/")
    assert service["KillSignal"] == "SIGTERM"
    assert unit(name)["Install"]["WantedBy"] == "multi-user.target"


def test_readme_references_the_deployment_examples() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for path in ("deploy/systemd/iop-edge.service", "deploy/systemd/iop-node.service", "deploy/grafana/iop-edge.json"):
        assert path in readme, path
