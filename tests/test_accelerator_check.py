"""The accelerator check's CPU smoke run, its phase file when cut short, and the step profile."""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from private_t5.models import config as config_lib
from private_t5.models import network
from private_t5.experiments import benchmark_case as bench
from private_t5.train import step_profile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "accelerator_check.py")
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
    assert phases == STEP_PHASES + ["profile"], phases  # the first case is profiled too
    profile = next(r for r in records if r.get("case") == name and r["phase"] == "profile")
    assert profile["ms_per_step"] > 0 and profile["top_ops"] and os.path.exists(profile["trace"])
    assert sum(profile["by_kind"].values()) == pytest.approx(profile["ms_per_step"], rel=1e-3)
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
  assert "| DP-ghost − non-DP |" in summary and "Costliest ops of t5_1_1_tiny 32/8 b4 ghost" in summary


@pytest.mark.slow
def test_a_run_stopped_by_its_budget_keeps_every_finished_phase(tmp_path):
  proc = _run(tmp_path, "--budget_s=12")
  assert proc.returncode == 3, proc.stderr[-3000:]
  lines = (tmp_path / "phases.jsonl").read_text().splitlines()
  records = [json.loads(line) for line in lines]  # every line complete
  assert records[-1]["phase"] == "stopped" and "budget" in records[-1]["reason"]
  assert any(r["phase"] == "devices" for r in records)
  finished = [r for r in records if "case" in r]
  assert finished and all(r["wall_s"] >= 0 for r in finished)
  assert (tmp_path / "accelerator_check.md").exists()


def test_a_phase_line_cut_short_is_skipped(tmp_path):
  log = step_profile.PhaseLog(str(tmp_path / "p.jsonl"))
  assert log.time("c", "work", lambda: 7, stats=lambda v: {"value": v}) == 7
  with open(tmp_path / "p.jsonl", "a") as f:
    f.write('{"case": "c", "phase": "comp')  # killed mid-write
  records = step_profile.read_phases(str(tmp_path / "p.jsonl"))
  assert [(r["phase"], r["value"]) for r in records] == [("work", 7)]


def test_analytic_flops_count_every_kernel_once_per_token():
  config = config_lib.load_preset("t5_1_1_small")
  flat = jax.tree_util.tree_flatten_with_path(network.param_shapes(config))[0]
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
  assert stats["while_loops"] == 1
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


# --- no device loops in the step lowered for a GPU (read here, on the CPU) -------------------------

@pytest.mark.parametrize("preset,method,inputs", [
    ("t5_1_1_tiny", bench.GHOST, 32), ("t5_1_0_tiny", bench.GHOST, 32), ("t5_1_1_tiny", bench.VMAP, 32),
    ("t5_1_1_tiny", bench.NONDP, 32),
    ("t5_1_1_base", bench.GHOST, 512)])  # base at 512 inputs: Gram norms of 512 positions, in 4 blocks
def test_train_step_lowered_for_a_gpu_holds_no_while_loop(preset, method, inputs):
  # A GPU reads a `while` loop's predicate back on the host every iteration. The DP step's noise is
  # drawn in one batched draw per parameter shape there, and the Gram norms of long sequences are
  # an unrolled chain of blocks: as loop-free as the non-DP step.
  config, trainer = bench.make_trainer(preset, method, 2, 1.0, 1.0, 0.0, None)
  if preset == "t5_1_1_base":
    from private_t5.dp import ghost_norms as gn  # pylint: disable=g-import-not-at-top
    assert gn.choose_linear_method(inputs, config.d_model, config.d_ff) == gn.GRAM
    assert inputs > gn.GRAM_BLOCK
  batch = bench.random_batch(config.vocab_size, 2, inputs, 8, 0)
  keys = (jax.random.PRNGKey(1), jax.random.PRNGKey(2))
  lowered = trainer.lower_train_step(trainer.abstract_state(), batch, *keys, platforms=("cuda",))
  assert step_profile.lowered_stats(lowered.as_text())["while_loops"] == 0


def test_noise_rows_are_the_same_bits_with_or_without_a_loop():
  from private_t5.dp import noise as noise_lib  # pylint: disable=g-import-not-at-top
  key = jax.random.PRNGKey(7)
  looped = jax.jit(lambda k: noise_lib.normal_rows(k, 5, (3, 4), loop=True))
  batched = jax.jit(lambda k: noise_lib.normal_rows(k, 5, (3, 4), loop=False))
  np.testing.assert_array_equal(looped(key), batched(key))
  want = [jax.random.normal(jax.random.fold_in(key, r), (3, 4), jnp.float32) for r in range(5)]
  np.testing.assert_array_equal(batched(key), np.stack(want))
  text = lambda fn, platform: jax.jit(fn).trace(key).lower(lowering_platforms=(platform,)).as_text()
  draw = lambda k: noise_lib.gaussian_like(k, [jnp.zeros((3, 4)), jnp.zeros((2,)), jnp.zeros((3, 4))])
  assert step_profile.lowered_stats(text(draw, "cuda"))["while_loops"] == 0
  assert step_profile.lowered_stats(text(draw, "cpu"))["while_loops"] >= 2  # a loop per shape on a CPU


def test_nothing_is_written_after_the_last_line(tmp_path):
  # The watchdog's stop line stays last even when a phase on the main thread ends meanwhile.
  log = step_profile.PhaseLog(str(tmp_path / "p.jsonl"))
  log.write({"phase": "devices"})
  log.write({"phase": "stopped"}, last=True)
  log.time("c", "trace", lambda: None)
  assert [r["phase"] for r in step_profile.read_phases(str(tmp_path / "p.jsonl"))] == ["devices", "stopped"]


# --- bad flags: one error line, exit status 2, nothing written, before any work -------------------

def _script():
  """The script as a module, to call its `main` in this process (milliseconds a case)."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location("accelerator_check", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture
def jax_cache_config():
  """`main` points JAX's persistent compilation cache at OUT: restored for the next tests."""
  names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
           "jax_persistent_cache_min_entry_size_bytes")
  saved = {name: getattr(jax.config, name) for name in names}
  yield
  for name, value in saved.items():
    jax.config.update(name, value)


def _refused(argv, capsys) -> str:
  """Runs the script's `main(argv)` here; asserts exit status 2 and one error line, no traceback."""
  try:
    rc = _script().main(argv)
  except SystemExit as e:  # argparse
    rc = e.code
  err = capsys.readouterr().err
  lines = err.strip().splitlines()
  assert rc == 2 and len(lines) == 1 and lines[0].startswith("accelerator_check.py: error: "), err
  assert "Traceback" not in err
  return lines[0]


@pytest.mark.parametrize("flags, message", [
    (["--budget_s=-5"], "argument --budget_s: must be a finite number > 0, got '-5'"),
    (["--budget_s=0"], "argument --budget_s: must be a finite number > 0"),
    (["--budget_s=nan"], "argument --budget_s: must be a finite number > 0, got 'nan'"),
    (["--budget_s=inf"], "argument --budget_s: must be a finite number > 0, got 'inf'"),
    (["--presets="], "argument --presets: must name at least one of"),
    (["--presets=t5_1_1_small,t5_9_9"], "argument --presets: unknown 't5_9_9'"),
    (["--dtype=bf16"], "argument --dtype: invalid choice: 'bf16'"),
    (["--attention_variants=flash"], "argument --attention_variants: unknown 'flash'"),
    (["--methods=nondp,fast"], "argument --methods: unknown 'fast'"),
    (["--methods=,"], "argument --methods: must name at least one of"),
    (["--batch=0"], "argument --batch: must be an integer >= 1, got 0"),
    (["--inputs=0"], "argument --inputs: must be an integer >= 1, got 0"),
    (["--targets=x"], "argument --targets: must be an integer >= 1, got 'x'"),
    (["--steps=0"], "argument --steps: must be an integer >= 1"),
    (["--large_batch=-1"], "argument --large_batch: must be an integer >= 0"),
    (["--train_steps=-1"], "argument --train_steps: must be an integer >= 0"),
    (["--peak_tflops=-1"], "argument --peak_tflops: must be a finite number > 0, got '-1'"),
    (["--smoke", "--dtype=float32", "--attention_variants=cudnn"], "needs bfloat16 or float16 activations"),
    (["--smoke", "--presets=t5_1_0_tiny", "--attention_variants=xla"], "no dropout on the attention weights"),
    (["--smoke", "--batch=1000000000000"], "argument --batch: t5_1_1_tiny nondp at 32/8 tokens"),
    (["--smoke", "--large_batch=1000000000000"], "argument --large_batch: "),
    (["--smoke", "--inputs=100000000"], "argument --inputs/--targets: "),
])
def test_bad_flags_are_one_line_before_any_work(flags, message, tmp_path, capsys):
  line = _refused([f"--out={tmp_path / 'out'}", *flags], capsys)
  assert message in line, line
  assert not (tmp_path / "out").exists()


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="cuDNN's attention runs on a GPU")
def test_cudnn_attention_off_a_gpu_is_refused_as_train_refuses_it(tmp_path, capsys):
  line = _refused([f"--out={tmp_path / 'out'}", "--attention_variants=xla,cudnn"], capsys)
  assert "argument --attention_variants: T5Config.attention 'cudnn'" in line and "needs a GPU" in line
  assert not (tmp_path / "out").exists()


def test_an_out_that_cannot_be_written_is_refused(tmp_path, capsys, read_only):
  (tmp_path / "a_file").write_text("kept")
  assert "'%s' cannot be written: Not a directory" % (tmp_path / "a_file") in _refused(
      [f"--out={tmp_path / 'a_file'}"], capsys)
  assert "cannot be written: Not a directory" in _refused([f"--out={tmp_path / 'a_file' / 'out'}"], capsys)
  assert "argument --cache_dir:" in _refused([f"--out={tmp_path / 'out'}", f"--cache_dir={tmp_path / 'a_file'}"],
                                             capsys)
  (tmp_path / "ro").mkdir()
  read_only(tmp_path / "ro")
  assert "argument --out:" in _refused([f"--out={tmp_path / 'ro' / 'out'}"], capsys)
  assert sorted(os.listdir(tmp_path)) == ["a_file", "ro"] and not os.listdir(tmp_path / "ro")
  assert (tmp_path / "a_file").read_text() == "kept"


def test_bad_flags_from_the_command_line(tmp_path):
  """The script as run: one line on stderr, exit status 2, nothing under --out (no JAX work)."""
  (tmp_path / "a_file").write_text("")
  env = dict(os.environ, PYTHONPATH=ROOT)
  for flags in (["--budget_s=inf"], ["--methods=fast"], ["--presets="]):
    proc = subprocess.run([sys.executable, SCRIPT, f"--out={tmp_path / 'out'}", *flags], capture_output=True,
                          text=True, env=env, timeout=120, check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
  assert sorted(os.listdir(tmp_path)) == ["a_file"]


def test_smoke_changes_only_the_defaults():
  script = _script()
  args = script.parse_args(["--smoke", "--steps=5", "--batch=2", "--large_batch=0", "--presets=t5_1_0_tiny",
                            "--train_steps=0", "--out=/tmp"])
  assert (args.steps, args.batch, args.large_batch, args.presets, args.train_steps) == (5, 2, 0, ["t5_1_0_tiny"], 0)
  assert (args.inputs, args.targets) == (32, 8)  # not given: the smoke run's
  args = script.parse_args(["--smoke", "--out=/tmp"])
  assert {k: getattr(args, k) for k in script.SMOKE} == script.SMOKE
  args = script.parse_args(["--out=/tmp"])
  assert {k: getattr(args, k) for k in script.DEFAULTS} == script.DEFAULTS


def test_a_failed_case_makes_the_exit_status_1_after_the_summary(tmp_path, monkeypatch, capsys, jax_cache_config):
  del jax_cache_config
  script = _script()

  def fail(log, args, preset, batch_size, method, peak, attention=None, profile_dir=None):
    raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")

  monkeypatch.setattr(script, "run_case", fail)
  monkeypatch.chdir(ROOT)  # main changes to the checkout: restored
  rc = script.main([f"--out={tmp_path}", "--smoke", "--compile_only", "--no_max_batch", "--large_batch=0",
                    "--methods=nondp,ghost", "--attention_variants=", "--budget_s=120"])
  captured = capsys.readouterr()
  assert rc == 1
  assert "2 case(s) failed (t5_1_1_tiny 32/8 b4 nondp; t5_1_1_tiny 32/8 b4 ghost)" in captured.err
  summary = (tmp_path / "accelerator_check.md").read_text()
  assert "RESOURCE_EXHAUSTED" in summary and summary in captured.out
  assert step_profile.read_phases(str(tmp_path / "phases.jsonl"))[-1]["phase"] == "done"
