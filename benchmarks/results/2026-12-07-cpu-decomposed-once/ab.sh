#!/bin/bash
# W1 (meta device): the shallow model then the whole graph made, the code before (ac30e85, unpacked
# into /tmp/oldk with `git archive ac30e85 kopt | tar -x -C /tmp/oldk`) and this code, alternated.
for i in 1 2 3; do
  PYTHONPATH=/tmp/oldk python shallow_then_whole.py before | grep shallow
  python shallow_then_whole.py after | grep shallow
done
