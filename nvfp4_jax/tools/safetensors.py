"""The safetensors file format, read and written with numpy (no extra package).

A safetensors file is an 8-byte little-endian header length `n`, `n` bytes of
JSON mapping each tensor name to `{"dtype", "shape", "data_offsets": [begin,
end]}` (offsets into the data that follows; an optional `"__metadata__"` maps
strings to strings), then the tensors' raw little-endian bytes. This module
writes exactly that, including the float8 dtypes that NVFP4 checkpoints use
(`F8_E4M3`), and reads it back with a clear error for every kind of damage.
"""

from __future__ import annotations

import json
import pathlib
import struct
from typing import Any, Mapping

import ml_dtypes
import numpy as np

_DTYPES = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8), "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16), "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32), "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_NAMES = {v: k for k, v in _DTYPES.items()}
_MAX_HEADER = 100 * 2**20


class SafetensorsError(ValueError):
  """A file that is not a valid safetensors file (names the file and why)."""


def save(path: str | pathlib.Path, tensors: Mapping[str, np.ndarray],
         metadata: Mapping[str, str] | None = None) -> None:
  """Writes `tensors` (name -> array) to `path` in the safetensors format."""
  header, offset, blobs = {}, 0, []
  for name in sorted(tensors):
    a = np.asarray(tensors[name], order="C")
    if a.dtype not in _NAMES:
      raise TypeError(f"safetensors cannot store {name!r} of dtype {a.dtype}; "
                      f"use one of {sorted(_DTYPES)}.")
    data = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
    header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape),
                    "data_offsets": [offset, offset + len(data)]}
    blobs.append(data)
    offset += len(data)
  if metadata:
    header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
  text = json.dumps(header, separators=(",", ":")).encode()
  text += b" " * (-len(text) % 8)  # Aligns the data to 8 bytes.
  path = pathlib.Path(path)
  tmp = path.with_name(path.name + ".tmp")
  with open(tmp, "wb") as f:
    f.write(struct.pack("<Q", len(text)))
    f.write(text)
    for blob in blobs:
      f.write(blob)
  tmp.replace(path)  # Atomic: a reader never sees a half-written file.


def load(path: str | pathlib.Path
         ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
  """Reads a safetensors file: `(name -> array, metadata)`.

  Raises:
    FileNotFoundError: no such file.
    SafetensorsError: a truncated or malformed file, naming what is wrong.
  """
  path = pathlib.Path(path)
  raw = path.read_bytes()

  def bad(why: str) -> SafetensorsError:
    return SafetensorsError(f"{path} is not a valid safetensors file: {why}. "
                            f"Re-export it (python -m train.export).")
  if len(raw) < 8:
    raise bad(f"{len(raw)} bytes, shorter than the 8-byte header length")
  (n,) = struct.unpack("<Q", raw[:8])
  if n > _MAX_HEADER or 8 + n > len(raw):
    raise bad(f"the header claims {n} bytes but the file has {len(raw) - 8} "
              f"after the length (truncated?)")
  try:
    header = json.loads(raw[8:8 + n].decode())
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise bad(f"the header is not JSON ({e})") from None
  if not isinstance(header, dict):
    raise bad("the header is not a JSON object")
  metadata = header.pop("__metadata__", {}) or {}
  data = memoryview(raw)[8 + n:]
  tensors = {}
  for name, info in header.items():
    try:
      dtype = _DTYPES[info["dtype"]]
      shape = tuple(int(d) for d in info["shape"])
      begin, end = (int(o) for o in info["data_offsets"])
    except (KeyError, TypeError, ValueError):
      raise bad(f"tensor {name!r} has a bad entry {info!r}") from None
    size = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
    if not 0 <= begin <= end <= len(data) or end - begin != size:
      raise bad(f"tensor {name!r} needs bytes [{begin}, {end}) of "
                f"{len(data)} ({size} for {info['dtype']}{list(shape)}); the "
                f"file is truncated or damaged")
    tensors[name] = np.frombuffer(data[begin:end], dtype.newbyteorder("<")
                                  ).astype(dtype).reshape(shape)
  return tensors, dict(metadata)


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """A nested dict of arrays as one dict of "a/b/c" names (safetensors is flat)."""
  out = {}
  for k, v in tree.items():
    path = f"{prefix}/{k}" if prefix else str(k)
    if isinstance(v, Mapping):
      out.update(flatten(v, path))
    else:
      out[path] = v
  return out


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
  """The inverse of `flatten`: "a/b/c" names back to nested dicts."""
  tree: dict[str, Any] = {}
  for path, v in flat.items():
    node = tree
    *parents, leaf = path.split("/")
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = v
  return tree
