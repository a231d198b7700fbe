import json, sys, time, statistics
# Scratch probe as run for docs/study_v3/validity.json (vLLM-CPU offline). Env: OMP_NUM_THREADS=1
# VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0; vprobe.py takes the temperature as argv[1]
# (its max_tokens and variants were edited between the rows of validity.json).
from vllm import LLM, SamplingParams
from transformers import AutoTokenizer
from megatron_stare.study.word_problems import make_rows, compute_score, INSTRUCTION
M = "/root/.cache/megatron-stare/models/smollm2-135m-instruct"
tok = AutoTokenizer.from_pretrained(M)
llm = LLM(M, dtype="float32", enforce_eager=True, max_model_len=640, seed=0)
VARIANTS = {
  "orig": INSTRUCTION,
  "number": "Reply with the final number only.",
}
rows = make_rows("test", 24, 0)
k = 4
sp = SamplingParams(n=k, temperature=float(sys.argv[1]), top_p=1.0, max_tokens=256)
res = {}
for name, ins in VARIANTS.items():
    prompts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"][0]["content"].rsplit(" " + INSTRUCTION, 1)[0] + " " + ins}], add_generation_prompt=True, tokenize=False) for r in rows]
    t = time.time()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    acc = {1: [], 2: [], 3: []}; lens = []
    for r, o in zip(rows, outs):
        for c in o.outputs:
            acc[r["extra_info"]["tier"]].append(compute_score("", c.text, r["reward_model"]["ground_truth"]))
            lens.append(len(c.token_ids))
    allacc = [x for v in acc.values() for x in v]
    res[name] = {"acc": statistics.fmean(allacc), **{f"tier{t_}": statistics.fmean(v) for t_, v in acc.items()},
                 "len": statistics.fmean(lens), "trunc": statistics.fmean(l >= 256 for l in lens), "s": round(time.time() - t)}
    print(name, res[name], flush=True)
    print("  e.g.", repr(outs[0].outputs[0].text[:160]), "| gt", rows[0]["reward_model"]["ground_truth"], flush=True)
