#!/usr/bin/env bash
# The drafts retrained on the distilled head (distill_train.sh dmtp|dmtp-d2), evaluated on exactly the prompts and
# settings of reports/smollm2/eval.json (first 20 prompts of GSM8K, HumanEval, MT-Bench, Alpaca and the held-out
# code and chat questions, 128 new tokens, T = 0), so their columns compare with the bundled drafts' there. Two
# processes of one thread (benchmark sets | held-out sets), acceptance only (no timing).
#
#     bash scripts/reproduce/smollm2/distill_eval.sh dmtp       # one column: DMTP on the distilled head
#     bash scripts/reproduce/smollm2/distill_eval.sh dmtp-d2    # DMTP(D2) on the distilled head
#     bash scripts/reproduce/smollm2/distill_eval.sh report     # merge the columns, print the comparison
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=reports/smollm2/distilled-drafts
D=outputs/smollm2/distill
HEAD=$D/head-mix-online/final_mtp_head
NAMED=outputs/smollm2/named-prompts  # the report names a prompt set after its file
what=${1:?usage: distill_eval.sh dmtp|dmtp-d2|report}
if [ "$what" = report ]; then
  exec .venv/bin/python scripts/reproduce/smollm2/distill_compare.py reports/smollm2/eval.json $OUT
fi
mkdir -p $NAMED outputs/logs
ln -sf "$PWD/outputs/corpus/bench/code_question.jsonl" $NAMED/held-out-code.jsonl
ln -sf "$PWD/outputs/corpus/bench/chat_question.jsonl" $NAMED/held-out-chat.jsonl
label=$what-dh
common=(--bundle smollm2 --head distilled=$HEAD --extra-draft "$label=$D/$what/final@distilled" --strategies "$label"
  --limit 20 --max-new-tokens 128 --no-baseline --no-progress)
OMP_NUM_THREADS=1 .venv/bin/dmtp eval "${common[@]}" --datasets gsm8k,humaneval,mt_bench,alpaca \
  --output-dir $OUT/parts/$what-sets > outputs/logs/distill-eval-$what-sets.log 2>&1 &
OMP_NUM_THREADS=1 .venv/bin/dmtp eval "${common[@]}" --datasets none --prompts $NAMED/held-out-code.jsonl \
  --prompts $NAMED/held-out-chat.jsonl --output-dir $OUT/parts/$what-held-out > outputs/logs/distill-eval-$what-held-out.log 2>&1
wait
echo "wrote $OUT/parts/$what-sets and $OUT/parts/$what-held-out"
