"""private_t5: differentially private pretraining and fine-tuning of T5 in JAX."""
import os

from setuptools import find_namespace_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _requirements_section(extra: str):
  """The lines of requirements.txt after its `# extra: <extra>` marker, up to the next comment."""
  out, inside = [], False
  with open(os.path.join(HERE, "requirements.txt"), encoding="utf-8") as f:
    for line in f:
      line = line.strip()
      if line.startswith("#"):
        inside = line == f"# extra: {extra}"
      elif inside and line:
        out.append(line)
  return out


# Version ranges around the stack that requirements.txt pins and the tests run on (a range
# holds each pin; tests/test_packaging.py checks it). Training, benchmarking, memorization
# and GLUE evaluation on local corpora need no TensorFlow; `tfds:` corpora, GLUE from TFDS
# and the TensorFlow-based interop take the `tf` extra.
# jax 0.11 is what current CUDA images ship (the GPU check ran on 0.11.2); the tests run on the pin.
JAX = "jax>=0.10.2,<0.12"
INSTALL_REQUIRES = [
    JAX,
    "flax>=0.12.8,<0.13",
    "optax>=0.2.8,<0.3",
    "orbax-checkpoint>=0.12.8,<0.13",
    "sentencepiece>=0.2.3,<0.3",
    "protobuf>=7,<8",  # sentencepiece 0.2.3's model protocol buffers are protobuf-7 generated code
    "dp-accounting>=0.6,<0.7",
    "jax-privacy>=2.0,<2.1",  # correlated noise: banded / BLT strategies, their accounting (imported lazily)
    "absl-py>=2",
    "gin-config>=0.5,<0.6",
    "numpy>=2.4,<3",
    "scipy>=1.17,<2",
    "scikit-learn>=1.6,<2",
    "datasketch>=2,<3",
    "editdistance>=0.8,<1",
    "matplotlib>=3.11,<4",
    "safetensors>=0.8,<1",
    "tqdm>=4,<5",
    "toolz>=1,<2",  # partition_all: texts streamed a chunk at a time
]
EXTRAS_REQUIRE = {
    # JAX for an accelerator (the default `jax` runs on the CPU).
    "cuda12": [JAX.replace("jax", "jax[cuda12]", 1)],
    "cuda13": [JAX.replace("jax", "jax[cuda13]", 1)],
    "tpu": [JAX.replace("jax", "jax[tpu]", 1)],
    # Corpus-scale stages on Apache Beam: its runtime needs. apache-beam itself declares
    # protobuf<7, which sentencepiece's generated code cannot run on, so it goes in after, without
    # its declared dependencies: `pip install --no-deps apache-beam==2.77.0` (it runs on protobuf 7).
    "beam": _requirements_section("beam"),
    # Beam's DaskRunner (`--runner=DaskRunner`): the corpus stages on a dask.distributed cluster
    # (docs/scaling.md). Ranges around the pins of requirements-test.txt, which the tests run on.
    "dask": ["dask>=2026.8.0,<2027", "distributed>=2026.8.0,<2027"],
    # Hugging Face: load an exported checkpoint in `transformers` (PyTorch) and compare.
    "hf": ["torch>=2.13,<3", "transformers>=5.23,<6"],
    # TensorFlow: `tfds:` corpora and GLUE from TensorFlow Datasets.
    "tf": ["tensorflow>=2.21,<2.22", "tensorflow-datasets>=4.9.10,<5"],
    # seqio: train on a registered seqio Task or Mixture (`--gin.MIXTURE_OR_TASK_NAME`, docs/data.md);
    # t5 for its preprocessors (span corruption). t5 declares nightly builds of seqio and TFDS and
    # mesh-tensorflow; scripts/install.sh installs t5 alone with --no-deps instead.
    "seqio": ["seqio>=0.0.20,<0.1", "t5>=0.9.4,<0.10", "tensorflow>=2.21,<2.22",
              "tensorflow-text>=2.21,<2.22", "tensorflow-datasets>=4.9.10,<5"],
}

setup(
    name="private_t5",
    version="0.1.0",
    description="Differentially private pretraining and fine-tuning of T5 (JAX/Flax)",
    # The data folders (private_t5/configs/*, private_t5/data/glue_like/*: no __init__.py) are
    # namespace packages that hold only data: declared as packages, their files ship as package data.
    packages=find_namespace_packages(include=["private_t5", "private_t5.*"], exclude=["*.__pycache__"]),
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
    # The Gin configs and the small built-in GLUE-layout tasks (rotten_tomatoes, bible_paraphrase,
    # bbc_news) ship in the wheel.
    package_data={"private_t5.configs": ["*/*.gin"], "private_t5.data.glue_like": ["*/*.tsv"]},
    include_package_data=True,
    entry_points={"console_scripts": ["private-t5=private_t5.stages.cli:main"]},
)
