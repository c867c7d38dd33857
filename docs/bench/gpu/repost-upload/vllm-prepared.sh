#!/usr/bin/env bash
# vLLM's pattern (official Python API, prepare timed) with BOUNCE's
# preparation in make_prepped_xfer (prepare_at_post=false): tables uploaded
# there (new) against small ones as the launch's parameter (old, carried as
# .gpu/old/libplugin_BOUNCE.so); 128 and 8192 tokens at TP=4, two rounds
# alternating. Needs .gpu and .py312 carried.
exec bash "$(dirname "$0")/../vllm-old-new.sh" vllm-prepared --bounce-param prepare_at_post=false
