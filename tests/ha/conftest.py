from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest

from .etcd_server import EtcdServer, running_etcd


@pytest.fixture
def etcd(tmp_path: pathlib.Path) -> Iterator[EtcdServer]:
    with running_etcd(tmp_path) as server:
        yield server
