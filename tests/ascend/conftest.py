"""tests/ascend: make the lowering helpers importable as `lowering`."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
