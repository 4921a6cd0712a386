#!/bin/bash
# The quickstart's RL on a GPU machine with nothing downloaded there: trainer rank 0 training in a child
# process, then in a thread (STEPS steps each), then bench/peer_trl.py (ours vs TRL's GRPOTrainer, seed 1).
# Prepare here, in an ignored folder .gpucheck/ that travels with the tree:
#   .gpucheck/sft_start: the starting model (the quickstart's SFT warm-up, as bench/peer_trl.py makes it)
#   .gpucheck/wheels: what the machine's image lacks, for its Python (pip download --no-deps
#     --python-version 3.12 --only-binary=:all: omegaconf antlr4-python3-runtime submitit highspy pymetis
#     datasets dill multiprocess math-verify latex2sympy2_extended bm25s openai httpx2 jiter pydantic
#     pydantic_core annotated-types typing-inspection sniffio trl, at the versions of .venv)
# then there: OUT=$OUT bash bench/gpu_quickstart.sh (results in $OUT, logs of every run included).
set -u
cd "$(dirname "$0")/.."  # the repository
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
PY=${PY:-python3}; OUT=${OUT:-/tmp/gqout}; STEPS=${STEPS:-100}; PEER_STEPS=${PEER_STEPS:-200}
mkdir -p "$OUT"
if [ -z "${NO_INSTALL:-}" ]; then
  $PY -m pip install -q --no-index --no-deps .gpucheck/wheels/*.whl 2>&1 | tail -3
  $PY -m pip check 2>&1 | head -12
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -m pip list 2>/dev/null | grep -i -E "^(torch|transformers|pyarrow|datasets|trl|accelerate) "
fi
$PY -c "import areal_hpc.train.driver, areal_hpc.rollout.server; print('areal_hpc imports')"
for mode in child thread; do
  started=$(date +%s)
  timeout ${RL_TIMEOUT:-120} $PY -m areal_hpc train --config configs/quickstart.yaml model.path=.gpucheck/sft_start \
    rl.sft_warmup_steps=0 rl.total_train_steps=$STEPS rl.eval_every_steps=20 rl.rank0_training=$mode \
    cluster.fileroot=/tmp/gq-$mode saver.freq_steps=0 stats.tensorboard=false stats.plot=false \
    > "$OUT/quickstart-$mode.log" 2>&1
  echo "quickstart rank0_training=$mode: exit $? in $(( $(date +%s) - started )) s"
  cp /tmp/gq-$mode/quickstart/trial0/metrics.jsonl "$OUT/metrics-$mode.jsonl" 2>/dev/null
  tail -4 "$OUT/quickstart-$mode.log"
done
[ -n "${SKIP_PEER:-}" ] && exit 0
$PY -c "import trl, datasets" || { echo "no TRL here: peer_trl skipped"; exit 0; }
timeout ${PEER_TIMEOUT:-300} $PY bench/peer_trl.py --steps $PEER_STEPS --seeds 1 --start-model .gpucheck/sft_start \
  --root /tmp/gq-peer > "$OUT/peer.log" 2>&1
echo "peer_trl: exit $?"; tail -25 "$OUT/peer.log"
cp /tmp/gq-peer/peer_trl-*.md /tmp/gq-peer/peer_trl-*.json /tmp/gq-peer/peer_trl-*.png "$OUT/" 2>/dev/null  # kept under --root
tail -c 3000 /tmp/gq-peer/trl-seed1/log.txt > "$OUT/trl-seed1-log.txt" 2>/dev/null
