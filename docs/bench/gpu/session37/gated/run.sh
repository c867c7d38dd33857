#!/usr/bin/env bash
# Became the standing-credit call before it ran (no device was lent until
# then): see ../standing/run.sh, which also holds one round of the
# announcement off and on.
exec bash docs/bench/gpu/session37/standing/run.sh
