#!/usr/bin/env bash
# The next H200 campaign, one device call per part (each under the 10-minute limit).
# Session 5 (2026-11-30) ran quick/models/unrolled/kernel/kernel2 as they were then; the parts
# below are the next ones (see pallas_kernels/MOSAIC_NOTES.md, "Fifth H200 session"):
#
#   bash experiments/h200_session.sh quick      # ~6 min: check_mosaic_gpu --quick (the bf16 defaults
#                                               #   changed: 64x64 sub-tiles / 5 stages; epi_read_ahead),
#                                               #   then bf16 timing of the new defaults against XLA,
#                                               #   on the 8B shapes and on qwen3-0.6b's
#   bash experiments/h200_session.sh kernel     # ~6.5 min: fp32 sweep (epi_read_ahead) + timing at every
#                                               #   T, bf16 sweep (the new defaults with and without it)
#   bash experiments/h200_session.sh models     # ~6.5 min: 8B models with the new bf16 defaults,
#                                               #   and qwen3-14b FORGE
#   bash experiments/h200_session.sh unrolled   # <10 min: unrolled rows (the Mosaic kernel now lowers
#                                               #   once per shape; forge_unrolled timed out before)
#   bash experiments/h200_session.sh unrolled8b # <10 min: the same for Llama-3.1-8B (optax_unrolled
#                                               #   timed out at 139 s in session 2)
#   bash experiments/h200_session.sh kernel2    # ~6 min: ptxas registers/spills and profiles of the
#                                               #   fp32, bf16, SR and int8 epilogues (why SR and int8
#                                               #   are slow; spills or read stalls in the arithmetic)
#
# Run from the repository root on the device machine. Results go to $OUT as one
# tarball per part (the device tool returns at most 8 files, 2 folders deep):
# unpack it into experiments/results/h200/ and commit it with this script.
# Every step has its own time limit, so a hang costs that step, not the call.
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
part="${1:?usage: h200_session.sh quick|kernel|models|models8b|unrolled|unrolled8b|kernel2}"
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
    step timing_bf16 225 python -m experiments.check_mosaic_gpu --out "$work/timing_bf16" --sections timing \
      --state-dtype bfloat16
    # qwen3-0.6b's projections (FORGE's step was 1.16x optax's there): per layer, bf16, T=1024.
    step small 100 python -m experiments.check_mosaic_gpu --out "$work/small" --sections timing \
      --state-dtype bfloat16 --tokens 1024 --shapes 1024x2048 1024x1024 2048x1024 1024x3072 3072x1024
    ;;
  kernel)
    step mosaic 340 python -m experiments.check_mosaic_gpu --out "$work/mosaic" --sections sweep timing
    step sweep_bf16 215 python -m experiments.check_mosaic_gpu --out "$work/sweep_bf16" --sections sweep \
      --state-dtype bfloat16
    ;;
  kernel2)
    step ptxas 240 python -m experiments.ptxas_report --out "$work/ptxas" --read-ahead \
      --storage fp32 bf16_rtn_bf16 bf16_sr_bf16 fp32_int8
    step profile 170 python -m experiments.profile_mosaic --out "$work/profile" \
      --problems 64x4096x4096,1024x4096x4096 --storage fp32 bf16_rtn_bf16 bf16_sr_bf16 fp32_int8
    ;;
  models|models8b)
    step models 300 python -m experiments.bench_models --out "$work/models" \
      --models llama-3.1-8b,qwen3-8b --impls optax,optax_clip,forge --timeout 150
    [ "$part" = models8b ] || step models14 250 python -m experiments.bench_models --out "$work/models14" \
      --models qwen3-14b --impls forge --timeout 200
    ;;
  unrolled)
    step unrolled 570 python -m experiments.bench_models --out "$work/unrolled" --models qwen3-0.6b \
      --impls forge_unrolled,forge,optax_unrolled,optax --timeout 280
    ;;
  unrolled8b)
    step unrolled8b 570 python -m experiments.bench_models --out "$work/unrolled8b" --models llama-3.1-8b \
      --impls forge_unrolled,optax_unrolled,optax --timeout 270
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
