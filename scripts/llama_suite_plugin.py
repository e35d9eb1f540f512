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
