#!/usr/bin/env bash
# Issue 38 in one lease of the GPU machine (device tool; a session has ~30 min of device time and
# 10 min a call, so the calls below are planned to ~9 min each and run back to back).
#
#   here, before:  bash ../shared/tools/gpu-ort-wheel.sh        # .gpu/p1..pN (git-ignored), ~5 min
#                  PYTHON=.venv/bin/python bash tools/gpu_lease.sh pack   # every file exported here: .gpu/files
#                  REHEARSAL=1 PYTHON=.venv/bin/python bash tools/gpu_lease.sh all /tmp/rehearsal   # ORT CPU, short
#   call 0   (carry .gpu/files):  bash tools/gpu_lease.sh prepare
#   call k   (carry .gpu/pk):  mkdir -p /root/parts && cp .gpu/pk/* /root/parts/
#   call N   (carry .gpu/pN):  cp as above && bash tools/gpu_lease.sh correctness $OUT   # steps 1, 2, 5
#   call N+1:                  bash tools/gpu_lease.sh ort $OUT                          # step 3, ONNX Runtime
#   call N+2:                  bash tools/gpu_lease.sh torch $OUT                        # step 3, PyTorch; step 4
#   call N+3, if time remains: bash tools/gpu_lease.sh parity $OUT   # the parity jobs correctness left
#   here, after (each call's files_at as A, B, C):
#     python tools/gpu_order.py write A; tar -xzf A/parity.tar.gz -C A; python tools/gpu_parity.py write A
#     (after a `parity` call D: its tarball holds every report so far; write D instead)
#     python tools/gpu_session.py write B C; python tools/gpu_decode_real.py write C
#     cp C/dec/gpu_decode.* benchmarks/
#
# The files are exported here (pack: this checkout's torch, the one CI tests) and carried, ~10 MB;
# prepare unpacks them, exports whatever is missing, and builds the BLOOM-560m folder and file in
# the background, where it runs on while the next calls carry the wheel's parts; later calls wait. The work folder
# ($GPU_WORK, /root/gpu) outlives each call while the machine is held; $OUT is emptied per call and
# brings back at most 8 files, two folders deep.
set -u
step=$1; out=${2:-}
cd "$(dirname "$0")/.."
if [ -n "${REHEARSAL:-}" ]; then
  work=${GPU_WORK:-/tmp/gpu-rehearsal}; provider=cpu; small=--small
else
  work=${GPU_WORK:-/root/gpu}; provider=cuda; small=
fi
mkdir -p "$work"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

ort_gpu() {  # onnxruntime-gpu from the carried parts (../shared/tools/gpu-ort-wheel.sh)
  [ -n "${REHEARSAL:-}" ] && return 0
  ls /tmp/ortgpu >/dev/null 2>&1 || { mkdir -p /tmp/ortgpu && cat /root/parts/* | xz -d -T0 | tar -x -C /tmp/ortgpu; }
  export PYTHONPATH=/tmp/ortgpu:$PWD
  $py -c "import onnxruntime as o; o.preload_dlls(); print(o.__version__, o.get_available_providers())"
}

ready() {  # wait for prepare's marker $1 (files: the parity / timing files; prepared: all), at most $2 seconds
  for _ in $(seq "$2"); do [ -e "$work/$1" ] && return 0; sleep 1; done
  echo "prepare has not made $1: see $work/prepare.log"; return 1
}

case $step in
  pack)  # here: the parity and timing files, exported once, for call 0 to carry
    export PYTHONPATH=$PWD
    files=$(mktemp -d)
    $py tools/gpu_parity.py build "$files" $small || exit 1
    mkdir -p .gpu/files && tar -cJf .gpu/files/files.tar.xz -C "$files" . && rm -rf "$files" && ls -la .gpu/files ;;
  prepare)
    if [ -e .gpu/files/files.tar.xz ]; then mkdir -p "$work/files" && tar -xJf .gpu/files/files.tar.xz -C "$work/files"; fi
    setsid nohup bash tools/gpu_lease.sh _prepare > "$work/prepare.log" 2>&1 < /dev/null &
    echo "prepare started (log: $work/prepare.log)" ;;
  _prepare)
    export PYTHONPATH=$PWD
    rm -f "$work/files_ready" "$work/prepared"
    $py tools/gpu_parity.py build "$work/files" $small && touch "$work/files_ready"
    $py tools/gpu_decode_real.py run "$work/dec" --device $provider $small --prepare-only
    touch "$work/prepared" ;;
  correctness)  # steps 1, 2 and 5: nothing here is timed, so they share the machine
    ort_gpu; ready files_ready 300 || exit 1
    runtimes=; [ -n "${REHEARSAL:-}" ] && runtimes="--runtimes ort-cpu"
    (timeout 420 $py tools/gpu_parity.py run "$work/files" "$work/parity" --jobs 6 --deadline 330 $runtimes \
      > "$out/parity.log" 2>&1) &
    timeout 200 $py tools/gpu_order.py run "$work/order" tools/data/alibi_attention_0f33d6a.onnx \
      "$work/files/models/alibi_float32_portable.onnx" --provider $provider $small --cache "$work/order_cache" > "$out/order.log" 2>&1
    cp "$work/order/gpu_order.json" "$out/" 2>/dev/null
    if [ -z "${REHEARSAL:-}" ]; then
      timeout 200 $py -m pytest -q -rs -p no:cacheprovider tests/test_runtimes.py tests/test_gpu_targets.py \
        -k "cuda or tf32" > "$out/cuda_tests.log" 2>&1
      for p in cpu cuda; do  # the same greedy bytes on both providers, the cache kept on the GPU
        timeout 60 $py runtimes/ort/generate.py "$work/files/lm/alibi_kv.onnx" --prompt "To be, or not" \
          --max-new-tokens 300 --provider $p --output "$work/gen_$p.bin" >> "$out/cuda_tests.log" 2>&1
      done
      cmp "$work/gen_cpu.bin" "$work/gen_cuda.bin" >> "$out/cuda_tests.log" 2>&1 && echo "GENERATE TOKENS EQUAL" >> "$out/cuda_tests.log"
    fi
    wait
    cp "$work/parity/machine.json" "$out/" 2>/dev/null
    tar -czf "$out/parity.tar.gz" -C "$work/parity" par ;;
  parity)  # the parity jobs correctness left (each job's report marks it done), if device time remains
    ort_gpu
    timeout 540 $py tools/gpu_parity.py run "$work/files" "$work/parity" --jobs 6 --deadline 420 > "$out/parity.log" 2>&1
    cp "$work/parity/machine.json" "$out/" 2>/dev/null
    tar -czf "$out/parity.tar.gz" -C "$work/parity" par ;;
  ort)  # step 3, the ONNX Runtime cells (alone on the GPU: these are timings)
    ort_gpu; ready files_ready 120 || exit 1
    lengths=; [ -n "${REHEARSAL:-}" ] && lengths="--lengths 64,256 --biases alibi,t5"
    timeout 540 $py tools/gpu_session.py ort "$out" --models "$work/files/models" --provider $provider $lengths \
      > "$out/ort.log" 2>&1 ;;
  torch)  # step 3, the PyTorch cells; step 4, decode
    ort_gpu; ready prepared 60 || exit 1
    if [ -z "${REHEARSAL:-}" ]; then
      timeout 260 $py tools/gpu_session.py torch "$out" > "$out/torch.log" 2>&1
      timeout 120 $py -m posbias_export bench-decode --device cuda --steps 32 --out-dir "$out/dec" > "$out/decode.log" 2>&1
    fi
    timeout 150 $py tools/gpu_decode_real.py run "$work/dec" --device $provider $small >> "$out/decode.log" 2>&1
    cp "$work/dec/gpu_decode_real.json" "$out/" 2>/dev/null ;;
  all)  # the rehearsal, one step after the other into OUT/<step>
    for s in _prepare correctness ort torch; do mkdir -p "$out/$s"; bash tools/gpu_lease.sh $s "$out/$s" || exit 1; done ;;
  *) echo "usage: tools/gpu_lease.sh prepare|correctness|parity|ort|torch [OUT]   (REHEARSAL=1 ... all OUT)"; exit 2 ;;
esac
ls -la "${out:-$work}"
