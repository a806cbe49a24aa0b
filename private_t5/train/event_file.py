"""TensorBoard event files of scalars, written and read without TensorFlow.

An event file is a sequence of TFRecord records, each an `Event` protocol buffer
(tensorboard/compat/proto/event.proto): the first holds `file_version = "brain.Event:2"`, each
later one a step, a wall time and a `Summary` of `{tag, simple_value}` scalars (the form
TensorBoard's readers load as scalars, and the one PyTorch's and tensorboardX's writers use).
A TFRecord record is `uint64 length, uint32 masked CRC-32C of the length, data, uint32 masked
CRC-32C of the data`, little-endian. The few protocol-buffer fields needed are encoded here
directly, so writing a run's metrics needs neither TensorFlow nor the tensorboard package;
tests/test_event_file.py reads these files with TensorFlow's own reader and reads files
TensorFlow wrote.
"""
import itertools
import math
import os
import socket
import struct
import time
from typing import Dict, Iterator, List, Mapping, Optional, Tuple

FILE_VERSION = b"brain.Event:2"
FILE_PREFIX = "events.out.tfevents."
_MASK_DELTA = 0xA282EAD8
_U32 = 0xFFFFFFFF
_U64 = (1 << 64) - 1
# Wire types of the protocol-buffer encoding.
_VARINT, _FIXED64, _BYTES, _FIXED32 = 0, 1, 2, 5
# TensorProto dtypes a scalar summary may hold (tensorflow/core/framework/types.proto).
_DT_FLOAT, _DT_DOUBLE = 1, 2
_file_counter = itertools.count()


def _crc32c_table() -> List[int]:
  table = []
  for byte in range(256):
    crc = byte
    for _ in range(8):
      crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1  # Castagnoli, reflected
    table.append(crc)
  return table


_CRC32C_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
  """CRC-32C (Castagnoli) of `data`."""
  crc = _U32
  for byte in data:
    crc = _CRC32C_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
  return crc ^ _U32


def masked_crc32c(data: bytes) -> int:
  """The CRC as TFRecord stores it (rotated right by 15 bits, plus a constant)."""
  crc = crc32c(data)
  return ((((crc >> 15) | (crc << 17)) & _U32) + _MASK_DELTA) & _U32


def _varint(value: int) -> bytes:
  value &= _U64  # negative int64 values take ten bytes, as protocol buffers encode them
  out = bytearray()
  while True:
    low, value = value & 0x7F, value >> 7
    out.append(low | (0x80 if value else 0))
    if not value:
      return bytes(out)


def _field(number: int, wire_type: int, payload: bytes) -> bytes:
  key = _varint((number << 3) | wire_type)
  if wire_type == _BYTES:
    return key + _varint(len(payload)) + payload
  return key + payload


def encode_event(wall_time: float, step: int, scalars: Optional[Mapping[str, float]] = None,
                 file_version: Optional[bytes] = None) -> bytes:
  """An `Event`: wall_time (1), step (2), and file_version (3) or a Summary (5) of scalars."""
  out = _field(1, _FIXED64, struct.pack("<d", wall_time)) + _field(2, _VARINT, _varint(int(step)))
  if file_version is not None:
    return out + _field(3, _BYTES, file_version)
  values = b"".join(  # Summary.value (1): Summary.Value{tag (1), simple_value (2)}
      _field(1, _BYTES, _field(1, _BYTES, tag.encode("utf-8")) + _field(2, _FIXED32, struct.pack("<f", value)))
      for tag, value in (scalars or {}).items())
  return out + _field(5, _BYTES, values)


def encode_record(data: bytes) -> bytes:
  """One TFRecord record holding `data`."""
  length = struct.pack("<Q", len(data))
  return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


class EventFileWriter:
  """Appends scalar events to a new event file in `log_dir` (created on the first write)."""

  def __init__(self, log_dir: str):
    self.log_dir = log_dir
    self._file = None

  def _open(self):
    if self._file is None:
      os.makedirs(self.log_dir, exist_ok=True)
      name = (f"{FILE_PREFIX}{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}."
              f"{next(_file_counter)}")
      self._file = open(os.path.join(self.log_dir, name), "ab")  # pylint: disable=consider-using-with
      self._file.write(encode_record(encode_event(time.time(), 0, file_version=FILE_VERSION)))
    return self._file

  def add_scalars(self, step: int, values: Mapping[str, float]) -> None:
    """Writes the finite values of `values` as one event at `step` (None and NaN are skipped)."""
    finite = {tag: float(v) for tag, v in values.items() if v is not None and math.isfinite(float(v))}
    if finite:
      self._open().write(encode_record(encode_event(time.time(), step, finite)))

  def flush(self) -> None:
    if self._file is not None:
      self._file.flush()

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
      self._file = None


def _fields(data: bytes) -> Iterator[Tuple[int, int, object]]:
  """(field number, wire type, value) of a protocol-buffer message: an int or bytes."""
  pos = 0
  while pos < len(data):
    key, pos = _read_varint(data, pos)
    number, wire_type = key >> 3, key & 7
    if wire_type == _VARINT:
      value, pos = _read_varint(data, pos)
    elif wire_type == _FIXED64:
      value, pos = data[pos:pos + 8], pos + 8
    elif wire_type == _FIXED32:
      value, pos = data[pos:pos + 4], pos + 4
    elif wire_type == _BYTES:
      size, pos = _read_varint(data, pos)
      value, pos = data[pos:pos + size], pos + size
    else:
      raise ValueError(f"unsupported protocol-buffer wire type {wire_type}")
    yield number, wire_type, value


def _read_varint(data: bytes, pos: int) -> Tuple[int, int]:
  value, shift = 0, 0
  while True:
    byte = data[pos]
    value |= (byte & 0x7F) << shift
    pos, shift = pos + 1, shift + 7
    if not byte & 0x80:
      return value, pos


def read_records(path: str) -> Iterator[bytes]:
  """The records of a TFRecord file; stops at a torn last record (a writer killed mid-write).

  Raises:
    ValueError: a record's checksum does not match (the file is corrupt).
  """
  with open(path, "rb") as f:
    while True:
      header = f.read(12)
      if len(header) < 12:
        return
      length = struct.unpack("<Q", header[:8])[0]
      if struct.unpack("<I", header[8:])[0] != masked_crc32c(header[:8]):
        raise ValueError(f"{path}: corrupt record length")
      data, footer = f.read(length), f.read(4)
      if len(footer) < 4:
        return
      if struct.unpack("<I", footer)[0] != masked_crc32c(data):
        raise ValueError(f"{path}: corrupt record")
      yield data


def _tensor_scalar(tensor: bytes) -> Optional[float]:
  """The value of a float or double scalar TensorProto (as TensorFlow's summary writer stores it)."""
  dtype, value = None, None
  for number, _, payload in _fields(tensor):
    if number == 1:
      dtype = payload
    elif number in (4, 5, 6):  # tensor_content, float_val or double_val: little-endian bytes
      value = payload
  if value is None or dtype not in (_DT_FLOAT, _DT_DOUBLE):
    return None
  return struct.unpack_from("<f" if dtype == _DT_FLOAT else "<d", value)[0]


def decode_scalars(event: bytes) -> Tuple[int, Dict[str, float]]:
  """(step, {tag: value}) of an `Event`'s scalar summary values (simple_value or a scalar tensor)."""
  step, scalars = 0, {}
  for number, _, payload in _fields(event):
    if number == 2:
      step = payload - (1 << 64) if payload >> 63 else payload
    elif number == 5:
      for value_number, _, value in _fields(payload):
        if value_number != 1:
          continue
        tag, scalar = None, None
        for field, _, content in _fields(value):
          if field == 1:
            tag = content.decode("utf-8")
          elif field == 2:
            scalar = struct.unpack("<f", content)[0]
          elif field == 8:
            scalar = _tensor_scalar(content)
        if tag is not None and scalar is not None:
          scalars[tag] = scalar
  return step, scalars


def read_scalars(event_dir: str) -> Dict[str, List[Tuple[int, float]]]:
  """{tag: [(step, value), ...]} from the event files in `event_dir`, in file and write order."""
  out: Dict[str, List[Tuple[int, float]]] = {}
  for name in sorted(os.listdir(event_dir)):
    if FILE_PREFIX not in name:
      continue
    for record in read_records(os.path.join(event_dir, name)):
      step, scalars = decode_scalars(record)
      for tag, value in scalars.items():
        out.setdefault(tag, []).append((step, value))
  return out
