"""`private-t5 spm`: a public SentencePiece vocabulary trained from a corpus."""
import gzip
import json
import os

import pytest

from private_t5.stages import cli
from private_t5.tokenizer import spm as spm_lib
from private_t5 import vocabulary
from private_t5.stages import spm as spm_stage


@pytest.mark.parametrize("model_type,vocab_size", [pytest.param("unigram", 600, marks=pytest.mark.slow), ("char", 200)])
def test_spm_command_trains_t5_vocabulary(shared_data, tmp_path, capsys, model_type, vocab_size):
  output = tmp_path / "vocab" / "spm.model"
  rc = cli.main(["spm", f"--corpus={shared_data}/pretrain/fortunes.jsonl.gz", f"--vocab_size={vocab_size}",
                 f"--model_type={model_type}", f"--output={output}", "--max_documents=600"])
  assert rc == 0
  summary = json.loads(capsys.readouterr().out)
  assert summary["documents"] == 600 and summary["lines"] > 600 and summary["private"] is False
  assert summary["vocab_size_with_sentinels"] == summary["pieces"] + 100
  assert summary["pieces"] == vocab_size if model_type == "unigram" else 50 < summary["pieces"] <= vocab_size
  assert sorted(os.listdir(output.parent)) == ["spm.model"]  # no temp file left
  vocab = vocabulary.load_vocabulary(str(output))
  text = "Time flies like an arrow."
  assert vocab.decode(vocab.encode(text)) == text
  assert vocab.tokenizer.GetPieceSize() == summary["pieces"] + 100


def test_spm_bad_input(tmp_path, capsys):
  blank = tmp_path / "blank.txt"
  blank.write_text("\n\n")
  output = tmp_path / "out.model"
  assert cli.main(["spm", f"--corpus={blank}", "--vocab_size=100", f"--output={output}"]) == 2
  assert "is empty" in capsys.readouterr().err
  assert cli.main(["spm", f"--corpus={tmp_path}/missing.jsonl", "--vocab_size=100", f"--output={output}"]) == 2
  assert "corpus not found" in capsys.readouterr().err
  assert cli.main(["spm", f"--corpus={blank}", "--vocab_size=100", f"--output={tmp_path}/v.bin"]) == 2
  tiny = tmp_path / "tiny.txt"
  tiny.write_text("a few words only\nand a second line\n")
  assert cli.main(["spm", f"--corpus={tiny}", "--vocab_size=5000", f"--output={output}"]) == 2
  assert "SentencePiece" in capsys.readouterr().err
  assert not output.exists() and not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def test_document_lines_splits_long_documents():
  from private_t5.documents import Document  # pylint: disable=g-import-not-at-top
  counts = {"lines": 0}
  lines = list(spm_stage.document_lines(iter([Document("a", "one\n\n two \nthree"), Document("b", "four")]), counts))
  assert lines == ["one", " two ", "three", "four"] and counts["lines"] == 4


def test_spm_corpus_error_is_one_line(tmp_path, capsys):
  corpus = tmp_path / "bad.jsonl"
  corpus.write_text("".join(json.dumps({"text": f"hello world number {i} more words"}) + "\n" for i in range(50))
                    + "{not json\n")
  assert cli.main(["spm", f"--corpus={corpus}", f"--output={tmp_path / 'v.model'}", "--vocab_size=40"]) == 2
  err = capsys.readouterr().err
  assert err.strip() == (f"error: {corpus}: line 51: not valid JSON (Expecting property name enclosed in "
                         "double quotes)")
  assert not os.path.exists(tmp_path / "v.model")


@pytest.mark.parametrize("name,header", [("c.txt.gz", ""), ("c.tsv.gz", "text\n")], ids=["txt", "tsv"])
def test_spm_truncated_gzip_corpus_is_one_line(tmp_path, capsys, name, header):
  data = gzip.compress((header + "".join(f"hello world number {i} more words\n" for i in range(3000))).encode())
  corpus = tmp_path / name
  corpus.write_bytes(data[:len(data) // 2])
  output = tmp_path / "v.model"
  assert cli.main(["spm", f"--corpus={corpus}", f"--output={output}", "--vocab_size=40"]) == 2
  err = capsys.readouterr().err
  assert err.startswith(f"error: cannot read {corpus}: Compressed file ended before") and err.count("\n") == 1, err
  assert sorted(os.listdir(tmp_path)) == [name]


def test_spm_output_that_cannot_be_written_is_one_line_before_training(tmp_path, capsys, read_only, monkeypatch):
  corpus = tmp_path / "c.txt"
  corpus.write_text("hello world some words\n")
  (tmp_path / "folder.model").mkdir()
  (tmp_path / "file").write_text("not a folder")
  (tmp_path / "ro").mkdir()
  read_only(tmp_path / "ro")
  monkeypatch.setattr(spm_lib, "train_from_sentences", None)  # nothing may be trained
  for output, reason in [("folder.model", "Is a directory"),
                         ("file/v.model", f"Not a directory ({tmp_path / 'file'})"),
                         ("ro/v.model", f"Read-only file system ({tmp_path / 'ro'})"),
                         ("ro/new/v.model", f"Read-only file system ({tmp_path / 'ro'})")]:
    assert cli.main(["spm", f"--corpus={corpus}", f"--output={tmp_path / output}", "--vocab_size=40"]) == 2
    assert capsys.readouterr().err == f"error: --output {str(tmp_path / output)!r} cannot be written: {reason}\n"
  assert sorted(os.listdir(tmp_path)) == ["c.txt", "file", "folder.model", "ro"]
  assert not os.listdir(tmp_path / "ro") and not os.listdir(tmp_path / "folder.model")


def test_spm_single_line_longer_than_max_sentence_length(tmp_path, capsys):
  corpus = tmp_path / "long.jsonl"
  corpus.write_text(json.dumps({"text": " ".join(f"word{i % 300}" for i in range(2000))}) + "\n")
  output = tmp_path / "v.model"
  assert cli.main(["spm", f"--corpus={corpus}", f"--output={output}", "--vocab_size=40"]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1
  assert "longer than SentencePiece's maximum sentence length (4192 bytes" in err
  assert "--max_sentence_length" in err and not output.exists()
  assert cli.main(["spm", f"--corpus={corpus}", f"--output={output}", "--vocab_size=40",
                   "--max_sentence_length=100000", "--model_type=char"]) == 0
  assert output.exists()
