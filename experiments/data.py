"""Real text that every machine has offline: the Python standard library's source.

The corpus is every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]``
(docstrings and comments included), minus the directories that are not the
library itself or that distributions ship separately (``site-packages``,
``test``/``tests``, ...), read as bytes in sorted path order. Held-out files
(chosen by a hash of the relative path, so the split does not depend on the
file list) form the eval split. Tokens are either raw bytes (``"bytes"``:
vocab 256 + end-of-text) or a byte-level BPE trained here with Hugging Face
``tokenizers`` on the train split (``"bpe"``), cached on disk.

The stdlib differs between Python versions (3.11 on the CPU machines, 3.12
on the GPU machine), so the corpus differs too: :func:`load` returns a
fingerprint (sha256 of the paths and bytes, byte and file counts, the
Python version, the tokenizer's and the token stream's hashes) that every
training log records.

Batches are a pure function of ``(seed, step)`` (:class:`BatchSampler`): a
run resumed at step ``k`` sees exactly the batches a straight run sees.

    python -m experiments.data --tokenizer bpe --vocab-size 8192   # build the cache, print the fingerprint
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import pathlib
import platform
import sysconfig
import tempfile
from typing import Iterator, Optional

import numpy as np

# Not the library itself (installed packages, byte code), or shipped apart by
# some distributions (tests, IDLE, Tk demos): dropped so that the corpus is
# the same on every install of one Python version.
EXCLUDED_DIRS = frozenset({
    "site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test",
    "idlelib", "tkinter", "turtledemo", "ensurepip",
})
TOKENIZERS = ("bytes", "bpe")
EOS = "<|endoftext|>"
CACHE_VERSION = 1  # bump when the cached token format changes


def default_cache_dir() -> pathlib.Path:
  """``$FORGE_DATA_CACHE``, else ``~/.cache/forge_jax/data``."""
  env = os.environ.get("FORGE_DATA_CACHE")
  return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "forge_jax" / "data"


@dataclasses.dataclass(frozen=True)
class Corpus:
  """The raw text: file paths relative to ``root``, in sorted order, with their bytes."""

  root: str
  paths: tuple[str, ...]
  contents: tuple[bytes, ...]

  @property
  def num_bytes(self) -> int:
    return sum(map(len, self.contents))

  @property
  def fingerprint(self) -> str:
    """sha256 over every (path, length, bytes), in order."""
    h = hashlib.sha256()
    for path, data in zip(self.paths, self.contents):
      h.update(f"{path}\0{len(data)}\0".encode())
      h.update(data)
    return h.hexdigest()


def stdlib_root() -> pathlib.Path:
  """This interpreter's standard library directory."""
  return pathlib.Path(sysconfig.get_paths()["stdlib"])


def read_corpus(root: Optional[str | os.PathLike] = None, max_bytes: int = 0) -> Corpus:
  """Reads every ``*.py`` under ``root`` (default: the stdlib) in sorted order.

  Args:
    root: a directory of text; ``None`` for the Python standard library.
    max_bytes: keep only the first files (in sorted order) up to about this
      many bytes (0: all); for quick tests.
  """
  root = pathlib.Path(root) if root is not None else stdlib_root()
  files = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]  # prune: site-packages is big
    rel_dir = pathlib.Path(dirpath).relative_to(root)
    files += [(rel_dir / f).as_posix() for f in filenames if f.endswith(".py")]
  files.sort()  # code-point order of posix paths: the same on every machine
  if not files:
    raise ValueError(f"no *.py files under {root}")
  paths, contents, total = [], [], 0
  for rel in files:
    data = (root / rel).read_bytes()
    paths.append(rel)
    contents.append(data)
    total += len(data)
    if max_bytes and total >= max_bytes:
      break
  return Corpus(str(root), tuple(paths), tuple(contents))


def _path_hash(path: str) -> int:
  return int.from_bytes(hashlib.sha256(path.encode()).digest()[:8], "little")


def split_files(paths: tuple[str, ...], eval_fraction: float) -> tuple[list[int], list[int]]:
  """(train indices, eval indices): a file is held out when its path hash falls below the fraction.

  Hashing the path (not its position) keeps a file on the same side of the
  split whatever other files exist, e.g. across Python versions. At least one
  file is held out (the lowest hash) and at least one kept.
  """
  if len(paths) < 2:
    raise ValueError(f"need at least 2 files for a held-out split, got {len(paths)}: the "
                     "corpus is too small (raise --corpus-bytes, or 0 for the whole stdlib)")
  hashes = [_path_hash(p) for p in paths]
  cut = int(eval_fraction * 2**64)
  held = [i for i, h in enumerate(hashes) if h < cut]
  if not held:
    held = [min(range(len(paths)), key=hashes.__getitem__)]
  if len(held) == len(paths):
    held = held[:-1]
  held_set = set(held)
  return [i for i in range(len(paths)) if i not in held_set], held


# ----------------------------------------------------------------------------
# Tokenizers.
# ----------------------------------------------------------------------------


def _texts(contents) -> list[str]:
  # A few stdlib files are not valid UTF-8; replacement is deterministic.
  return [c.decode("utf-8", errors="replace") for c in contents]


def train_bpe(contents, vocab_size: int):
  """A byte-level BPE (GPT-2 style pre-tokenizer) trained on ``contents``.

  ``tokenizers``' BPE trainer has no randomness, and its ties are broken by
  token ids, which start from the sorted byte alphabet: the same input gives
  the same tokenizer (checked across processes for 0.23).
  """
  try:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  except ImportError as e:  # pragma: no cover - depends on the install
    raise ImportError("tokenizer='bpe' needs Hugging Face tokenizers: "
                      "pip install -e '.[experiments]' (or use tokenizer='bytes')") from e
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS], show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(_texts(contents), trainer=trainer)
  return tok


def _encode(contents, tokenizer, kind: str) -> np.ndarray:
  """Documents concatenated, each followed by end-of-text."""
  if kind == "bytes":
    parts = []
    for c in contents:
      parts += [np.frombuffer(c, np.uint8).astype(np.uint16), np.array([256], np.uint16)]
    return np.concatenate(parts)
  eos = tokenizer.token_to_id(EOS)
  encodings = tokenizer.encode_batch(_texts(contents), add_special_tokens=False)
  parts = []
  for e in encodings:
    parts += [np.asarray(e.ids, np.uint16), np.array([eos], np.uint16)]
  return np.concatenate(parts)


# ----------------------------------------------------------------------------
# The tokenized data, cached.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TokenData:
  """Token streams of the two splits and what they were made from.

  Attributes:
    train: uint16 token ids of the train files, each document ended by ``eos_id``.
    eval: the same for the held-out files.
    vocab_size: the tokenizer's vocabulary (ids are ``< vocab_size``).
    eos_id: the end-of-text id.
    info: the fingerprint to log: corpus hash, bytes, files, Python version,
      tokenizer and its hash, token counts and the token streams' hash.
  """

  train: np.ndarray
  eval: np.ndarray
  vocab_size: int
  eos_id: int
  info: dict
  tokenizer_json: Optional[str] = None

  def decode(self, ids) -> str:
    """Text of ``ids`` (for looking at samples)."""
    ids = [int(i) for i in ids]
    if self.tokenizer_json is None:
      return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
    from tokenizers import Tokenizer
    return Tokenizer.from_str(self.tokenizer_json).decode(ids)


def _atomic_write(path: pathlib.Path, write) -> None:
  """Writes through a temp file + rename, so concurrent builders never see half a file."""
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      write(f)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def _tokens_hash(train: np.ndarray, eval_: np.ndarray) -> str:
  h = hashlib.sha256()
  for a in (train, eval_):
    h.update(np.ascontiguousarray(a, np.uint16).tobytes())
  return h.hexdigest()


def load(tokenizer: str = "bpe", vocab_size: int = 8192, *, root=None, max_bytes: int = 0,
         eval_fraction: float = 0.02, cache_dir=None) -> TokenData:
  """The tokenized corpus: built once, then read from ``cache_dir``.

  Args:
    tokenizer: ``"bytes"`` (ids 0..255 and 256 = end-of-text) or ``"bpe"``.
    vocab_size: the BPE vocabulary (ignored for bytes, which have 257).
    root: a directory of ``*.py`` text; ``None`` for the stdlib.
    max_bytes: use only the first files up to about this many bytes (0: all).
    eval_fraction: share of files held out (by path hash) for eval.
    cache_dir: where tokenizers and token streams are kept (default
      :func:`default_cache_dir`); keyed by the corpus fingerprint and the
      settings, so a changed corpus is never read from a stale cache.
  """
  if tokenizer not in TOKENIZERS:
    raise ValueError(f"tokenizer={tokenizer!r} is not one of {TOKENIZERS}")
  if tokenizer == "bpe" and not 257 <= vocab_size <= 65535:
    raise ValueError(f"vocab_size={vocab_size} must be in [257, 65535] (uint16 token ids)")
  corpus = read_corpus(root, max_bytes)
  train_idx, eval_idx = split_files(corpus.paths, eval_fraction)
  info = {
      "corpus": "python-stdlib" if root is None else str(root),
      "corpus_sha256": corpus.fingerprint, "corpus_bytes": corpus.num_bytes,
      "corpus_files": len(corpus.paths), "python": platform.python_version(),
      "max_bytes": max_bytes, "eval_fraction": eval_fraction,
      "train_files": len(train_idx), "eval_files": len(eval_idx), "tokenizer": tokenizer,
  }
  import importlib.metadata as md
  if tokenizer == "bpe":
    info["tokenizers_version"] = md.version("tokenizers")
  settings = json.dumps({k: info.get(k) for k in ("corpus_sha256", "eval_fraction", "tokenizer",
                                                  "tokenizers_version")}
                        | {"vocab_size": vocab_size if tokenizer == "bpe" else 257,
                           "v": CACHE_VERSION}, sort_keys=True)
  key = hashlib.sha256(settings.encode()).hexdigest()[:16]
  cache = pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir()
  cached = cache / f"{tokenizer}-{key}"
  meta_path = cached / "meta.json"
  if not meta_path.exists():
    _build(corpus, train_idx, eval_idx, tokenizer, vocab_size, cached)
  meta = json.loads(meta_path.read_text())
  train = np.load(cached / "train.npy")
  eval_ = np.load(cached / "eval.npy")
  tok_json = (cached / "tokenizer.json").read_text() if tokenizer == "bpe" else None
  info.update(meta["info"], cache=str(cached))
  return TokenData(train, eval_, meta["vocab_size"], meta["eos_id"], info, tok_json)


def _build(corpus: Corpus, train_idx, eval_idx, kind: str, vocab_size: int,
           cached: pathlib.Path) -> None:
  train_docs = [corpus.contents[i] for i in train_idx]
  eval_docs = [corpus.contents[i] for i in eval_idx]
  extra = {}
  if kind == "bpe":
    # Trained on the train split only, so eval text is unseen by the tokenizer too.
    tok = train_bpe(train_docs, vocab_size)
    tok_json = tok.to_str()
    extra["tokenizer_sha256"] = hashlib.sha256(tok_json.encode()).hexdigest()
    vocab, eos_id = tok.get_vocab_size(), tok.token_to_id(EOS)
    _atomic_write(cached / "tokenizer.json", lambda f: f.write(tok_json.encode()))
  else:
    tok, vocab, eos_id = None, 257, 256
  train = _encode(train_docs, tok, kind)
  eval_ = _encode(eval_docs, tok, kind)
  extra.update(vocab_size=vocab, train_tokens=int(train.size), eval_tokens=int(eval_.size),
               tokens_sha256=_tokens_hash(train, eval_))
  _atomic_write(cached / "train.npy", lambda f: np.save(f, train))
  _atomic_write(cached / "eval.npy", lambda f: np.save(f, eval_))
  meta = {"vocab_size": vocab, "eos_id": eos_id, "info": extra}
  # meta.json last: its presence says the cache entry is complete.
  _atomic_write(cached / "meta.json", lambda f: f.write(json.dumps(meta, indent=1).encode()))


# ----------------------------------------------------------------------------
# Batches.
# ----------------------------------------------------------------------------

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
  """SplitMix64's finalizer on uint64 arrays: a fixed bijection, the same in every numpy.

  (numpy's Generator does not promise the same stream across numpy versions.)
  """
  with np.errstate(over="ignore"):
    x = (x + np.uint64(0x9E3779B97F4A7C15)) & _M64
    x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _M64
    x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _M64
    return x ^ (x >> np.uint64(31))


def permutation(n: int, seed: int, epoch: int) -> np.ndarray:
  """A permutation of ``range(n)`` that depends only on ``(seed, epoch)``."""
  base = _splitmix64(np.array([seed * 1_000_003 + epoch], np.uint64))[0]
  keys = _splitmix64(np.arange(n, dtype=np.uint64) ^ base)
  return np.argsort(keys, kind="stable")


class BatchSampler:
  """Training batches ``[batch, seq + 1]`` (inputs ``[:, :-1]``, targets ``[:, 1:]``).

  The train stream is cut into ``(len - 1) // seq`` windows of ``seq + 1``
  tokens (neighbours share one token). Each epoch visits every window once in
  the order :func:`permutation` gives for ``(seed, epoch)``; step ``s`` takes
  windows ``s * batch ... (s + 1) * batch - 1`` of that endless sequence. A
  batch is a pure function of ``(seed, step)``: resume needs only the step.
  """

  def __init__(self, tokens: np.ndarray, batch: int, seq: int, seed: int = 0):
    self.tokens, self.batch, self.seq, self.seed = tokens, batch, seq, seed
    self.num_windows = (len(tokens) - 1) // seq
    if self.num_windows < 1:
      raise ValueError(f"the stream has {len(tokens)} tokens, fewer than seq + 1 = {seq + 1}")
    self._perm_cache: dict[int, np.ndarray] = {}

  def _perm(self, epoch: int) -> np.ndarray:
    if epoch not in self._perm_cache:
      if len(self._perm_cache) > 2:
        self._perm_cache.clear()
      self._perm_cache[epoch] = permutation(self.num_windows, self.seed, epoch)
    return self._perm_cache[epoch]

  def windows_at(self, step: int) -> np.ndarray:
    """Window indices (into the stream, in units of ``seq``) of step ``step``'s rows."""
    idx = step * self.batch + np.arange(self.batch)
    epochs, pos = np.divmod(idx, self.num_windows)
    return np.array([self._perm(int(e))[p] for e, p in zip(epochs, pos)])

  def batch_at(self, step: int) -> np.ndarray:
    """The int32 batch ``[batch, seq + 1]`` of step ``step``."""
    starts = self.windows_at(step) * self.seq
    rows = [self.tokens[s:s + self.seq + 1] for s in starts]
    return np.stack(rows).astype(np.int32)

  def epoch_of(self, step: int) -> float:
    """Epochs of train data seen before step ``step``."""
    return step * self.batch / self.num_windows

  def iterate(self, start_step: int = 0) -> Iterator[tuple[int, np.ndarray]]:
    """``(step, batch)`` from ``start_step`` on, endlessly."""
    step = start_step
    while True:
      yield step, self.batch_at(step)
      step += 1


def eval_batches(tokens: np.ndarray, batch: int, seq: int, num_batches: int) -> list[np.ndarray]:
  """A fixed eval set: ``num_batches`` batches of windows spread evenly over ``tokens``.

  Fewer batches when the held-out stream is short (windows never repeat).
  """
  n = (len(tokens) - 1) // seq
  if n < batch:
    raise ValueError(f"the eval stream has {n} windows of {seq + 1} tokens, fewer than "
                     f"batch={batch}: hold out more files (eval_fraction) or use a shorter seq")
  count = min(num_batches, n // batch)
  windows = np.linspace(0, n - 1, count * batch).round().astype(np.int64) * seq
  rows = np.stack([tokens[s:s + seq + 1] for s in windows]).astype(np.int32)
  return list(rows.reshape(count, batch, seq + 1))


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokenizer", choices=TOKENIZERS, default="bpe")
  parser.add_argument("--vocab-size", type=int, default=8192)
  parser.add_argument("--max-bytes", type=int, default=0)
  parser.add_argument("--cache-dir", default=None)
  args = parser.parse_args(argv)
  data = load(args.tokenizer, args.vocab_size, max_bytes=args.max_bytes, cache_dir=args.cache_dir)
  print(json.dumps(data.info, indent=1))
  print(repr(data.decode(data.train[:60])))
  return data.info


if __name__ == "__main__":
  main()
