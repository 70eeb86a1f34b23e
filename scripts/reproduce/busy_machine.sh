#!/usr/bin/env bash
# The quiet and loaded tables of reports/performance/README.md ("On a busy machine"): the drafters at fixed K and
# under verify_length="auto", next to their peers (prompt lookup; Transformers' own DFlash path on the same DFlash
# weights; Transformers' use_mtp on the same MTP head), three interleaved repeats each, once on a quiet machine and
# once with a CPU burner on one core for the whole run (`dmtp bench --burner 1`; it stops with the run).
#
#   bash scripts/reproduce/busy_machine.sh [bundled|smollm2|mtp|demo|all]    (default all; about an hour on 2 cores)
#
# Held-out prompts: the first items of the corpus' code and chat questions (no benchmark set, nothing tuned on them).
# The bench picks its threads from the cores free when it starts, less the burner's.
set -euo pipefail
cd "$(dirname "$0")/../.."
WHAT=${1:-all}
OUT=${OUT:-reports/performance/busy}
DMTP=.venv/bin/dmtp
CORPUS=outputs/corpus/bench
[ -f "$CORPUS/code_question.jsonl" ] || .venv/bin/python scripts/reproduce/build_corpus.py --out outputs/corpus
HELD_OUT=(--datasets none --prompts "$CORPUS/code_question.jsonl" --prompts "$CORPUS/chat_question.jsonl")
mkdir -p "$OUT"

for burner in 0 1; do
  if [ "$WHAT" = bundled ] || [ "$WHAT" = all ]; then
    # every drafter of the bundle, fixed K and auto; the peers cannot run on this hybrid target (the table says why)
    $DMTP bench --strategies dmtp,dmtp:auto,dflash,dflash:auto,dflash2,dflash2:auto,dmtp-d2,dmtp-d2:auto,mtp4,mtp4:auto \
      "${HELD_OUT[@]}" --limit 4 --max-new-tokens 96 --batch-sizes 1,2,4 --repeats 3 --burner $burner \
      --output-dir "$OUT/bundled-burner$burner" --no-progress
  fi
  if [ "$WHAT" = smollm2 ] || [ "$WHAT" = all ]; then
    # SmolLM2: DMTP, DFlash and MTP-1 at fixed K and auto; prompt lookup and Transformers' DFlash path on the same
    # DFlash weights (batch size 1 only: Transformers' assisted decoding)
    $DMTP bench --bundle smollm2 --strategies dmtp,dmtp:auto,dflash,dflash:auto,mtp1,mtp1:auto "${HELD_OUT[@]}" \
      --limit 2 --max-new-tokens 64 --batch-sizes 1,2 --repeats 3 --burner $burner \
      --output-dir "$OUT/smollm2-burner$burner" --no-progress
  fi
  if [ "$WHAT" = mtp ] || [ "$WHAT" = all ]; then
    # our MTP-k against Transformers' use_mtp on the same native head: a tiny DeepSeek-V3 checkpoint in the real
    # layout (random weights: equal acceptance for both, so the table compares the machinery)
    TINY=outputs/performance/tiny-deepseek-v3
    [ -f "$TINY/config.json" ] || .venv/bin/python -c "
from dmtp_hf_assets.tiny_targets import make_tiny_target, tiny_tokenizer
tiny_tokenizer().save_pretrained(make_tiny_target('deepseek_v3', '$TINY'))"
    $DMTP bench --target "$TINY" --strategies mtp1,mtp1:auto,mtp2 --datasets gsm8k,mt_bench --limit 4 \
      --max-new-tokens 64 --batch-sizes 1 --repeats 3 --burner $burner --output-dir "$OUT/mtp-burner$burner" \
      --no-progress
  fi
  if [ "$WHAT" = demo ] || [ "$WHAT" = all ]; then
    # how long `make demo-smollm2` takes once its target is set up, and what it prints, quiet and loaded
    .venv/bin/python - "$burner" "$OUT/demo-smollm2-burner$burner.txt" <<'PY'
import contextlib, io, sys, time
from dmtp_hf.demo import run_demo
from dmtp_hf.machine import Burner
burner, path = int(sys.argv[1]), sys.argv[2]
printed = io.StringIO()
with Burner(burner), contextlib.redirect_stdout(printed):
    start = time.perf_counter()
    code = run_demo(bundle="smollm2")
    seconds = time.perf_counter() - start
with open(path, "w") as f:
    f.write(printed.getvalue() + f"\n[dmtp demo --bundle smollm2: {seconds:.0f} s, burner on {burner} core(s), exit {code}]\n")
PY
  fi
done
