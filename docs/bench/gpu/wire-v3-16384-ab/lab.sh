R=$(pwd); O=$OUT
source .gpu/run.sh python >/dev/null 2>&1; cd $R
NEWPD=$NIXL_PLUGIN_DIR; NEWLD=$LD_LIBRARY_PATH
mkdir -p /tmp/nb-old && tar -C /tmp/nb-old -xJf .gpu/old.tar.xz
OLDPD=/tmp/nb-old/site/.nixl_cu13.mesonpy.libs/plugins; OLDLD=/tmp/nb-old/site/.nixl_cu13.mesonpy.libs
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog; mkdir -p /tmp/mps /tmp/mpslog; nvidia-cuda-mps-control -d
for round in 1 2 3; do for which in new old; do
if [ $which = old ]; then export NIXL_PLUGIN_DIR=$OLDPD LD_LIBRARY_PATH=$OLDLD; V=/tmp/nb-old/bin/bounce-vram; P="--param copy_pair_tables=false"; else export NIXL_PLUGIN_DIR=$NEWPD LD_LIBRARY_PATH=$NEWLD; V=/tmp/nixl-bounce-gpu/bin/bounce-vram; P=""; fi
$V bench --backend BOUNCE --label "r$round-$which" --param enable_peer_map=false $P --sizes 4096 --counts 16384 --concurrent 0 --iters 40 > $O/w-r$round-$which.log 2>&1
done; done
echo quit | nvidia-cuda-mps-control
grep -h -A1 -E "x .*inflight" $O/w-r*.log > $O/ab16384.txt; cat $O/ab16384.txt
