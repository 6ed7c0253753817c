#!/bin/bash
# Router distillation's recovery on a tiny model (issue 29): REAP, frequency and HC-SMoE at a quarter
# of the experts, held-out stdlib perplexity before and after `moejax reroute`.
#   bash experiments/reroute/recovery.sh MODEL OUT [STEPS] [LR]
# Calibration (scores, merge, reroute): standard-library files the tiny models trained on (none of
# their held-out files); held-out perplexity: experiments/skills/heldout_ppl.py (128-byte windows).
set -euo pipefail
MODEL=$1; OUT=$2; STEPS=${3:-200}; LR=${4:-5e-3}
LIB=$(python -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
CALIB="$LIB/json $LIB/argparse.py $LIB/collections $LIB/dataclasses.py $LIB/enum.py $LIB/functools.py"
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"
ppl() { python "$HERE/../skills/heldout_ppl.py" "$1" --seq-len 128 | sed 's/.*perplexity \([0-9.]*\).*/\1/'; }
GROUP_FLAG=$(python -c "import json,sys; c=json.load(open('$MODEL/config.json')); print('--group-aware' if c.get('n_group',1)>1 else '')")
COLLAPSE=$(python -c "import json,sys; c=json.load(open('$MODEL/config.json')); print('--collapse-groups' if c.get('n_group',1)>1 else '')")
moejax score "$MODEL" --text $CALIB --seq-len 128 --max-tokens 32768 --scores reap,frequency --out "$OUT/scores.parquet" > /dev/null
E=$(python -c "import json; c=json.load(open('$MODEL/config.json')); print(c.get('n_routed_experts') or c.get('num_experts'))")
KEEP=$((E / 4))
echo "| variant (keep $KEEP of $E) | perplexity | rerouted | unpruned | KL first -> last | reroute time |"
echo "|---|---:|---:|---:|---|---:|"
BASE=$(ppl "$MODEL")
for v in reap frequency hc_smoe; do
  rm -rf "$OUT/$v" "$OUT/$v-rerouted"
  if [ "$v" = hc_smoe ]; then
    moejax merge "$MODEL" "$OUT/$v" --method hc_smoe --keep $KEEP --text $CALIB --seq-len 128 --max-tokens 32768 $COLLAPSE > /dev/null
  else
    moejax prune "$MODEL" "$OUT/$v" --scores-file "$OUT/scores.parquet" --score $v --keep $KEEP $GROUP_FLAG > /dev/null
  fi
  moejax reroute "$MODEL" "$OUT/$v" "$OUT/$v-rerouted" --text $CALIB --seq-len 128 --max-tokens 32768 \
      --steps $STEPS --lr $LR --batch-size 16 > /dev/null
  RUN=$(python -c "import json; r=json.load(open('$OUT/$v-rerouted/reroute.json')); l=r['losses']; print(f\"{l[0]:.3f} -> {l[-1]:.3f} | {r['train_seconds']:.0f} s\")")
  echo "| $v | $(ppl "$OUT/$v") | $(ppl "$OUT/$v-rerouted") | $BASE | $RUN |"
done
