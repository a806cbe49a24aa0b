#!/usr/bin/env python
"""Full DP fine-tuning vs DP-LoRA at two ranks, side by side, from one pretrained checkpoint.

  python benchmarks/bench_lora.py --output=/tmp/bench_lora.json

1. Public side (in-domain public data, as in Kerrigan et al. 2020): the first --public_rows
   rows of rotten_tomatoes' training file (the SST-2 analogue) are declared public; a
   SentencePiece vocabulary on them and on the bbc_news and bible_paraphrase training text (so
   the vocabulary is public), and a tiny T5 trained non-privately on them: the "pretrained"
   checkpoint (its validation accuracy is the first row of the table).
2. Private side: the other rows of the training file, fine-tuned with DP-Adafactor at the same
   target ε, δ, expected batch size, steps and clip norm by (a) full fine-tuning, (b) DP-LoRA on
   query and value at each of --ranks, through `train()` (untruncated Poisson sampling,
   microbatches, ghost clipping) as `private-t5 train` runs it.
3. For each: validation accuracy (1366 examples on ../shared/data; 95% normal-approximation
   interval), trainable parameters, step time (median over the run's steps after the first),
   compiled peak memory of one microbatch step with ghost and with vmap clipping and its step
   time on a fixed batch, and the size of the final checkpoint on disk.

Printed as a markdown table and written as JSON (--output).
"""
import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

PUBLIC_TASKS = ("bbc_news", "bible_paraphrase")
TASK = "rotten_tomatoes"
PUBLIC_TASK, PRIVATE_TASK = "rt_public", "rt_private"
LABEL_LINE = ("positive negative business entertainment politics sports tech equivalent not_equivalent "
              "sentence: sentence1: sentence2: rotten_tomatoes bbc_news bible_paraphrase")


def _log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def split_task(work: str, public_rows: int) -> None:
  """Registers rt_public (the first `public_rows` training rows) and rt_private (the others, and
  the validation split), both formatted as rotten_tomatoes."""
  from private_t5.data import glue_tasks  # pylint: disable=g-import-not-at-top
  from private_t5.data import glue_registry  # pylint: disable=g-import-not-at-top
  with open(os.path.join(glue_registry.DEFAULT_GLUE_LIKE_DIR, TASK, "train.tsv")) as f:
    header, *rows = f.readlines()
  with open(os.path.join(glue_registry.DEFAULT_GLUE_LIKE_DIR, TASK, "validation.tsv")) as f:
    validation = f.read()
  for name, part in ((PUBLIC_TASK, rows[:public_rows]), (PRIVATE_TASK, rows[public_rows:])):
    os.makedirs(os.path.join(work, name), exist_ok=True)
    with open(os.path.join(work, name, "train.tsv"), "w") as f:
      f.writelines([header] + part)
    with open(os.path.join(work, name, "validation.tsv"), "w") as f:
      f.write(validation)
    glue_registry.register_local_tsv_task(name, os.path.join(work, name), ["sentence"], "label",
                                       ["negative", "positive"], metric="accuracy", benchmark_name=TASK)


def public_vocab(path: str, vocab_size: int) -> str:
  """A SentencePiece model on the public training text and the label words."""
  from private_t5.tokenizer import spm  # pylint: disable=g-import-not-at-top
  from private_t5 import vocabulary  # pylint: disable=g-import-not-at-top
  from private_t5.data import glue_rows  # pylint: disable=g-import-not-at-top
  lines = []
  for task in PUBLIC_TASKS + (PUBLIC_TASK,):
    texts, _ = glue_rows.load_rows(task, "train", None, None)[0]
    for column in texts.values():
      lines += [t[:2000] for t in column[:6000]]
  lines += [LABEL_LINE] * 1000
  return spm.train_from_sentences(lines, path, vocab_size)


def _interval(accuracy: float, n: int):
  half = 1.96 * math.sqrt(max(accuracy * (1 - accuracy), 1e-12) / n)
  return accuracy - half, accuracy + half


def _dir_bytes(path: str) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def clipping_costs(config, lora, base, dp_setup, batch, lr, repeats: int = 5) -> dict:
  """Compiled peak memory and median step time (wall and CPU seconds) of one microbatch step,
  ghost vs vmap, their timed calls interleaved so that both see the same machine load."""
  import jax  # pylint: disable=g-import-not-at-top
  from private_t5.dp import mechanism  # pylint: disable=g-import-not-at-top
  from private_t5.dp.privacy_params import NoisySum  # pylint: disable=g-import-not-at-top
  from private_t5.experiments.benchmark_case import compiled_memory  # pylint: disable=g-import-not-at-top
  from private_t5.train import optimizers  # pylint: disable=g-import-not-at-top
  from private_t5.models import sharding  # pylint: disable=g-import-not-at-top
  from private_t5.train.trainer import Trainer, make_loss_fn  # pylint: disable=g-import-not-at-top
  mesh = sharding.create_mesh((1, 1), jax.devices()[:1])
  keys = (jax.random.PRNGKey(1), jax.random.PRNGKey(2))
  steps, out = {}, {}
  for method in ("ghost", "vmap"):
    aggregator = mechanism.AGGREGATORS[method](
        make_loss_fn(config, 0.0, lora),
        NoisySum(dp_setup["clip_norm"], dp_setup["noise_multiplier"], dp_setup["expected_batch_size"]))
    trainer = Trainer(config, aggregator, optimizers.adafactor(lr), mesh, lora=lora,
                      base_params=base if lora is not None else None)
    state = trainer.init_state(jax.random.PRNGKey(0), None if lora is not None else base)
    start = time.perf_counter()
    compiled = trainer.compile_train_step(state, batch, *keys)
    out[method] = {"peak_bytes": compiled_memory(compiled).get("peak_bytes"),
                   "compile_s": time.perf_counter() - start, "wall": [], "cpu": []}
    steps[method] = [compiled, state, trainer.place_batch(batch)]
  for repeat in range(repeats + 1):  # the first round warms up
    for method, (compiled, state, placed) in steps.items():
      t0, c0 = time.perf_counter(), time.process_time()
      state, metrics = compiled(state, placed, *keys)
      jax.block_until_ready((state, metrics))
      steps[method][1] = state
      if repeat:
        out[method]["wall"].append(time.perf_counter() - t0)
        out[method]["cpu"].append(time.process_time() - c0)
  for method, entry in out.items():
    entry["step_s"], entry["step_cpu_s"] = statistics.median(entry.pop("wall")), statistics.median(entry.pop("cpu"))
    _log(f"[bench]   {method}: peak {entry['peak_bytes'] / 2**20:.1f} MiB, {entry['step_s'] * 1000:.0f} ms "
         f"({entry['step_cpu_s'] * 1000:.0f} CPU ms) / {len(batch['example_weight'])}-row step")
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="t5_1_0_tiny")
  parser.add_argument("--vocab_size", type=int, default=2000)
  parser.add_argument("--inputs_length", type=int, default=64)
  parser.add_argument("--targets_length", type=int, default=4)
  parser.add_argument("--public_rows", type=int, default=2000)
  parser.add_argument("--pretrain_steps", type=int, default=300)
  parser.add_argument("--steps", type=int, default=80, help="DP fine-tuning steps of every run")
  parser.add_argument("--batch_size", type=int, default=64, help="expected Poisson batch (q N)")
  parser.add_argument("--microbatch_size", type=int, default=32)
  parser.add_argument("--epsilon", type=float, default=8.0)
  parser.add_argument("--clip_norm", type=float, default=1.0)
  parser.add_argument("--ranks", default="4,16")
  parser.add_argument("--lr_full", type=float, default=1e-3, help="configs/runs/finetune_dp.gin's rate")
  parser.add_argument("--lr_lora", type=float, default=3e-3, help="configs/runs/finetune_lora_dp.gin's rate")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--work_dir", default=None)
  parser.add_argument("--output", default=None)
  args = parser.parse_args(argv)

  import jax  # pylint: disable=g-import-not-at-top
  from private_t5.models import config as config_lib  # pylint: disable=g-import-not-at-top
  from private_t5.data import glue_tasks  # pylint: disable=g-import-not-at-top
  from private_t5.data import glue_registry  # pylint: disable=g-import-not-at-top
  from private_t5.dp.config import DPConfig  # pylint: disable=g-import-not-at-top
  from private_t5.eval import glue_eval  # pylint: disable=g-import-not-at-top
  from private_t5.models import lora as lora_lib, run_dir  # pylint: disable=g-import-not-at-top
  from private_t5.models import checkpoint_read  # pylint: disable=g-import-not-at-top
  from private_t5.tokenizer import spm  # pylint: disable=g-import-not-at-top
  from private_t5 import vocabulary  # pylint: disable=g-import-not-at-top
  from private_t5.train import main as train_main, optimizers  # pylint: disable=g-import-not-at-top

  started = time.perf_counter()
  work = args.work_dir or tempfile.mkdtemp(prefix="bench_lora_")
  lengths = {"inputs": args.inputs_length, "targets": args.targets_length}
  split_task(work, args.public_rows)
  vocab = public_vocab(os.path.join(work, "public.model"), args.vocab_size)
  ids = vocabulary.load_vocabulary(vocab).vocab_size
  config = config_lib.load_preset(args.preset, vocab_size=-(-ids // 128) * 128, dropout_rate=0.0)
  quiet = lambda _: None

  pretrained = os.path.join(work, "pretrained")
  _log(f"[bench] public pre-training: {args.preset} on {PUBLIC_TASK}, {args.pretrain_steps} steps")
  train_main.train(model_config=config, train_data=glue_tasks.GlueSource(PUBLIC_TASK, "train", vocab, lengths,
                                                                          vocab_size=config.vocab_size),
                   model_dir=pretrained, train_steps=args.pretrain_steps, batch_size=32,
                   learning_rate=optimizers.constant_schedule(1e-2), vocab_path=vocab,
                   checkpoint_every=args.pretrain_steps, log_every=100, mesh_shape=(1, 1),
                   insecure_deterministic_seed=args.seed, log=quiet)
  base, _, _ = checkpoint_read.restore_for_inference(pretrained)
  base = jax.tree.map(lambda x: x.astype("float32"), base)

  def accuracy_of(params):
    result = glue_eval.evaluate_params(params, config, PRIVATE_TASK, vocab, lengths, batch_size=256,
                                       progress=False)["tasks"][PRIVATE_TASK]
    accuracy = result["metrics"]["accuracy"] / 100.0
    return accuracy, result["num_examples"], result["majority_baseline"]["metrics"]["accuracy"] / 100.0

  accuracy, n, majority = accuracy_of(base)
  pretrained_row = {"run": "pretrained (public rows only)", "validation_accuracy": accuracy,
                    "validation_ci95": _interval(accuracy, n), "validation_examples": n, "majority_accuracy": majority}
  _log(f"[bench] pretrained: accuracy {accuracy:.3f} (majority {majority:.3f})")

  train = glue_tasks.GlueSource(PRIVATE_TASK, "train", vocab, lengths, vocab_size=config.vocab_size)
  runs = [("full", None, args.lr_full)] + [
      (f"lora_r{r}", lora_lib.LoraConfig(rank=int(r), alpha=2.0 * int(r)), args.lr_lora)
      for r in args.ranks.split(",")]
  rows = []
  for name, lora, lr in runs:
    model_dir = os.path.join(work, name)
    dp = DPConfig(clip_norm=args.clip_norm, target_epsilon=args.epsilon, expected_batch_size=args.batch_size,
                  vocab_is_public=True)
    _log(f"[bench] {name}: DP fine-tuning on {PRIVATE_TASK} ({train.num_examples} examples), "
         f"{args.steps} steps, lr {lr:g}")
    summary = train_main.train(
        model_config=config, train_data=train, model_dir=model_dir, train_steps=args.steps,
        batch_size=args.microbatch_size, microbatch_size=args.microbatch_size, clipping_method="ghost",
        learning_rate=optimizers.constant_schedule(lr), dp=dp, vocab_path=vocab, checkpoint_every=args.steps,
        log_every=args.steps, mesh_shape=(1, 1), initial_checkpoint=pretrained, lora=lora,
        insecure_deterministic_seed=args.seed + 1, log=quiet)
    accuracy, n, majority = accuracy_of(checkpoint_read.restore_for_inference(model_dir)[0])
    batch = train.get_batch(list(range(args.microbatch_size)), 0, args.microbatch_size)
    batch = {k: v for k, v in batch.items() if k not in ("example_index", "is_padding")}
    setup = {"clip_norm": args.clip_norm, "noise_multiplier": summary["noise_multiplier"],
             "expected_batch_size": float(args.batch_size)}
    row = {
        "run": name, "rank": None if lora is None else lora.rank, "learning_rate": lr,
        "trainable_params": summary["num_params"], "epsilon": summary["epsilon"], "delta": summary["delta"],
        "noise_multiplier": summary["noise_multiplier"], "validation_accuracy": accuracy,
        "validation_ci95": _interval(accuracy, n), "validation_examples": n,
        "majority_accuracy": majority,
        "step_s": 1.0 / summary["steps_per_second"] if summary.get("steps_per_second") else None,
        "checkpoint_bytes": _dir_bytes(os.path.join(run_dir.checkpoints_dir(model_dir), str(args.steps))),
        "clipping": clipping_costs(config, lora, base, setup, batch, lr),
    }
    rows.append(row)
    _log(f"[bench] {name}: accuracy {accuracy:.3f} [{row['validation_ci95'][0]:.3f}, {row['validation_ci95'][1]:.3f}], "
         f"{row['trainable_params']} trainable, ε = {row['epsilon']:.3g}")

  report = {"preset": args.preset, "model_config": config.__dict__, "feature_lengths": lengths,
            "public_rows": args.public_rows, "private_rows": train.num_examples, "pretrain_steps": args.pretrain_steps,
            "pretrained": pretrained_row, "steps": args.steps, "expected_batch_size": args.batch_size,
            "microbatch_size": args.microbatch_size, "target_epsilon": args.epsilon, "clip_norm": args.clip_norm,
            "devices": f"{len(jax.devices())} {jax.devices()[0].platform}", "total_s": time.perf_counter() - started,
            "runs": rows}
  print(markdown(report))
  if args.output:
    with open(args.output, "w") as f:
      json.dump(report, f, indent=1)
  return 0


def markdown(report: dict) -> str:
  mib = lambda b: f"{b / 2**20:.1f}"
  lines = [f"{report['preset']}, {report['feature_lengths']}, {report['steps']} DP steps, expected batch "
           f"{report['expected_batch_size']} (microbatches of {report['microbatch_size']}), target ε "
           f"{report['target_epsilon']}, C = {report['clip_norm']}; {report['devices']}; "
           f"{report['total_s'] / 60:.1f} min in all", "",
           "| run | trainable params | val. accuracy [95% CI] | step (s) | ckpt (MiB) | peak ghost / vmap (MiB) "
           "| microbatch step ghost / vmap (ms) | (CPU ms) |", "|---|---|---|---|---|---|---|---|"]
  for r in report["runs"]:
    lo, hi = r["validation_ci95"]
    c = r["clipping"]
    lines.append(f"| {r['run']} | {r['trainable_params']:,} | {r['validation_accuracy']:.3f} [{lo:.3f}, {hi:.3f}] "
                 f"| {r['step_s']:.2f} | {mib(r['checkpoint_bytes'])} | {mib(c['ghost']['peak_bytes'])} / "
                 f"{mib(c['vmap']['peak_bytes'])} | {c['ghost']['step_s'] * 1000:.0f} / {c['vmap']['step_s'] * 1000:.0f} "
                 f"| {c['ghost']['step_cpu_s'] * 1000:.0f} / {c['vmap']['step_cpu_s'] * 1000:.0f} |")
  p = report["pretrained"]
  lines.append(f"\npretrained on the {report['public_rows']} public rows only: {p['validation_accuracy']:.3f} "
               f"[{p['validation_ci95'][0]:.3f}, {p['validation_ci95'][1]:.3f}]; DP fine-tuning on "
               f"{report['private_rows']} private rows; majority class: {report['runs'][0]['majority_accuracy']:.3f}; σ = "
               f"{report['runs'][0]['noise_multiplier']:.3g}, ε = {report['runs'][0]['epsilon']:.3g}")
  return "\n".join(lines)


if __name__ == "__main__":
  sys.exit(main())
