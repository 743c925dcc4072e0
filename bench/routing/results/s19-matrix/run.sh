#!/bin/bash
# The matrix at ce2b800 (session 19: a turn whose claim went leads at once; readiness waits for the peers),
# run from the repository root: session 17's commands, the router of that commit.
set -e
REV=${REV:-ce2b800} OUT=bench/routing/results/s19-matrix exec bash bench/routing/results/s17-matrix/run.sh
