"""What a person reads: the run's console, from one place, in one format (rank 0).

A run tells its story in a few lines::

    [megatron-stare] model Qwen2ForCausalLM, 1.2M parameters (runs/tiny/model)
    [megatron-stare] layout TP2xPP1xCP1xDP1 on 2 ranks | engine hf | data 32 train rows, 4 eval rows
    [megatron-stare] 4 steps of 4 prompts x 4 responses | logs runs/x/logs (console.log, metrics.jsonl) | ...
    step 1/4, eta 9s | generate 0.3s score 2ms train 0.6s sync 40ms | reward 0.50 len 7.2 | H 5.82/10.00 gate on | ...
    [megatron-stare] eval after step 2: avg@4 0.250 pass@4 0.500 len 7.5
    [megatron-stare] saved checkpoint /abs/ckpt/step_00000002
    [megatron-stare] done: 4 steps in 14s (set-up 5s) | checkpoint /abs/ckpt/step_00000004 | logs runs/x/logs

Notices (resume, skipped optimizer steps, preemption, the start-up summary, saves, evals, the
final line) and step lines go to stdout; warnings and errors to stderr. Everything also goes to
the run's log file, ``<logging.dir>/console.log`` (rank 0; another rank ``console_rank<r>.log``,
opened at its first record), with the full text of every warning.

Warnings: once ``install()``-ed (``train.main``), Python ``warnings`` and ``logging`` records
(transformers', vLLM's, torch's and megatron's loggers lose their own console handlers and
propagate here) are written whole to the log file and collapsed on the console to ONE line per
distinct text, at its first occurrence: third-party texts cut to their first line and
``WIDTH`` characters, the project's own kept whole (they are written as one clear line). Only
rank 0 shows warnings (every rank would repeat them); any rank shows its errors. Records below
WARNING go to the file only.

Step lines: every ``logging.log_every`` steps (and the last), with the ETA at the mean pace of
the steps run by this process. The formats are ``console_lines.py``'s.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, List, Mapping, Optional, Sequence, TextIO

from transformers.utils import logging as hf_logging

from megatron_stare.checkpoint.core import finished_checkpoint
from megatron_stare.trainer.console_lines import (PREFIX, RunSummary, eval_line, sample_records, source_of, step_line,
                                                  warning_line)
from megatron_stare.trainer.metrics import format_duration
from megatron_stare.rollout.spawned import CONSOLE_ONLY_ENV
from megatron_stare.runtime import notices
from megatron_stare.runtime.preemption import PREEMPTED_EXIT_CODE

THIRD_PARTY = ("transformers", "vllm", "torch", "megatron", "sglang", "accelerate", "urllib3", "datasets")
"""Libraries whose loggers' console handlers are replaced by the console's."""
_FORMAT = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")


# ------------------------------------------------------------------------------------ console
class _Handler(logging.Handler):
    """The root logger's handler: every record to the console's ``record``."""

    def __init__(self, console: "Console"):
        super().__init__(logging.NOTSET)
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        try:
            full = _FORMAT.format(record)
            self.console.record(record.name.split(".")[0], record.getMessage(), full, record.levelno)
        except Exception:  # noqa: BLE001 - logging's own contract: a broken record never kills the run
            self.handleError(record)


class Console:
    """The run's console on one rank; see the module docstring.

    ``rank``: the global rank (only rank 0 prints notices, step lines and warnings). ``out``,
    ``err``: streams (default: ``sys.stdout``/``sys.stderr`` at each write).
    """

    def __init__(self, rank: int = 0, out: Optional[TextIO] = None, err: Optional[TextIO] = None):
        self.rank, self._out, self._err = rank, out, err
        self.log_path: Optional[Path] = None
        self._file: Optional[TextIO] = None
        self._pending: List[str] = []  # log-file text before the log directory is known
        self._seen: set = set()
        self._installed: Optional[tuple] = None
        self._adopted: List[tuple] = []  # (logger, its removed handlers, its propagate) to restore
        self.total_steps: Optional[int] = None
        self.log_every, self.target_entropy = 1, None
        self._t_start = time.perf_counter()
        self._t_ready: Optional[float] = None  # set-up done: the ETA counts from here
        self._first_step: Optional[int] = None  # the first step this process runs (1-based)
        self.last_saved: Optional[Path] = None
        self.log_dir: Optional[str] = None
        self._logger = self._tokenizer = None  # the trainer's (``started``)
        self.samples_every = 0

    # -------------------------------------------------------------- set-up
    @classmethod
    def from_env(cls) -> "Console":
        """The console of this process (``RANK`` from torchrun; before any process group)."""
        return cls(rank=int(os.environ.get("RANK", "0")))

    def configure(self, cfg) -> "Console":
        """Take the run's settings (``Config``): the log file under ``logging.dir``, how often
        step lines are printed, the total steps and STARE's target entropy."""
        self.total_steps, self.log_every = cfg.trainer.total_steps, cfg.logging.log_every
        self.samples_every = cfg.logging.samples_every
        stare_loss = cfg.algorithm.policy_loss == "stare"
        self.target_entropy = cfg.algorithm.stare.target_entropy if stare_loss else None
        self.log_dir = cfg.logging.dir
        name = "console.log" if self.rank == 0 else f"console_rank{self.rank}.log"
        self.log_path = Path(cfg.logging.dir) / name
        if self.rank == 0 or self._pending:
            self._open()
        return self

    def _open(self) -> None:
        if self._file is None and self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.log_path, "a", encoding="utf-8")
            self._file.write(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} rank {self.rank}: "
                             f"{' '.join(sys.argv)}\n")
        if self._file is not None:
            self._file.writelines(self._pending)
            self._pending = []
            self._file.flush()

    def install(self) -> "Console":
        """Route Python warnings and library logging through this console (see the module
        docstring); ``uninstall()`` undoes it."""
        if self._installed is not None:
            return self
        root, vllm = logging.getLogger(), logging.getLogger("vllm")
        handler = _Handler(self)
        self._installed = (warnings.showwarning, handler, root.level, vllm.level,
                           hf_logging.is_progress_bar_enabled(), "VLLM_CONFIGURE_LOGGING" in os.environ,
                           notices.set_sink(self.echo))  # the lower layers' lines come here
        warnings.showwarning = self._showwarning
        root.addHandler(handler)
        if root.level == logging.WARNING:  # the default: INFO records reach the log file too
            root.setLevel(logging.INFO)
        # vLLM configures its own console handler at import unless told not to; it then logs here.
        # (Set for this process: a spawned vLLM server drops it, ``spawned.server_environ``.)
        if "VLLM_CONFIGURE_LOGGING" not in os.environ:
            os.environ["VLLM_CONFIGURE_LOGGING"] = "0"
            CONSOLE_ONLY_ENV.add("VLLM_CONFIGURE_LOGGING")
            vllm.setLevel(logging.INFO)
        hf_logging.disable_progress_bar()  # weight loading and saving bars: noise on a run's console
        self._adopted = adopt_library_loggers()
        return self

    def uninstall(self) -> None:
        if self._installed is None:
            return
        showwarning, handler, level, vllm_level, bars, vllm_env, sink = self._installed
        warnings.showwarning = showwarning
        notices.set_sink(sink)
        root = logging.getLogger()
        root.removeHandler(handler)
        root.setLevel(level)
        logging.getLogger("vllm").setLevel(vllm_level)
        if not vllm_env:
            os.environ.pop("VLLM_CONFIGURE_LOGGING", None)
            CONSOLE_ONLY_ENV.discard("VLLM_CONFIGURE_LOGGING")
        if bars:
            hf_logging.enable_progress_bar()
        for lg, handlers, propagate in self._adopted:
            for h in handlers:
                lg.addHandler(h)
            lg.propagate = propagate
        self._installed, self._adopted = None, []

    def close(self) -> None:
        self.uninstall()
        if self._file is not None:
            self._file.close()
            self._file = None

    # -------------------------------------------------------------- sinks
    def _stream(self, err: bool) -> TextIO:
        return (self._err or sys.stderr) if err else (self._out or sys.stdout)

    def _log(self, text: str) -> None:
        text = text if text.endswith("\n") else text + "\n"
        if self._file is None:
            self._pending.append(text)
            if self.log_path is not None:  # a rank's first record: its file now
                self._open()
            return
        self._file.write(text)
        self._file.flush()

    def say(self, line: str, err: bool = False) -> None:
        """Print ``line`` (rank 0) and keep it in the log file."""
        if self.rank == 0:
            self.echo(line, err)

    def echo(self, line: str, err: bool = False) -> None:
        """Print ``line`` on this rank and keep it in the log file: the sink of the lower layers'
        lines (``runtime/notices.py``), whose callers chose the ranks that speak."""
        print(line, file=self._stream(err), flush=True)
        self._log(line)

    def note(self, text: str) -> None:
        """A notice: ``[megatron-stare] <text>``."""
        self.say(f"{PREFIX} {text}")

    def record(self, source: str, text: str, full: str, level: int, category: Optional[str] = None) -> None:
        """A warning or log record: whole to the log file; at WARNING and above one collapsed
        line on the console (rank 0; errors from any rank), the first time its line is seen."""
        self._log(full)
        if level < logging.WARNING or (self.rank != 0 and level < logging.ERROR):
            return
        line = warning_line(source, text, category, error=level >= logging.ERROR)
        if line in self._seen:
            return
        self._seen.add(line)
        print(line if self.rank == 0 else f"[rank {self.rank}] {line}", file=self._stream(True), flush=True)

    def _showwarning(self, message, category, filename, lineno, file=None, line=None) -> None:
        full = warnings.formatwarning(message, category, filename, lineno, line)
        self.record(source_of(filename), str(message), full, logging.WARNING, category.__name__)

    # -------------------------------------------------------------- the story
    def started(self, summary: RunSummary, logger, tokenizer) -> None:
        """Set-up is done: the start-up ``summary``. Libraries imported during set-up (vLLM) gave
        their loggers console handlers: adopted here. The trainer's metrics ``logger``
        (``MetricsLogger``) and ``tokenizer`` record each step (``step``)."""
        if self._installed is not None:
            self._adopted += adopt_library_loggers()
        self._t_ready, self._first_step = time.perf_counter(), summary.start_step + 1
        self._logger, self._tokenizer = logger, tokenizer
        if self.rank == 0:
            for ln in summary.lines():
                self.say(ln)

    def already_complete(self, cfg) -> bool:
        """True (and one line from rank 0) when the checkpoint this run would resume from is at
        ``trainer.total_steps`` already: called before any set-up, so the rerun of a finished
        run exits at once."""
        c = cfg.checkpoint
        done = finished_checkpoint(c.resume, c.dir, cfg.trainer.total_steps)
        if done is not None:
            self.note(f"already complete: {done[1].absolute()} is step {done[0]} of trainer.total_steps="
                      f"{cfg.trainer.total_steps}; nothing to do (raise trainer.total_steps to train on)")
        return done is not None

    def step(self, step: int, metrics: Mapping[str, Any], samples: Sequence = ()) -> None:
        """Step ``step`` (1-based) is done: record its metrics (the metrics logger), print its
        line (every ``log_every`` steps and at the last) and its eval line when it evaluated,
        and every ``logging.samples_every`` steps write a few of its ``samples`` (``types.Sample``)."""
        if self._logger is not None:
            self._logger.log(step, metrics)
        if self._first_step is None:
            self._first_step = step
        if self.log_every > 0 and (step % self.log_every == 0 or step == self.total_steps):
            self.say(step_line(step, self.total_steps, metrics, self.eta(step), self.target_entropy))
        if (ev := eval_line(step, metrics)) is not None:
            self.say(ev)
        if self._logger is not None and self.samples_every and step % self.samples_every == 0 and samples:
            self._logger.log_samples(step, sample_records(samples, self._tokenizer))

    def eta(self, step: int) -> Optional[float]:
        """Seconds left after ``step`` at the mean pace of this process's steps so far (from
        the end of set-up, or from the console's start)."""
        if not self.total_steps:
            return None
        t0 = self._t_ready if self._t_ready is not None else self._t_start
        done = max(step - (self._first_step or step) + 1, 1)
        return (time.perf_counter() - t0) / done * max(self.total_steps - step, 0)

    def saved(self, path: Path) -> Path:
        """A checkpoint was saved at ``path`` (returned)."""
        self.last_saved = Path(path)
        self.note(f"saved checkpoint {path}")
        return path

    def preempted(self, signal_name: str, step: int, ckpt_dir: Optional[str], start_step: int,
                  code: int = PREEMPTED_EXIT_CODE, how: str = "") -> None:
        """The run stops with ``step`` steps done on a preemption signal (rank 0's line); ``how``:
        the phase the signal came in, what became of it, the time since (``step_interrupt.py``)."""
        where = ("no checkpoint.dir: nothing saved" if not ckpt_dir
                 else "no step finished since the start" if step == start_step
                 else f"saved {Path(ckpt_dir).absolute() / f'step_{step:08d}'}")
        self.note(f"preempted by {signal_name} after step {step}: {where}{f' ({how})' if how else ''}; rerun the "
                  f"same command to resume (exit {code})")

    def finished(self, start_step: int, stopped: Optional[int] = None) -> None:
        """The final line of a run that ran to ``total_steps`` from ``start_step`` (nothing when
        ``stopped`` at a preemption: its line was the last)."""
        if stopped is not None or self.total_steps is None:
            return
        now = time.perf_counter()
        ran = self.total_steps - start_step
        steps = f"{self.total_steps} steps" + (f" ({ran} in this run)" if start_step else "")
        setup = f" (set-up {format_duration(self._t_ready - self._t_start)})" if self._t_ready else ""
        where = [f"checkpoint {self.last_saved}"] if self.last_saved else []
        if self.log_dir:
            where.append(f"logs {Path(self.log_dir).absolute()}")
        self.note(f"done: {steps} in {format_duration(now - self._t_start)}{setup}"
                  + "".join(f" | {w}" for w in where))


def adopt_library_loggers(names=THIRD_PARTY) -> List[tuple]:
    """Remove the console handlers (stream handlers other than files) that the ``names``
    libraries put on their loggers, and let those loggers propagate to the root logger (the
    console's handler). Returns ``(logger, removed handlers, its propagate before)`` of each."""
    adopted = []
    for name, lg in list(logging.root.manager.loggerDict.items()):
        if not isinstance(lg, logging.Logger) or name.split(".")[0] not in names:
            continue
        mine = [h for h in lg.handlers
                if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)]
        if mine:
            adopted.append((lg, mine, lg.propagate))
            for h in mine:
                lg.removeHandler(h)
            lg.propagate = True
    return adopted


def console_of(cfg, rank: int, console: Optional[Console]) -> Console:
    """``console`` (``train.main``'s, installed), or a plain one for a ``Trainer`` built directly
    (tests, benchmarks: their own warning capture stays in place)."""
    return console if console is not None else Console(rank).configure(cfg)
