#!/usr/bin/env bash
# GPU benchmark scenarios, one per table of BENCHMARKS.md. From the repository root of a GPU machine:
#
#   bash benchmarks/gpu.sh SCENARIO [SCENARIO ...]
#
#   peers     1 GPU    pipeserve against DeepSpeed-FastGen and transformers: 64 requests, prompts U[128,2048], 128 out
#   prefix    1 GPU    prefix sharing (Mooncake, shared prefix): caching off / on / grouping, against FastGen
#   sharegpt  1 GPU    1,000 ShareGPT requests, pipeserve against FastGen
#   scaling   2 GPUs   one GPU against pp=2 and tp=2 on the same machine, two offline workloads
#   scaling4  4 GPUs   one GPU against tp=4, pp=4 and tp=2 × pp=2 on the same machine (WORKLOADS= to pick)
#   big4      4 GPUs   the Llama-3-70B shape: DeepSpeed-FastGen tp=4 (768- and 2,048-token forwards) against
#                      pipeserve tp=4, tp=2 × pp=2, pp=4 (LAYOUTS= and WORKLOADS= to pick, ROUNDS= timed rounds each,
#                      the last one reported: with WORKLOADS=peers, as FastGen's decode-heavy round takes ~3 min;
#                      FastGen's wheels in .whl/)
#   async     2 GPUs   one GPU and tp=2 without token feedback (async scheduling), against scaling's runs
#   coldstart 1 GPU    start-up and the first rounds after it, with an empty compile cache and a filled one (TP=N: at tp=N)
#   coldserve 1 GPU    the same through `pipeserve serve`: time to its ready line, then TTFT of HTTP rounds (TP=N too)
#   capacity  1-2 GPUs sarathi against the vllm policy: highest Poisson rate with P99 TBT <= 100 ms
#   bubbles   2 GPUs   pp=2 bubbles: sarathi with a profiled time budget (twice), orca
#   roofline  1 GPU    prefill MFU and decode steps against the weight-read floor
#   fp8       1 GPU    FP8 weights against bf16: throughput, KV blocks, decode steps against each floor, greedy agreement
#   pairs     2-4 GPUs this tree and BEFORE=<another checkout> at once at tp=TP (default 2: GPUs 0,1 and 2,3; TP=1:
#                      GPU 0 and 1), then swapped: a same-time A/B, with every rank's timeline (WORKLOADS= to pick)
#   ranks     2-4 GPUs per-step timelines of every rank at tp=2 (tp=4 on 4 GPUs) and of one GPU: which rank starts late,
#                      device gaps (the longest, with their steps), the workers' full collections
#   tpsteps   2 GPUs   one micro-batch at tp=1 and tp=2 (and tp=4 on 4 GPUs), NCCL's sums against symmetric memory, kernels by kind;
#                      a layer's sums in line against overlapped with the other half's GEMMs (tools/tp_overlap);
#                      the sum kernels per size: PyTorch's one-shot and two-shot against pipeserve's push and its two-shot (tools/sum_kernels)
#   sums      1-4 GPUs the sum kernels per size (tools/sum_kernels), and a sum followed by the next residual add and
#                      RMSNorm: the forward's sum then the norm kernel against the push's and its two-shot's fused kernels,
#                      at tp=2 (and tp=4 on 4 GPUs); on any GPU first, pipeserve's tp=2 kernels with the peer simulated
#   structured 1 GPU   plain, penalties, a quarter under a JSON schema; xgrammar against outlines-core per token
#   profile   1 GPU    the card's cost model, which bubbles needs (kept in /tmp/gpu_runs for later invocations)
#
# benchmarks/README.md says what each measures, how long it takes and what to carry (FastGen's
# wheels in .whl/ for peers, prefix and sharegpt). Each scenario prints its table; the tables of
# the whole invocation print again last. Under $OUT (default /tmp/out): summary.md (every table),
# results.json (the figures, by tree and scenario) and logs.tar.gz (every log, result.json and
# profile); the run folders stay in /tmp/gpu_runs.
#
#   TREE=<folder>  run against another checkout of pipeserve (an older commit in a git-ignored
#                  folder): `TREE=.before bash benchmarks/gpu.sh peers; bash benchmarks/gpu.sh peers`
#                  measures before and after in one run. LABEL=<name> names a tree in the tables.
#   BEFORE=<folder> pairs: the other tree, run at the same time as TREE on the other GPUs
#   DRY=1          print the commands instead of running them (no GPU needed)
#   SYSTEMS=<list> bench_peers systems for peers, prefix and sharegpt (e.g. pipeserve,fastgen)
#   COST_MODEL=<json>  the bubbles scenario's profile (default: profiled once per card, kept in /tmp)
set -uo pipefail
cd "$(dirname "$0")/.."
SCENARIOS="peers prefix sharegpt scaling scaling4 big4 async coldstart coldserve capacity bubbles roofline fp8 ranks pairs tpsteps sums structured profile"
[ $# -gt 0 ] || { sed -n '2,/^set /{/^#/p;}' benchmarks/gpu.sh; exit 2; }
for s in "$@"; do
  [[ " $SCENARIOS " == *" $s "* ]] || { echo "unknown scenario $s (one of: $SCENARIOS)"; exit 2; }
done
REPO=$(pwd)
DRY=${DRY:-}
ROOT=$(cd "${TREE:-.}" && pwd) || exit 2
export TREE=$ROOT
if [ -n "$DRY" ]; then
  OUT=${OUT:-/tmp/out}; NGPU=${NGPU:-2}; CARD=${CARD:-GPU}
else
  source .ci/gpu_env.sh || exit 2
  NGPU=$(nvidia-smi -L | wc -l)
  CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
fi
tree_label() {  # a checkout's commit, "+changes" where its files differ from it, else its folder's name
  # (the device machine's copy of .git can lag the files sent with each call: pass LABEL= there)
  local c
  c=$([ -e "$1/.git" ] && git -C "$1" rev-parse --short HEAD 2>/dev/null)
  if [ -n "$c" ]; then
    [ -z "$(git -C "$1" status --porcelain --untracked-files=no 2>/dev/null)" ] || c="$c+changes"
    echo "$c"
  elif [ "$1" = "$REPO" ]; then echo this-tree
  else basename "$1" | sed "s|^\.||"
  fi
}
LABEL=${LABEL:-$(tree_label "$ROOT")}
BASE=/tmp/gpu_runs
MODEL_DIR=$BASE/llama3-8b   # bench_peers' model folder: its random weights are written once, then reused

# The GPT-2 tokenizer that older GPU scripts carried: trees whose bench needs one get it, and the
# current tree accepts it (without it, the dummy model's vocabulary is generated, of the same size).
TOK=$REPO/.whl/gpt2_tokenizer.json
if [ -f "$TOK" ]; then
  TOK_BENCH="dummy_model.tokenizer=$TOK" TOK_TOOL="--tokenizer $TOK"
else
  TOK_BENCH="" TOK_TOOL=""
  [ "$ROOT" != "$REPO" ] && echo "note: no .whl/gpt2_tokenizer.json; an older tree's bench may need it"
fi
D8="dummy_model.shape=llama3-8b $TOK_BENCH"
QUIET="bench.progress=false bench.plots=false bench.save_steps=false"
ARXIV="workload=arxiv workload.max_prompt_len=null workload.max_output_len=512"

run() {  # run NAME SECONDS GPUS COMMAND...: in the tree under test; output in $DIR/NAME.log
  local name=$1 limit=$2 gpus=$3; shift 3
  if [ -n "$DRY" ]; then
    echo "$([ "$ROOT" != "$REPO" ] && echo "(in $ROOT) ")CUDA_VISIBLE_DEVICES=$gpus timeout $limit $*"
    return 0
  fi
  local t0=$SECONDS rc
  echo "# CUDA_VISIBLE_DEVICES=$gpus $*" >"$DIR/$name.log"
  (cd "$ROOT" && CUDA_VISIBLE_DEVICES=$gpus timeout "$limit" "$@") >>"$DIR/$name.log" 2>&1
  rc=$?
  echo "$name: exit $rc after $((SECONDS - t0)) s"
  [ "$rc" = 0 ] || grep -v "^#" "$DIR/$name.log" | tail -12
  return "$rc"
}

bench() {  # bench NAME SECONDS GPUS OVERRIDES...: pipeserve bench on the Llama-3-8B shape, run folder $DIR/NAME
  local name=$1 limit=$2 gpus=$3; shift 3
  run "$name" "$limit" "$gpus" python3 -m pipeserve.launch.cli bench $D8 $QUIET hydra.run.dir="$DIR/$name" "$@"
}

tool() {  # tool NAME SECONDS GPUS MODULE ARGS...: `python -m tools.MODULE` of the tree under test
  local name=$1 limit=$2 gpus=$3 module=tools.$4; shift 4
  [ -d "$ROOT/tools" ] || module=pipeserve.launch.${module#tools.}   # trees from before tools/ held the probes in launch/
  run "$name" "$limit" "$gpus" python3 -m "$module" "$@"
}

need_gpus() {
  [ "$NGPU" -ge "$1" ] && return 0
  echo "$SCENARIO needs $1 GPUs, this machine has $NGPU: skipped"
  return 1
}

peers() {  # ~6 min: writes the random weights once (FastGen and transformers load them), FastGen's kernel build ~140 s
  tool peers 590 0 bench_peers --systems "${SYSTEMS:-pipeserve,transformers,fastgen}" $TOK_TOOL \
    --workdir "$MODEL_DIR" --out "$DIR/peers.json"
}

prefix() {  # ~4 min after peers on the same machine: 64 requests, 128 out each, per workload
  local w
  for w in mooncake shared_prefix; do
    tool "prefix-$w" 290 0 bench_peers --workload "$w" \
      --systems "${SYSTEMS:-pipeserve,pipeserve:prefix=caching,pipeserve:prefix=grouping,fastgen}" $TOK_TOOL \
      --workdir "$MODEL_DIR" --out "$DIR/prefix-$w.json"
  done
}

sharegpt() {  # ~9 min (FastGen alone ~6): run it alone, after peers built FastGen's kernels, or with SYSTEMS=pipeserve
  tool sharegpt 595 0 bench_peers --workload sharegpt --num-requests 1000 --systems "${SYSTEMS:-pipeserve,fastgen}" \
    $TOK_TOOL --workdir "$MODEL_DIR" --out "$DIR/sharegpt.json"
}

scaling() {  # ~5 min: six runs of about 45 s (start-up and graph capture included)
  need_gpus 2 || return 0
  # Through the public LLM(...) API (benchmarks/throughput.py, this checkout's copy), so an older
  # TREE runs the same measurement.
  local w
  for w in uniform decode-heavy; do
    run "scaling-$w-1gpu" 170 0 python3 "$REPO/benchmarks/throughput.py" --workload "$w" $TOK_TOOL
    run "scaling-$w-pp2" 170 0,1 python3 "$REPO/benchmarks/throughput.py" --workload "$w" $TOK_TOOL --pp 2
    run "scaling-$w-tp2" 170 0,1 python3 "$REPO/benchmarks/throughput.py" --workload "$w" $TOK_TOOL --tp 2
  done
}

scaling4() {  # ~4-5 min per workload: four runs of about a minute (start-up and graph capture included)
  need_gpus 4 || return 0
  local w
  for w in ${WORKLOADS:-uniform decode-heavy}; do
    run "scaling4-$w-1gpu" 170 0 python3 "$REPO/benchmarks/throughput.py" --workload "$w" $TOK_TOOL
    run "scaling4-$w-tp4" 170 0,1,2,3 python3 "$REPO/benchmarks/throughput.py" --workload "$w" $TOK_TOOL --tp 4
    run "scaling4-$w-pp4" 170 0,1,2,3 python3 "$REPO/benchmarks/throughput.py" --workload "$w" $TOK_TOOL --pp 4
    run "scaling4-$w-tp2pp2" 170 0,1,2,3 python3 "$REPO/benchmarks/throughput.py" --workload "$w" $TOK_TOOL --tp 2 --pp 2
  done
}

big4() {  # FastGen ~7 min a budget (141 GB of weights written once, its kernels built ~140 s once); pipeserve ~1.5 min a layout and workload
  need_gpus 4 || return 0
  local w l dir
  local workloads=${WORKLOADS:-peers decode-heavy}
  for l in ${LAYOUTS:-fastgen-tp4 fastgen-tp4-2048 tp4 tp2pp2 pp4}; do
    if [[ "$l" == fastgen-tp4* ]]; then  # the weights FastGen reads: in memory when /dev/shm has room
      dir=/dev/shm/llama3-70b   # (an earlier invocation's copy is reused)
      if [ -z "$DRY" ] && [ ! -f "$dir/model.safetensors.index.json" ]; then
        local room; room=$(df --output=avail -BG /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)
        [ "${room:-0}" -ge 160 ] || dir=$BASE/llama3-70b
      fi
      [ -f "$dir/model.safetensors.index.json" ] \
        || run big4-write 400 "" python3 "$REPO/tools/fastgen_tp.py" write "$dir" --shape llama3-70b $TOK_TOOL \
        || continue
      local budget=""   # fastgen-tp4: MII's default 768-token forwards; fastgen-tp4-2048: pipeserve's budget
      [ "$l" = fastgen-tp4-2048 ] && budget="--max-ragged-batch-size 2048"
      run "big4-$l" 590 0,1,2,3 python3 -m deepspeed.launcher.runner --num_gpus 4 "$REPO/tools/fastgen_tp.py" \
        run "$dir" --tp 4 --workloads "${workloads// /,}" $budget --rounds "${ROUNDS:-1}"
      continue
    fi
    local flags=${l/tp4/--tp 4}; flags=${flags/tp2pp2/--tp 2 --pp 2}; flags=${flags/pp4/--pp 4}
    for w in $workloads; do
      run "big4-$w-$l" 300 0,1,2,3 python3 "$REPO/benchmarks/throughput.py" --shape llama3-70b --workload "$w" $TOK_TOOL $flags \
        --rounds "${ROUNDS:-1}"
    done
  done
}

async() {  # ~4 min: one GPU and tp=2 with token feedback off; scaling's runs are the default (on)
  need_gpus 2 || return 0
  local w
  for w in uniform decode-heavy; do
    run "async-$w-1gpu-off" 170 0 python3 "$REPO/benchmarks/throughput.py" --workload "$w" $TOK_TOOL --token-feedback off
    run "async-$w-tp2-off" 170 0,1 python3 "$REPO/benchmarks/throughput.py" --workload "$w" $TOK_TOOL --tp 2 --token-feedback off
  done
}

coldstart() {  # ~3 min: the first work after start-up, with an empty compile cache and then with the one it left
  # (TP=N: at tp=N on the first N GPUs; every rank's step timeline beside each run's log)
  local cache=$BASE/coldstart-triton-cache tp=${TP:-1}
  need_gpus "$tp" || return 0
  rm -rf "$cache"
  for c in cold warm; do
    (export TRITON_CACHE_DIR=$cache PIPESERVE_STAGE_STATS_DIR=$DIR/coldstart-$c-ranks
     run "coldstart-$c" 200 "$(seq -s, 0 $((tp - 1)))" python3 "$REPO/benchmarks/throughput.py" --workload peers \
       $TOK_TOOL --no-warmup --rounds 3 --tp "$tp")
  done
}

coldserve() {  # ~3 min: coldstart's measurement through `pipeserve serve` and HTTP (benchmarks/cold_serve.py), TP=N too
  local cache=$BASE/coldserve-triton-cache tp=${TP:-1}
  need_gpus "$tp" || return 0
  rm -rf "$cache"
  for c in cold warm; do
    (export TRITON_CACHE_DIR=$cache
     run "coldserve-$c" 300 "$(seq -s, 0 $((tp - 1)))" python3 "$REPO/benchmarks/cold_serve.py" $TOK_TOOL --tp "$tp")
  done
}

capacity() {  # two GPUs: ~6 min, each policy on its own card at once; one GPU: ~9 min, in turn, a coarser search
  local cap="$ARXIV capacity.enabled=true capacity.tbt_p99_slo_s=0.1 capacity.num_requests=48 capacity.probe_duration_s=20"
  local sarathi="scheduler=sarathi scheduler.max_num_batched_tokens=512 capacity.start_rate=10"
  local vllm="scheduler=vllm capacity.start_rate=4"
  if [ "$NGPU" -ge 2 ]; then
    cap="$cap capacity.rel_tol=0.1 capacity.max_probes=6"
    bench capacity-sarathi 420 0 $cap $sarathi &
    bench capacity-vllm 420 1 $cap $vllm &
    wait
  else
    cap="$cap capacity.rel_tol=0.2 capacity.max_probes=4"
    bench capacity-sarathi 280 0 $cap $sarathi
    bench capacity-vllm 280 0 $cap $vllm
  fi
}

cost_model() {  # prints the path of this card's profile: COST_MODEL, one kept by an earlier invocation on this machine, or a new one
  if [ -n "${COST_MODEL:-}" ]; then echo "$COST_MODEL"; return 0; fi
  local path=$BASE/cost_model_$(echo "$CARD" | tr -c 'A-Za-z0-9\n' '_').json
  [ -f "$path" ] && { echo "$path"; return 0; }
  # The budget it prints is a 128-token chunk's predicted time (scheduler.max_num_batched_tokens);
  # prefixes to 6,144 tokens: arXiv prompts reach 8k.
  run profile 240 0 python3 -m pipeserve.launch.cli profile $D8 hydra.run.dir="$DIR/profile" \
    scheduler.max_num_batched_tokens=128 profile.chunk_tokens=[64,128,256,512,1024] \
    profile.prefix_lens=[0,1024,3072,6144] profile.decode_batch_sizes=[1,8,32,64] \
    profile.decode_context_lens=[512,2048,4096] >&2 || return 1
  [ -n "$DRY" ] && { echo "$DIR/profile/cost_model.json"; return 0; }
  cp "$DIR/profile/cost_model.json" "$path" && echo "$path"
}

bubbles() {  # ~4 min with a kept profile (each run about a minute on an H200), ~5 without
  need_gpus 2 || return 0
  local load="$ARXIV workload.rate=8 workload.num_requests=288 parallel.pp=2"
  local cm budget i
  cm=$(cost_model) || { echo "bubbles: no profile"; return 0; }
  if [ -n "$DRY" ]; then
    budget='<suggested_time_budget_s>'
  else
    budget=$(python3 -c "import json, sys; print(round(json.load(open(sys.argv[1]))['suggested_time_budget_s'], 5))" "$cm")
  fi
  echo "time budget $budget s (pipeserve profile's suggestion, $cm)"
  local time="scheduler=sarathi scheduler.max_num_batched_tokens=4096 scheduler.cost_model_path=$cm scheduler.time_budget_s=$budget"
  for i in 1 2; do  # orca between the two sarathi runs, so a drift of the machine shows between them
    bench "bubbles-time-$i" 150 0,1 $load $time
    gaps "bubbles-time-$i"
    if [ "$i" = 1 ]; then
      bench bubbles-orca 150 0,1 $load scheduler=orca
      gaps bubbles-orca
    fi
  done
}

gaps() {  # where a run's idle time went (tools.pipeline_gaps; CPU only), beside its log
  [ -n "$DRY" ] || [ -f "$DIR/$1/trace.json" ] || return 0
  tool "$1.gaps" 60 "" pipeline_gaps "$DIR/$1" >/dev/null
}

roofline() {  # ~2 min
  tool roofline 300 0 roofline $TOK_TOOL --profile --out "$DIR/roofline.json"
}

fp8() {  # ~7 min: four throughput runs, two roofline runs, the agreement of 64 SmolLM2 chats
  local w q
  for w in uniform decode-heavy; do
    for q in bf16 fp8; do
      run "fp8-$w-$q" 170 0 python3 "$REPO/benchmarks/throughput.py" --workload "$w" $TOK_TOOL \
        $([ $q = fp8 ] && echo --quantization fp8)
    done
  done
  tool fp8-roofline-bf16 200 0 roofline $TOK_TOOL --out "$DIR/roofline-bf16.json"
  tool fp8-roofline-fp8 200 0 roofline $TOK_TOOL --quantization fp8 --out "$DIR/roofline-fp8.json"
  tool fp8-agreement 300 0 agreement --layouts fp8 --workdir "$DIR" --out "$DIR/agreement.json"
}

ranks() {  # ~4.5 min: both scaling workloads at tp=2 (tp=4 on 4 GPUs) and on one GPU, every rank's step timeline
  need_gpus 2 || return 0
  local w tp=2 gpus=0,1
  [ "$NGPU" -ge 4 ] && tp=4 gpus=0,1,2,3
  for w in ${WORKLOADS:-decode-heavy uniform}; do
    timeline_run "ranks-$w" "$ROOT" /tmp/pkg "$gpus" "$w" "$tp"
    timeline_run "ranks-$w-1gpu" "$ROOT" /tmp/pkg 0 "$w" 1
  done
}

pairs() {  # ~1.5 min a workload and round: the two trees at once at tp=TP (default 2) on disjoint GPUs, then swapped
  local tp=${TP:-2}
  need_gpus $((2 * tp)) || return 0
  [ -n "${BEFORE:-}" ] || { echo "pairs needs BEFORE=<another checkout of pipeserve>: skipped"; return 0; }
  local before w round ga gb gt gbf
  before=$(cd "$BEFORE" && pwd) || return 0
  [ -n "$DRY" ] || { mkdir -p /tmp/pkg-before && ln -sfn "$before" /tmp/pkg-before/pipeserve; }
  rm -rf "${DIR:?}"/pairs-*   # an earlier invocation's runs would show under this one's trees
  { echo "this $LABEL"; echo "before $(tree_label "$before")"
    echo "tp $tp"; } >"$DIR/pairs.trees"
  ga=$(seq -s, 0 $((tp - 1))) gb=$(seq -s, "$tp" $((2 * tp - 1)))
  for w in ${WORKLOADS:-decode-heavy uniform}; do
    for round in 1 2; do  # each tree on each group once: the groups' own difference cancels
      gt=$ga gbf=$gb; [ "$round" = 2 ] && gt=$gb gbf=$ga
      timeline_run "pairs-$w-this-$round" "$ROOT" /tmp/pkg "$gt" "$w" "$tp" &
      timeline_run "pairs-$w-before-$round" "$before" /tmp/pkg-before "$gbf" "$w" "$tp" &
      wait
    done
  done
}

timeline_run() {  # timeline_run NAME TREE PACKAGE_DIR GPUS WORKLOAD TP: one throughput.py run of TREE with every
  # rank's step timeline, then their table (this checkout's rank_lag, which reads an older tree's timelines too)
  local name=$1 tree=$2 pkg=$3 gpus=$4 w=$5 tp=$6
  rm -rf "${DIR:?}/$name"
  (export PIPESERVE_STAGE_STATS_DIR=$DIR/$name PYTHONPATH=$pkg:/tmp/site PIPESERVE_TREE=$tree ROOT=$tree
   run "$name" 200 "$gpus" python3 "$REPO/benchmarks/throughput.py" --workload "$w" $TOK_TOOL --tp "$tp")
  run "$name-table" 60 "" python3 "$REPO/tools/rank_lag.py" "$DIR/$name" --out "$DIR/$name.json"
}

tpsteps() {  # ~5 min (~8 on 4 GPUs): tools/tp_steps at each tp (start-up and graph capture included), then the two probes
  need_gpus 2 || return 0
  tool tpsteps-tp1 200 0 tp_steps $TOK_TOOL --profile --out "$DIR/tp1.json"
  run tpsteps-tp2 200 0,1 torchrun --nproc-per-node 2 -m tools.tp_steps $TOK_TOOL --profile --out "$DIR/tp2.json"
  run tpsteps-tp2-nccl 200 0,1 torchrun --nproc-per-node 2 -m tools.tp_steps $TOK_TOOL --nccl --out "$DIR/tp2-nccl.json"
  [ -f "$ROOT/tools/tp_overlap.py" ] && run tpsteps-overlap-tp2 120 0,1 torchrun --nproc-per-node 2 -m tools.tp_overlap --out "$DIR/overlap-tp2.json"
  grep -q -- "--sums" "$ROOT/tools/tp_overlap.py" && run tpsteps-overlap-pull-tp2 120 0,1 torchrun --nproc-per-node 2 -m tools.tp_overlap --sums pull --out "$DIR/overlap-pull-tp2.json"
  [ -f "$ROOT/tools/sum_kernels.py" ] && run tpsteps-sumkernels-tp2 180 0,1 torchrun --nproc-per-node 2 -m tools.sum_kernels --out "$DIR/sumkernels-tp2.json"
  [ "$NGPU" -ge 4 ] || return 0
  run tpsteps-tp4 200 0,1,2,3 torchrun --nproc-per-node 4 -m tools.tp_steps $TOK_TOOL --profile --out "$DIR/tp4.json"
  [ -f "$ROOT/tools/tp_overlap.py" ] && run tpsteps-overlap-tp4 120 0,1,2,3 torchrun --nproc-per-node 4 -m tools.tp_overlap --out "$DIR/overlap-tp4.json"
  grep -q -- "--sums" "$ROOT/tools/tp_overlap.py" && run tpsteps-overlap-pull-tp4 120 0,1,2,3 torchrun --nproc-per-node 4 -m tools.tp_overlap --sums pull --out "$DIR/overlap-pull-tp4.json"
  [ -f "$ROOT/tools/sum_kernels.py" ] && run tpsteps-sumkernels-tp4 180 0,1,2,3 torchrun --nproc-per-node 4 -m tools.sum_kernels --out "$DIR/sumkernels-tp4.json"
}

sums() {  # ~1 min on 1 GPU, ~4 on 2 (~7 on 4): tools/sum_kernels, the peer simulated, then plain and with --norms at each tp
  local tp gpus
  grep -q -- "--simulated" "$ROOT/tools/sum_kernels.py" \
    && run sums-simulated 120 0 python3 -m tools.sum_kernels --simulated --rows 16 128 512 1024 2048 --out "$DIR/sumsimulated.json"
  for tp in 2 4; do
    [ "$NGPU" -ge "$tp" ] || continue
    gpus=$(seq -s, 0 $((tp - 1)))
    run sums-tp$tp 180 "$gpus" torchrun --nproc-per-node $tp -m tools.sum_kernels --out "$DIR/sumkernels-tp$tp.json"
    run sums-norms-tp$tp 180 "$gpus" torchrun --nproc-per-node $tp -m tools.sum_kernels --norms --out "$DIR/sumnorms-tp$tp.json"
  done
}

structured() {  # ~8 min: three throughput runs, then the grammar probes (outlines-core's wheel from .whl)
  # JSON needs a vocabulary that spells it: the generated word-level one cannot.
  [ -n "$TOK_TOOL" ] || { echo "structured: needs .whl/gpt2_tokenizer.json: skipped"; return 0; }
  run structured-plain 170 0 python3 "$REPO/benchmarks/throughput.py" $TOK_TOOL
  run structured-penalties 170 0 python3 "$REPO/benchmarks/throughput.py" $TOK_TOOL --penalties
  run structured-json 170 0 python3 "$REPO/benchmarks/throughput.py" $TOK_TOOL --json-fraction 0.25
  [ -f "$ROOT/tools/grammar_steps.py" ] || return 0   # (older trees lack the probes)
  tool structured-libraries 400 0 grammar_overhead --out "$DIR/libraries.json"
  tool structured-steps 120 0 grammar_steps batch --threads 1,2,4,8 $TOK_TOOL
}

profile() {  # ~2-3 min, once per card
  local cm
  cm=$(cost_model) && [ -z "$DRY" ] && cp "$cm" "$DIR/cost_model.json"
}

TABLES=$(mktemp)
for SCENARIO in "$@"; do
  DIR=$BASE/$(echo "$LABEL" | tr -c 'A-Za-z0-9._\n-' '_')/$SCENARIO
  mkdir -p "$DIR"
  echo "== $SCENARIO · tree $LABEL ($ROOT) · $NGPU × $CARD"
  "$SCENARIO"
  [ -n "$DRY" ] && continue
  { echo; echo "### $SCENARIO · tree $LABEL · $CARD"
    python3 "$REPO/benchmarks/summarize.py" "$SCENARIO" "$DIR" --label "$LABEL" --card "$CARD" --json "$OUT/results.json"
  } | tee -a "$TABLES"
done
[ -n "$DRY" ] && exit 0
cat "$TABLES" >>"$OUT/summary.md"
tar -czf "$OUT/logs.tar.gz" -C "$BASE" --exclude=llama3-8b --exclude=trace.json --exclude='*.png' . 2>/dev/null
echo; echo "==== $(date -u +%FT%TZ) · tree $LABEL · $NGPU × $CARD"; cat "$TABLES"; rm -f "$TABLES"
