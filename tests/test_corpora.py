"""Corpus readers: every format, ids kept, blanks counted, bad input named."""
import gzip
import json
import os

import pytest

from private_t5.data import builtin_corpus
from private_t5.data import corpora
from private_t5 import documents
from private_t5.errors import ConfigError, DataError
from conftest import expected


def _ids_texts(docs):
  return [(d.id, d.text) for d in docs]


def test_txt_one_document_a_line(tmp_path):
  path = tmp_path / "lines.txt"
  path.write_bytes(b"first line\n\n   \nsecond line\r\nthird\n")
  docs, stats = corpora.read_corpus(str(path))
  assert _ids_texts(docs) == [("lines.txt:1", "first line"), ("lines.txt:4", "second line"), ("lines.txt:5", "third")]
  assert (stats.documents, stats.blank_skipped) == (3, 2)


def test_folder_one_document_a_file(tmp_path):
  (tmp_path / "sub").mkdir()
  (tmp_path / "b.txt").write_text("second\nfile")
  (tmp_path / "a.txt").write_text("first file")
  (tmp_path / "sub" / "c.txt").write_text("   \n")
  (tmp_path / "ignored.md").write_text("not text corpus")
  docs, stats = corpora.read_corpus(str(tmp_path))
  assert _ids_texts(docs) == [("a.txt", "first file"), ("b.txt", "second\nfile")]
  assert stats.blank_skipped == 1


def test_jsonl_gz_real_corpus(shared_data):
  docs, stats = corpora.read_corpus(os.path.join(shared_data, "pretrain/fortunes.jsonl.gz"))
  assert stats.documents == len(docs) == expected(15218, 2000)
  assert docs[0].id == "fortune/art/0" and "Bionic Dog" in docs[0].text
  assert len({d.id for d in docs}) == len(docs)
  assert stats.characters == sum(len(d.text) for d in docs)


def test_jsonl_ids_users_and_fallback_ids(tmp_path):
  path = tmp_path / "c.jsonl"
  path.write_text("\n".join([json.dumps({"id": "x", "body": "hello", "who": "ann"}),
                             json.dumps({"body": "world", "who": "bob"}),
                             json.dumps({"id": "z", "body": " ", "who": "bob"})]) + "\n")
  docs, stats = corpora.read_corpus(str(path), text_field="body", user_field="who")
  assert docs == [documents.Document("x", "hello", "ann"), documents.Document("c.jsonl:2", "world", "bob")]
  assert stats.blank_skipped == 1
  with pytest.raises(DataError, match=r"c.jsonl: line 1: no text field 'text'"):
    corpora.read_corpus(str(path))
  with pytest.raises(DataError, match="no user field 'owner'"):
    corpora.read_corpus(str(path), text_field="body", user_field="owner")


def test_tsv_with_header(shared_data):
  path = os.path.join(shared_data, "glue_like/bbc_news/validation.tsv")
  docs, stats = corpora.read_corpus(path, text_field="sentence", max_documents=5)
  assert len(docs) == 5 == stats.documents and docs[0].id == "validation.tsv:2"
  with pytest.raises(DataError, match=r"no text column 'text' \(columns: \['sentence', 'label'\]\)"):
    corpora.read_corpus(path)


def _truncated_gzip(path, text):
  """`text` gzip-compressed into `path`, cut in the middle of the compressed stream."""
  data = gzip.compress(text.encode("utf-8"))
  path.write_bytes(data[:len(data) // 2])
  return str(path)


@pytest.mark.parametrize("name,line", [("c.txt.gz", "words {i} and more words"),
                                       ("c.tsv.gz", "row {i}\twords {i} and more"),
                                       ("c.jsonl.gz", '{{"text": "words {i} and more"}}')],
                         ids=["txt", "tsv", "jsonl"])
def test_truncated_or_corrupt_gzip_is_one_error_naming_the_file(tmp_path, name, line):
  header = "id\ttext\n" if name.startswith("c.tsv") else ""
  text = header + "".join(line.format(i=i) + "\n" for i in range(3000))
  path = _truncated_gzip(tmp_path / name, text)
  with pytest.raises(DataError, match=rf"cannot read {path}: Compressed file ended before"):
    corpora.read_corpus(path)
  (tmp_path / name).write_bytes(b"not gzip data at all\n")
  with pytest.raises(DataError, match=rf"cannot read {path}: Not a gzipped file"):
    corpora.read_corpus(path)


def test_invalid_utf8_named_or_replaced(tmp_path):
  txt = tmp_path / "bad.txt"
  txt.write_bytes(b"good\nbad \xff byte\n")
  with pytest.raises(DataError, match=r"bad.txt: line 2: invalid UTF-8"):
    corpora.read_corpus(str(txt))
  docs, stats = corpora.read_corpus(str(txt), errors="replace")
  assert docs[1].text == "bad \ufffd byte" and stats.replaced_lines == 1
  gz = tmp_path / "bad.jsonl.gz"
  with gzip.open(gz, "wb") as f:
    f.write(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
  with pytest.raises(DataError, match=r"bad.jsonl.gz: line 2: invalid UTF-8"):
    corpora.read_corpus(str(gz))
  folder = tmp_path / "folder"
  folder.mkdir()
  (folder / "doc.txt").write_bytes(b"one\ntwo\nthree \xc3\x28\n")
  with pytest.raises(DataError, match=r"doc.txt: line 3: invalid UTF-8"):
    corpora.read_corpus(str(folder))
  with pytest.raises(ConfigError, match="errors must be one of"):
    corpora.read_corpus(str(txt), errors="ignore")


def test_missing_empty_and_malformed(tmp_path):
  with pytest.raises(DataError, match="corpus not found"):
    corpora.iter_documents(str(tmp_path / "nope.jsonl"))  # eager: fails before iterating
  blank = tmp_path / "blank.txt"
  blank.write_text("\n \n\t\n")
  with pytest.raises(DataError, match=r"is empty \(3 blank documents skipped\)"):
    corpora.read_corpus(str(blank))
  empty_dir = tmp_path / "empty_dir"
  empty_dir.mkdir()
  with pytest.raises(DataError, match="contains no .txt files"):
    corpora.read_corpus(str(empty_dir))
  broken = tmp_path / "broken.jsonl"
  broken.write_text('{"text": "ok"}\n{"text": \n')
  with pytest.raises(DataError, match=r"broken.jsonl: line 2: not valid JSON"):
    corpora.read_corpus(str(broken))
  other = tmp_path / "data.parquet"
  other.write_text("x")
  with pytest.raises(DataError, match="unsupported corpus format"):
    corpora.read_corpus(str(other))
  with pytest.raises(DataError, match="unknown builtin corpus"):
    corpora.read_corpus("builtin:wikipedia")


def test_builtin_python_docs():
  docs, stats = corpora.read_corpus("builtin:python_docs")
  ids = [d.id for d in docs]
  assert len(set(ids)) == len(ids)
  assert "topic:for" in ids and "stdlib:json.decoder" in ids
  assert sum(i.startswith("topic:") for i in ids) == 79
  assert stats.characters > 2_000_000  # a few MB of real English prose
  assert "for" in dict(_ids_texts(docs))["topic:for"]
  assert not any("/work/shared" in i for i in ids)
  assert builtin_corpus.BUILTIN_CORPORA == ("python_docs",)


# A small TFDS builder prepared locally: the same code path as `tfds:c4/en:train`.
def _tfds_builder_class():
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  class PrivateT5TinyCorpus(tfds.core.GeneratorBasedBuilder):
    """Three documents with a text and a url feature, like C4."""
    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
      return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
          {"text": tfds.features.Text(), "url": tfds.features.Text()}))

    def _split_generators(self, dl_manager):
      return {"train": self._generate_examples(3), "validation": self._generate_examples(1)}

    def _generate_examples(self, n):
      for i in range(n):
        yield i, {"text": f"Document number {i}." if i != 1 else "  ", "url": f"http://example.org/{i}"}

  return PrivateT5TinyCorpus


@pytest.mark.slow
def test_tfds_local_builder(tmp_path):
  builder = _tfds_builder_class()(data_dir=str(tmp_path))
  builder.download_and_prepare()
  docs, stats = corpora.read_corpus("tfds:private_t5_tiny_corpus:train", data_dir=str(tmp_path), id_field="url")
  assert sorted(_ids_texts(docs)) == [("http://example.org/0", "Document number 0."),
                                      ("http://example.org/2", "Document number 2.")]
  assert stats.blank_skipped == 1
  docs, _ = corpora.read_corpus(f"tfds:{builder.data_dir}:validation")
  assert _ids_texts(docs) == [(f"{builder.data_dir}:validation:0", "Document number 0.")]
  with pytest.raises(DataError, match="no split 'test'"):
    corpora.read_corpus("tfds:private_t5_tiny_corpus:test", data_dir=str(tmp_path))
  with pytest.raises(DataError, match="'c4/en' is not prepared"):
    corpora.read_corpus("tfds:c4/en:train", data_dir=str(tmp_path))
