#!/usr/bin/env bash
# The next H200 campaign, one device call per part (each under the 10-minute limit):
#
#   bash experiments/h200_session.sh quick      # ~6 min: check_mosaic_gpu --quick (int8 states first: never run
#                                               #   on a GPU), low-precision per-layer timing with the Mosaic kernel
#   bash experiments/h200_session.sh kernel     # ~6.5 min: Mosaic sweep + timing (fp32, every T), bf16 sweep
#   bash experiments/h200_session.sh kernel2    # ~4.5 min: bf16 timing (default per shape), the in-kernel profile
#   bash experiments/h200_session.sh models     # ~6 min: whole 8B models (new defaults, lean loss), memory analysis
#   bash experiments/h200_session.sh unrolled   # <10 min: unrolled whole-model rows (qwen3-0.6b; long compiles)
#
# Run from the repository root on the device machine. Results go to $OUT as one
# tarball per part (the device tool returns at most 8 files, 2 folders deep):
# unpack it into experiments/results/h200/ and commit it with this script.
# Every step has its own time limit, so a hang costs that step, not the call.
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
part="${1:?usage: h200_session.sh quick|kernel|kernel2|models|unrolled}"
out="${OUT:?OUT must name the folder that comes back}"
work="/tmp/h200_$part"
rm -rf "$work" && mkdir -p "$work"

step() {  # step NAME SECONDS COMMAND...: runs it with a limit, logs to $work/NAME.log
  local name="$1" limit="$2"
  shift 2
  echo "== $name (limit ${limit}s): $*"
  timeout "$limit" "$@" >"$work/$name.log" 2>&1
  echo "   rc $? ($name)"
  tail -n 3 "$work/$name.log"
}

case "$part" in
  quick)
    step quick 170 python -m experiments.check_mosaic_gpu --out "$work/quick" --quick
    step lowp 320 python -m experiments.bench_lowp --out "$work/lowp" --tokens 1024 4096 \
      --shapes 4096x4096 4096x14336 --configs fp32 bf16_rtn_bf16 bf16_sr_bf16 fp32_int8 bf16_sr_int8 \
      --impls xla pallas mosaic optax_fp32 optax_bf16
    ;;
  kernel)
    step mosaic 340 python -m experiments.check_mosaic_gpu --out "$work/mosaic" --sections sweep timing
    step sweep_bf16 215 python -m experiments.check_mosaic_gpu --out "$work/sweep_bf16" --sections sweep \
      --state-dtype bfloat16
    ;;
  kernel2)
    step timing_bf16 225 python -m experiments.check_mosaic_gpu --out "$work/timing_bf16" --sections timing \
      --state-dtype bfloat16
    step profile 150 python -m experiments.profile_mosaic --out "$work/profile"
    ;;
  models)
    step models 380 python -m experiments.bench_models --out "$work/models" \
      --models llama-3.1-8b,qwen3-8b --impls optax,optax_clip,forge,forge_int8_mosaic --timeout 150
    step memana 190 python -m experiments.memory_analysis --out "$work/memana" --model llama-3.1-8b \
      --impls optax_clip,forge --batch 32 --loss lean,optax
    ;;
  unrolled)
    step unrolled 570 python -m experiments.bench_models --out "$work/unrolled" --models qwen3-0.6b \
      --impls optax_unrolled,forge_unrolled,optax,forge --timeout 280
    ;;
  *)
    echo "unknown part $part" >&2
    exit 2
    ;;
esac

# Per-section JSON is repeated inside a finished check_mosaic_gpu.json: drop it there only.
for merged in $(find "$work" -name check_mosaic_gpu.json); do
  rm -f "$(dirname "$merged")"/{audit,correctness,sweep,timing}.json
done
tar czf "$out/h200_$part.tgz" -C /tmp "h200_$part"
ls -la "$out"
