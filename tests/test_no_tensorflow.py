"""`private-t5` train, evaluate and memorization on local data in a Python that has no TensorFlow
(nor seqio, t5, tensorboard): scripts/no_tensorflow hides them as if not installed.

`bench` builds its steps from the modules `train` uses (models, dp, train.trainer) on random
batches; a tiny-preset bench step compiles for ~20 s on two busy cores, more than this test may
take, so here its stage module is only imported; benchmarks/bench_startup.py runs it without
TensorFlow."""
import json
import os
import subprocess
import sys

from private_t5.train import metrics

from micro_run import MICRO_TRAIN_ARGS, fortunes_corpus_and_vocab, split_corpus

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HIDE_TENSORFLOW = os.path.join(PROJECT_ROOT, "scripts", "no_tensorflow")

# Runs each stage through the dispatcher in this one process, then reports what was imported.
SCRIPT = """
import importlib.util, json, sys, time
assert importlib.util.find_spec("tensorflow") is None
import private_t5.stages.bench  # its steps' modules are train's, imported by the train stage
from private_t5.stages import cli
codes = []
for args in json.loads(sys.argv[1]):
  start = time.time()
  codes.append(cli.main(args))
  print(args[0], "took", round(time.time() - start, 1), "s", file=sys.stderr)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("tensorflow", "seqio", "t5", "tensorboard"))
print(json.dumps({"codes": codes, "imported": heavy}))
"""


def test_stages_run_without_tensorflow(shared_data, tmp_path):
  corpus, vocab = fortunes_corpus_and_vocab(shared_data, str(tmp_path))
  train_corpus, valid_corpus = split_corpus(corpus, str(tmp_path), 300, 40)
  model_dir = tmp_path / "model"
  stages = [
      ["train", "--gin_file=configs/experiments/quickstart.gin", f"--gin.MODEL_DIR={model_dir}",
       f"--gin.CORPUS={train_corpus}", f"--gin.VOCAB_PATH={vocab}", "--gin.TRAIN_STEPS=2",
       f"--gin.DATA_CACHE_DIR={tmp_path / 'cache'}", *MICRO_TRAIN_ARGS],
      ["evaluate", "--gin_file=configs/runs/eval.gin", f"--gin.MODEL_DIR={model_dir}",
       "--gin.MIXTURE_OR_TASK_NAME=rotten_tomatoes", "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 8}",
       "--gin.evaluate.max_examples=8"],
      ["memorization", "--gin_file=configs/runs/memorization.gin", f"--gin.MODEL_DIR={model_dir}",
       f"--gin.TRAIN_CORPUS={train_corpus}", f"--gin.VALID_CORPUS={valid_corpus}",
       f"--gin.OUTPUT_DIR={tmp_path / 'memorization'}", "--gin.PROMPT_LENGTH=4", "--gin.GENERATION_LENGTH=4",
       "--gin.BATCH_SIZE=4", "--gin.MAX_EXAMPLES_PER_SPLIT=4", "--gin.SplitConfig.num_perm=900",
       "--gin.SplitConfig.num_bands=90", "--gin.SplitConfig.num_workers=1"],
  ]
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([HIDE_TENSORFLOW, PROJECT_ROOT]))
  done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(stages)], cwd=PROJECT_ROOT, env=env,
                        capture_output=True, text=True, timeout=300, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  result = json.loads(done.stdout.strip().splitlines()[-1])
  assert result == {"codes": [0, 0, 0], "imported": []}, done.stderr[-3000:]
  # The run's TensorBoard files, the reports and the benchmark are all there.
  assert [step for step, _ in metrics.read_scalars(str(model_dir / "tensorboard" / "train"))["nondp/loss"]] == [1, 2]
  assert json.loads((model_dir / "summary.json").read_text())["final_step"] == 2
  assert (tmp_path / "memorization" / "report.json").is_file()
