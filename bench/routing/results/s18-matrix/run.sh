#!/bin/bash
# The matrix at fcb5eef (session 18: turns claimed across replicas, replicas in sync from their start), run
# from the repository root: session 17's commands, the router of that commit.
set -e
REV=${REV:-fcb5eef} OUT=bench/routing/results/s18-matrix exec bash bench/routing/results/s17-matrix/run.sh
