#!/usr/bin/env bash
# For the session after the thirty-third: what its GPU calls left.
# 1. The GPU suite's last stages at the tree's commit (the thirty-third ran
#    `.gpu/run.sh tests` up to the fallback test): the fallback test and
#    vLLM's mixed-memory READs both ways through the host-staged arenas
#    (the launch rule and the pass limit apply there too; not run yet).
# 2. On an H200 (issue 15's targets are set there; the thirty-third had an
#    H100 only): lone arena WRITEs of 1024 and 16,384 x 4 KiB and 128 in
#    flight under MPS, then without MPS (issue 15: 16,384 x 4 KiB at least
#    80 GB/s), ITERS (20) timed each.
# 3. (optional) the plan without branches against the plugin before it.
# $OUT/all.tgz. From the repository root, .gpu and .py312 carried: bash THIS.
set -uo pipefail
source docs/bench/gpu/lib.sh
gpu_call s34-next || exit 1
summary="$work/summary.txt"
s=$SECONDS; timeout 90 "$v" test --target-param enable=false --expect-fallback >"$work/vram-test-fallback.log" 2>&1
echo "vram-test-fallback rc=$? ($((SECONDS-s)) s)" | tee -a "$summary"; pack
for dirs in "cuda torch-cpu" "torch-cpu cuda"; do
  set -- $dirs
  s=$SECONDS
  timeout 150 python3 bench/vllm_pattern.py --device "$1" --reader-device "$2" --cases tp4-128,tp4-8k \
    --token-scale 0.25 --iters 3 --warmup 1 --backends BOUNCE --expect-route "bounce(staged)" \
    >"$work/mixed-$1-$2.log" 2>&1
  echo "mixed-$1-$2 rc=$? ($((SECONDS-s)) s)" | tee -a "$summary"; pack
done
bench() { # tag
  timeout 100 "$v" bench --backend BOUNCE --label "$1" --param enable_peer_map=false --sizes 4096 \
    --counts 1024,16384 --concurrent 128 --iters "${ITERS:-20}" >"$work/bench-$1.log" 2>&1
  echo "bench-$1 rc=$?" >>"$summary"
  grep -h "inflight\|preparation" "$work/bench-$1.log" | cut -c1-150
  pack
}
mps_start; bench arena-mps; mps_stop
bench arena-nomps
# 3. With .gpu/old/libplugin_BOUNCE.so (3355d8d's plugin, before the plan
#    without branches, 48c62d6; copied there after the pack), both
#    alternating under MPS, two rounds: the preparation lines compare the
#    plan's cost on the GPU host.
if [[ -f .gpu/old/libplugin_BOUNCE.so ]]; then
  new=$NIXL_PLUGIN_DIR old=$(old_plugin_dir)
  mps_start
  for round in 1 2; do
    for k in old new; do NIXL_PLUGIN_DIR=${!k} bench "plan-$k-r$round"; done
  done
  mps_stop
fi
cat "$summary"
