"""``tensorxfer``: the umbrella command (``demo``, ``doctor``)."""

from __future__ import annotations

import argparse
import sys
import time


def demo(args: argparse.Namespace) -> int:
    """Pack a synthetic 820-tensor model into one region, ship its manifest, rebuild and verify it."""
    import numpy as np

    from tensorxfer import Manifest, TensorRegion, synthetic

    size = int(args.size)
    t0 = time.perf_counter()
    src = dict(synthetic.tensors(size))
    with TensorRegion.from_tensors(src) as region:
        t_pack = time.perf_counter() - t0
        wire = region.manifest.pack()
        manifest = Manifest.unpack(wire)
        ext = region.resolve_extent()
        with TensorRegion.from_manifest(manifest) as copy:
            t1 = time.perf_counter()
            copy.update_from(region.tensors())
            t_copy = time.perf_counter() - t1
            views = copy.tensors()
            ok = all(views[n].tobytes() == a.tobytes() for n, a in src.items())
            del views
        print(f"packed {len(manifest)} tensors, {region.nbytes / 1e6:.1f} MB into one region of "
              f"{len(region.region.chunks)} memfd chunks in {t_pack:.2f} s")
        print(f"extent: one registration covers {len(ext.segments)} handles, {ext.length} bytes")
        print(f"manifest: {len(wire)} bytes of msgpack, validated on unpack")
        print(f"rebuilt from the manifest and copied in {t_copy:.3f} s "
              f"({region.nbytes / t_copy / 1e9:.2f} GB/s); byte-identical: {ok}")
    del np
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tensorxfer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="a built-in round trip of a synthetic 820-tensor model")
    p.add_argument("--size", default=256 << 20, type=int, help="model bytes (default 256 MiB)")
    p.set_defaults(func=demo)
    from tensorxfer.cli import doctor

    doctor.add_parser(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
