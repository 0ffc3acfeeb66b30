"""A machine without the optional native modules (no libibverbs-dev, no CUDA headers).

Built with ``TENSORXFER_NO_VERBS=1 TENSORXFER_NO_CUDA=1`` the package must import, name the
missing piece plainly, and every test must pass or skip with that reason.  Here the missing
modules are simulated in a child process by a finder that refuses them the way Python does for
a module that does not exist, so this runs on fully built machines too.
"""

from __future__ import annotations

import json

from tests.helpers import child, finish

WITHOUT_NATIVE = """
import json, sys

MISSING = {"tensorxfer.transport._verbs", "tensorxfer.memory._cuda"}

class Missing:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name in MISSING:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Missing)
import tensorxfer
from tensorxfer.transport import local_transports, rdma, unavailable_reason
from tensorxfer.memory import CUDA_UNAVAILABLE
print(json.dumps({"rdma": rdma.rdma_available()[1], "reason": unavailable_reason("rdma"),
                  "transports": local_transports(), "cuda": CUDA_UNAVAILABLE}))
"""


def test_missing_native_modules_are_named_not_called_circular_imports():
    rc, out, err = finish(child(WITHOUT_NATIVE))
    assert rc == 0, err
    r = json.loads(out)
    for key in ("rdma", "reason", "cuda"):
        assert "circular" not in r[key], r[key]
    assert "No module named 'tensorxfer.transport._verbs'" in r["rdma"] and "libibverbs-dev" in r["rdma"]
    assert r["reason"] == r["rdma"]
    assert "rdma" not in r["transports"] and "tcp" in r["transports"]
    assert "tensorxfer.memory._cuda" in r["cuda"]
