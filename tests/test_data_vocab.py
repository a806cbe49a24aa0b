"""Vocabulary used by the data tests (trained once per process) and its T5 layout."""
import os

import pytest

from private_t5.errors import DataError
from private_t5.tokenizer import spm as spm_lib
from private_t5 import vocabulary
from conftest import shared_or_fixture

FORTUNES = "pretrain/fortunes.jsonl.gz"
LINUX_DOCS = "pretrain/linux_docs.jsonl.gz"


def small_vocab_path(tmp_path_factory, shared_data) -> str:
  """A 2k unigram vocabulary trained on 3000 fortunes + 100 kernel docs (cached per process)."""
  path = os.path.join(str(tmp_path_factory.getbasetemp()), "data_vocab", "small.model")
  if not os.path.isfile(path):
    from private_t5.stages import spm as spm_stage  # pylint: disable=g-import-not-at-top
    from private_t5.data import corpora  # pylint: disable=g-import-not-at-top

    def lines():
      counts = {"lines": 0}
      for spec, n in ((FORTUNES, 3000), (LINUX_DOCS, 100)):
        docs = corpora.iter_documents(shared_or_fixture(spec), max_documents=n)
        yield from spm_stage.document_lines(docs, counts)

    spm_lib.train_from_sentences(lines(), path, vocab_size=2000, input_sentence_size=200_000)
  return path


@pytest.fixture(scope="module")
def vocab_path(tmp_path_factory, shared_data):
  return small_vocab_path(tmp_path_factory, shared_data)


def test_t5_layout_and_sentinels(vocab_path):
  vocab = vocabulary.load_vocabulary(vocab_path)
  assert vocab.vocab_size == 2000 + vocabulary.NUM_EXTRA_IDS
  assert (vocab.pad_id, vocab.eos_id, vocab.unk_id) == (0, 1, 2)
  # <extra_id_0> is the top id, as t5's noise_span_to_unique_sentinel assumes.
  assert vocab.encode("<extra_id_0>")[-1] == vocab.vocab_size - 1
  assert vocab.decode([vocab.vocab_size - 1, vocab.vocab_size - 2]).split() == ["<extra_id_0>", "<extra_id_1>"]
  ids = vocab.encode("The kernel schedules tasks.")
  assert vocab.decode(ids) == "The kernel schedules tasks."


def test_not_a_sentencepiece_model(tmp_path):
  bad = tmp_path / "vocab.model"
  bad.write_bytes(b"this is not a protobuf")
  with pytest.raises(DataError, match="not a SentencePiece model"):
    vocabulary.load_vocabulary(str(bad))
  with pytest.raises(DataError, match="not found"):
    vocabulary.load_vocabulary(str(tmp_path / "missing.model"))


def test_same_ids_pieces_and_model_as_seqio(vocab_path):
  """The vocabulary adds T5's sentinels itself: the serialized model, the ids and the decoded
  text are seqio's SentencePieceVocabulary's, without importing seqio."""
  from private_t5 import quiet_tf  # pylint: disable=g-import-not-at-top
  from private_t5.data import corpora  # pylint: disable=g-import-not-at-top
  quiet_tf.import_tensorflow()
  import seqio  # pylint: disable=g-import-not-at-top
  ours = vocabulary.load_vocabulary(vocab_path)
  reference = seqio.SentencePieceVocabulary(vocab_path, extra_ids=vocabulary.NUM_EXTRA_IDS)
  assert ours.sp_model == reference.sp_model
  assert (ours.vocab_size, ours.eos_id, ours.unk_id, ours.pad_id) == (
      reference.vocab_size, reference.eos_id, reference.unk_id, reference.pad_id)
  texts = [d.text for d in corpora.iter_documents(shared_or_fixture(FORTUNES), max_documents=50)]
  texts.append("Fill <extra_id_0> in and <extra_id_7> here.")
  for text in texts:
    ids = ours.encode(text)
    assert ids == reference.encode(text)
    assert ours.decode(ids) == reference.decode(ids)
  # Sentinels, an EOS in the middle and ids past the vocabulary decode as seqio's do.
  odd = [ours.vocab_size - 1, 5, 1, 7, ours.vocab_size + 3]
  assert ours.decode(odd) == reference.decode(odd)
  assert ours.decode([5, ours.vocab_size + 3]) == reference.decode([5, ours.vocab_size + 3])
