#!/usr/bin/env bash
# Issue 50 in ONE lease of 15 device minutes (start, every call, idle waits and give-back counted;
# 10 min a call; an idle machine goes back after ~30 s): two calls, back to back.
#
#   here, before:  bash ../shared/tools/gpu-ort-wheel.sh                 # .gpu/p1..p5 (git-ignored)
#                  PYTHON=.venv/bin/python bash tools/gpu_lease.sh pack   # files + slim wheel: .gpu/c1, .gpu/c2
#                  REHEARSAL=1 PYTHON=.venv/bin/python bash tools/gpu_lease.sh rehearse DIR   # both calls on ORT CPU, timed
#   call 1 (carry .gpu/c1, ~43 MB):  bash tools/gpu_lease.sh receive           (33-37 s with the machine's start)
#   call 2 (carry .gpu/c2, ~19 MB):  bash tools/gpu_lease.sh work $OUT   (timeout_s 560; 298 s on the H200)
#   give_back at once.  (later leases: diagnose, verify, retime, compare, serve, big in place of work; see each below)
#   here, after (files_at as A):  tar -xzf A/results.tar.gz -C A && python tools/gpu_parity.py write A/r
#     python tools/gpu_order.py write A/r; python tools/gpu_session.py write A/r
#
# The work call joins the wheel, then runs the issue's steps in priority order, each under its own
# timeout, and rewrites $OUT/results.tar.gz after each, so a call cut at its limit still brings
# back every finished step:
#   1. correctness (nothing timed, so they share the GPU): the validate jobs (gpu_parity.py), the
#      order-dependent error (gpu_order.py), `generate` CPU vs CUDA bytes; in the background
#      meanwhile, one untimed pass of the PyTorch cells compiles FlexAttention into the caches;
#   3. timings, alone on the GPU (gpu_session.py ort, then torch);
#   4. one decode timing vs PyTorch CUDA eager (bench-decode).
set -u
step=$1; out=${2:-}
cd "$(dirname "$0")/.."
if [ -n "${REHEARSAL:-}" ]; then
  work=${GPU_WORK:-/tmp/gpu-rehearsal}; provider=cpu; small=--small; cpu_only=--cpu-only
else
  work=${GPU_WORK:-/root/gpu}; provider=cuda; small=; cpu_only=
fi
pack=${GPU_PACK:-.gpu}  # where pack writes c1, c2 and receive reads them (the rehearsal: its own folder)
mkdir -p "$work/parts"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
py=${PYTHON:-python3}

receive() {  # this call's carried folder: its wheel part to $work/parts, its files (if any) to $work/files
  for c in "$pack"/c*; do
    [ -d "$c" ] || continue
    cp "$c"/ort.tar.xz.* "$work/parts/"
    if [ -e "$c/files.tar.xz" ] && [ ! -e "$work/files/jobs.json" ]; then
      mkdir -p "$work/files" && tar -xJf "$c/files.tar.xz" -C "$work/files"
    fi
  done
  ls -la "$work/parts"
}

join() {  # onnxruntime-gpu from the parts: /tmp/ortgpu ahead of the image's CPU onnxruntime
  local dest=$work/ortgpu
  [ -e "$dest/onnxruntime/__init__.py" ] || { mkdir -p "$dest" && ls "$work"/parts/ort.tar.xz.* | sort -V | xargs cat | xz -d -T0 | tar -x -C "$dest"; } || return 1
  if [ -n "${REHEARSAL:-}" ]; then ls -la "$dest/onnxruntime/capi" 2>&1; return 0; fi  # a cp312 wheel: imported there only
  export PYTHONPATH=$dest:$PWD
  $py - <<'EOF'
import numpy as np, onnxruntime as o
o.preload_dlls()
print(o.__version__, o.get_available_providers())
from onnx import helper, TensorProto  # one Add on the GPU: the slim provider's sm_90 code loads and runs
g = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
s = o.InferenceSession(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10).SerializeToString(),
                       providers=["CUDAExecutionProvider"])
assert s.get_providers()[0] == "CUDAExecutionProvider", s.get_providers()
assert (s.run(None, {"x": np.arange(4, dtype=np.float32)})[0] == np.arange(4) * 2).all()
print("CUDA provider runs")
EOF
}

save() {  # everything so far into $OUT/results.tar.gz (one file: $OUT brings back 8 at most)
  # not the CPU reference arrays (cpu_ref, ~100 MB): what comes back is 16 MiB a file
  tar -czf "$out/results.tar.gz.part" --exclude=cpu_ref --exclude='*.npy' -C "$work" r 2>/dev/null
  mv "$out/results.tar.gz.part" "$out/results.tar.gz"
  echo "[$(date +%T)] saved after $1 ($(du -h "$out/results.tar.gz" | cut -f1))"
}

case $step in
  pack)  # here: every file exported with this checkout's torch (the one CI tests), then the wheel cut to the calls
    files=$(mktemp -d)
    $py tools/gpu_parity.py build "$files" $small || exit 1
    [ -n "${GPU_EXTRA:-}" ] && cp -r "$GPU_EXTRA" "$files/"  # files to compare beside them (the compare step)
    mkdir -p "$pack" && tar -cJf "$pack/files.tar.xz" -C "$files" . && rm -rf "$files"
    if [ -n "${REHEARSAL:-}" ] && ! ls .gpu/p1 >/dev/null 2>&1; then  # no wheel to cut: a stand-in part
      mkdir -p "$pack/c1" && cp "$pack/files.tar.xz" "$pack/c1/" && tar -cf - -T /dev/null | xz > "$pack/c1/ort.tar.xz.1"
    else
      $py tools/gpu_wheel.py pack --files "$pack/files.tar.xz" --out "$pack" || exit 1
    fi ;;
  receive)  # call 1
    receive ;;
  work)  # call 2: see the top
    t0=$(date +%s); rm -rf "$work/r"; mkdir -p "$work/r/par" "$out"
    receive >/dev/null
    join > "$work/r/join.log" 2>&1; joined=$?
    cat "$work/r/join.log"
    echo "[$(date +%T)] joined rc=$joined in $(( $(date +%s) - t0 )) s"; save join
    [ -e "$work/files/jobs.json" ] || { echo "no files: call 1 (receive) did not run on this machine"; exit 1; }
    files=$work/files
    if [ "$joined" = 0 ]; then
      # 1. correctness: validate jobs, the order error and generate share the GPU (nothing here is timed)
      (timeout 300 $py tools/gpu_parity.py run "$files" "$work/r" --jobs 10 --deadline 220 $cpu_only \
        > "$work/r/parity.log" 2>&1) &
      (timeout 220 $py tools/gpu_order.py run "$work/r/order" tools/data/alibi_attention_0f33d6a.onnx \
        "$files/models/alibi_float32_portable.onnx" --provider $provider $small --cache "$work/order_cache" \
        --workers 6 > "$work/r/order.log" 2>&1) &
      if [ -z "${REHEARSAL:-}" ]; then  # FlexAttention compiled once, untimed: the timing step finds it in the caches
        (timeout 200 $py tools/gpu_session.py torch "$work/warm" --warm > "$work/r/warm.log" 2>&1) &
      fi
      for p in cpu $provider; do  # the same greedy bytes on both providers, the cache kept on the GPU
        timeout 90 $py runtimes/ort/generate.py "$files/lm/alibi_kv.onnx" --prompt "To be, or not" \
          --max-new-tokens 300 --provider $p --output "$work/gen_$p.bin" >> "$work/r/generate.log" 2>&1
      done
      cmp "$work/gen_cpu.bin" "$work/gen_$provider.bin" >> "$work/r/generate.log" 2>&1 \
        && echo "GENERATE TOKENS EQUAL (cpu, $provider)" >> "$work/r/generate.log"
      wait
      echo "[$(date +%T)] correctness done at $(( $(date +%s) - t0 )) s"; save correctness
      # 3. timings, alone on the GPU
      timeout 80 $py tools/gpu_session.py ort "$work/r/timing" --models "$files/models" --provider $provider $small \
        > "$work/r/timing_ort.log" 2>&1
      save "timings (ORT)"
    fi
    if [ -z "${REHEARSAL:-}" ]; then  # PyTorch's cells need no ONNX Runtime: they run even if the join failed
      timeout 70 $py tools/gpu_session.py torch "$work/r/timing" > "$work/r/timing_torch.log" 2>&1
      save "timings (PyTorch)"
    fi
    # 4. one decode timing: ONNX Runtime with the cache on the GPU vs PyTorch eager on the GPU
    contexts=4096; steps=32; [ -n "${REHEARSAL:-}" ] && { contexts=256; steps=8; }
    first=$($py -c "from posbias_export.biases import BIASES; print(next(iter(BIASES)))")  # the registry's first family
    [ "$joined" = 0 ] && timeout 50 $py -m posbias_export bench-decode --device $provider --biases "$first" \
      --contexts $contexts --steps $steps --out-dir "$work/r/decode" > "$work/r/decode.log" 2>&1
    save decode
    echo "[$(date +%T)] work done in $(( $(date +%s) - t0 )) s" ;;
  diagnose)  # a second lease's work call (after receive): the CUDA race's cure candidates on the failing files,
             # the long parity jobs the first call's deadline left, FlexAttention for the table families
    t0=$(date +%s); rm -rf "$work/r"; mkdir -p "$work/r/par" "$out"
    receive >/dev/null
    join > "$work/r/join.log" 2>&1 || { cat "$work/r/join.log"; exit 1; }
    files=$work/files; save join
    (timeout 170 $py tools/gpu_parity.py run "$files" "$work/r" --jobs 13 --only _long --deadline 60 $cpu_only \
      > "$work/r/parity.log" 2>&1) &
    (timeout 170 $py tools/gpu_order.py run "$work/r/race" --race-models "$files/models" --race --provider $provider --workers 12 \
      --cache "$work/race_cache" > "$work/r/race.log" 2>&1) &
    wait
    echo "[$(date +%T)] parity and race done at $(( $(date +%s) - t0 )) s"; save "long parity, race"
    [ -z "${REHEARSAL:-}" ] && timeout 80 $py tools/gpu_session.py torch "$work/r/timing" --flex-only \
      > "$work/r/timing_torch.log" 2>&1
    save "flex (table families)"
    echo "[$(date +%T)] diagnose done in $(( $(date +%s) - t0 )) s" ;;
  verify)  # a third lease's work call (after receive): the runners' cure (host-synchronous CUDA) re-judged on
           # every GPU cell that failed or did not run, then the timings as served with it
    t0=$(date +%s); rm -rf "$work/r"; mkdir -p "$work/r/par" "$out"
    receive >/dev/null
    join > "$work/r/join.log" 2>&1 || { cat "$work/r/join.log"; exit 1; }
    files=$work/files; save join
    timeout 120 $py tools/gpu_parity.py run "$files" "$work/r" --jobs 14 --no-cpu --only cuda-ort,alibi_lm,alibi_kv,_long \
      > "$work/r/parity.log" 2>&1
    echo "[$(date +%T)] parity done at $(( $(date +%s) - t0 )) s"; save parity
    timeout 60 $py tools/gpu_session.py ort "$work/r/timing" --models "$files/models" --provider $provider $small \
      > "$work/r/timing_ort.log" 2>&1
    save "timings (ORT, host-synchronous)"
    echo "[$(date +%T)] verify done in $(( $(date +%s) - t0 )) s" ;;
  retime)  # a fourth lease's work call (after receive): the slim table path changed (8-key windows, widest
            # block first): its timings and memory alone on the GPU beside the PyTorch cells, the decode
            # timing with host-synchronous launches, then the slim files re-judged and the jobs never run alone
    t0=$(date +%s); rm -rf "$work/r"; mkdir -p "$work/r/par" "$out"
    receive >/dev/null
    join > "$work/r/join.log" 2>&1 || { cat "$work/r/join.log"; exit 1; }
    files=$work/files; save join
    timeout 90 $py tools/gpu_session.py ort "$work/r/timing" --models "$files/models" --provider $provider $small \
      > "$work/r/timing_ort.log" 2>&1
    save "timings (ORT)"
    [ -z "${REHEARSAL:-}" ] && timeout 110 $py tools/gpu_session.py torch "$work/r/timing" > "$work/r/timing_torch.log" 2>&1
    save "timings (PyTorch)"
    contexts=4096; steps=32; [ -n "${REHEARSAL:-}" ] && { contexts=256; steps=8; }
    first=$($py -c "from posbias_export.biases import BIASES; print(next(iter(BIASES)))")
    timeout 60 $py -m posbias_export bench-decode --device $provider --biases "$first" \
      --contexts $contexts --steps $steps --out-dir "$work/r/decode" > "$work/r/decode.log" 2>&1
    save decode
    timeout 200 $py tools/gpu_parity.py run "$files" "$work/r" --jobs 12 --deadline 120 $cpu_only \
      --only att_kerple,att_t5,att_sandwich,att_window,att_none_float32_cuda-ort_long,hf_bloom_float16_cuda-ort_long \
      > "$work/r/parity.log" 2>&1
    save parity
    echo "[$(date +%T)] retime done in $(( $(date +%s) - t0 )) s" ;;
  compare)  # a fifth lease's work call (after receive): the slim path's two block-bias forms timed alone on the
             # GPU (this checkout's files in models/, the other form's, packed with GPU_EXTRA, in models_other/)
             # beside compiled Flex, then this checkout's table files re-judged and the BLOOM long job
    t0=$(date +%s); rm -rf "$work/r"; mkdir -p "$work/r/par" "$out"
    receive >/dev/null
    join > "$work/r/join.log" 2>&1 || { cat "$work/r/join.log"; exit 1; }
    files=$work/files; save join
    grid=kerple_log,t5; [ -n "${REHEARSAL:-}" ] && grid=t5
    timeout 70 $py tools/gpu_session.py ort "$work/r/timing" --models "$files/models" --provider $provider $small \
      --biases $grid > "$work/r/timing_ort.log" 2>&1
    save "timings (this checkout)"
    timeout 70 $py tools/gpu_session.py ort "$work/r/timing_other" --models "$files/models_other" --provider $provider \
      $small --biases $grid > "$work/r/timing_other.log" 2>&1
    save "timings (the other form)"
    [ -z "${REHEARSAL:-}" ] && timeout 80 $py tools/gpu_session.py torch "$work/r/timing" --flex-only \
      > "$work/r/timing_torch.log" 2>&1
    save "flex"
    timeout 170 $py tools/gpu_parity.py run "$files" "$work/r" --jobs 8 --deadline 90 $cpu_only \
      --only att_kerple,att_t5,hf_bloom_float16_cuda-ort_long > "$work/r/parity.log" 2>&1
    save parity
    echo "[$(date +%T)] compare done in $(( $(date +%s) - t0 )) s" ;;
  serve)  # a sixth lease's work call (after receive): the in-place cache files (float32, float16, int8 cache)
           # judged on CUDA with launches asynchronous (CUDA_LAUNCH_BLOCKING=0: they have no If or Loop) and
           # with the runners' cure, then decode timed against PyTorch eager both ways (gpu_serve.py)
    t0=$(date +%s); rm -rf "$work/r"; mkdir -p "$work/r/par" "$out"
    receive >/dev/null
    join > "$work/r/join.log" 2>&1 || { cat "$work/r/join.log"; exit 1; }
    files=$work/files; save join
    # SERVE_JOBS / SERVE_FILES / SERVE_LIMIT: a later lease's subset (its job names, files under lm/, seconds)
    jobs=${SERVE_JOBS:-alibi_kv_inplace}; limit=${SERVE_LIMIT:-150}
    inplace=$(for f in ${SERVE_FILES:-alibi_kv_inplace alibi_kv_inplace_float16 alibi_kv_inplace_int8}; do echo "$files/lm/$f.onnx"; done)
    (CUDA_LAUNCH_BLOCKING=0 timeout $limit $py tools/gpu_parity.py run "$files" "$work/r/async" --jobs 4 ${cpu_only:---no-cpu} \
      --only $jobs > "$work/r/parity_async.log" 2>&1) &
    (timeout $limit $py tools/gpu_parity.py run "$files" "$work/r" --jobs 4 $cpu_only --only $jobs \
      > "$work/r/parity.log" 2>&1) &
    wait
    echo "[$(date +%T)] parity done at $(( $(date +%s) - t0 )) s"; save parity
    contexts=512,4096; steps=32; [ -n "${REHEARSAL:-}" ] && { contexts=64,256; steps=8; }
    for blocking in 0 1; do  # alone on the GPU: the two settings one after the other
      CUDA_LAUNCH_BLOCKING=$blocking timeout 70 $py tools/gpu_serve.py run "$work/r/serve" $inplace --provider $provider \
        --contexts $contexts --steps $steps >> "$work/r/serve.log" 2>&1
      save "serve (CUDA_LAUNCH_BLOCKING=$blocking)"
    done
    echo "[$(date +%T)] serve done in $(( $(date +%s) - t0 )) s" ;;
  big)  # a seventh lease's work call (after receive), issue 48: the MPT-7B configuration written on the GPU
         # machine (13.3 GB of bfloat16 shards: too large to carry), exported to float16 with the in-place cache,
         # decoded on ONNX Runtime CUDA at 512 and 4096 tokens against the floor and transformers eager (gpu_big.py)
    t0=$(date +%s); rm -rf "$work/r"; mkdir -p "$work/r" "$out"
    receive >/dev/null
    join > "$work/r/join.log" 2>&1 || { cat "$work/r/join.log"; exit 1; }
    save join
    tiny=; contexts=512,4096; [ -n "${REHEARSAL:-}" ] && { tiny=--tiny; contexts=64,2100; }
    (while sleep 20; do save "big (so far)" > /dev/null; done) & saver=$!  # a cut call keeps the stages done
    timeout ${BIG_LIMIT:-480} $py tools/gpu_big.py run "$work/r/big" --work "$work/big" --provider $provider \
      --contexts $contexts --steps 16 $tiny > "$work/r/big.log" 2>&1
    kill $saver; save big; rm -rf "$work/big"
    echo "[$(date +%T)] big done in $(( $(date +%s) - t0 )) s" ;;
  cure)  # issue 59 (after receive): where ORT CUDA goes wrong with asynchronous launches (gpu_cure.py: every
          # attention file and its If-free / control-flow-free variants, ORT's placement log) while the MPT-7B
          # float16 run (big) writes and exports its folder beside it; big's timings start after the matrix ends
    t0=$(date +%s); rm -rf "$work/r"; mkdir -p "$work/r" "$out"
    receive >/dev/null
    join > "$work/r/join.log" 2>&1 || { cat "$work/r/join.log"; exit 1; }
    files=$work/files; save join
    tiny=; contexts=512,4096; small=; [ -n "${REHEARSAL:-}" ] && { tiny=--tiny; contexts=64,2100; small=--small; }
    (timeout ${BIG_LIMIT:-400} $py tools/gpu_big.py run "$work/r/big" --work "$work/big" --provider $provider \
      --contexts $contexts --steps 16 $tiny > "$work/r/big.log" 2>&1; echo "big rc=$?" >> "$work/r/big.log") &
    big=$!
    (while sleep 20; do save "so far" > /dev/null; done) & saver=$!  # a cut call keeps the stages done
    $py tools/gpu_cure.py variants "$files" > "$work/r/variants.log" 2>&1
    timeout ${CURE_LIMIT:-170} $py tools/gpu_cure.py run "$files" "$work/r/cure" --provider $provider $small \
      --workers ${CURE_WORKERS:-14} > "$work/r/cure.log" 2>&1
    echo "[$(date +%T)] cure matrix done at $(( $(date +%s) - t0 )) s"; save cure
    wait $big
    kill $saver; save big; rm -rf "$work/big"
    echo "[$(date +%T)] cure and big done in $(( $(date +%s) - t0 )) s" ;;
  cured)  # issue 59's second lease (after receive): the files of the fixed export judged with asynchronous launches
           # (gpu_cure.py, no variants) beside every validate job's GPU cells with CUDA_LAUNCH_BLOCKING=0
    t0=$(date +%s); rm -rf "$work/r"; mkdir -p "$work/r/par" "$out"
    receive >/dev/null
    join > "$work/r/join.log" 2>&1 || { cat "$work/r/join.log"; exit 1; }
    files=$work/files; save join
    small=; [ -n "${REHEARSAL:-}" ] && small=--small
    (while sleep 20; do save "so far" > /dev/null; done) & saver=$!
    (CUDA_LAUNCH_BLOCKING=0 timeout ${PARITY_LIMIT:-230} $py tools/gpu_parity.py run "$files" "$work/r" --jobs 10 \
      --deadline ${PARITY_DEADLINE:-150} ${cpu_only:---no-cpu} > "$work/r/parity.log" 2>&1) & parity=$!
    $py tools/gpu_cure.py variants "$files" --kinds loop > "$work/r/variants.log" 2>&1  # the verified If-free form beside
    timeout ${CURE_LIMIT:-150} $py tools/gpu_cure.py run "$files" "$work/r/cure" --provider $provider $small \
      --workers ${CURE_WORKERS:-8} --extra tools/data/alibi_attention_0f33d6a.onnx > "$work/r/cure.log" 2>&1
    echo "[$(date +%T)] cure matrix done at $(( $(date +%s) - t0 )) s"; save cure
    wait $parity
    echo "[$(date +%T)] parity done at $(( $(date +%s) - t0 )) s"; save parity
    # the speed the cure gives back: the same files timed with asynchronous launches (the runners' old switch off)
    for blocking in 0 1; do  # alone on the GPU, one after the other: what the old switch cost
      CUDA_LAUNCH_BLOCKING=$blocking timeout ${TIMING_LIMIT:-80} $py tools/gpu_session.py ort "$work/r/timing_$blocking" \
        --models "$files/models" --provider $provider $small > "$work/r/timing_ort_$blocking.log" 2>&1
      save "timings (CUDA_LAUNCH_BLOCKING=$blocking)"
    done
    kill $saver
    echo "[$(date +%T)] cured done in $(( $(date +%s) - t0 )) s" ;;
  rehearse)  # REHEARSAL=1: pack, then both calls here on ORT CPU, each timed into OUT/calls.txt
    [ -n "${REHEARSAL:-}" ] || { echo "rehearse needs REHEARSAL=1"; exit 2; }
    rm -rf "$work" "$out/pack"; mkdir -p "$out"; : > "$out/calls.txt"; export GPU_PACK=$out/pack GPU_WORK=$work
    for s in pack receive ${REHEARSE_STEP:-work}; do
      t=$(date +%s); bash tools/gpu_lease.sh $s "$out" > "$out/$s.log" 2>&1 || { cat "$out/$s.log"; exit 1; }
      echo "$s $(( $(date +%s) - t )) s" | tee -a "$out/calls.txt"
    done ;;
  *) echo "usage: tools/gpu_lease.sh pack|receive|work OUT   (REHEARSAL=1 ... rehearse OUT)"; exit 2 ;;
esac
