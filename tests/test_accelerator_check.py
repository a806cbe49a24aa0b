"""The accelerator check's CPU smoke run, its phase file when cut short, and the step profile."""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from private_t5 import models
from private_t5.experiments import benchmark_case as bench
from private_t5.train import step_profile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "accelerator_check.py")
STEP_PHASES = ["build", "init_trace", "init_lower", "init_compile", "init_run", "trace", "lower",
               "compile", "first_step", "steady"]


def _run(out, *flags, timeout=600):
  env = dict(os.environ, PYTHONPATH=ROOT)
  return subprocess.run([sys.executable, SCRIPT, "--smoke", f"--out={out}", "--train_steps=0",
                         "--no_max_batch", *flags], capture_output=True, text=True, env=env,
                        timeout=timeout, check=False)


@pytest.mark.slow
def test_smoke_run_times_every_phase_of_every_case(tmp_path):
  proc = _run(tmp_path, "--large_batch=0")
  assert proc.returncode == 0, proc.stderr[-3000:]
  records = step_profile.read_phases(str(tmp_path / "phases.jsonl"))
  assert records[0]["phase"] == "devices" and records[-1]["phase"] == "done"
  for method in ("nondp", "ghost"):
    name = f"t5_1_1_tiny 32/8 b4 {method}"
    phases = [r["phase"] for r in records if r.get("case") == name]
    assert phases == STEP_PHASES, phases
    steady = next(r for r in records if r.get("case") == name and r["phase"] == "steady")
    assert steady["sequences_per_s"] > 0 and steady["analytic_flops_per_step"] > 0
    lowered = next(r for r in records if r.get("case") == name and r["phase"] == "lower")
    assert 0 < lowered["largest_constant_bytes"] < 2 ** 20
  for method in ("nondp", "ghost"):  # the attention as one jax.nn.dot_product_attention call
    name = f"t5_1_1_tiny 32/8 b4 {method} attention=xla"
    assert [r["phase"] for r in records if r.get("case") == name] == STEP_PHASES
  sensitivity = [r for r in records if r["phase"] == "sensitivity"]
  assert len(sensitivity) == 4  # vmap and ghost, float32 and bfloat16
  assert all(1 - 1e-5 < r["max_ratio"] <= 1 + 1e-5 and r["over_1e-5"] == 0 for r in sensitivity)
  summary = (tmp_path / "accelerator_check.md").read_text()
  assert "| t5_1_1_tiny 32/8 b4 ghost |" in summary and "DP-ghost ÷ non-DP throughput" in summary


@pytest.mark.slow
def test_a_run_stopped_by_its_budget_keeps_every_finished_phase(tmp_path):
  proc = _run(tmp_path, "--budget_s=25")
  assert proc.returncode == 3, proc.stderr[-3000:]
  lines = (tmp_path / "phases.jsonl").read_text().splitlines()
  records = [json.loads(line) for line in lines]  # every line complete
  assert records[-1]["phase"] == "stopped" and "budget" in records[-1]["reason"]
  assert any(r["phase"] == "devices" for r in records)
  finished = [r for r in records if "case" in r]
  assert all(r["wall_s"] >= 0 for r in finished)
  assert (tmp_path / "accelerator_check.md").exists()


def test_a_phase_line_cut_short_is_skipped(tmp_path):
  log = step_profile.PhaseLog(str(tmp_path / "p.jsonl"))
  assert log.time("c", "work", lambda: 7, stats=lambda v: {"value": v}) == 7
  with open(tmp_path / "p.jsonl", "a") as f:
    f.write('{"case": "c", "phase": "comp')  # killed mid-write
  records = step_profile.read_phases(str(tmp_path / "p.jsonl"))
  assert [(r["phase"], r["value"]) for r in records] == [("work", 7)]


def test_analytic_flops_count_every_kernel_once_per_token():
  config = models.load_preset("t5_1_1_small")
  flat = jax.tree_util.tree_flatten_with_path(models.param_shapes(config))[0]
  kernels = {"/".join(str(getattr(k, "key", k)) for k in path): int(np.prod(x.shape)) for path, x in flat
             if len(x.shape) == 2 and "relpos" not in str(path) and "token_embedder" not in str(path)}
  encoder = sum(v for k, v in kernels.items() if k.startswith("encoder"))
  decoder = sum(v for k, v in kernels.items() if k.startswith("decoder"))  # logits_dense included
  attention = 12 * 6 * 64 * 8 * (512 * 512 + 114 * 114 + 114 * 512)
  want = 6 * (encoder * 512 + decoder * 114) + attention
  assert step_profile.analytic_train_flops(config, 512, 114) == pytest.approx(want, rel=1e-12)
  assert 95e9 < want < 105e9  # about 100 GFLOP per 512/114 sequence


def test_program_stats_read_constants_and_loops():
  big = np.arange(300_000, dtype=np.float32).reshape(1000, 300)
  fn = jax.jit(lambda x: jax.lax.fori_loop(0, 3, lambda i, y: y + jnp.asarray(big), x))
  lowered = fn.lower(jnp.zeros((1000, 300), jnp.float32))
  stats = step_profile.lowered_stats(lowered.as_text())
  assert stats["largest_constant_bytes"] == big.nbytes and stats["constants_over_1mib"] == 1
  assert step_profile.compiled_stats(lowered.compile().as_text())["while_loops"] >= 1


def test_dp_ghost_step_holds_no_position_sized_constant():
  # The relative position bias's per-example norms sum the output gradient's diagonals by bucket
  # (no [q * k, buckets] one-hot constant); the model gathers the bias by offset (no [q, k] index
  # constant). At 128/32 either would be >= 64 KiB; the program's largest constant stays tiny.
  _, trainer = bench.make_trainer("t5_1_1_tiny", bench.GHOST, 2, 1.0, 1.0, 0.0, None)
  batch = bench.random_batch(trainer.model_config.vocab_size, 2, 128, 32, 0)
  keys = (jax.random.PRNGKey(1), jax.random.PRNGKey(2))
  lowered = trainer.trace_train_step(trainer.abstract_state(), batch, *keys).lower()
  stats = step_profile.lowered_stats(lowered.as_text())
  assert stats["largest_constant_bytes"] < 16 * 1024, stats


def test_nothing_is_written_after_the_last_line(tmp_path):
  # The watchdog's stop line stays last even when a phase on the main thread ends meanwhile.
  log = step_profile.PhaseLog(str(tmp_path / "p.jsonl"))
  log.write({"phase": "devices"})
  log.write({"phase": "stopped"}, last=True)
  log.time("c", "trace", lambda: None)
  assert [r["phase"] for r in step_profile.read_phases(str(tmp_path / "p.jsonl"))] == ["devices", "stopped"]
