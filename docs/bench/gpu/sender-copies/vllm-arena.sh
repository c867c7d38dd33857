#!/usr/bin/env bash
# vLLM's pattern (official Python API, prepare timed, READs with a
# notification) over the bounce arena (--bounce-param enable_peer_map=false,
# no MPS): the plan's packed copies (new: the reader's READ encoded and its
# scatter tables filled from them) against runs (old, carried as
# .gpu/old/libplugin_BOUNCE.so); TP=4 at 128 and 8192 tokens,
# two rounds alternating. Needs .gpu and .py312 carried.
exec bash "$(dirname "$0")/../vllm-old-new.sh" vllm-arena --bounce-param enable_peer_map=false
