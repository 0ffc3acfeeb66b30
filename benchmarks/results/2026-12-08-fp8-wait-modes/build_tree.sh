#!/usr/bin/env bash
# build_tree.sh REV|work OUTDIR: a cp312 in-place build of REV (or the work tree) for the device
set -eu
REV=$1; D=$2; rm -rf $D; mkdir -p $D
if [ "$REV" = work ]; then git ls-files -co --exclude-standard | grep -v '^\.out/\|^\.whl/' | tar cf - -T - | tar xf - -C $D
else git archive $REV | tar xf - -C $D; fi
[ -n "${3:-}" ] && (cd $D && patch -p1 -s < $3)
cd $D && /tmp/v312/bin/python setup.py build_ext --inplace -q -j 2 > build.log 2>&1 || { tail -30 build.log; exit 1; }
rm -rf build benchmarks/results build.log
find . -name '*.c' ! -name '*_helpers.c' -delete; find . -name '*.cpp' -delete
du -sh .
