"""The tuner's choices (dflash2_kernels/tuning/tuner.py) with the GPU's parts stood in:
a timer that reports given times, a GPU name, tensors that count as on a GPU. The timing
itself runs in tests/test_conv_gpu.py where CUDA is present."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from dflash2_kernels.tuning import SPACES, Config, Space, Tuner, key_text, rows_class
from dflash2_kernels.tuning.tuner import TUNER

GPU = "NVIDIA H200"
SPACE = Space("toy", (Config("a", 4), Config("b", 8), Config("c", 4, 2)))
KEY = (1024, torch.bfloat16, 4096)


class _Launch:
    """What a trial builds: the tuner reads only ``args`` (to restore what a kernel mutates)."""

    def __init__(self, config, buffer):
        self.config, self.args = config, {"out_ptr": buffer}


class _StandInTuner(Tuner):
    """A tuner whose tensors count as on a GPU, that may time, and whose timer reports
    ``times`` by configuration name (and scribbles on the mutated buffer, as a kernel that
    accumulates would)."""

    def __init__(self, times, shipped_path, **kwargs):
        self.timed = []

        def timer(launch, device_of):
            self.timed.append(launch.config.name)
            launch.args["out_ptr"].add_(1.0)
            value = times[launch.config.name]
            if isinstance(value, Exception):
                raise value
            return value

        super().__init__(device_name=lambda index: GPU, timer=timer, shipped_path=shipped_path, **kwargs)

    on_gpu = staticmethod(lambda device_of: True)
    can_time = staticmethod(lambda device_of: True)


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH2_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("DFLASH2_AUTOTUNE", raising=False)
    shipped = tmp_path / "shipped.json"
    shipped.write_text("{}")
    return shipped


def _choose(tuner, space=SPACE, key=KEY, buffer=None):
    buffer = torch.zeros(3) if buffer is None else buffer
    return tuner.choose(space, key, buffer, lambda config: _Launch(config, buffer))


def test_times_every_member_once_and_keeps_the_fastest(env):
    tuner = _StandInTuner({"a": 3.0, "b": 1.0, "c": 2.0}, env)
    assert _choose(tuner).name == "b"
    assert tuner.timed == ["a", "b", "c"]
    assert _choose(tuner).name == "b" and tuner.timed == ["a", "b", "c"]  # remembered in the process
    (trial,) = tuner.trials
    assert trial["winner"] == "b" and trial["default"] == "a" and trial["gpu"] == GPU
    assert trial["times_ms"] == {"a": 3.0, "b": 1.0, "c": 2.0}


def test_a_tie_keeps_the_default(env):
    tuner = _StandInTuner({"a": 1.0, "b": 1.0, "c": 1.0}, env)
    assert _choose(tuner).name == "a"


def test_another_shape_class_is_timed_again(env):
    tuner = _StandInTuner({"a": 3.0, "b": 1.0, "c": 2.0}, env)
    _choose(tuner)
    _choose(tuner, key=(2048, torch.bfloat16, 4096))
    assert len(tuner.timed) == 6


def test_the_winner_outlives_the_process_on_disk(env, tmp_path):
    _choose(_StandInTuner({"a": 3.0, "b": 1.0, "c": 2.0}, env))
    (path,) = (tmp_path / "cache" / "tuning").iterdir()
    assert GPU.replace(" ", "_") in path.name and "triton-" in path.name
    table = json.loads(path.read_text())
    assert table["toy"] == {"digest": SPACE.digest, "winners": {key_text(KEY): "b"}}
    later = _StandInTuner({"a": 1.0, "b": 9.0, "c": 9.0}, env)  # a new process: reads, does not time
    assert _choose(later).name == "b" and later.timed == []


def test_a_changed_space_does_not_trust_old_winners(env):
    _choose(_StandInTuner({"a": 3.0, "b": 1.0, "c": 2.0}, env))
    changed = Space("toy", (Config("a", 4), Config("b", 8, 4)))
    later = _StandInTuner({"a": 1.0, "b": 2.0}, env)
    assert _choose(later, space=changed).name == "a" and later.timed == ["a", "b"]


def test_the_shipped_table_comes_first(env):
    env.write_text(json.dumps({GPU: {"toy": {"digest": SPACE.digest, "winners": {key_text(KEY): "c"}}}}))
    tuner = _StandInTuner({"a": 3.0, "b": 1.0, "c": 2.0}, env)
    assert _choose(tuner).name == "c" and tuner.timed == []
    other_gpu = _StandInTuner({"a": 3.0, "b": 1.0, "c": 2.0}, env)
    other_gpu._device_name = lambda index: "NVIDIA A100-SXM4-80GB"
    assert _choose(other_gpu).name == "b"


def test_an_unknown_name_in_a_table_is_ignored(env):
    env.write_text(json.dumps({GPU: {"toy": {"digest": SPACE.digest, "winners": {key_text(KEY): "zzz"}}}}))
    tuner = _StandInTuner({"a": 3.0, "b": 1.0, "c": 2.0}, env)
    assert _choose(tuner).name == "b"


def test_retune_skips_the_tables(env, monkeypatch):
    env.write_text(json.dumps({GPU: {"toy": {"digest": SPACE.digest, "winners": {key_text(KEY): "c"}}}}))
    monkeypatch.setenv("DFLASH2_AUTOTUNE", "retune")
    tuner = _StandInTuner({"a": 3.0, "b": 1.0, "c": 2.0}, env)
    assert _choose(tuner).name == "b" and len(tuner.timed) == 3


@pytest.mark.parametrize("value", ["0", "off", " OFF "])
def test_autotune_off_launches_the_default_untimed(env, monkeypatch, value):
    env.write_text(json.dumps({GPU: {"toy": {"digest": SPACE.digest, "winners": {key_text(KEY): "c"}}}}))
    monkeypatch.setenv("DFLASH2_AUTOTUNE", value)
    tuner = _StandInTuner({"a": 3.0, "b": 1.0, "c": 2.0}, env)
    assert _choose(tuner).name == "a" and tuner.timed == []


def test_a_bad_autotune_value_names_the_variable(env, monkeypatch):
    monkeypatch.setenv("DFLASH2_AUTOTUNE", "fast")
    with pytest.raises(ValueError, match="DFLASH2_AUTOTUNE must be 1 .* got 'fast'"):
        _choose(_StandInTuner({"a": 3.0, "b": 1.0, "c": 2.0}, env))


def test_mutated_buffers_are_restored_after_each_trial(env):
    space = Space("acc", SPACE.configs, mutates=("out_ptr",))
    buffer = torch.tensor([1.0, 2.0, 3.0])
    _choose(_StandInTuner({"a": 3.0, "b": 1.0, "c": 2.0}, env), space=space, buffer=buffer)
    assert buffer.tolist() == [1.0, 2.0, 3.0]


def test_a_member_that_fails_is_skipped_with_a_warning(env):
    tuner = _StandInTuner({"a": 3.0, "b": RuntimeError("out of resources"), "c": 2.0}, env)
    with pytest.warns(UserWarning, match="toy configuration b failed on NVIDIA H200"):
        assert _choose(tuner).name == "c"


def test_where_nothing_can_be_timed_the_default_runs_and_is_not_remembered(env):
    tuner = _StandInTuner({"a": 3.0, "b": 1.0, "c": 2.0}, env)
    tuner.can_time = lambda device_of: False  # a CUDA graph capture, a compile trace
    assert _choose(tuner).name == "a" and tuner.timed == []
    tuner.can_time = lambda device_of: True
    assert _choose(tuner).name == "b"


def test_an_unwritable_cache_warns_and_still_tunes(env, monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("DFLASH2_CACHE_DIR", str(blocker))
    tuner = _StandInTuner({"a": 3.0, "b": 1.0, "c": 2.0}, env)
    with pytest.warns(UserWarning, match="cannot write the tuning cache"):
        assert _choose(tuner).name == "b"


def test_forced_configurations_win_and_unwind(env):
    tuner = _StandInTuner({"a": 3.0, "b": 1.0, "c": 2.0}, env)
    with tuner.forced({"toy": SPACE.configs[2]}):
        assert _choose(tuner).name == "c"
    assert _choose(tuner).name == "b"


def test_cpu_tensors_take_the_default_without_timing():
    """The real tuner: under the interpreter (CPU tensors) nothing is timed or remembered."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = TUNER.choose(SPACE, KEY, torch.zeros(2), lambda config: pytest.fail("timed on the CPU"))
    assert config is SPACE.default


def test_spaces_are_closed_small_and_distinct():
    for name, space in SPACES.items():
        assert space.name == name
        assert 2 <= len(space.configs) <= 5, name
        assert len({(c.num_warps, c.num_stages, tuple(sorted(c.params.items()))) for c in space.configs}) == \
            len(space.configs), f"{name} has two identical members"
    assert len({space.digest for space in SPACES.values()}) == len(SPACES)


def test_rows_class():
    assert [rows_class(n) for n in (1, 64, 65, 256, 257, 70_000)] == [64, 64, 128, 256, 512, 65536]


def test_the_shipped_table_is_valid():
    """Every shipped winner names a member of its space (else it would be silently ignored)."""
    from dflash2_kernels.tuning.tuner import SHIPPED_TABLE

    table = json.loads(SHIPPED_TABLE.read_text())
    for gpu, spaces in table.items():
        for name, entry in spaces.items():
            space = SPACES[name]
            assert entry["digest"] == space.digest, f"{gpu}: {name}'s shipped winners are for another space"
            for key, winner in entry["winners"].items():
                assert space.named(winner) is not None, (gpu, name, key, winner)
