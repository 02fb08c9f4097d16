"""data.mixture: every example drawn from one source by (seed, its global index) alone, each
source read in its own shuffled order, resumable and split over processes like one source."""
import json
import math

import numpy as np
import pytest

from delta_jax.data.pipeline import MixtureSchedule, build_mixture_iterator, make_window_source
from delta_jax.data.prepare import prepare
from delta_jax.train.config import dump_config, load_config

T, B = 16, 16
LETTERS = ("abcdefgh", "ABCDEFGH", "01234567")  # each source's alphabet tells its rows apart


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Three prepared sources (byte tokenizer) of 60 to 120 windows, written in disjoint
    alphabets."""
    root = tmp_path_factory.mktemp("mixture")
    paths = []
    for i, letters in enumerate(LETTERS):
        rng = np.random.default_rng(i)
        with (root / f"{i}.jsonl").open("w") as f:
            for _ in range(30 * (i + 2)):
                f.write(json.dumps({"text": "".join(rng.choice(list(letters), 40))}) + "\n")
        prepare([root / f"{i}.jsonl"], root / f"s{i}", validation_fraction=0.1, progress=False)
        paths.append(root / f"s{i}")
    return paths


def _iterator(paths, weights, **kw):
    kw = dict(split="train", seq_len=T, global_batch_size=B, seed=5, process_index=0,
              process_count=1, num_threads=1) | kw
    return build_mixture_iterator(paths, MixtureSchedule(weights, kw["seed"]), **kw)


def _source_of(row: np.ndarray) -> int:
    """Which alphabet a window's letters come from (the EOS, 256, belongs to all)."""
    text = bytes(int(t) for t in row if t < 256).decode()
    (found,) = {i for i, letters in enumerate(LETTERS) if set(text) <= set(letters)}
    return found


def _rows(batch):
    return np.concatenate([batch["input_ids"], batch["labels"][:, -1:]], axis=1)


def test_realised_proportions_are_within_sampling_error(sources):
    """Over n examples a source of share w gives w n +- 4 sqrt(w (1 - w) n) examples; the rows
    read are the schedule's."""
    weights = np.array([1.0, 2.0, 5.0])
    shares = weights / weights.sum()
    it, steps = _iterator(sources, weights), 100
    drawn = [_source_of(row) for _ in range(steps) for row in _rows(next(it))]
    n = steps * B
    assert drawn == MixtureSchedule(weights, 5).sources(0, n).tolist()
    bound = 4 * np.sqrt(shares * (1 - shares) / n)
    assert (np.abs(np.bincount(drawn, minlength=3) / n - shares) < bound).all()
    big = 10**6  # the schedule alone, far beyond the first batches
    counts = MixtureSchedule(weights, 5).counts(10**9, 10**9 + big)
    assert (np.abs(counts / big - shares) < 4 * np.sqrt(shares * (1 - shares) / big)).all()


@pytest.mark.slow
def test_each_source_is_read_in_its_own_order_without_skipping(sources):
    """A source's k-th example is item k of its shuffled windows: every window once before
    any repeats, in a seeded order that differs between seeds."""
    def order(seed):
        it = _iterator(sources, [1.0, 1.0, 1.0], seed=seed)
        seen = [r.tobytes() for _ in range(40) for r in _rows(next(it)) if _source_of(r) == 0]
        return seen
    windows = make_window_source(sources[0], split="train", seq_len=T)
    first = order(5)[:len(windows)]
    assert len(first) == len(windows) == len(set(first))
    assert sorted(first) == sorted(windows[i].tobytes() for i in range(len(windows)))
    assert order(6)[:len(windows)] != first


def test_resume_gives_the_uninterrupted_batches_bitwise(sources):
    weights = [1.0, 3.0, 2.0]
    reference = [next(it) for it in [_iterator(sources, weights, packing="documents")]
                 for _ in range(12)]
    it = _iterator(sources, weights, packing="documents")
    for _ in range(5):
        next(it)
    state = json.loads(json.dumps(it.get_state()))  # what a checkpoint stores
    restored = _iterator(sources, weights, packing="documents")  # a fresh schedule: no counts
    restored.set_state(state)
    for want in reference[5:]:
        got = next(restored)
        assert set(got) == set(want) == {"input_ids", "labels", "segment_ids", "positions"}
        for key in want:
            assert got[key].tobytes() == want[key].tobytes(), key


@pytest.mark.parametrize("processes", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_processes_read_disjoint_rows_of_the_same_global_batch(sources, processes):
    weights = [1.0, 1.0, 2.0]
    whole = [_rows(next(it)) for it in [_iterator(sources, weights)] for _ in range(4)]
    slices = [[_rows(next(it)) for _ in range(4)] for it in
              [_iterator(sources, weights, process_index=p, process_count=processes)
               for p in range(processes)]]
    for step, batch in enumerate(whole):
        parts = [s[step] for s in slices]
        assert all(len(p) == B // processes for p in parts)
        np.testing.assert_array_equal(np.concatenate(parts), batch)  # in order
        keys = [r.tobytes() for p in parts for r in p]
        assert len(set(keys)) == B  # no row read twice: the processes' rows are disjoint


@pytest.mark.slow
def test_sources_with_different_tokenizers_are_refused(sources, tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "x" * 400}) + "\n")
    prepare([tmp_path / "d.jsonl"], tmp_path / "other", tokenizer="qwen3",
            validation_fraction=0.0, progress=False)
    with pytest.raises(ValueError, match="must share one tokenizer"):
        _iterator([sources[0], tmp_path / "other"], [1.0, 1.0])


def _slow(*args):  # make test keeps two cases; make test-all runs every case
    return pytest.param(*args, marks=pytest.mark.slow)


@pytest.mark.parametrize("data, message", [
    ({"path": "x", "mixture": [{"name": "a", "path": "y", "weight": 1}]},
     "data.path='x' and data.mixture are exclusive"),
    ({"mixture": [{"name": "a", "path": "y"}]}, "data.mixture[0] lacks weight"),
    _slow({"mixture": [{"name": "a", "path": "y", "weight": 0}]},
          "data.mixture[0].weight=0.0 is invalid"),
    _slow({"mixture": [{"name": "a", "path": "y", "weight": 1},
                       {"name": "a", "path": "z", "weight": 1}]},
          "data.mixture[1].name='a' is invalid: expected a unique name"),
    _slow({"mixture": [{"name": "a", "path": "tfds:x", "weight": 1}]}, "a TFDS stream"),
    _slow({"mixture": [{"name": "a", "path": "y", "weight": 1, "share": 2}]},
          "unknown key(s) data.mixture[0].share"),
])
def test_mixture_config_errors_name_the_key(tmp_path, data, message):
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({"data": data}))
    with pytest.raises(ValueError) as error:
        load_config(config)
    assert message in str(error.value) and str(config) in str(error.value)
    assert "\n" not in str(error.value)


def test_a_mixture_config_round_trips(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({"data": {"mixture": [
        {"name": "web", "path": "a", "weight": 3}, {"name": "code", "path": "b", "weight": 1}]}}))
    cfg = load_config(config)
    assert cfg.data.path is None and [s.name for s in cfg.data.mixture] == ["web", "code"]
    (tmp_path / "saved.yaml").write_text(dump_config(cfg))
    assert load_config(tmp_path / "saved.yaml") == cfg
    assert math.isclose(sum(MixtureSchedule([s.weight for s in cfg.data.mixture], 0).shares), 1)
