"""The entropy study's task (pick_sum), its summary numbers, goals, and run bookkeeping."""

import itertools
import math

import pytest

from megatron_stare.study import methods as sm
from megatron_stare.study.sft import sft_target
from megatron_stare.study.v2 import RunSpec, StudySettings, run_key, study_specs, tuning_specs
from megatron_stare.study.report import (goals, goals_values_md, medians_md, pearson, summarize_run, theory_pairs)
from megatron_stare.rewards import get_reward_fn, make_task
from megatron_stare.study.tasks.pick_sum import parse_response, pick_sum_reward


# ------------------------------------------------------------------------------------------------ task
def test_every_study_task_names_a_config_that_exists_and_its_reward_and_rows_by_name():
    """The tasks live in ``study/tasks/``: their configs are found from there, and their rewards and
    row generators are registered by name (setup.py entry points), not from ``rewards/``."""
    from megatron_stare.rewards.registry import REWARDS
    from megatron_stare.rewards.synthetic import TASKS
    from megatron_stare.study.tasks import TASKS as STUDY_TASKS

    for name, task in STUDY_TASKS.items():
        assert task.config.is_file(), task.config
        assert name not in REWARDS and name not in TASKS  # not built into rewards/
        assert get_reward_fn(name).__module__ == f"megatron_stare.study.tasks.{name}"
        assert make_task(name, 2, seed=0, **task.kwargs) == make_task(name, 2, seed=0, **task.kwargs)


def test_pick_sum_rows_are_deterministic_and_solutions_are_exactly_the_correct_responses():
    rows = make_task("pick_sum", 50, seed=7)
    assert rows == make_task("pick_sum", 50, seed=7) and rows != make_task("pick_sum", 50, seed=8)
    assert get_reward_fn("pick_sum") is pick_sum_reward
    for r in rows:
        digits = [int(c) for c in r["digits"].split()]
        assert len(set(digits)) == 6 and r["prompt"].endswith(f"sum to {r['answer']}:")
        # Brute force over every "a+b" response: the reward accepts exactly the listed solutions.
        correct = {f"{a}+{b}" for a, b in itertools.product(range(10), repeat=2)
                   if pick_sum_reward(f" {a}+{b}", r["answer"], r) == 1.0}
        assert correct == set(r["solutions"].split("|"))
        assert len(correct) >= 4  # >= 2 unordered pairs, both orders


def test_pick_sum_three_terms_and_rejections():
    r = make_task("pick_sum", 1, seed=0, length=7, terms=3, min_solutions=2)[0]
    sols = r["solutions"].split("|")
    assert len(sols) >= 12 and all(pick_sum_reward(s, r["answer"], r) == 1.0 for s in sols)
    a, b, c = (int(x) for x in sols[0].split("+"))
    assert pick_sum_reward(f"{a}+{b}", r["answer"], r) == 0.0  # too few terms
    row = {"digits": "1 2 3 4 5 6", "terms": "2"}
    assert pick_sum_reward(" 4+5", "9", row) == 1.0 and pick_sum_reward("4 + 5\n", "9", row) == 1.0
    for bad in ("5+4+0", "0+9", "7+2", "4+4", "9", "4+5.", "4+5 then 3", "", "4+5" + " " * 100):
        assert pick_sum_reward(bad, "9" if bad != "4+4" else "8", row) == 0.0, bad
    assert pick_sum_reward("4+5", "9", {}) == 0.0  # no offered digits: nothing is correct
    assert parse_response(" 1 + 2+3 ") == [1, 2, 3] and parse_response("12+3") is None
    with pytest.raises(ValueError, match="terms"):
        make_task("pick_sum", 1, seed=0, length=3, terms=4)


def test_sft_target_draws_every_solution():
    import random

    row = make_task("pick_sum", 1, seed=3)[0]
    rng = random.Random(0)
    drawn = {sft_target(row, rng) for _ in range(200)}
    assert drawn == {" " + s for s in row["solutions"].split("|")}
    assert sft_target({"answer": "7"}, rng) == " 7"


# ------------------------------------------------------------------------------------------------ summary
def _rows(ent, acc=None, gate=None, pred=None, evals=None):
    rows = []
    for i, h in enumerate(ent):
        r = {"step": i + 1, "stare/entropy": h, "reward/accuracy": (acc or [0.5] * len(ent))[i],
             "response/mean_length": 5.0, "dynamics/pred_dH": (pred or [0.0] * len(ent))[i]}
        if gate is not None:
            r["stare/gate"] = gate[i]
        if evals and i + 1 in evals:
            r["eval/avg@8"], r["eval/pass@8"] = evals[i + 1]
        rows.append(r)
    return rows


def test_summary_band_after_first_below_target_and_late_evals():
    target = 0.2
    # Steps 1-4 above target, from step 5: 0.19 (in band), 0.1 (below 0.14), 0.25 (in), 0.3 (above 0.26) ...
    ent = [0.6, 0.5, 0.4, 0.3, 0.19, 0.1, 0.25, 0.3, 0.2, 0.2]
    evals = {4: (0.1, 0.2), 8: (0.3, 0.5), 10: (0.5, 0.9)}
    r = summarize_run(_rows(ent, evals=evals), target)
    assert r["first_gate_step"] == 5
    assert r["in_band"] == pytest.approx(4 / 6)  # 0.19, 0.25, 0.2, 0.2 of the 6 steps from step 5
    assert r["final_entropy"] == pytest.approx(sum(ent[-5:]) / 5)  # the last max(5, 10%) steps
    assert r["final_ratio"] == pytest.approx(r["final_entropy"] / target)
    assert (r["pass1"], r["pass8"]) == (pytest.approx(0.4), pytest.approx(0.7))  # steps 8 and 10: the last quarter
    # With a gate log, the band counts from the gate's first firing.
    gate = [0, 0, 0, 0, 0, 0, 1, 1, 1, 1]
    assert summarize_run(_rows(ent, gate=gate), target)["in_band"] == pytest.approx(3 / 4)
    assert math.isnan(summarize_run(_rows([0.5] * 10), target)["in_band"])  # never below target


def test_theory_check_correlation():
    import random

    rng = random.Random(0)
    ent = [1.0]
    pred = []
    for _ in range(60):
        pred.append(rng.uniform(-0.01, 0.01))
        ent.append(ent[-1] + 3 * pred[-1])  # the measured change is exactly 3x the prediction
    rows = _rows(ent[:-1], pred=pred)
    xs, ys = theory_pairs(rows, 1)
    assert ys == pytest.approx([3 * x for x in xs])
    r = summarize_run(rows, 0.5)
    assert r["corr_step"] == pytest.approx(1.0) and r["corr_window"] == pytest.approx(1.0)
    assert pearson(xs, [-y for y in ys]) == pytest.approx(-1.0)
    assert math.isnan(pearson([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]))


def test_goals_per_seed():
    def s(ratio, band, acc, p8):
        return {"final_ratio": ratio, "in_band": band, "train_acc": acc, "pass8": p8}

    per = {"grpo": s(0.3, 0.1, 0.70, 0.80), "dapo": s(0.4, 0.2, 0.72, 0.82),
           "stare_o1": s(0.9, 0.85, 0.72, 0.90), "stare_c2": s(1.0, 0.79, 0.71, 0.95)}
    g = goals(per)
    assert g["stare_o1"] == {"grpo_collapses": True, "stare_holds": True, "acc_at_least": True, "pass8_higher": True}
    assert g["stare_c2"] == {"grpo_collapses": True, "stare_holds": False, "acc_at_least": False, "pass8_higher": True}
    per["grpo"]["final_ratio"] = 0.5  # not strictly below half the target
    per["dapo"]["pass8"] = 0.90       # a tie is not higher
    assert goals(per)["stare_o1"]["grpo_collapses"] is False and goals(per)["stare_o1"]["pass8_higher"] is False


def test_goals_with_values_and_medians_over_seeds():
    def s(ratio, band, p32, length=30.0):
        return {"final_ratio": ratio, "in_band": band, "pass1": 0.2, "pass8": 0.4, "pass32": p32, "passk": p32,
                "length": length}

    summaries = {
        0: {"grpo": s(0.4, 0.5, 0.50), "dapo": s(0.3, 0.2, 0.55), "stare_c2": s(1.0, 0.9, 0.60),
            "stare_o1": s(1.0, 0.85, 0.55)},
        1: {"grpo": s(0.7, 0.6, 0.40), "dapo": s(0.3, 0.2, 0.45), "stare_c2": s(0.9, 0.79, 0.44),
            "stare_o1": s(1.0, math.nan, 0.70)},
        2: {"grpo": s(0.2, 0.1, 0.30), "dapo": s(0.3, 0.2, 0.35), "stare_c2": s(1.1, 0.95, 0.90, length=64.0),
            "stare_o1": s(1.0, 0.9, 0.50)},
    }
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:] for line in goals_values_md(summaries).splitlines()[2:]}
    collapse, holds, higher = (rows[k] for k in ("GRPO's final entropy below half the target",
                                                 "STARE in the band on >= 80% of the steps after its gate",
                                                 "STARE's pass@k above GRPO's and DAPO's"))
    assert collapse[0].startswith("**met** (0.40x)") and collapse[1].startswith("**missed** (0.70x)")
    # seed 1: C2 just under 0.8 and O1 never below target (nan) -> missed, both values shown
    assert holds[0].startswith("**met**") and holds[1].startswith("**missed**") and "0.79" in holds[1] and "-" in holds[1]
    # seed 0: O1 equals DAPO -> a tie, not a win; seed 1: C2 below DAPO -> missed, O1 above both -> met
    assert "STARE C2 0.600: met" in higher[0] and "STARE O1 0.550: tie" in higher[0] and "DAPO 0.550" in higher[0]
    assert "STARE C2 0.440: missed" in higher[1] and "STARE O1 0.700: met" in higher[1]

    med = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:] for line in medians_md(summaries).splitlines()[2:]}
    c2, o1 = med["STARE C2"], med["STARE O1"]
    assert c2[0] == "3" and c2[1] == "1.00" and c2[2] == "0.90" and c2[5] == "0.600"  # medians, not means
    assert c2[6] == "30.00"  # one 64-token seed does not move the median
    assert c2[7].strip(" |") == "0.600 / 0.440 / 0.900"
    assert o1[2] == "0.88 (2 of 3 seeds)"  # the median of the two seeds that had a gate


# ------------------------------------------------------------------------------------------------ bookkeeping
def test_grids_equal_size_and_runs_keyed_by_their_settings(monkeypatch):
    sm.check_grids()
    assert {m.name for m in sm.METHODS} == set(sm.GRIDS) == set(sm.CHOSEN)
    s = StudySettings(seeds=[0, 1])
    specs = study_specs(s)
    # v1/v2 run every method but study v3's additions (their runners and results predate them).
    assert s.methods == [m.name for m in sm.METHODS if m.name not in ("grpo_ds", "stare_ref")]
    assert len(specs) == 2 * len(s.methods) and len({(x.seed, run_key(x)) for x in specs}) == len(specs)
    # The study's seed-0 run of a method is its chosen tuning point: same directory, run once.
    tuned = {run_key(x) for x in tuning_specs(s, "methods")}
    assert all(run_key(x) in tuned for x in specs if x.seed == 0)
    assert run_key(RunSpec(0, "grpo", ("a=1",))) != run_key(RunSpec(0, "grpo", ("a=2",)))
    monkeypatch.setitem(sm.GRIDS, "gepo", sm.GRIDS["gepo"][:sm.GRID_SIZE - 1])  # a smaller grid is refused
    with pytest.raises(ValueError, match=f"'gepo'.*{sm.GRID_SIZE} points"):
        sm.check_grids()


def test_a_run_that_ran_dry_is_a_result_and_other_failures_are_not(tmp_path):
    from megatron_stare.study.results import ran_dry

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "train.log").write_text(
        '[rank0]:     raise RuntimeError(f"step {step}: no informative prompt groups after "\n'
        "[rank0]: RuntimeError: step 332: no informative prompt groups after 10 generation batches\n")
    assert ran_dry(tmp_path) == "step 332: no informative prompt groups after 10 generation batches"
    # The trainer's one line (generation.RanDry), in the v3 runner's log.
    (tmp_path / "runner.log").write_text("step 55/100, eta 28m | ...\nerror: step 56: no informative prompt groups "
                                         "after 10 generation batches (dynamic sampling kept 1 ...)\n")
    assert ran_dry(tmp_path, "runner.log").startswith("step 56: no informative prompt groups after 10 generation")
    (tmp_path / "train.log").write_text("[rank0]: RuntimeError: CUDA out of memory\n")
    assert ran_dry(tmp_path) is None
    (tmp_path / "train.log").write_text("[rank0]: RuntimeError: step 3: no informative prompt groups after 1 x\n")
    (tmp_path / "metrics.jsonl").unlink()
    assert ran_dry(tmp_path) is None  # no steps ran: nothing to report, a failure


def test_tuning_table_marks_each_methods_best_eligible_point(tmp_path):
    """``write_tuning`` groups points by their method (names ending in a digit included: a STARE O1
    point is labelled ``stare_o10``), marks the best non-diverged score, and lists the own knobs."""
    import json

    from megatron_stare.study.report import write_tuning

    def run(name, p1, p8, acc):
        d = tmp_path / name
        d.mkdir()
        rows = _rows([0.5] * 8, acc=[acc] * 8, evals={8: (p1, p8)})
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (d / "done.json").write_text(json.dumps({"stopped": None}))
        return str(d)

    s = StudySettings(out=str(tmp_path / "out"))
    start = {"H0": 1.0, "accuracy": 0.3}
    specs = [RunSpec(0, "stare_o1", tuple(sm.method_overrides("stare_o1", k)), label=f"stare_o1{i}")
             for i, k in enumerate(sm.GRIDS["stare_o1"])]
    # The higher score has diverged (final train accuracy below the start's): the other is chosen.
    runs = {specs[0]: run("a", 0.80, 0.90, 0.6), specs[1]: run("b", 0.95, 0.99, 0.2)}
    write_tuning(s, start, runs, "methods")
    md = (tmp_path / "out" / "tuning_methods.md").read_text()
    assert "## stare_o1" in md
    assert "| stare_o10 **chosen** | top_p=0.2 adaptive=true w=1 m=1 alpha=0.1 w_max=10 |" in md
    assert "| stare_o11 (diverged) |" in md and "policy_loss" not in md
