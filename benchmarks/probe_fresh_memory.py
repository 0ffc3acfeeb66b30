"""What fresh memory costs on this machine: a 2 GB private host region allocated and committed (every page
touched) again and again in one process, right after freeing the last one and after pauses.

On a VM that hands freed guest memory back to its host (virtio-balloon free page reporting, virtio-mem),
the first touch of memory the guest has not used lately is the host's work too, and costs many times a
touch of memory freed a moment ago.  Every CLI process pays it for its region, and the receiver again for
the page cache of the files it writes: that, not the copies, is most of the CLI's time on such a VM.
Prints one JSON line::

    python3 benchmarks/probe_fresh_memory.py [--size 2e9] [--pauses 0 0 5 0 10]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tensorxfer.memory import HostRegion


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=float, default=2e9)
    p.add_argument("--pauses", type=float, nargs="*", default=[0, 0, 5, 0, 10])
    args = p.parse_args(argv)
    rounds = []
    for pause in args.pauses:
        time.sleep(pause)
        t = time.perf_counter()
        region = HostRegion.allocate(int(args.size), private=True)     # committed: every page touched
        seconds = time.perf_counter() - t
        region.close()
        rounds.append({"pause_before_s": pause, "allocate_and_commit_s": seconds})
    print(json.dumps({"size": int(args.size), "rounds": rounds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
