"""pytest plugin for scripts/llama-server-suite.sh: every model preset of llama.cpp's server
test-suite serves the local GGUF named by $SUITE_MODEL (SmolLM2-135M) instead of a download."""

import os

import utils

_start = utils.ServerProcess.start


def _start_with_local_model(self, *args, **kwargs):
    self.model_file = os.environ["SUITE_MODEL"]
    self.model_hf_repo = None
    self.model_hf_file = None
    self.model_url = None
    self.offline = False
    return _start(self, *args, **kwargs)


utils.ServerProcess.start = _start_with_local_model


def pytest_collection_modifyitems(config, items):
    """Leaves out the tests named, one exact node id a line, in the file $SUITE_DESELECT
    (pytest's --deselect matches prefixes: `test_rerank` would also drop `test_rerank_tei`)."""
    path = os.environ.get("SUITE_DESELECT")
    if not path:
        return
    with open(path) as f:
        names = {line.strip() for line in f if line.strip()}
    kept = [item for item in items if item.nodeid not in names]
    dropped = [item for item in items if item.nodeid in names]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
