"""tensorxfer-send / tensorxfer-recv killed at 60 % and run again (issue 40): one record per run, as JSON.

    TENSORXFER_RESTART_SHARD_MB=512 TENSORXFER_RESTART_KILL_AFTER=1.5 PYTHONPATH=. \
        python benchmarks/bench_resume_restart.py send|recv

The harness is ``tests/test_cli_restart.py``'s (separate CLI processes through the pausing relay process,
SIGKILL at the pause, byte-identical output asserted); 4 shards of ``TENSORXFER_RESTART_SHARD_MB`` MiB each
in a fresh directory under /tmp, removed afterwards.  Results: benchmarks/results/2026-12-06-resume-restart/.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

from tests.test_cli_restart import BIG_SHARD_BYTES, kill_receiver_then_resume, kill_sender_then_resume


def main() -> None:
    which = sys.argv[1] if len(sys.argv) > 1 else "send"
    if which not in ("send", "recv"):
        sys.exit("usage: bench_resume_restart.py send|recv")
    tmp = Path(tempfile.mkdtemp(prefix="tensorxfer-restart-"))
    try:
        run = kill_receiver_then_resume if which == "recv" else kill_sender_then_resume
        print(json.dumps(run(tmp / "x", BIG_SHARD_BYTES)))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
