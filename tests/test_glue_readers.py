"""Raw GLUE rows (glue_readers) on ../shared/data/glue_like and on official-layout files."""
import os

import pytest

from private_t5.data import glue_readers
from private_t5.errors import ConfigError, DataError
from conftest import expected


def _write(path, text, bom=False):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w", encoding="utf-8-sig" if bom else "utf-8") as f:
    f.write(text)


def test_glue_like_tasks(shared_data):
  root = os.path.join(shared_data, "glue_like")
  sst = glue_readers.load_glue("rotten_tomatoes", "train", data_dir=root)
  assert len(sst) == expected(10028, 3000)
  assert sst[0] == {"sentence": "A three-hour cinema master class.", "label": 1, "idx": 0}
  assert {ex["label"] for ex in sst} == {0, 1}
  mrpc = glue_readers.load_glue(os.path.join(root, "bible_paraphrase"), "validation")
  assert len(mrpc) == expected(1232, 120) and {"sentence1", "sentence2", "label", "idx"} <= set(mrpc[0])
  assert mrpc[0]["label"] in (0, 1) and mrpc[0]["#1 ID"]
  bbc = glue_readers.load_glue("bbc_news", "test", data_dir=root, max_examples=10)
  assert len(bbc) == 10 and {ex["label"] for ex in bbc} <= {"business", "entertainment", "politics", "sports", "tech"}


def test_official_layouts(tmp_path):
  root = str(tmp_path)
  _write(f"{root}/CoLA/train.tsv", "gj04\t1\t\tOur friends won't buy this analysis.\n"
                                   "gj04\t0\t*\tOne more pseudo generalization and I'm giving up.\n")
  _write(f"{root}/CoLA/test.tsv", "index\tsentence\n0\tBill whistled past the house.\n")
  _write(f"{root}/SST-2/dev.tsv", "sentence\tlabel\nit 's a charming and often affecting journey . \t1\n")
  _write(f"{root}/MRPC/msr_paraphrase_train.txt",
         "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t702876\t702977\tAmrozi accused his brother .\t"
         "Referring to him as only \" the witness \" , Amrozi accused his brother .\n", bom=True)
  _write(f"{root}/MNLI/dev_matched.tsv",
         "index\tpromptID\tpairID\tgenre\tsentence1\tsentence2\tlabel1\tgold_label\n"
         "0\t1\t1e\tgov\tThe new rights are nice enough\tEveryone really likes the newest benefits\tneutral\tneutral\n")
  _write(f"{root}/STS-B/train.tsv", "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\t"
         "sentence2\tscore\n0\tmain-captions\tMSRvid\t2012test\t0001\tnone\tnone\tA plane is taking off.\t"
         "An air plane is taking off.\t5.000\n")
  _write(f"{root}/QNLI/train.tsv", "index\tquestion\tsentence\tlabel\n0\tWhen?\tIn 1990.\tnot_entailment\n")
  assert glue_readers.load_glue("cola", "train", data_dir=root)[1] == {
      "sentence": "One more pseudo generalization and I'm giving up.", "label": 0, "idx": 1}
  assert glue_readers.load_glue("CoLA", "test", data_dir=root) == [
      {"sentence": "Bill whistled past the house.", "label": -1, "idx": 0}]
  assert glue_readers.load_glue("SST-2", "validation", data_dir=root)[0]["label"] == 1
  mrpc = glue_readers.load_glue(f"{root}/MRPC", "train")[0]
  assert mrpc["label"] == 1 and mrpc["sentence2"].startswith('Referring to him as only " the witness "')
  assert glue_readers.load_glue("mnli", "validation_matched", data_dir=root)[0] == {
      "premise": "The new rights are nice enough", "hypothesis": "Everyone really likes the newest benefits",
      "label": 1, "idx": 0}
  assert glue_readers.load_glue("mnli", "validation", data_dir=root)[0]["label"] == 1
  assert glue_readers.load_glue("stsb", "train", data_dir=root)[0]["label"] == 5.0
  assert glue_readers.load_glue("qnli", "train", data_dir=root)[0]["label"] == 1


def test_bad_glue_input(tmp_path, shared_data):
  root = str(tmp_path)
  with pytest.raises(DataError, match="GLUE task folder not found"):
    glue_readers.load_glue("sst2", data_dir=root)
  _write(f"{root}/RTE/train.tsv", "index\tsentence1\tsentence2\tlabel\n0\ta\tb\tmaybe\n")
  with pytest.raises(DataError, match=r"train.tsv: line 2: invalid label 'maybe'"):
    glue_readers.load_glue("rte", data_dir=root)
  _write(f"{root}/QQP/train.tsv", "id\tquestion1\tquestion2\n0\ta\tb\n")
  with pytest.raises(DataError, match="no column 'is_duplicate'"):
    glue_readers.load_glue("qqp", data_dir=root)
  with pytest.raises(DataError, match="no file for split 'test'"):
    glue_readers.load_glue("rte", "test", data_dir=root)
  with pytest.raises(ConfigError, match="split must be one of"):
    glue_readers.load_glue("rte", "dev", data_dir=root)
  with pytest.raises(DataError, match="not prepared"):
    glue_readers.load_glue("tfds:glue/sst2", "validation", data_dir=root)


def test_a_ragged_row_is_named_as_such(tmp_path):
  """A row with another number of cells than the header is a ragged row (line, both counts), not a bad label."""
  root = str(tmp_path)
  _write(f"{root}/RTE/train.tsv", "index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n1\ta\tentailment\n")
  with pytest.raises(DataError, match=r"train.tsv: line 3: ragged row: 3 tab-separated columns, the header has 4$"):
    glue_readers.load_glue("rte", data_dir=root)
  _write(f"{root}/mine/train.tsv", "sentence\tlabel\nfine\tx\na\ttab inside\ty\n")
  with pytest.raises(DataError, match=r"train.tsv: line 3: ragged row: 3 tab-separated columns, the header has 2$"):
    glue_readers.load_glue(f"{root}/mine")
  _write(f"{root}/CoLA/train.tsv", "gj04\t1\t\tFine.\ngj04\t0\n")  # no header
  with pytest.raises(DataError, match=r"train.tsv: line 2: ragged row: 2 tab-separated columns, expected at least 4$"):
    glue_readers.load_glue("cola", data_dir=root)
