"""The one table of Gin names: what .gin files may use, what each configures, and which stages use it.

Each name maps to "module:attribute" of the class or function it configures and to the stage
entries that use it; `gin_utils.parse(..., entry=NAME)` imports and registers only the names of
that entry, so that `private-t5 info` does not import the trainer. `CONFIGURABLES`,
`STAGE_CONFIGURABLES` and `ENTRIES` are views of `GIN_TABLE`.
"""

# The one Gin table: each name .gin files may use -> ("module:attribute" of the class or
# function it configures, the stage entries whose `parse(..., entry=...)` registers it).
# The entries are the names listed as users (each lists itself); `CONFIGURABLES`,
# `STAGE_CONFIGURABLES` and `ENTRIES` below are views of this table, never edited by hand.
_MODEL_USERS = ("T5Config", "train", "just_fine_tune_twice", "train_adaptive", "run_memorization", "evaluate", "run_study",
                "run_utility_study")
_TRAINING_USERS = ("train", "just_fine_tune_twice", "train_adaptive", "run_study", "run_utility_study")
GIN_TABLE = {
    # models
    "T5Config": ("private_t5.models.config:T5Config", _MODEL_USERS),
    # training (`private-t5 train`, and the runs built on it)
    "train": ("private_t5.train.main:train", _TRAINING_USERS),
    "DPConfig": ("private_t5.dp.config:DPConfig", _TRAINING_USERS),
    "LoraConfig": ("private_t5.models.lora:LoraConfig", ("train",)),
    "make_source": ("private_t5.data.source:make_source", _TRAINING_USERS),
    "make_glue_source": ("private_t5.data.glue_tasks:make_glue_source", _TRAINING_USERS),
    # the task a fine-tuning or evaluation run reads: TASK_MODULE imported, TASK_DIR registered
    "glue_task": ("private_t5.data.task_dir:task_name", _TRAINING_USERS + ("evaluate",)),
    "make_seqio_source": ("private_t5.data.seqio_store:make_seqio_source", _TRAINING_USERS),
    "seqio_vocab_path": ("private_t5.data.seqio_lookup:seqio_vocab_path", _TRAINING_USERS),
    "finetune_vocab_path": ("private_t5.train.initial_checkpoint:finetune_vocab_path", _TRAINING_USERS),
    "adafactor": ("private_t5.train.optimizers:adafactor", _TRAINING_USERS),
    "rsqrt_schedule": ("private_t5.train.optimizers:rsqrt_schedule", _TRAINING_USERS),
    "constant_schedule": ("private_t5.train.optimizers:constant_schedule", _TRAINING_USERS),
    "linear_warmup_schedule": ("private_t5.train.optimizers:linear_warmup_schedule", _TRAINING_USERS),
    # selective DP
    "just_fine_tune_twice": ("private_t5.selective.jft:just_fine_tune_twice", ("just_fine_tune_twice",)),
    "train_adaptive": ("private_t5.selective.adaptive_train:train_adaptive", ("train_adaptive",)),
    # evaluation
    "run_memorization": ("private_t5.eval.memorization_run:run_memorization", ("run_memorization",)),
    "SplitConfig": ("private_t5.eval.split_types:SplitConfig", ("run_memorization", "run_study")),
    "evaluate": ("private_t5.eval.glue_eval:evaluate", ("evaluate",)),
    # tokenizer
    "train_dp_vocabulary": ("private_t5.tokenizer.dp_spm:train_dp_vocabulary", ("train_dp_vocabulary",)),
    # benchmarks
    "benchmark": ("private_t5.experiments.benchmark:benchmark", ("benchmark",)),
    # the end-to-end study
    "run_study": ("private_t5.experiments.study:run_study", ("run_study",)),
    "run_utility_study": ("private_t5.experiments.study_utility:run_utility_study", ("run_utility_study",)),
}
# Views of GIN_TABLE. Gin name -> "module:attribute".
CONFIGURABLES = {name: target for name, (target, _) in GIN_TABLE.items()}
# The stage entries (the names a `parse(..., entry=...)` may give), in the table's order.
ENTRIES = tuple(dict.fromkeys(user for _, users in GIN_TABLE.values() for user in users))
# Entry -> the names its configs may use (registered by `parse(..., entry=...)`).
STAGE_CONFIGURABLES = {entry: tuple(name for name, (_, users) in GIN_TABLE.items() if entry in users)
                       for entry in ENTRIES}
