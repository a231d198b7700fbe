"""Study v2: its tasks (hop_path, sum_steps), the validity numbers, the committed results, DAPO at
equal generated tokens, pass@k from 32 samples."""

import json
import math
import random

import pytest
import torch

from megatron_stare.study import results as sr
from megatron_stare.study.report import equal_tokens, goals, summarize_run
from megatron_stare.study.validate import Validity, pass_at_k
from megatron_stare.trainer.generation import pass_at_j
from megatron_stare.rewards import get_reward_fn, make_task
from megatron_stare.study.tasks.hop_path import hop_path_reward, random_path, reachable
from megatron_stare.study.tasks.sum_steps import random_solution, scratchpad, sum_steps_reward


# ------------------------------------------------------------------------------------------------ tasks
def test_hop_path_rows_paths_and_reward():
    rows = make_task("hop_path", 40, seed=1)
    assert rows == make_task("hop_path", 40, seed=1) and get_reward_fn("hop_path") is hop_path_reward
    rng = random.Random(0)
    for r in rows:
        hops = [int(h) for h in r["hops"].split()]
        avoid = [int(x) for x in r["avoid"].split()]
        assert len(set(hops)) == 3 and 15 <= int(r["answer"]) <= 35 and reachable(hops, int(r["answer"]), avoid)[0]
        assert r["prompt"].endswith(f"avoiding {avoid[0]} {avoid[1]}:") and 0 < avoid[0] < avoid[1] < int(r["answer"])
        paths = {random_path(r, rng) for _ in range(20)}
        assert len(paths) > 1  # several correct orders of work
        assert all(hop_path_reward(p, r["answer"], r) == 1.0 for p in paths)
        assert not any(str(a) in p.split() for a in avoid for p in paths)
    row = {"hops": "2 3 5", "avoid": "4 7"}
    assert hop_path_reward(" 2 5 10", "10", row) == 1.0 and hop_path_reward("3 5 10\n", "10", row) == 1.0
    for bad in (" 2 5 9", " 2 5 10 12", " 2 5", " 1 3 10", " 2,5,10", "", " 5 10 10", " 2 5 10.", "x",
                " 2 4 5 10", " 5 7 10"):  # the last two step on an avoided position
        assert hop_path_reward(bad, "10", row) == 0.0, bad
    assert hop_path_reward(" 2 5 10", "10", {}) == 0.0
    # Hops 4 and 5 to 11 avoiding 7: from 6 (+5), 2 (+4 to 6), 1 (+5 to 6); 0, 3, 4, 5 lead only to dead ends.
    ok = reachable([4, 5], 11, avoid=[7])
    assert [p for p in range(12) if ok[p]] == [1, 2, 6, 11]


def test_sum_steps_rows_solutions_and_reward():
    rows = make_task("sum_steps", 30, seed=2)
    rng = random.Random(0)
    for r in rows:
        k = int(r["terms"])
        for sub in r["subsets"].split("|"):
            assert sum(map(int, sub.split())) == int(r["answer"]) and len(sub.split()) == k
        sols = {random_solution(r, rng) for _ in range(20)}
        assert len(sols) > 1 and all(sum_steps_reward(x, r["answer"], r) == 1.0 for x in sols)
    assert scratchpad([7, 5, 2, 6]) == "7+5=12 12+2=14 14+6=20"
    row = {"digits": "1 2 5 6 7 8 9 3", "terms": "4"}
    assert sum_steps_reward(" 7+5=12 12+2=14 14+6=20", "20", row) == 1.0
    for bad in (" 7+5=12 12+2=14 14+6=21", " 7+5=12 12+2=15 15+5=20", " 7+5=12 13+2=15 15+5=20",
                " 7+5=12 12+8=20", " 7+5=12 12+2=14 14+6=20 20+1=21", " 4+5=9 9+2=11 11+9=20", "7+5=12,"):
        assert sum_steps_reward(bad, "20", row) == 0.0, bad


# ------------------------------------------------------------------------------------------------ pass@k
def test_pass_at_k_estimator_hand_cases():
    assert pass_at_k(4, 0, 2) == 0.0 and pass_at_k(4, 4, 1) == 1.0 and pass_at_k(4, 3, 2) == 1.0
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # C(3,2) / C(4,2)
    assert pass_at_k(32, 1, 1) == pytest.approx(1 / 32)
    correct = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.float64)
    assert pass_at_j(correct, 2) == pytest.approx((0.5 + (1 - 1 / 6) + 0.0) / 3)
    assert pass_at_j(correct, 4) == pytest.approx(2 / 3)  # = any correct


def test_validity_checks_name_their_thresholds():
    v = Validity(prompts=4, samples=32, pass_at={"1": 0.2, "32": 0.85}, frac_pos_high=0.06,
                 frac_pos_high_of_nonzero=0.08, mean_length=25.0, entropy=0.4, accuracy=0.2)
    assert all(v.checks().values()) and json.loads(json.dumps(v.to_json()))["checks"] == v.checks()
    v.pass_at["32"], v.mean_length = 0.95, 12.0
    assert [ok for ok in v.checks().values()] == [False, True, False]


# ------------------------------------------------------------------------------------------------ results
def test_results_are_written_atomically_and_matched_by_key(tmp_path):
    rows = [{"step": 1, "stare/entropy": 0.123456789, "perf/step_s": 3.0, "eval/pass@32": 0.5}]
    p = sr.write_result(tmp_path, seed=0, method="grpo", key="k1", rows=rows, seconds=1.5, stopped=None,
                        target=0.1, steps=1, overrides=["a=1"])
    assert p == tmp_path / "seed0" / "grpo.json" and not list(tmp_path.rglob("*.tmp"))
    r = sr.finished(tmp_path, 0, "grpo", "k1")
    assert r["rows"] == [{"step": 1, "stare/entropy": 0.123457, "eval/pass@32": 0.5}]  # perf/ dropped, rounded
    assert sr.finished(tmp_path, 0, "grpo", "k2") is None and sr.finished(tmp_path, 1, "grpo", "k1") is None
    assert set(sr.load_results(tmp_path, [0, 1], ["grpo", "dapo"])) == {(0, "grpo")}
    assert sr.result_key(["a", "b"]) != sr.result_key(["a", "c"])


def test_a_seed_whose_methods_are_all_recorded_needs_no_warm_start(tmp_path):
    from megatron_stare.study import v2 as st

    s = st.StudySettings(out=str(tmp_path / "out"), seeds=[0], methods=["grpo", "dapo"], task="hop_path",
                         results=str(tmp_path / "res"))
    start = {"seed": 0, "quick": False, "task": "hop_path", "H0": 0.4}
    sr.write_json_atomic(tmp_path / "res" / "seed0" / "start.json", start)
    specs = st.study_specs(s)
    for spec in specs[:1]:
        sr.write_result(tmp_path / "res", seed=0, method=spec.method, key=st.result_key(s, spec, start), rows=[],
                        seconds=1.0, stopped=None, target=0.14, steps=400, overrides=spec.overrides)
    assert st.recorded_start(s, 0) is None  # dapo is not recorded: the warm start is needed
    sr.write_result(tmp_path / "res", seed=0, method="dapo", key="another start's key", rows=[], seconds=1.0,
                    stopped=None, target=0.14, steps=400, overrides=specs[1].overrides)
    assert st.recorded_start(s, 0) is None  # recorded, but under another warm start or settings
    sr.write_result(tmp_path / "res", seed=0, method="dapo", key=st.result_key(s, specs[1], start), rows=[],
                    seconds=1.0, stopped=None, target=0.14, steps=400, overrides=specs[1].overrides)
    assert st.recorded_start(s, 0) == start
    assert st.recorded_start(st.StudySettings(**{**s.__dict__, "steps": 200}), 0) is None  # another schedule


def _rows(n, tokens, acc=0.5, ent=0.3, evals=None):
    rows = []
    for i in range(n):
        r = {"step": i + 1, "stare/entropy": ent, "reward/accuracy": acc, "response/mean_length": 25.0,
             "rollout/generated_tokens": tokens}
        if evals and i + 1 in evals:
            r["eval/avg@32"], r["eval/pass@8"], r["eval/pass@32"] = evals[i + 1]
        rows.append(r)
    return rows


def test_summary_reads_32_sample_evals_and_goal_uses_pass32():
    r = summarize_run(_rows(8, 100.0, evals={8: (0.2, 0.5, 0.7)}), target=0.3)
    assert (r["pass1"], r["pass8"], r["pass32"], r["passk"]) == (0.2, 0.5, 0.7, 0.7) and r["gen_tokens"] == 800
    g = {"final_ratio": 0.4, "in_band": 0.5, "train_acc": 0.5, "pass8": 0.9, "passk": 0.6}
    s = {"final_ratio": 1.0, "in_band": 0.9, "train_acc": 0.5, "pass8": 0.1, "passk": 0.7}
    assert goals({"grpo": g, "dapo": dict(g), "stare_c2": s})["stare_c2"]["pass8_higher"] is True


def test_dapo_cut_at_grpos_generated_tokens():
    grpo = _rows(10, 100.0)                                       # 1000 tokens in all
    dapo = _rows(10, 300.0, acc=0.9, evals={2: (0.3, 0.4, 0.5), 6: (0.6, 0.7, 0.8)})  # 3x per step
    e = equal_tokens(dapo, grpo, target=0.3)
    assert e["steps"] == 3 and e["budget_tokens"] == 1000 and e["tokens"] == 900   # 900 <= 1000 < 1200
    short = equal_tokens(_rows(2, 300.0), grpo, target=0.3)        # DAPO's run ended before the budget
    assert short["steps"] == 2 and short["tokens"] == 600
    assert e["passk"] == 0.5 and e["train_acc"] == pytest.approx(0.9)
    assert equal_tokens(_rows(3, 2000.0), grpo, 0.3) is None        # DAPO's first step alone is over
    assert math.isnan(summarize_run(grpo, 0.3)["pass32"])


def test_warm_start_stops_at_probe_pass_at_k(tmp_path):
    """The pass@k stop rule (``SftSettings.stop_pass``): probed every ``pass_every`` steps once the
    sampled accuracy reaches ``pass_from_accuracy``, with ``pass_samples`` samples per prompt, and
    the run stops at the first probe at or above the bound (here the 3rd: step 6), not at max_steps."""
    from megatron_stare.study.sft import PolicyStats, SftSettings, train_sft
    from megatron_stare.models.tiny import build_tiny_hf_model

    base = build_tiny_hf_model("qwen2", tmp_path / "base", seed=0, num_layers=1, hidden_size=32,
                               ffn_hidden_size=64, num_heads=2, num_kv_heads=1)
    rows = make_task("pick_sum", 16, seed=0, length=6, terms=2, min_solutions=2)
    calls = []

    def probe(model, tok, probe_rows, seed, samples=1):
        calls.append(samples)
        passes = sum(1 for k in calls if k > 1)
        return PolicyStats(accuracy=0.1, entropy=1.0, mean_length=3.0, pass_at_k=0.3 * passes)

    cfg = SftSettings(max_steps=40, batch_size=4, eval_every=1, probe_prompts=4, stop_accuracy=0.9,
                      stop_pass=0.85, pass_samples=32, pass_every=2, pass_from_accuracy=0.05)
    train_sft(str(base), str(tmp_path / "sft"), rows, rows, cfg, seed=0, probe=probe, log=lambda m: None)
    assert [k for k in calls if k > 1] == [32, 32, 32]  # pass@32 0.3, 0.6, 0.9 -> stop
    assert len([k for k in calls if k == 1]) == 1 + 6  # the start's probe + one per step up to step 6
    assert (tmp_path / "sft" / "model.safetensors").is_file()
    # Below pass_from_accuracy, pass@k is never probed and the run goes to max_steps.
    calls.clear()
    cfg.max_steps, cfg.pass_from_accuracy = 8, 0.5
    train_sft(str(base), str(tmp_path / "sft2"), rows, rows, cfg, seed=0, probe=probe, log=lambda m: None)
    assert calls == [1] * 9


def test_report_leaves_out_results_of_an_earlier_warm_start(tmp_path):
    """A result whose key is another start's (the seed's start was rebuilt since) is not in the
    table: mixing it in would compare runs from different weights."""
    from megatron_stare.study import v2 as st

    s = st.StudySettings(out=str(tmp_path / "out"), seeds=[0], methods=["grpo", "dapo"], task="hop_path",
                         results=str(tmp_path / "res"))
    start = {"seed": 0, "quick": False, "task": "hop_path", "H0": 0.4, "accuracy": 0.1, "pass@8": 0.5,
             "eval_pass@1": 0.1, "eval_pass@8": 0.5}
    sr.write_json_atomic(tmp_path / "res" / "seed0" / "start.json", start)
    grpo, dapo = st.study_specs(s)
    rows = _rows(20, 100, evals={10: (0.2, 0.5, 0.8), 20: (0.3, 0.6, 0.85)})
    sr.write_result(tmp_path / "res", seed=0, method="grpo", key=st.result_key(s, grpo, start), rows=rows,
                    seconds=1.0, stopped=None, target=0.14, steps=20, overrides=grpo.overrides)
    sr.write_result(tmp_path / "res", seed=0, method="dapo", key=st.result_key(s, dapo, {**start, "H0": 0.41}),
                    rows=rows, seconds=1.0, stopped=None, target=0.14, steps=20, overrides=dapo.overrides)
    st.report(s, {0: start}, wall_seconds=0.0)
    md = (tmp_path / "out" / "study.md").read_text()
    assert "| 0 | GRPO |" in md and "| 0 | DAPO |" not in md
