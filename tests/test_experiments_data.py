"""experiments.data: a deterministic corpus, split, tokenization, cache and batch order."""

from __future__ import annotations

import numpy as np
import pytest

from experiments import data as data_lib

SMALL = 150_000  # bytes of the stdlib: a few dozen files


def test_stdlib_corpus_is_sorted_fingerprinted_and_excludes_installs():
  a = data_lib.read_corpus(max_bytes=SMALL)
  b = data_lib.read_corpus(max_bytes=SMALL)
  assert a.paths == b.paths and a.fingerprint == b.fingerprint
  assert list(a.paths) == sorted(a.paths) and len(a.paths) > 3
  assert a.num_bytes >= SMALL
  assert not any(set(p.split("/")[:-1]) & data_lib.EXCLUDED_DIRS for p in a.paths)


def test_corpus_from_a_directory(tmp_path):
  for rel, text in {"b.py": b"x = 1\n", "a/c.py": b"\xff not utf-8\n", "a/z.txt": b"skip",
                    "site-packages/pkg.py": b"skip", "test/test_b.py": b"skip"}.items():
    (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / rel).write_bytes(text)
  corpus = data_lib.read_corpus(tmp_path)
  assert corpus.paths == ("a/c.py", "b.py")
  before = corpus.fingerprint
  (tmp_path / "b.py").write_bytes(b"x = 2\n")
  assert data_lib.read_corpus(tmp_path).fingerprint != before


def test_split_depends_on_each_path_only():
  paths = tuple(f"mod{i}.py" for i in range(400))
  train, held = data_lib.split_files(paths, 0.05)
  assert 5 <= len(held) <= 40 and sorted(train + held) == list(range(400))
  # Adding or removing other files (another Python version) keeps each file's side.
  sub = paths[::3]
  _, held_sub = data_lib.split_files(sub, 0.05)
  assert {sub[i] for i in held_sub} == {paths[i] for i in held if paths[i] in sub}
  assert data_lib.split_files(("a.py", "b.py"), 0.0)[1]  # never an empty eval split


def test_permutation_is_pinned_across_numpy_versions():
  perm = data_lib.permutation(10, seed=0, epoch=0)
  # A literal: the batch order must not change with numpy or the machine.
  assert perm.tolist() == PINNED_PERMUTATION
  assert sorted(data_lib.permutation(1000, 3, 7)) == list(range(1000))
  assert data_lib.permutation(1000, 3, 7).tolist() != data_lib.permutation(1000, 3, 8).tolist()


PINNED_PERMUTATION = [1, 4, 5, 7, 6, 9, 0, 3, 2, 8]


def test_batches_are_a_function_of_seed_and_step():
  tokens = np.arange(1000, dtype=np.uint16)
  sampler = data_lib.BatchSampler(tokens, batch=4, seq=16, seed=1)
  assert sampler.num_windows == (1000 - 1) // 16
  straight = [b for _, (_, b) in zip(range(40), sampler.iterate(0))]
  fresh = data_lib.BatchSampler(tokens, batch=4, seq=16, seed=1)
  resumed = [sb for _, sb in zip(range(15), fresh.iterate(25))]
  assert [step for step, _ in resumed] == list(range(25, 40))
  for (_, batch), expected in zip(resumed, straight[25:]):
    np.testing.assert_array_equal(batch, expected)
  b = straight[3]
  assert b.shape == (4, 17) and b.dtype == np.int32
  assert (np.diff(b, axis=1) == 1).all()  # contiguous windows of the stream
  # One epoch visits every window once.
  n = sampler.num_windows
  seen = np.concatenate([sampler.windows_at(s) for s in range(n // 4)])
  assert len(set(seen.tolist())) == len(seen) == (n // 4) * 4
  other = data_lib.BatchSampler(tokens, batch=4, seq=16, seed=2)
  assert not np.array_equal(other.batch_at(0), sampler.batch_at(0))


def test_eval_batches_are_fixed_and_spread():
  tokens = np.arange(5000, dtype=np.uint16)
  ev = data_lib.eval_batches(tokens, batch=2, seq=10, num_batches=3)
  assert len(ev) == 3 and ev[0].shape == (2, 11)
  assert ev[0][0, 0] == 0 and ev[-1][-1, 0] > 4000
  with pytest.raises(ValueError, match="eval stream"):
    data_lib.eval_batches(tokens[:15], batch=2, seq=10, num_batches=1)


def test_bytes_tokens_round_trip_and_cache(tmp_path, monkeypatch):
  d = data_lib.load("bytes", max_bytes=SMALL, cache_dir=tmp_path)
  corpus = data_lib.read_corpus(max_bytes=SMALL)
  assert d.vocab_size == 257 and d.eos_id == 256 and d.train.max() <= 256
  for key in ("corpus_sha256", "corpus_bytes", "python", "tokens_sha256"):
    assert key in d.info
  assert d.info["corpus_sha256"] == corpus.fingerprint
  assert d.train.size + d.eval.size == corpus.num_bytes + len(corpus.paths)  # + one eos per file
  train_idx, _ = data_lib.split_files(corpus.paths, 0.02)
  first = corpus.contents[train_idx[0]]
  assert d.decode(d.train[:len(first)]) == first.decode("utf-8", errors="replace")

  def no_build(*args, **kwargs):
    raise AssertionError("the cache should have been used")

  monkeypatch.setattr(data_lib, "_build", no_build)
  again = data_lib.load("bytes", max_bytes=SMALL, cache_dir=tmp_path)
  np.testing.assert_array_equal(again.train, d.train)
  assert again.info == d.info


def test_bpe_is_deterministic_and_decodes(tmp_path):
  a = data_lib.load("bpe", 400, max_bytes=60_000, cache_dir=tmp_path / "a")
  b = data_lib.load("bpe", 400, max_bytes=60_000, cache_dir=tmp_path / "b")
  assert a.vocab_size == 400
  assert a.info["tokenizer_sha256"] == b.info["tokenizer_sha256"]
  assert a.info["tokens_sha256"] == b.info["tokens_sha256"]
  assert a.train.size < 0.6 * a.info["corpus_bytes"]  # merges happened
  text = a.decode(a.train[:200])
  corpus = data_lib.read_corpus(max_bytes=60_000)
  train_idx, _ = data_lib.split_files(corpus.paths, 0.02)
  assert corpus.contents[train_idx[0]].decode().startswith(text[:100])
