"""``python -m megatron_stare.train``'s user-error path under torchrun's signals."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_stare.models.tiny import build_tiny_hf_model

ROOT = Path(__file__).resolve().parents[2]

# torchrun SIGTERMs every worker as soon as one exits: a rank that finds a user error quickly
# exits 2 while rank 0 (the one that prints) may still be starting. The SIGTERM is sent here
# while rank 0 validates its config.
_SCRIPT = """
import os, signal, sys
import megatron_stare.train as t
validate = t.validate_config
def validate_after_sigterm(*a, **k):
    os.kill(os.getpid(), signal.SIGTERM)
    return validate(*a, **k)
t.validate_config = validate_after_sigterm
sys.exit(t.main(["--config", sys.argv[1], *sys.argv[2:]]))
"""


@pytest.mark.parametrize("override,needle", [
    ("reward.fn=no_such_module:score", "reward.fn: cannot import 'no_such_module:score'"),
    ("optimizer.lr=-1", "optimizer.lr"),
])
def test_user_error_is_printed_despite_torchruns_sigterm(tmp_path, override, needle):
    """Rank 0 gets torchrun's SIGTERM during set-up and still prints its one line and exits 2
    (before main() installed the preemption handler first, the signal killed it: CI saw no line)."""
    # The checks the config makes of paths pass; the reward path fails first in the trainer.
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    model = build_tiny_hf_model("qwen2", tmp_path / "model")
    out = subprocess.run([sys.executable, "-c", _SCRIPT, str(ROOT / "examples" / "tiny_cpu.yaml"), override,
                          "parallel.tp=1", f"logging.dir={tmp_path}",
                          f"model.path={model}", f"data.train_path={tmp_path / 'train.jsonl'}"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "RANK": "0", "WORLD_SIZE": "1", "OMP_NUM_THREADS": "1"})
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert out.returncode != -signal.SIGTERM
    assert len(errors) == 1 and needle in errors[0], out.stderr[-2000:]
