"""One RL step on the real model, the project against TRL's ``GRPOTrainer``, on the same machine.

The same job on both sides: SmolLM2-135M-Instruct (``megatron_stare/models/fetch.py``), the word
problems in chat format (``megatron_stare/study/word_problems.py``, its ``compute_score``), 8
prompts x 4 completions, lr 1e-4, every completion exactly ``L`` new tokens (EOS ignored), L in
``--lengths``. The project runs ``megatron_stare.train`` under torchrun (``_vs_trl_project.py``,
layout ``--layout``); TRL runs in its own virtual environment (``--trl-venv``, made here on first
use with ``trl==1.16.0`` and the CPU torch; never the project's ``.venv``) via ``_vs_trl_trl.py``.
Both stay alive through the run and take turns: each round, in a shuffled order, one step of
each while the other sleeps, after a torch.matmul probe of the machine's fp32 GEMM peak (``machine_peak``).
The first ``--warmup`` rounds are not counted; the figures are medians over the other rounds,
the ratio the median of the paired per-round ratios.

Printed and written to ``--out`` (``benchmarks/results/vs_trl.json``): step seconds, generated
tokens/s (``32*L`` / step), the phases (generate, log-prob, update, sync) of both, and the
training phase's model FLOP rate (``megatron_stare/models/flops.py``) against the probe's peak.

Usage: ``nice -n 5 .venv/bin/python benchmarks/bench_vs_trl.py [--lengths 64 256] [--rounds 3]``;
``--smoke``: one project step, no TRL, no file written (the CI smoke).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

from megatron_stare.models.flops import FlopShape, step_flops

ROOT = Path(__file__).resolve().parents[1]
TRL_PINS = ("torch==2.13.0", "trl==1.16.0")
DEFAULT_VENV = Path.home() / ".cache" / "megatron-stare" / "bench-trl-venv"

#: The project's layouts: config overrides and environment.
LAYOUTS = {
    "dp2-vllm": ("parallel.tp=1", "rollout.engine=vllm"),
    "tp2-vllm": ("parallel.tp=2", "rollout.engine=vllm", "rollout.tp=2"),
    "pp2-vllm-server": ("parallel.tp=1", "parallel.pp=2", "rollout.engine=vllm-server"),
    "dp2-hf": ("parallel.tp=1", "rollout.engine=hf"),
}
PROJECT_ENV = {"OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "PYTHONWARNINGS": "ignore"}


def ensure_trl_venv(venv: Path) -> Path:
    """The TRL environment's python, made on first use (``python -m venv`` + pip; minutes)."""
    py, mark = venv / "bin" / "python", venv / ".bench-ready"
    if mark.exists() and mark.read_text() == " ".join(TRL_PINS):
        return py
    base = Path(sys.base_prefix) / "bin" / "python3"
    print(f"making TRL's environment in {venv} ({' '.join(TRL_PINS)}) ...", flush=True)
    subprocess.run([str(base), "-m", "venv", str(venv)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", *TRL_PINS], check=True)
    mark.write_text(" ".join(TRL_PINS))
    return py


def matmul_peak(threads: int = 2, n: int = 2048, reps: int = 10) -> float:
    """fp32 GEMM GFLOP/s of ``torch.matmul`` on ``n x n`` operands with ``threads`` threads: the
    best of ``reps`` calls (a peak: the least disturbed call)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.matmul(a, b)
        best = min(_time(lambda: torch.matmul(a, b)) for _ in range(reps))
        return 2.0 * n ** 3 / best / 1e9
    finally:
        torch.set_num_threads(old)


def machine_peak() -> float:
    """The 2 cores' fp32 GEMM peak: the better of one 2-thread process and twice one thread (the
    ranks run one thread each; on a shared machine a 2-thread GEMM waits for its slower thread)."""
    return max(matmul_peak(2), 2 * matmul_peak(1))


def cpu_times() -> List[int]:
    """The machine's aggregate CPU times (``/proc/stat``'s first line), or [] where there is none."""
    try:
        return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return []


def steal_share(before: List[int], after: List[int]) -> float:
    """Steal time (the 8th field) over all time between two ``cpu_times`` readings."""
    if len(before) < 8 or len(after) < 8:
        return 0.0
    d = [b - a for a, b in zip(before, after)]
    return d[7] / max(sum(d[:8]), 1)


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class Side:
    """One system's process(es), stepped through its gate directory."""

    def __init__(self, name: str, cmd: List[str], env: Dict[str, str], gate: Path):
        self.name, self.gate = name, gate
        gate.mkdir(parents=True, exist_ok=True)
        self.log = open(gate / "log.txt", "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def step(self, k: int, timeout: float) -> dict:
        """Step ``k``'s record, with ``steal``: the share of the machine's CPU time the hypervisor
        gave to other guests during the step (``/proc/stat``; 0 where unknown)."""
        cpu0 = cpu_times()
        (self.gate / f"go_{k}").touch()
        done, t0 = self.gate / f"done_{k}.json", time.monotonic()
        while not done.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode} before step {k}: see {self.log.name}\n"
                                   + (self.gate / "log.txt").read_text()[-3000:])
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"{self.name}: step {k} took over {timeout:.0f} s ({self.log.name})")
            time.sleep(0.05)
        got = json.loads(done.read_text())
        got["steal"] = steal_share(cpu0, cpu_times())
        return got

    def close(self, timeout: float = 300) -> None:
        """Wait for the run to end (it stops after its last step); end its process group if not."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def project_side(args, length: int, steps: int, data: Path, model: Path, gate: Path) -> Side:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "benchmarks" / "_vs_trl_project.py"), "--config", str(ROOT / "examples" / "tiny_cpu.yaml"),
           f"model.path={model}", f"data.train_path={data}", "data.apply_chat_template=true",
           "data.answer_key=reward_model.ground_truth", f"data.max_prompt_length={args.max_prompt_length}",
           "reward.fn=megatron_stare.study.word_problems:compute_score", "checkpoint.dir=",
           f"logging.dir={gate / 'logs'}", "logging.tensorboard=false", f"trainer.total_steps={steps}",
           f"trainer.prompts_per_step={args.prompts}", f"rollout.n={args.n}", f"rollout.max_new_tokens={length}",
           f"optimizer.lr={args.lr}", "rollout.temperature=1.0", "rollout.verify_sync=off",
           "algorithm.policy_loss=vanilla", "rollout.cpu_kv_cache_gb=0.5", "rollout.ignore_eos=true",
           f"parallel.micro_batch_tokens={args.micro_batch_tokens}",
           *LAYOUTS[args.layout], *args.project_override]
    return Side("project", cmd, {**PROJECT_ENV, "BENCH_GATE": str(gate),
                                 "BENCH_PROFILE_STEP": str(args.profile_step)}, gate)


def trl_side(args, py: Path, length: int, steps: int, data: Path, model: Path, gate: Path) -> Side:
    cmd = [str(py), str(ROOT / "benchmarks" / "_vs_trl_trl.py"), "--model", str(model), "--data", str(data),
           "--length", str(length), "--steps", str(steps), "--gate", str(gate), "--prompts", str(args.prompts),
           "--n", str(args.n), "--lr", str(args.lr), "--threads", str(args.trl_threads),
           "--micro-batch", str(args.trl_micro_batch), *(["--bf16"] if args.trl_bf16 else []),
           *(["--gradient-checkpointing"] if args.trl_gradient_checkpointing else [])]
    return Side("trl", cmd, {"OMP_NUM_THREADS": str(args.trl_threads), "PYTHONWARNINGS": "ignore",
                             "TOKENIZERS_PARALLELISM": "false"}, gate)


def project_phases(m: dict) -> Dict[str, float]:
    return {"generate": m["time/generate"], "logprob": m.get("time/logprob", 0.0), "update": m["time/update"],
            "sync": m["time/sync"], "train": m["time/train"],
            "optimizer": m.get("time/optimizer_step", 0.0)}  # rank 0's Adam step, inside the update


def trl_phases(p: dict) -> Dict[str, float]:
    return {"generate": p.get("generate", 0.0), "logprob": p.get("logprob", 0.0), "update": p["update"],
            "sync": 0.0, "score": p.get("score", 0.0)}


def summarize(shape: FlopShape, rows: List[dict], peak: float, batch: int, length: int) -> dict:
    """Medians over the counted rounds of one side: step, tokens/s, phases, FLOP rates."""
    med = statistics.median
    phases = {k: med(r["phases"][k] for r in rows) for k in rows[0]["phases"]}
    flops = [step_flops(shape, r["seq_lens"], logprob_pass=r["phases"]["logprob"] > 0) for r in rows]
    train_s = [r["phases"]["logprob"] + r["phases"]["update"] for r in rows]
    rate = med(f.train / t for f, t in zip(flops, train_s)) / 1e9
    out = {"step_s": med(r["step_s"] for r in rows), "steps_s": [r["step_s"] for r in rows],
           "generated_tokens": batch * length, "gen_tokens_per_s": med(batch * length / r["step_s"] for r in rows),
           "generate_tokens_per_s": med(batch * length / r["phases"]["generate"] for r in rows),
           "phases_s": phases, "seq_tokens": med(sum(r["seq_lens"]) for r in rows),
           "train_gflop": med(f.train for f in flops) / 1e9, "train_gflops_per_s": rate,
           "cpu_steal": [round(r["steal"], 3) for r in rows],
           "train_peak_frac": rate / peak}
    if all(r["phases"]["logprob"] > 0 for r in rows):
        out["logprob_peak_frac"] = med(f.logprob / r["phases"]["logprob"] for f, r in zip(flops, rows)) / 1e9 / peak
    out["update_peak_frac"] = med(f.update / r["phases"]["update"] for f, r in zip(flops, rows)) / 1e9 / peak
    return out


def row(name: str, got: dict) -> dict:
    """One side's ``done_<k>.json`` as a row: step seconds, phases, sequence lengths, generated."""
    if name == "project":
        m = got["metrics"]
        return {"step_s": got["step_s"], "phases": project_phases(m), "seq_lens": got["seq_lens"],
                "generated": int(m["rollout/generated_tokens"]), "steal": got.get("steal", 0.0)}
    return {"step_s": got["step_s"], "phases": trl_phases(got["phases"]), "seq_lens": got["seq_lens"],
            "generated": got["generated"], "steal": got.get("steal", 0.0)}


def run_length(args, length: int, trl_py: Optional[Path], model: Path, data: Path, work: Path) -> dict:
    steps = args.warmup + args.rounds
    sides = {"project": project_side(args, length, steps, data, model, work / f"project_L{length}")}
    if trl_py is not None:
        sides["trl"] = trl_side(args, trl_py, length, steps, data, model, work / f"trl_L{length}")
    rows: Dict[str, List[dict]] = {n: [] for n in sides}
    peaks: List[float] = []
    order = random.Random(length)
    finished = False
    try:
        for k in range(steps):
            # Before the round's steps: both sides are idle then (after the last step they exit).
            peaks.append(machine_peak())
            print(f"L={length} round {k}: matmul probe {peaks[-1]:.1f} GFLOP/s", flush=True)
            for name in order.sample(list(sides), len(sides)):
                r = row(name, sides[name].step(k, args.step_timeout))
                rows[name].append(r)
                print(f"L={length} round {k}{' (warm-up)' if k < args.warmup else ''} {name}: step {r['step_s']:.1f} s | "
                      + " ".join(f"{p} {v:.1f}" for p, v in r["phases"].items())
                      + f" | CPU steal {r['steal']:.0%}", flush=True)
        finished = True
    finally:
        for s in sides.values():  # a side that failed leaves the other waiting on its gate: end it now
            s.close(timeout=300 if finished else 0)
    shape = FlopShape.from_hf_config(json.loads((model / "config.json").read_text()))
    out = result(shape, {n: r[args.warmup:] for n, r in rows.items()}, peaks, args.prompts * args.n, length)
    out["settings"] = {"warmup_rounds": args.warmup, "trl_gradient_checkpointing": args.trl_gradient_checkpointing,
                       "trl_micro_batch": args.trl_micro_batch, "trl_bf16": args.trl_bf16,
                       "project_micro_batch_tokens": args.micro_batch_tokens, "layout": args.layout}
    return out


def result(shape: FlopShape, counted: Dict[str, List[dict]], peaks: List[float], batch: int, length: int) -> dict:
    """One length's record from the counted rows of each side and the round's matmul probes."""
    for name, r in counted.items():  # EOS was ignored on both sides: every completion is L tokens
        gen = {x["generated"] for x in r}
        if gen != {batch * length} or any(len(x["seq_lens"]) != batch for x in r):
            raise RuntimeError(f"{name} generated {gen} tokens in {len(r[0]['seq_lens'])} sequences, "
                               f"not {batch} x {length}")
    peak = max(peaks)
    out = {"length": length, "rounds": len(counted["project"]), "matmul_peak_gflops": peak,
           "matmul_probes_gflops": peaks, "project": summarize(shape, counted["project"], peak, batch, length)}
    if "trl" in counted:
        out["trl"] = summarize(shape, counted["trl"], peak, batch, length)
        out["step_ratio_trl_over_project"] = statistics.median(
            t["step_s"] / p["step_s"] for t, p in zip(counted["trl"], counted["project"]))
    return out


def report(res: dict) -> None:
    L = res["length"]
    print(f"\nL={L}: fp32 matmul peak {res['matmul_peak_gflops']:.1f} GFLOP/s (2048^3, {len(res['matmul_probes_gflops'])} probes)")
    for name in ("project", "trl"):
        if name not in res:
            continue
        s = res[name]
        ph = " ".join(f"{k} {v:.1f}" for k, v in s["phases_s"].items())
        print(f"  {name:8s} step {s['step_s']:6.1f} s | {s['gen_tokens_per_s']:5.1f} gen tok/s "
              f"(generate phase {s['generate_tokens_per_s']:.0f} tok/s) | {ph} | training "
              f"{s['train_gflops_per_s']:.1f} GFLOP/s = {s['train_peak_frac']:.0%} of peak")
    if "step_ratio_trl_over_project" in res:
        print(f"  project step throughput = {res['step_ratio_trl_over_project']:.2f}x TRL's (median paired ratio)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--rounds", type=int, default=3, help="counted rounds per length")
    ap.add_argument("--warmup", type=int, default=1, help="rounds not counted (the first step warms up)")
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="dp2-vllm")
    ap.add_argument("--micro-batch-tokens", type=int, default=1024,
                    help="the project's parallel.micro_batch_tokens (2048: ~9 GB a rank, too much beside TRL)")
    ap.add_argument("--project-override", nargs="*", default=[], help="more a.b=c overrides for the trainer")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--max-prompt-length", type=int, default=96)
    ap.add_argument("--trl-threads", type=int, default=2)
    ap.add_argument("--trl-bf16", action="store_true")
    ap.add_argument("--trl-gradient-checkpointing", action="store_true",
                    help="TRL's default (recomputes the forward in backward); off: faster where memory allows")
    ap.add_argument("--trl-micro-batch", type=int, default=8,
                    help="completions per forward/backward (0: all 32, which ran out of memory beside the project)")
    ap.add_argument("--trl-venv", type=Path, default=DEFAULT_VENV)
    ap.add_argument("--step-timeout", type=float, default=1800)
    ap.add_argument("--model", type=Path, default=None, help="HF model directory (default: the fetched SmolLM2)")
    ap.add_argument("--profile-step", type=int, default=-1,
                    help="the project's training phase of this step (a warm-up one: 0) under torch.profiler; "
                         "op tables in the work directory")
    ap.add_argument("--work-dir", type=Path, default=None, help="keep the runs' files (logs, profiles) here")
    ap.add_argument("--smoke", action="store_true", help="one project step at L=8, no TRL, nothing written")
    ap.add_argument("--project-only", action="store_true",
                    help="no TRL: the project's figures alone (to compare layouts; give --out another file)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "vs_trl.json")
    ap.add_argument("--append", action="store_true",
                    help="keep --out's results for the lengths not run now (a length at a time)")
    args = ap.parse_args(argv)
    # A SIGTERM (kill, a job scheduler) unwinds like Ctrl-C: the `finally` of each length ends
    # both sides' process groups, which would otherwise outlive the driver.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.smoke:
        args.lengths, args.rounds, args.warmup = [8], 1, 0
    if args.model is None:
        from megatron_stare.models.fetch import fetch

        args.model = Path(fetch("smollm2-135m-instruct", quiet=True))
    from megatron_stare.study.word_problems import write_split

    trl_py = None if args.smoke or args.project_only else ensure_trl_venv(args.trl_venv)
    results = []
    kept = json.loads(args.out.read_text())["results"] if args.append and args.out.exists() else []
    with tempfile.TemporaryDirectory(prefix="bench_vs_trl_") as tmp:
        work = args.work_dir or Path(tmp)
        data = write_split(work / "data", n_train=max(64, args.prompts * (args.warmup + args.rounds)), n_test=8)["train"]
        for length in args.lengths:
            res = run_length(args, length, trl_py, args.model, data, work)
            report(res)
            results.append(res)
            if not args.smoke:  # after each length: a later one may not finish
                write_record(args, [r for r in kept if r["length"] not in args.lengths] + results)
    if args.smoke:
        print(json.dumps(results[0]))
    return 0


def write_record(args, results: List[dict]) -> None:
    record = {"machine": {"torch": torch.__version__, "cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg()},
              "job": {"model": args.model.name, "prompts": args.prompts, "n": args.n, "lr": args.lr,
                      "warmup_rounds": args.warmup},
              "project": {"overrides": list(LAYOUTS[args.layout]) + args.project_override,
                          "threads_per_rank": 1, "loss": "vanilla (GRPO clip), token-mean", "dtype": "float32"},
              "trl": {"version": TRL_PINS[1], "threads": args.trl_threads, "engine": "HF generate",
                      "loss": "dapo (default), beta 0", "per_length_settings": "results[i].settings"},
              "results": sorted(results, key=lambda r: r["length"])}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"written: {args.out}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
