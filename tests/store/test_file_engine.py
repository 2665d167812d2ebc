"""The file engine: the engine contract (`engine_conformance`), and what is its own:
URLs, the directory it makes, torn writes, dead writers' temporary files, the raw figure."""
from __future__ import annotations

import os

import pytest

from engine_conformance import EngineConformance
from kvtier.kernels.errors import KvtierError
from kvtier.store import Status, open_store
from kvtier.store.file import FileEngine, object_name


class TestFileEngineContract(EngineConformance):
    @pytest.fixture
    def open_engine(self, tmp_path):
        return lambda: open_store(f"file://{tmp_path}/store")
