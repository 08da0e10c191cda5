#!/usr/bin/env bash
# One GPU lease: 15 device minutes in all (start, every call, idle waits and give-back counted;
# 10 min a call; an idle machine goes back after ~30 s), as two calls back to back. tools/README.md.
#
#   here, before:  bash ../shared/tools/gpu-ort-wheel.sh                 # .gpu/p1..p5 (git-ignored)
#                  PYTHON=.venv/bin/python bash tools/gpu_lease.sh pack   # files + slim wheel: .gpu/c1, .gpu/c2
#                  REHEARSAL=1 PYTHON=.venv/bin/python bash tools/gpu_lease.sh rehearse DIR [STEP...]   # on ORT CPU, timed
#   call 1 (carry .gpu/c1):  bash tools/gpu_lease.sh receive           (~30 s with the machine's start)
#   call 2 (carry .gpu/c2):  bash tools/gpu_lease.sh work $OUT [STEP...]   (timeout_s <= 560)
#   give_back at once.
#   here, after (files_at as A):  tar -xzf A/results.tar.gz -C A, then each posbias_export.gpu module's `write` on A/r
#
# work joins the wheel, checks that a CUDA session runs, then runs the named steps in order (default:
# correctness timings torch_timings decode), each under its own timeout, rewriting $OUT/results.tar.gz
# after each, so a call cut at its limit still brings back every finished step.
# The steps:
#   correctness    the validate jobs (posbias_export/gpu/parity.py), the order check (posbias_export/gpu/order.py) and generate's bytes on
#                  CPU and CUDA, together (nothing timed), FlexAttention compiling into the caches meanwhile
#   parity         the validate jobs alone (PARITY_ONLY: job names; PARITY_LIMIT, PARITY_DEADLINE: seconds)
#   parity_async   the same with CUDA_LAUNCH_BLOCKING=0: the GPU cells only
#   race           every attention file's fresh-process runs in three orders (posbias_export/gpu/order.py --race)
#   cure           where ORT CUDA goes wrong with asynchronous launches (posbias_export/gpu/cure.py; CURE_VARIANTS: the
#                  variant kinds made beside each file, none for none; CURE_EXTRA: a control file; CURE_REPEATS:
#                  fresh processes per asynchronous case; CURE_LIMIT, CURE_WORKERS)
#   timings        our attention files alone on the GPU (posbias_export/gpu/session.py ort; GRID: the families)
#   timings_async  the same with launches asynchronous, then host-synchronous: what the switch costs
#   torch_timings  PyTorch's cells (eager, SDPA, compiled FlexAttention)
#   flex           compiled FlexAttention's cells only
#   decode         one decode timing, the cache on the GPU, vs PyTorch eager (bench-decode --device cuda)
#   serve          the in-place cache files judged and decode-timed with launches async and blocking
#                  (posbias_export/gpu/serve.py; SERVE_JOBS, SERVE_FILES, SERVE_LIMIT)
#   embed_build    (background) jina-v2-base's configuration written and exported float16 --target cuda-ort
#                  (posbias_export/gpu/embed.py build; its files stay on the machine for a later call's embed)
#   embed          that file on ONNX Runtime CUDA vs PyTorch SDPA with the bias and compiled FlexAttention,
#                  8192 / 32768 tokens and a padded batch, each judged against float64 (posbias_export/gpu/embed.py run)
#   big            the MPT-7B configuration written on the machine, exported float16 in place, decoded
#                  against the floor and transformers eager (posbias_export/gpu/big.py; BIG_LIMIT)
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

parity_run() {  # $1: results folder, $2: extra options; PARITY_ONLY / PARITY_LIMIT / PARITY_DEADLINE
  timeout ${PARITY_LIMIT:-300} $py -m posbias_export.gpu.parity run "$files" "$1" --jobs ${PARITY_JOBS:-10} \
    --deadline ${PARITY_DEADLINE:-220} ${PARITY_ONLY:+--only $PARITY_ONLY} $2
}

ort_timings() {  # $1: results folder
  timeout ${TIMING_LIMIT:-80} $py -m posbias_export.gpu.session ort "$1" --models "$files/models" --provider $provider $small \
    ${GRID:+--biases $GRID}
}

wait_step() {  # the step's background jobs, not the saver (a plain wait would wait for it forever)
  for p in $(jobs -p); do [ "$p" = "${saver:-}" ] || wait "$p"; done
}

run_step() {
  case $1 in
    correctness)
      (parity_run "$work/r" "$cpu_only" > "$work/r/parity.log" 2>&1) &
      (timeout 220 $py -m posbias_export.gpu.order run "$work/r/order" posbias_export/gpu/data/alibi_attention_0f33d6a.onnx \
        "$files/models/alibi_float32_portable.onnx" --provider $provider $small --cache "$work/order_cache" \
        --workers 6 > "$work/r/order.log" 2>&1) &
      [ -z "${REHEARSAL:-}" ] && (timeout 200 $py -m posbias_export.gpu.session torch "$work/warm" --warm > "$work/r/warm.log" 2>&1) &
      for p in cpu $provider; do  # the same greedy bytes on both providers, the cache kept on the GPU
        timeout 90 $py runtimes/ort/generate.py "$files/lm/alibi_kv.onnx" --prompt "To be, or not" \
          --max-new-tokens 300 --provider $p --output "$work/gen_$p.bin" >> "$work/r/generate.log" 2>&1
      done
      cmp "$work/gen_cpu.bin" "$work/gen_$provider.bin" >> "$work/r/generate.log" 2>&1 \
        && echo "GENERATE TOKENS EQUAL (cpu, $provider)" >> "$work/r/generate.log"
      wait_step ;;
    parity) parity_run "$work/r" "$cpu_only" > "$work/r/parity.log" 2>&1 ;;
    parity_async) CUDA_LAUNCH_BLOCKING=0 parity_run "$work/r/async" "${cpu_only:---no-cpu}" > "$work/r/parity_async.log" 2>&1 ;;
    race) timeout 170 $py -m posbias_export.gpu.order run "$work/r/race" --race-models "$files/models" --race --provider $provider \
            --workers 12 --cache "$work/race_cache" > "$work/r/race.log" 2>&1 ;;
    cure)
      [ "${CURE_VARIANTS:-}" = none ] || $py -m posbias_export.gpu.cure variants "$files" ${CURE_VARIANTS:+--kinds $CURE_VARIANTS} \
        > "$work/r/variants.log" 2>&1
      timeout ${CURE_LIMIT:-170} $py -m posbias_export.gpu.cure run "$files" "$work/r/cure" --provider $provider $small \
        --workers ${CURE_WORKERS:-14} --repeats ${CURE_REPEATS:-1} ${CURE_EXTRA:+--extra $CURE_EXTRA} \
        > "$work/r/cure.log" 2>&1 ;;
    timings) ort_timings "$work/r/timing" > "$work/r/timing_ort.log" 2>&1 ;;
    timings_async)
      for blocking in 0 1; do  # alone on the GPU, one after the other
        CUDA_LAUNCH_BLOCKING=$blocking ort_timings "$work/r/timing_$blocking" > "$work/r/timing_ort_$blocking.log" 2>&1
        save "timings (CUDA_LAUNCH_BLOCKING=$blocking)"
      done ;;
    torch_timings) [ -z "${REHEARSAL:-}" ] && timeout ${TORCH_LIMIT:-70} $py -m posbias_export.gpu.session torch "$work/r/timing" \
                     > "$work/r/timing_torch.log" 2>&1 ;;
    flex) [ -z "${REHEARSAL:-}" ] && timeout 80 $py -m posbias_export.gpu.session torch "$work/r/timing" --flex-only \
            > "$work/r/timing_torch.log" 2>&1 ;;
    decode)
      contexts=4096; steps=32; [ -n "${REHEARSAL:-}" ] && { contexts=256; steps=8; }
      first=$($py -c "from posbias_export.biases import BIASES; print(next(iter(BIASES)))")  # the registry's first
      timeout 60 $py -m posbias_export bench-decode --device $provider --biases "$first" \
        --contexts $contexts --steps $steps --out-dir "$work/r/decode" > "$work/r/decode.log" 2>&1 ;;
    serve)
      jobs=${SERVE_JOBS:-alibi_kv_inplace}; limit=${SERVE_LIMIT:-150}
      inplace=$(for f in ${SERVE_FILES:-alibi_kv_inplace alibi_kv_inplace_float16 alibi_kv_inplace_int8}; do echo "$files/lm/$f.onnx"; done)
      (PARITY_ONLY=$jobs PARITY_LIMIT=$limit CUDA_LAUNCH_BLOCKING=0 parity_run "$work/r/async" "${cpu_only:---no-cpu}" \
        > "$work/r/parity_async.log" 2>&1) &
      (PARITY_ONLY=$jobs PARITY_LIMIT=$limit parity_run "$work/r" "$cpu_only" > "$work/r/parity.log" 2>&1) &
      wait_step; save "serve (parity)"
      contexts=512,4096; steps=32; [ -n "${REHEARSAL:-}" ] && { contexts=64,256; steps=8; }
      for blocking in 0 1; do  # alone on the GPU: the two settings one after the other
        CUDA_LAUNCH_BLOCKING=$blocking timeout 70 $py -m posbias_export.gpu.serve run "$work/r/serve" $inplace --provider $provider \
          --contexts $contexts --steps $steps >> "$work/r/serve.log" 2>&1
      done ;;
    big)
      tiny=; contexts=512,4096; [ -n "${REHEARSAL:-}" ] && { tiny=--tiny; contexts=64,2100; }
      timeout ${BIG_LIMIT:-480} $py -m posbias_export.gpu.big run "$work/r/big" --work "$work/big" --provider $provider \
        --contexts $contexts --steps 16 $tiny > "$work/r/big.log" 2>&1
      rm -rf "$work/big" ;;
    embed_build)  # CPU work, in the background beside the next steps: the folder and our float16 file
      (timeout ${EMBED_BUILD_LIMIT:-400} $py -m posbias_export.gpu.embed build "$work/embed" ${small:+--tiny} \
        > "$work/r/embed_build.log" 2>&1 &) ;;
    embed) timeout ${EMBED_LIMIT:-540} $py -m posbias_export.gpu.embed run "$work/embed" "$work/r/embed" --provider $provider \
             ${small:+--tiny} --timeout ${EMBED_FORM_LIMIT:-200} > "$work/r/embed.log" 2>&1 ;;
    *) echo "unknown step $1"; return 2 ;;
  esac
}

case $step in
  pack)  # here: every file exported with this checkout's torch (the one CI tests), then the wheel cut to the calls
    files=$(mktemp -d)
    $py -m posbias_export.gpu.parity build "$files" $small || exit 1
    [ -n "${GPU_EXTRA:-}" ] && cp -r "$GPU_EXTRA" "$files/"  # files to compare beside them (timings of two forms)
    mkdir -p "$pack" && tar -cJf "$pack/files.tar.xz" -C "$files" . && rm -rf "$files"
    if [ -n "${REHEARSAL:-}" ] && ! ls .gpu/p1 >/dev/null 2>&1; then  # no wheel to cut: a stand-in part
      mkdir -p "$pack/c1" && cp "$pack/files.tar.xz" "$pack/c1/" && tar -cf - -T /dev/null | xz > "$pack/c1/ort.tar.xz.1"
    else
      $py tools/gpu_wheel.py pack --files "$pack/files.tar.xz" --out "$pack" || exit 1
    fi ;;
  receive)  # call 1
    receive ;;
  work)  # call 2: the steps named after OUT (see the top)
    shift 2; steps=${*:-correctness timings torch_timings decode}
    t0=$(date +%s); rm -rf "$work/r"; mkdir -p "$work/r/par" "$out"
    receive >/dev/null
    join > "$work/r/join.log" 2>&1; joined=$?
    cat "$work/r/join.log"
    echo "[$(date +%T)] joined rc=$joined in $(( $(date +%s) - t0 )) s"; save join
    [ -e "$work/files/jobs.json" ] || { echo "no files: call 1 (receive) did not run on this machine"; exit 1; }
    files=$work/files
    (while sleep 20; do save "so far" > /dev/null; done) & saver=$!  # a cut call keeps the stages done
    for s in $steps; do
      case $s in torch_timings|flex) ;; *) [ "$joined" = 0 ] || { echo "skip $s: no CUDA provider"; continue; } ;; esac
      run_step "$s"; rc=$?; echo "[$(date +%T)] $s done at $(( $(date +%s) - t0 )) s rc=$rc"; save "$s"
    done
    kill $saver
    echo "[$(date +%T)] work done in $(( $(date +%s) - t0 )) s" ;;
  rehearse)  # REHEARSAL=1: pack, then both calls here on ORT CPU, each timed into OUT/calls.txt
    [ -n "${REHEARSAL:-}" ] || { echo "rehearse needs REHEARSAL=1"; exit 2; }
    shift 2
    rm -rf "$work" "$out/pack"; mkdir -p "$out"; : > "$out/calls.txt"; export GPU_PACK=$out/pack GPU_WORK=$work
    for s in pack receive work; do
      t=$(date +%s); bash tools/gpu_lease.sh $s "$out" $([ $s = work ] && echo "$@") > "$out/$s.log" 2>&1 \
        || { cat "$out/$s.log"; exit 1; }
      echo "$s $(( $(date +%s) - t )) s" | tee -a "$out/calls.txt"
    done ;;
  *) echo "usage: tools/gpu_lease.sh pack | receive | work OUT [STEP...]   (REHEARSAL=1 ... rehearse OUT [STEP...])"; exit 2 ;;
esac
