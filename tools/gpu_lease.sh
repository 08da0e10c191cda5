#!/usr/bin/env bash
# One call of a GPU lease (device tool): `bash tools/gpu_lease.sh ort|torch OUT`.
# Expects onnxruntime-gpu on PYTHONPATH (../shared/tools/gpu-ort-wheel.sh) and the files
# exported beforehand under .gpu/models (attention) and .gpu/lm (LM files), see gpu_session.py.
set -u
part=$1; out=$2; mkdir -p "$out/par"
biases=$(python3 -c "import posbias_export as p; print(*p.BIASES)")  # the registry, not a list to keep
val() { python3 -m posbias_export validate "$@"; }
if [ "$part" = ort ]; then
  timeout 230 python3 tools/gpu_session.py ort "$out" .gpu/models > "$out/ort.log" 2>&1
  jobs_file=$(mktemp)
  for b in $biases; do
    echo "$b lm .gpu/lm/${b}_lm.onnx ort-cpu,ort-cuda,ort-cuda-tf32 1,17,1024,4096 3" >> "$jobs_file"
    echo "$b lmort .gpu/lm/${b}_lm_cuda-ort.onnx ort-cpu,ort-cuda 1,17,1024,4096 3" >> "$jobs_file"
    echo "$b att_portable .gpu/models/${b}_float32_portable.onnx ort-cpu,ort-cuda,ort-cuda-tf32 1,17,1024,4096,16384 1" >> "$jobs_file"
    for t in cuda cuda-ort; do
      echo "$b att_$t .gpu/models/${b}_float32_$t.onnx ort-cpu,ort-cuda 1,17,1024,4096 1" >> "$jobs_file"
    done
    echo "$b att16_cuda-ort .gpu/models/${b}_float16_cuda-ort.onnx ort-cuda 1,17,1024,4096 1" >> "$jobs_file"
  done
  (timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_runtimes.py -k "cuda or tf32" > "$out/cuda_tests.log" 2>&1) &
  timeout 320 xargs -P 8 -L 1 sh -c 'python3 -m posbias_export validate "$2" --runtimes "$3" --lengths "$4" --batch "$5" --json "'"$out"'/par/$0_$1.json" > "'"$out"'/par/$0_$1.txt" 2>&1' < "$jobs_file"
  wait
  grep -h -- "->" "$out"/par/*.txt > "$out/parity_summary.txt"
  tar -czf "$out/parity.tar.gz" -C "$out" par && rm -rf "$out/par"
else
  timeout 300 python3 tools/gpu_session.py torch "$out" > "$out/torch.log" 2>&1
  timeout 150 python3 -m posbias_export bench-decode --device cuda --steps 32 --out-dir "$out/dec" > "$out/decode.log" 2>&1
  timeout 60 python3 -m posbias_export bench-decode --device cuda --target cuda-ort --biases alibi,sandwich --steps 32 --out-dir "$out/dec_ort" >> "$out/decode.log" 2>&1
  TIMEFORMAT="%R s"
  for p in cpu cuda; do
    echo "generate --provider $p:" >> "$out/generate.log"
    { time timeout 60 python3 runtimes/ort/generate.py .gpu/lm/alibi_kv.onnx --prompt "To be, or not" \
      --max-new-tokens 300 --provider $p --output "$out/gen_$p.bin" ; } >> "$out/generate.log" 2>&1
  done
  cmp "$out/gen_cpu.bin" "$out/gen_cuda.bin" >> "$out/generate.log" 2>&1 && echo "TOKENS EQUAL" >> "$out/generate.log"
  python3 - >> "$out/generate.log" 2>&1 <<'PY'
import onnxruntime as ort
ort.set_default_logger_severity(1)
for f in (".gpu/models/alibi_float16_cuda.onnx", ".gpu/models/alibi_float16_cuda-ort.onnx", ".gpu/lm/alibi_kv.onnx"):
    print("SESSION", f, flush=True)
    ort.InferenceSession(f, providers=["CUDAExecutionProvider"])
PY
  grep -i "memcpy\|SESSION" "$out/generate.log" > "$out/memcpy.txt"
  tar -czf "$out/decode.tar.gz" -C "$out" dec dec_ort && rm -rf "$out/dec" "$out/dec_ort"
fi
ls -la "$out"
