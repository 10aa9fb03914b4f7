#!/usr/bin/env bash
# The next H200 campaign, one device call per part (each under the 10-minute limit).
# Session 6 (2026-11-30) ran quick, unrolled, models8b, kernel and kernel2 (results/h200/
# *_bf16_defaults*, *read_ahead*, ptxas_report, mosaic_profile_storage, bench_models_unrolled_fixed)
# plus experiments.diagnose_unrolled. Session 7 (2026-11-30) ran barriers and small
# (results/h200/mosaic_barriers, mosaic_small_shapes), which made no_auto_barriers and 64-row tiles
# for small grids the defaults, then defaults and defaults2 (mosaic_defaults_nb,
# bench_models_nb_defaults, mosaic_profile_diagnose/long_t) and the epilogue's diagnostic profiles
# at T=1024 (mosaic_profile_diagnose/epilogue_1024).
#
# Session 8 (2026-11-30) ran mainloop and cluster (results/h200/mosaic_cluster*: cluster_n=2
# correct, no faster), convergence (results/h200/convergence_fp32_b8) and qwen3-0.6b / 1.7b whole
# steps (bench_models_small_nb*).
#
# Session 9 (2026-11-30) ran xla_route (results/h200/xla_route_hlo, bench_models_xla_route),
# unrolled8b (bench_models_unrolled8b), large (bench_models_14b_mosaic, mosaic_cluster_profile4),
# capacity, capacity64, capacity48, extra and capacity_optaxloss (results/h200/capacity_lean,
# bench_models_4b_nb, mosaic_ring_1024).
#
# Session 10 (2026-11-30) ran limits, unrolled_diag, profile_steps, batch8_small, batch8_large,
# grid_unrolled_14b and limits_more (results/h200/capacity_mem95, unrolled_diag_gpu, profile_steps,
# bench_models_{batch8_small,batch8_large,unrolled_14b,14b_mem95,14b_b8_mem95}). limits_more's three
# steps ran as two inline commands that session (the same commands and limits; the part was written
# after), so its results sit under other names: bench_models_14b_b8_mem95 and capacity_mem95/.
#
# Session 11 (2026-11-30) ran capacity_prealloc, live_buffers and grid_1x (results/h200/
# capacity_prealloc, live_buffers, grid_1x_cache_check, bench_models_grid_1x*); grid_1x's time budget
# skipped three rows, which ran as two inline bench_models commands with the same flags on the same
# machine (bench_models_grid_1x_4b, bench_models_grid_1x_8b). With the last 250 s, live_buffers
# reran inline with a shared slot counted once (results/h200/live_rerun: FORGE and optax+clip at 64x1024).
#
# Session 12 (2026-11-30) ran live_hlo, grid_8x_small and grid_8x_large (results/h200/live_hlo,
# bench_models_grid_8x_{small,large}). live_hlo showed patches/dlogits_in_place.diff freeing 14.15
# GiB of FORGE's 64x1024 plan (92.72 -> 78.56 GiB); inline on the same machine it was timed under
# with_patch at 32x1024 beside main and run preallocated at 64x1024 (results/h200/dlogits_in_place/
# README.md has the commands), then landed in models/_loss.py. picked_by_reduction.diff changed
# nothing (92.72 GiB) and was deleted. grid_14b ran inline with --time-budget 500 instead of 560
# (bench_models_grid_14b), which filled issue #8's last grid cells.
#
# Session 13 (2026-11-30/12-01) ran plans (eight compile-only processes at once: the autotuner ran
# the device out of memory, so its capacity edges are wrong and kept marked, results/h200/
# capacity_per_impl/concurrent_autotuner_oom; live_landed and plan32 are valid: results/h200/
# live_landed, model_32b/plan), capacity_lanes (capacity_per_impl/lanes), edges32
# (bench_models_qwen3_32b_int8, bench_models_edge_{forge_112,optax_clip_64}) and over_edges' two
# OOM runs inline (bench_models_edge_{forge_120,optax_clip_72}; its landed32 step ran with
# --timeout 80 and timed out: capacity_per_impl/landed32_timeout).
#
# Session 14 (2026-12-01) ran capacity_rest (results/h200/capacity_per_impl/rest), whole_tile
# (results/h200/mosaic_whole_tile: slower than the defaults everywhere), then inline the commands now
# in capacity_rest2 (capacity_per_impl/rest2) and edges14 (bench_models_edge_{optax_112,optax_120,
# forge_unrolled_112}, bench_models_landed32; edges14's last row ran in its own call).
#
# Session 15 (2026-12-01) ran across_tiles (results/h200/mosaic_across_tiles: correct, no faster),
# producer (mosaic_producer), direct (mosaic_direct: epi_direct slower everywhere), int8_jump and
# clip_jump (live_jumps: dlogits live through the decoder's backward), then head_order and
# head_order_check (head_barrier: with the head's dX waiting for its update, forge_int8 runs 136
# sequences) and check_mosaic_gpu --quick inline (mosaic_quick15: 21/21).
#
# Its head_order_unrolled timed out (results/h200/head_barrier/unrolled_timeout).
#
# Session 16 (2026-12-01) ran stream, head_order_unrolled, copy, wide (results/h200/mosaic_stream:
# the W/state stream alone is the ring's TMA round trip; head_barrier/unrolled: the barrier costs
# nothing), shared and shared_profile (mosaic_shared: epi_shared_ring correct, not faster; the
# first shared_profile call asked for 4 stages and overflowed shared memory, the part now asks for
# 3) and compile_first (compile_first: compiling first puts the peak at XLA's plan).
#
# Session 17 (2026-12-01) ran mma_live (results/h200/mma_live: with its MMAs the main loop + ring
# takes the kernel's time; the PTX has div.full.f32 and sqrt.approx.f32; its PTX step ran as an
# inline python -c, now ptxas_report --ptx), ncu (ncu: the main loop latency-bound, x/dy read 3x
# from device memory beside the stream), stage_lookahead (slower), tile_t128 (no faster), rules
# (rules: the W-only stream runs at the same-tile GEMM's speed; --quick 28/28), grid_order and
# l2_hints (L2 cache policies on the TMA copies: no change) and ncu_rules (SGD's stream against
# AdamW's: x/dy 2.2x against 2.8x from device memory, tensor pipe 95.6% against 80.3%).
#
# Next:
#   (issue #4: nothing queued; MOSAIC_NOTES "Session 17" says what is left: an ncu run of the
#   kernel under experiments.l2_hints, to see whether the policies change the x/dy DRAM bytes)
#   bash experiments/h200_session.sh xla_route_fusions   # [200 s] the "xla" route's compiled HLO at 2
#                                                   #   layers (gzipped, with forge's for reference): what
#                                                   #   its 896 dynamic-update-slice kernel calls (45.8 ms) and
#                                                   #   the dynamic-slice fusions (~20 ms) compute
#   bash experiments/h200_session.sh profile_unrolled    # [480 s] 8 layers, scanned and unrolled
#   (Issue #8's empty cells: `python -m experiments.results_tables` lists them under the table. The
#   parts above compile all their rows first, in parallel processes, into jax's persistent
#   compilation cache, and then time the rows one by one; the one-model parts
#   grid_unrolled|grid_unrolled_4b|grid_unrolled_8b compile row by row.)
#
# Parts run before (kept to repeat them):
#   bash experiments/h200_session.sh plans|capacity_lanes|edges32|over_edges   # session 13's parts
#   bash experiments/h200_session.sh capacity_rest|capacity_rest2|edges14|whole_tile   # session 14's
#   bash experiments/h200_session.sh across_tiles|producer|direct|int8_jump|clip_jump|head_order|head_order_check
#                                               # session 15's
#   bash experiments/h200_session.sh stream|head_order_unrolled|copy|wide|shared|shared_profile|compile_first
#                                               # session 16's
#   bash experiments/h200_session.sh mma_live|ncu|stage_lookahead|tile_t128|rules|grid_order|l2_hints|ncu_rules
#                                               # session 17's
#   (The parts model_32b, landed, capacity_all, capacity_plan and capacity_edges, planned in session
#   12, were removed in session 13: their steps ran inside plans, edges32 and over_edges, or are
#   replaced by capacity_lanes, capacity_rest and prealloc_row.)
#   bash experiments/h200_session.sh capacity_prealloc|live_buffers|grid_1x   # session 11's parts
#   bash experiments/h200_session.sh live_hlo|grid_8x_small|grid_8x_large|grid_14b  # session 12's
#   bash experiments/h200_session.sh live_optax     # optax+clip's listing alone (done inline in session 11)
#   bash experiments/h200_session.sh limits|limits_more|unrolled_diag|profile_steps|batch8_small|batch8_large|grid_unrolled_14b
#                                               # session 10's parts (each case below says what it runs)
#   bash experiments/h200_session.sh xla_route|unrolled8b|large|capacity|capacity64|capacity48|extra|capacity_optaxloss
#                                               # session 9's parts (each case below says what it runs)
#   bash experiments/h200_session.sh cluster_profile|ring   # 4-stage cluster profiles; T=1024 ring configs
#   bash experiments/h200_session.sh mainloop   # ~2.5 min: --quick (leads with cluster_n=2), then
#                                               #   experiments.main_loop with and without clusters
#   bash experiments/h200_session.sh cluster    # ~2.5 min: cluster settings at T = 16384 and 4096
#                                               #   (its 5-stage profiles do not fit shared memory)
#   bash experiments/h200_session.sh defaults   # <10 min: the defaults correct, then timed
#                                               #   (bf16 at every T; bf16 and fp32 at small shapes)
#   bash experiments/h200_session.sh defaults2  # <10 min: fp32 timing, 8B rows, T=16384 main loop
#   bash experiments/h200_session.sh barriers   # <9 min: no_auto_barriers (Pallas's automatic
#                                               #   warpgroup barriers around shared-memory stores
#                                               #   left out: 90 -> 16 bar.sync in the fp32 kernel):
#                                               #   correct first (--quick leads with it), then both
#                                               #   sweeps side by side with the defaults, then bf16
#                                               #   timing against XLA at T=1024
#   bash experiments/h200_session.sh small      # ~5 min: per-layer timing of qwen3-0.6b's and
#                                               #   qwen3-1.7b's projections with 16 calls per dispatch
#                                               #   (device time; one call per dispatch timed the
#                                               #   dispatch), default tiling and 64-row tiles
#   bash experiments/h200_session.sh epilogue   # <9 min: profiles of the fp32 and bf16 epilogues with
#                                               #   diagnostic variants (no shared-memory reads; no
#                                               #   rule arithmetic; neither, nor writes): which one
#                                               #   the 17 us of the arithmetic region per tile is;
#                                               #   and T=16384 (main loop vs cuBLAS)
#   bash experiments/h200_session.sh sass       # ~4 min: SASS instruction classes of the kernel and
#                                               #   of each diagnostic variant (fp32, bf16)
#   bash experiments/h200_session.sh models8b   # ~2 min: the 8B rows with bench_models' device
#                                               #   timing (median of 3 back-to-back repeats): was the
#                                               #   old mean-of-5 biased for scanned steps too?
#   bash experiments/h200_session.sh unrolled8b # <10 min: Llama-3.1-8B unrolled (optax_unrolled timed
#                                               #   out at 139 s in session 2)
#   bash experiments/h200_session.sh models     # ~6.5 min: models8b + qwen3-14b FORGE
#   bash experiments/h200_session.sh convergence # <9 min: FORGE vs optax vs the control at
#                                               #   8x256 (1x256 parted both pairs by 0.07 nat after
#                                               #   ~150 steps: does a larger batch hold them closer?)
#   bash experiments/h200_session.sh quick|kernel|kernel2|unrolled   # as in session 6
#
# Run from the repository root on the device machine. Results go to $OUT as one
# tarball per part (the device tool returns at most 8 files, 2 folders deep):
# unpack it into experiments/results/h200/ and commit it with this script.
# Every step has its own time limit, so a hang costs that step, not the call.
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
part="${1:?usage: h200_session.sh head_order_unrolled|head_order_check|head_order|int8_jump|capacity_rest|capacity_rest2|edges14|clip_jump|plans|over_edges|edges32|capacity_lanes|live_hlo|live_optax|grid_1x|grid_8x_small|grid_8x_large|grid_14b|live_buffers|xla_route_fusions|compile_first|capacity_prealloc|limits_more|capacity48|extra|capacity_optaxloss|limits|batch8_small|batch8_large|grid_unrolled|grid_unrolled_4b|grid_unrolled_8b|grid_unrolled_14b|unrolled_diag|profile_steps|profile_unrolled|capacity|xla_route|small_models|models|models8b|unrolled|unrolled8b|convergence}"
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

if [ -n "${H200_DRY_RUN:-}" ]; then  # tests: record each step's command (fields split by \x1f)
  step() {  # one write per command: parts may run steps in the background
    shift 2
    local line
    line="$(printf '%s\x1f' "$@")"
    printf '%s\n' "$line" >> "$H200_DRY_RUN"
  }
fi

capacity_lane() {  # capacity_lane IMPL PROBES LIMIT_S [IMPL PROBES LIMIT_S ...]: capacity_plan
  # searches (Llama-3.1-8B, 1024 tokens, multiples of 8, jax's default limit) one after another
  while [ $# -ge 3 ]; do
    step "cap_$1" "$3" python -m experiments.capacity_plan --out "$work/cap_$1" \
      --model llama-3.1-8b --impls "$1" --tokens 1024 --probes "$2" --multiple 8 \
      --max-compiles 4 --limit-gib 104.8515625
    shift 3
  done
}

prealloc_row() {  # prealloc_row NAME LIMIT_S IMPL BATCH TIMEOUT_S: one Llama-3.1-8B step at
  # BATCHx1024 with the pool preallocated (jax's default) under jax's default limit
  step "$1" "$2" python -m experiments.bench_models --out "$work/$1" --models llama-3.1-8b \
    --impls "$3" --batch "$4" --steps 1 --preallocate --timeout "$5"
}

landed32_row() {  # landed32_row LIMIT_S: the landed loss timed side by side, FORGE and optax+clip
  # at 32x1024 (5 steps, on demand)
  step landed32 "$1" python -m experiments.bench_models --out "$work/landed32" --models llama-3.1-8b \
    --impls forge,optax_clip --batch 32 --steps 5 --timeout 115
}

live_row() {  # live_row NAME IMPL BATCH: the buffers live at the peak of one Llama-3.1-8B step at
  # BATCHx1024 (compile-only)
  step "$1" 200 python -m experiments.live_buffers --out "$work/$1" --model llama-3.1-8b \
    --impls "$2" --batch "$3" --timeout 150
}

case "$part" in
  capacity)
    # The capacity table (results/h200/capacity) used optax's cross-entropy; the lean loss
    # (models.cross_entropy, the default since) cut FORGE's step at 32x1024 by 7.8 GiB compile-only.
    step capacity 570 python -m experiments.bench_models --out "$work/capacity" --capacity \
      --models llama-3.1-8b --impls optax_clip,forge --tokens 1024 --max-batch 64 --time-budget 520 --steps 1
    ;;
  xla_route)
    step hlo 200 python -m experiments.memory_analysis --model llama-3.1-8b --impls forge_xla,forge_int8,forge \
      --batch 1 --tokens 1024 --hlo --out "$work/hlo"
    rm -rf "$work/hlo/hlo"  # the HLO text (hundreds of MB); the counts are in memory_analysis.json
    step models 330 python -m experiments.bench_models --out "$work/models" --models llama-3.1-8b \
      --impls optax,forge_xla,forge_int8,forge --timeout 150
    ;;
  capacity48)
    # Both OOM at 64x1024 and fit at 32x1024: which fits 48x1024?
    step b48 330 python -m experiments.bench_models --out "$work/b48" --models llama-3.1-8b \
      --impls optax_clip,forge --tokens 1024 --batch 48 --steps 1 --timeout 160
    ;;
  extra)
    # optax+clip between 32 (fits) and 48 (OOM); qwen3-4b's rows with device timing.
    step b40 130 python -m experiments.bench_models --out "$work/b40" --models llama-3.1-8b \
      --impls optax_clip --tokens 1024 --batch 40 --steps 1 --timeout 120
    step models4b 230 python -m experiments.bench_models --out "$work/models4b" --models qwen3-4b \
      --impls optax,optax_clip,forge --timeout 75
    ;;
  capacity_optaxloss)
    # optax+clip OOMs at 40x1024 with the lean loss, which raised its step's temporaries at 32x1024
    # (memory_analysis_b32_loss): does it fit 40 or 48 with optax's cross-entropy?
    step optaxloss 230 python -m experiments.bench_models --out "$work/optaxloss" --models llama-3.1-8b \
      --impls optax_clip --tokens 1024 --batch 40,48 --steps 1 --loss optax --timeout 110
    ;;
  limits)
    step default 100 python -m experiments.bench_models --out "$work/default" --models qwen3-0.6b \
      --impls optax --timeout 90
    step q14 180 python -m experiments.bench_models --out "$work/q14" --models qwen3-14b \
      --impls optax,optax_clip --mem-fraction 0.95 --timeout 88
    step l8_optax 110 python -m experiments.bench_models --out "$work/l8_optax" --models llama-3.1-8b \
      --impls optax_clip --batch 40 --steps 1 --mem-fraction 0.95 --timeout 100
    step l8_forge 130 python -m experiments.bench_models --out "$work/l8_forge" --models llama-3.1-8b \
      --impls forge --batch 64 --steps 1 --mem-fraction 0.95 --timeout 120
    ;;
  grid_1x)
    # First check that a step loads from jax's persistent cache on this machine (a FORGE step holds
    # Mosaic GPU custom calls); without it the grid compiles row by row (fewer rows fit).
    step cache_check 110 python -m experiments.bench_models --out "$work/cache_check" --models qwen3-0.6b \
      --impls forge --steps 1 --precompile 1 --compile-cache /tmp/jax_cache_check --timeout 100
    pre="--precompile 6 --compile-cache /tmp/jax_cache_grid"
    if [ -z "${H200_DRY_RUN:-}" ] && ! grep -q '"step_from_cache": true' "$work/cache_check/bench_models.json" 2>/dev/null; then
      echo "   no step came from the cache: the rows compile one by one"
      pre=""
    fi
    # shellcheck disable=SC2086  # $pre: flags or nothing
    step grid_1x 470 python -m experiments.bench_models --out "$work/grid_1x" \
      --models qwen3-1.7b,qwen3-4b,qwen3-8b --impls optax_unrolled,forge_unrolled --timeout 280 \
      --time-budget 455 $pre
    ;;
  grid_8x_small)
    step grid_8x_small 575 python -m experiments.bench_models --out "$work/grid_8x_small" \
      --models qwen3-0.6b,qwen3-1.7b,qwen3-4b --impls optax_unrolled,forge_unrolled --batch 8 \
      --timeout 280 --time-budget 560 --precompile 6 --compile-cache /tmp/jax_cache_grid
    ;;
  grid_8x_large)
    step grid_8x_large 575 python -m experiments.bench_models --out "$work/grid_8x_large" \
      --models qwen3-8b,llama-3.1-8b --impls optax_unrolled,forge_unrolled --batch 8 \
      --timeout 280 --time-budget 560 --precompile 4 --compile-cache /tmp/jax_cache_grid
    ;;
  grid_14b)
    # Scanned optax runs out of memory on qwen3-14b under the default limit, but unrolled optax holds
    # no full gradient pool (Llama-3.1-8B: 49.73 against 59.01 GiB), so it is tried under the default
    # limit like every grid row (an OOM is recorded; a 95% row can follow).
    step grid_14b 575 python -m experiments.bench_models --out "$work/grid_14b" --models qwen3-14b \
      --impls optax_unrolled,forge_unrolled --batch 1,8 --timeout 280 --time-budget 560 \
      --precompile 4 --compile-cache /tmp/jax_cache_grid
    ;;
  live_buffers)
    # What is live at FORGE's peak at 64x1024, with and without the head barrier (compile-only), then
    # the barrier's effect at 32x1024: the same row on the tree as it is and on the patched copy.
    # (Session 11 ran this with head_update_first.diff, the barrier's first form, then not landed;
    # session 15 landed the barrier and retired that patch: git show a88db37:experiments/patches/...)
    step live_forge 200 python -m experiments.live_buffers --out "$work/live_forge" --model llama-3.1-8b \
      --impls forge,forge_xla --batch 64 --patch experiments/patches/no_head_barrier.diff --timeout 90
    step b32_main 110 python -m experiments.bench_models --out "$work/b32_main" --models llama-3.1-8b \
      --impls forge --batch 32 --steps 1 --timeout 100
    step b32_patched 120 python -m experiments.with_patch experiments/patches/no_head_barrier.diff -- \
      python -m experiments.bench_models --out "$work/b32_patched" --models llama-3.1-8b --impls forge \
      --batch 32 --steps 1 --timeout 100
    ;;
  plans)
    # Every compile-only plan of session 13 at once (no process preallocates, so they share the
    # device): issue #8's capacity searches (Llama-3.1-8B, 1024-token sequences, the largest
    # multiple of 8 whose compiled step fits jax's default limit, given rather than read from the
    # device) for the grid's five implementations and int8 states, the landed loss's live buffers at
    # 64x1024 (FORGE and optax+clip) and Qwen3-32B's init and step plans with int8 states.
    # As run in session 13, kept as it ran: eight compiles at once ran XLA's autotuner out of device
    # memory (it allocates real operands), so most large batches failed to compile and the searches'
    # edges were wrong (results/h200/capacity_per_impl/concurrent_autotuner_oom). Use capacity_lanes
    # or capacity_rest for edges.
    for impl in optax optax_clip forge forge_int8; do
      ( export XLA_PYTHON_CLIENT_PREALLOCATE=false
        step "cap_$impl" 560 python -m experiments.capacity_plan --out "$work/cap_$impl" \
          --model llama-3.1-8b --impls "$impl" --tokens 1024 --probes 32,64 --multiple 8 \
          --max-compiles 6 --limit-gib 104.8515625 ) &
    done
    for impl in optax_unrolled forge_unrolled; do
      ( export XLA_PYTHON_CLIENT_PREALLOCATE=false
        step "cap_$impl" 560 python -m experiments.capacity_plan --out "$work/cap_$impl" \
          --model llama-3.1-8b --impls "$impl" --tokens 1024 --probes 16,32 --multiple 8 \
          --max-compiles 4 --limit-gib 104.8515625 ) &
    done
    ( export XLA_PYTHON_CLIENT_PREALLOCATE=false
      step live_landed 400 python -m experiments.live_buffers --out "$work/live_landed" \
        --model llama-3.1-8b --impls forge,optax_clip --batch 64 --timeout 190 ) &
    ( export XLA_PYTHON_CLIENT_PREALLOCATE=false
      step plan32 400 python -m experiments.memory_analysis --out "$work/plan32" --model qwen3-32b \
        --impls forge_int8 ) &
    wait
    ;;
  capacity_lanes)
    # plans' six capacity searches again in three serial lanes, each started near the edge that session 13's
    # plans part predicted: eight compiles at once ran the autotuner out of device memory (it
    # allocates real operands: 27 GiB for the logits at 112x1024), so most large batches failed
    # to compile. At most three compile at once here.
    export XLA_PYTHON_CLIENT_PREALLOCATE=false
    capacity_lane forge 112,120 280 forge_int8 128,136 280 &
    capacity_lane optax 80,88 280 optax_clip 64,72 280 &
    capacity_lane optax_unrolled 104,112 400 forge_unrolled 104,112 165 &
    wait
    ;;
  edges32)
    # The edges capacity_lanes found, run with the pool preallocated (jax's default limit): FORGE
    # at 112 and optax+clip at 64 (plans 103.83 and 102.13 GiB); first Qwen3-32B's run (its plan
    # came from the plans part: 130.97 GiB, 125.86 of them weights and states).
    step run32 250 python -m experiments.bench_models --out "$work/run32" --models qwen3-32b \
      --impls forge_int8 --mem-fraction 0.97 --preallocate --compile-first --steps 1 --timeout 240
    prealloc_row edge_forge 165 forge 112 155
    prealloc_row edge_optax_clip 165 optax_clip 64 155
    ;;
  over_edges)
    # One multiple of 8 past edges32's batches, preallocated (session 13 ran these inline, the same
    # commands): FORGE at 120 and optax+clip at 72 (plans 108.04 and 106.6 GiB) must run out of
    # memory. Then the landed loss timed side by side at 32x1024 (session 13 gave it --timeout 80,
    # which both rows ran past; 115 here).
    prealloc_row over_forge 130 forge 120 120
    prealloc_row over_optax_clip 130 optax_clip 72 120
    landed32_row 240
    ;;
  capacity_rest)
    # The edges session 13's capacity_lanes left open (plans so far in results/h200/capacity_per_impl):
    # optax >= 88 (96.97 GiB there, near 104 by its slope), optax_unrolled and forge_unrolled >= 112
    # (103.21 and 103.83 GiB), forge_int8 unknown (its compile at 128 failed beside two others). Two
    # lanes, so that at most two autotuners allocate at once; unrolled compiles take 2-3 minutes.
    export XLA_PYTHON_CLIENT_PREALLOCATE=false
    capacity_lane optax_unrolled 112,120 280 forge_unrolled 112,120 280 &
    capacity_lane optax 96,104 200 forge_int8 128,136 360 &
    wait
    ;;
  capacity_rest2)
    # Session 14 ran these inline after capacity_rest (results/h200/capacity_per_impl/rest2): the
    # probes that capacity_rest's step limits cut or left over the limit.
    export XLA_PYTHON_CLIENT_PREALLOCATE=false
    capacity_lane optax_unrolled 120,128 290 forge_int8 112,120 270 &
    capacity_lane optax 104,112 300 &
    wait
    ;;
  edges14)
    # Session 14's preallocated runs, inline (results/h200/bench_models_edge_{optax_112,optax_120,
    # forge_unrolled_112}), and over_edges' landed32 step with its flags (bench_models_landed32).
    prealloc_row edge_optax_112 165 optax 112 155
    prealloc_row over_optax_120 160 optax 120 150
    landed32_row 245
    prealloc_row edge_forge_unrolled_112 290 forge_unrolled 112 280
    ;;
  live_hlo)
    # FORGE's step at 64x1024: the buffers live at the peak and the optimized HLO (compile-only).
    # Session 12 ran it with --patch experiments/patches/picked_by_reduction.diff --patch
    # experiments/patches/dlogits_in_place.diff beside main; the second landed, the first was deleted.
    step live_hlo 400 python -m experiments.live_buffers --out "$work/live_hlo" --model llama-3.1-8b \
      --impls forge --batch 64 --timeout 130 --save-hlo
    ;;
  live_optax)
    step live_optax 120 python -m experiments.live_buffers --out "$work/live_optax" --model llama-3.1-8b \
      --impls optax_clip --batch 64 --timeout 110
    ;;
  xla_route_fusions)
    step xla_hlo 200 python -m experiments.diagnose_unrolled --out "$work/xla_hlo" --model llama-3.1-8b \
      --layers 2 --impls forge forge_xla forge_int8 --layouts scanned
    ;;
  compile_first)
    # The same four rows compiled from shapes before the state exists (--compile-first) and, side
    # by side, next to the resident state (the default): peak minus XLA's plan says what the GEMM
    # autotuner's buffers add to each.
    step compile_first 230 python -m experiments.bench_models --out "$work/compile_first" \
      --models llama-3.1-8b --impls optax,forge,forge_xla,forge_int8 --compile-first --timeout 100 \
      --time-budget 220
    step compile_next 230 python -m experiments.bench_models --out "$work/compile_next" \
      --models llama-3.1-8b --impls optax,forge,forge_xla,forge_int8 --timeout 100 \
      --time-budget 220
    ;;
  capacity_prealloc)
    # Llama-3.1-8B, 1024-token sequences, workers with the whole limit preallocated (--preallocate).
    # Default limit: optax+clip at 40 and FORGE at 64 ran out of memory allocating on demand.
    prealloc_row pre_default40 110 optax_clip 40 100
    prealloc_row pre_default64 110 forge 64 100
    # 95%: FORGE at 96 ran out of memory on demand; optax+clip at 96 was never tried.
    step pre95 300 python -m experiments.bench_models --out "$work/pre95" --models llama-3.1-8b \
      --impls forge,optax_clip --batch 96 --steps 1 --preallocate --mem-fraction 0.95 --timeout 145
    ;;
  limits_more)
    # With 95% of the device (132.8 GiB): optax on qwen3-14b at 8x1024 (OOM under the default 104.9
    # GiB); Llama-3.1-8B optax+clip at FORGE's default-limit maximum (64x1024), FORGE at 96x1024.
    step q14_b8 300 python -m experiments.bench_models --out "$work/q14_b8" --models qwen3-14b \
      --impls optax_clip,optax --batch 8 --steps 1 --mem-fraction 0.95 --timeout 140 --time-budget 290
    step optax_clip_b64 290 python -m experiments.bench_models --out "$work/optax_clip_b64" \
      --models llama-3.1-8b --impls optax_clip --batch 64 --steps 1 --mem-fraction 0.95 --timeout 130
    step forge_b96 150 python -m experiments.bench_models --out "$work/forge_b96" \
      --models llama-3.1-8b --impls forge --batch 96 --steps 1 --mem-fraction 0.95 --timeout 140
    ;;
  batch8_small)
    step batch8_small 420 python -m experiments.bench_models --out "$work/batch8_small" \
      --models qwen3-0.6b,qwen3-1.7b,qwen3-4b --impls optax,optax_clip,forge --batch 8 --timeout 90
    step b40 120 python -m experiments.bench_models --out "$work/b40" --models llama-3.1-8b \
      --impls optax_clip --tokens 1024 --batch 40 --steps 1 --timeout 110
    ;;
  batch8_large)
    step batch8_large 570 python -m experiments.bench_models --out "$work/batch8_large" \
      --models qwen3-8b,llama-3.1-8b,qwen3-14b --impls optax,optax_clip,forge --batch 8 --timeout 100 \
      --time-budget 555
    ;;
  # Unrolled steps compile for 110-185 s on the H200 whatever the model's size: two rows a call.
  # --time-budget records a row that would not fit as skipped instead of losing it to `timeout`.
  grid_unrolled)
    step grid_unrolled 575 python -m experiments.bench_models --out "$work/grid_unrolled" \
      --models qwen3-1.7b --impls optax_unrolled,forge_unrolled --timeout 280 --time-budget 560
    ;;
  grid_unrolled_4b)
    step grid_unrolled_4b 575 python -m experiments.bench_models --out "$work/grid_unrolled_4b" \
      --models qwen3-4b --impls optax_unrolled,forge_unrolled --timeout 280 --time-budget 560
    ;;
  grid_unrolled_8b)
    step grid_unrolled_8b 575 python -m experiments.bench_models --out "$work/grid_unrolled_8b" \
      --models qwen3-8b --impls optax_unrolled,forge_unrolled --timeout 280 --time-budget 560
    ;;
  grid_unrolled_14b)
    # optax runs out of memory on qwen3-14b even scanned: FORGE only.
    step grid_unrolled_14b 400 python -m experiments.bench_models --out "$work/grid_unrolled_14b" \
      --models qwen3-14b --impls forge_unrolled --timeout 390
    ;;
  unrolled_diag)
    # Unrolled Llama-3.1-8B steps hold ~3.4 GiB more temporaries than scanned FORGE (both optax and
    # FORGE; bench_models_unrolled8b). On XLA:CPU (helper investigation, 2026-11-30) they grow 1.48
    # GiB per layer in bf16: every layer's recomputed forward scheduled before the backward, plus
    # W_up copies in FORGE. Per-layer slope, copies and their shapes on the GPU:
    step diag 400 python -m experiments.diagnose_unrolled --out "$work/diag" --model llama-3.1-8b \
      --layers 2 4 --impls forge optax --layouts scanned unrolled
    # The "xla" route peaks 4.3 GiB above its state (forge_xla 49.16 vs 44.87 GiB; forge_int8 35.13 vs
    # 30.85), 2.0 GiB beyond XLA's plan for the step. Our guess: GEMM autotuning at compile time
    # allocating the LM head's float32 dW (2 GiB) for candidate and reference outputs while the state
    # is resident. Without autotuning:
    (export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0"
     step noautotune 120 python -m experiments.bench_models --out "$work/noautotune" \
       --models llama-3.1-8b --impls forge_xla --steps 1 --timeout 110)
    ;;
  profile_steps)
    # Where the "xla" route's 46 ms over the kernel's step go, and the int8 route's 66 ms
    # (bench_models_xla_route): kernels by class, side by side; then unrolled vs scanned optax.
    # (CUDA-graph command buffers are off while profiling: launch overhead is not what this shows.)
    step xla 330 python -m experiments.profile_step --out "$work/xla" --model llama-3.1-8b \
      --impls optax,forge,forge_xla,forge_int8 --timeout 80
    ;;
  profile_unrolled)
    # Llama-3.1-8B cut to 8 layers (unrolled 32-layer workers took 116-143 s before profiling):
    # kernels by class, scanned and unrolled, side by side.
    step profile_unrolled 480 python -m experiments.profile_step --out "$work/profile_unrolled" \
      --model llama-3.1-8b --layers 8 --impls optax,optax_unrolled,forge,forge_unrolled --timeout 115
    ;;
  clip_jump)
    # optax+clip's plan jumps by 12.16 GiB between 48 and 56 sequences (1.52 GiB per sequence,
    # against 0.53 from 32 to 48; results/h200/capacity_per_impl): the buffers live at each peak,
    # compile-only, one after the other (never beside other compiles: the autotuner's operands).
    live_row clip48 optax_clip 48
    live_row clip56 optax_clip 56
    ;;
  head_order)
    # The LM head's dX now waits for its update (forge_jax/_dense.py: an optimization barrier on
    # dX and the update's outputs), so its dY, the 29.4 GiB of dlogits at 120 sequences, dies
    # before the layers' backward (results/h200/live_jumps/: int8 states kept it live from
    # instruction 163 to 740). Compile-only listings, one after the other.
    live_row int8_120 forge_int8 120
    live_row forge_120 forge 120
    live_row int8_136 forge_int8 136
    live_row forge_112 forge 112
    ;;
  head_order_check)
    # The head barrier's cost and gain measured: FORGE at 32x1024 timed on the tree and on a copy
    # without the barrier (experiments/patches/no_head_barrier.diff), one after the other; then
    # forge_int8 at 136 sequences preallocated (its plan with the barrier: 102.71 GiB).
    step b32_main 200 python -m experiments.bench_models --out "$work/b32_main" --models llama-3.1-8b \
      --impls forge --batch 32 --steps 5 --timeout 170
    step b32_nobarrier 200 python -m experiments.with_patch experiments/patches/no_head_barrier.diff -- \
      python -m experiments.bench_models --out "$work/b32_nobarrier" --models llama-3.1-8b --impls forge \
      --batch 32 --steps 5 --timeout 170
    prealloc_row int8_136 190 forge_int8 136 170
    ;;
  head_order_unrolled)
    # The head barrier sits on every layer of an unrolled model: qwen3-1.7b unrolled at 8x1024
    # timed on the tree and on a copy without it, one after the other. (Session 15 gave each run
    # 120 s and both timed out: results/h200/head_barrier/unrolled_timeout.)
    step u8_main 280 python -m experiments.bench_models --out "$work/u8_main" --models qwen3-1.7b \
      --impls forge_unrolled --batch 8 --steps 5 --timeout 270
    step u8_nobarrier 280 python -m experiments.with_patch experiments/patches/no_head_barrier.diff -- \
      python -m experiments.bench_models --out "$work/u8_nobarrier" --models qwen3-1.7b \
      --impls forge_unrolled --batch 8 --steps 5 --timeout 270
    ;;
  int8_jump)
    # forge_int8's plan jumps by 21.53 GiB from 112 to 120 sequences (91.99 -> 113.52 GiB; bf16
    # FORGE's grows 4.21; results/h200/capacity_per_impl/rest2): the buffers live at each peak,
    # compile-only, one after the other.
    live_row int8_112 forge_int8 112
    live_row int8_120 forge_int8 120
    ;;
  small_models)
    step small_models 290 python -m experiments.bench_models --out "$work/small_models" \
      --models qwen3-0.6b,qwen3-1.7b --impls optax,optax_clip,forge --timeout 140
    ;;
  convergence)
    # Session 8's first try (300 pretraining steps, 120 s a run) stopped the pretraining at step
    # 248 and came back as a 4.9 GB tarball of checkpoints: at 8x256 in true float32 a step takes
    # ~0.4 s. Shorter now (100 + 300 steps), no per-run limit, no checkpoints in the tarball.
    step convergence 540 python -m experiments.convergence --out "$work/convergence" --dtype float32 \
      --matmul-precision highest --batch 8 --seq 256 --pretrain-steps 100 --steps 300 --warmup 50
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
    # optax (scanned) was timed side by side in models8b; the two unrolled rows get the whole call.
    step unrolled8b 575 python -m experiments.bench_models --out "$work/unrolled8b" --models llama-3.1-8b \
      --impls forge_unrolled,optax_unrolled --timeout 285
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
# Checkpoints and Hugging Face weights stay on the device (the tool returns files of at most 16 MiB).
tar czf "$out/h200_$part.tgz" --exclude=ckpt --exclude=hf -C /tmp "h200_$part"
ls -la "$out"
