"""Imported first by the scripts beside it: with KVTIER_AT=DIR, kvtier is imported from
DIR (a package tree laid out as installed: DIR/kvtier/{store,pool,...}; see README)
instead of the editable install, so one script measures two commits in turn."""
import os
import sys

if os.environ.get("KVTIER_AT"):
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    sys.path.insert(0, os.environ["KVTIER_AT"])
