"""scripts/wheelhouse.py's logic, offline: markers, the image list, the resolver (on a fake
index of tiny wheels), the size limit, the manifest and build's handling of ``--out``.

The real ``build`` and ``check`` (PyPI, an isolated interpreter, a training step) run in
scripts/gpu_check.sh; here one download of a 24 KiB wheel checks the pip command line,
skipped without network.
"""

from __future__ import annotations

import importlib.util
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("wheelhouse", ROOT / "scripts" / "wheelhouse.py")
wh = sys.modules["wheelhouse"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(wh)


def names(requirements) -> list[str]:
    return [req.name for req in requirements]


# --- markers ----------------------------------------------------------------------------


LINES = ["plain", "old; python_version < '3.12'", "windows; sys_platform == 'win32'", "dev; extra == 'dev'",
         "x86; platform_machine == 'x86_64' and platform_system == 'Linux'", "new; python_full_version >= '3.12.3'"]


def test_markers_are_those_of_linux_x86_64_cpython_of_the_version_asked():
    assert names(wh.active_requirements(LINES, wh.marker_environment("3.12"))) == ["plain", "x86", "new"]
    assert names(wh.active_requirements(LINES, wh.marker_environment("3.11"))) == ["plain", "old", "x86"]
    # 3.12 is the image's 3.12.3; 3.12.1 is not.
    assert "new" not in names(wh.active_requirements(LINES, wh.marker_environment("3.12.1")))


def test_extra_lines_count_only_for_the_extras_asked_for():
    env = wh.marker_environment("3.12")
    assert "dev" not in names(wh.active_requirements(LINES, env))
    assert "dev" in names(wh.active_requirements(LINES, env, extras={"dev"}))


@pytest.mark.parametrize("bad", ["3", "2.7", "3.x", "3.12.3.1", ""])
def test_a_bad_python_version_names_the_argument(bad):
    with pytest.raises(wh.WheelhouseError, match="--python-version"):
        wh.marker_environment(bad)


# --- the image list ---------------------------------------------------------------------


def test_the_committed_image_list_has_the_versions_kinds_md_gives():
    image = wh.read_image()
    assert {name: image.versions[name] for name in ("torch", "triton", "transformers", "numpy", "huggingface-hub",
                                                    "safetensors", "tokenizers")} == {
        "torch": "2.11.0", "triton": "3.6.0", "transformers": "5.17.0", "numpy": "2.5.2",
        "huggingface-hub": "1.33.0", "safetensors": "0.8.0", "tokenizers": "0.23.2"}
    assert image.versions["typing-extensions"] is None  # there, version not read
    assert len(image.versions) > 150


def test_each_requirement_is_carried_skipped_or_left_out():
    image = wh.read_image()
    never = ("torch", "TorchVision", "nvidia-cublas", "nvidia-cutlass-dsl")
    assert [image.kind(name) for name in never] == ["never"] * 4
    assert [image.kind(name) for name in ("huggingface_hub", "PyYAML", "aiohttp")] == ["image"] * 3
    assert [image.kind(name) for name in ("pydantic", "Pydantic_Core", "datasets", "hs-connectors")] == ["bundle"] * 4
    assert image.kind("mistral_common") == "left out"


@pytest.mark.parametrize("bad", ["numpy>=2", "numpy>2", "numpy==", "numpy==two", "-numpy"])
def test_a_malformed_image_line_is_named(tmp_path, bad):
    path = tmp_path / "image.txt"
    path.write_text(f"# comment\ntorch==2.11.0  # a note\n\n{bad}\n")
    with pytest.raises(wh.WheelhouseError, match=r"image.txt:4"):
        wh.read_image(path)


def test_the_roots_are_requirements_upstream_pins():
    upstream = wh.read_upstream()
    assert [str(req) for req in wh.roots_of(upstream, with_nemo=True)] == ["speculators==0.9.0",
                                                                          "nemo-automodel==0.7.0"]
    assert wh.pinned_versions(upstream.values())["pydantic"] == "2.14.4"


# --- the resolver, on a fake index ------------------------------------------------------


def make_wheel(directory: Path, name: str, version: str, requires: list[str], size: int = 0) -> Path:
    """A minimal wheel: METADATA with ``requires``, and ``size`` bytes of padding."""
    path = directory / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    dist_info = f"{name.replace('-', '_')}-{version}.dist-info"
    metadata = "".join([f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
                        *(f"Requires-Dist: {line}\n" for line in requires)])
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as archive:
        archive.writestr(f"{dist_info}/METADATA", metadata)
        archive.writestr(f"{name}/pad.bin", b"\0" * size)
    return path


def fake_index(index: dict[str, dict[str, list[str]]], size: int = 0, log: list | None = None):
    """A fetch that writes the newest version of each spec that ``index`` holds."""
    def fetch(specs: list[str], dest: Path) -> None:
        if log is not None:
            log.append(list(specs))
        for spec in specs:
            req = Requirement(spec)
            versions = [version for version in sorted(index.get(req.name, {}), key=wh.Version, reverse=True)
                        if req.specifier.contains(version)]
            if not versions:
                raise wh.WheelhouseError(f"no {spec}")
            make_wheel(dest, req.name, versions[0], index[req.name][versions[0]], size)
    return fetch


IMAGE = wh.Image({"torch": "2.11.0", "transformers": "5.17.0", "numpy": "2.5.2", "typing-extensions": None})
INDEX = {
    "app": {"1.0": ["lib>=1", "torch>=2.9", "numpy<=2.5.4", "typing-extensions>=4.16", "mistral-common",
                    "win; sys_platform == 'win32'", "dev; extra == 'dev'", "old; python_version < '3.12'",
                    "helper[fast]", "nvidia-cutlass-dsl"]},
    "lib": {"2.0": ["numpy>=3"], "1.5": ["tiny>=1"]},
    "tiny": {"1.0": [], "2.0": []},
    "helper": {"1.0": ["speedup; extra == 'fast'"]},
    "speedup": {"1.0": []},
}


def resolve(tmp_path, index=INDEX, prefer=None, log=None):
    dest = tmp_path / "dest"
    dest.mkdir(exist_ok=True)
    return wh.resolve([Requirement("app==1.0")], IMAGE, wh.marker_environment("3.12"), dest,
                      fake_index(index, log=log), prefer=prefer)


def test_the_resolver_carries_what_the_image_lacks_and_passes_over_what_it_cannot_meet(tmp_path):
    log = []
    resolution = resolve(tmp_path, prefer={"tiny": "1.0"}, log=log)
    assert {name: pick.version for name, pick in resolution.picks.items()} == {
        "app": "1.0", "helper": "1.0", "lib": "1.5", "speedup": "1.0", "tiny": "1.0"}
    assert sorted(p.name for p in (tmp_path / "dest").iterdir()) == sorted(
        pick.path.name for pick in resolution.picks.values())  # one wheel each, lib 2.0 gone
    assert resolution.passed_over == ["lib 2.0: needs numpy>=3 (image: 2.5.2)"]
    assert resolution.left_out == {"mistral-common": ["app 1.0"]}
    assert resolution.unverified == {"typing-extensions": [">=4.16 (app 1.0)"]}
    assert resolution.missing == ["app 1.0 needs nvidia-cutlass-dsl: not in the image, and never carried"]
    assert resolution.picks["lib"].needed_by == ["app 1.0: lib>=1"]
    # One pip call a round: the pin, the roots' requirements together, an older lib.
    assert log == [["app==1.0"], ["helper", "lib>=1"], ["lib>=1,!=2.0", "speedup"], ["tiny==1.0"]]


def test_an_image_package_in_carry_over_is_carried_at_what_every_pick_asks(tmp_path):
    assert "transformers" in wh.CARRY_OVER
    index = {"app": {"1.0": ["transformers<=5.19", "lib"]}, "lib": {"1.0": ["transformers==5.18.0"]},
             "transformers": {"5.19.0": [], "5.18.0": ["numpy>=1.17"]}}
    resolution = resolve(tmp_path, index=index)
    assert {name: pick.version for name, pick in resolution.picks.items()} == {
        "app": "1.0", "lib": "1.0", "transformers": "5.18.0"}
    assert resolution.carried == {"transformers": "5.17.0"}
    assert resolution.picks["transformers"].needed_by == ["app 1.0: transformers<=5.19",
                                                          "lib 1.0: transformers==5.18.0"]
    assert not resolution.passed_over


def test_the_resolver_fails_when_no_version_fits_the_image(tmp_path):
    index = {**INDEX, "lib": {"2.0": ["numpy>=3"]}}
    with pytest.raises(wh.WheelhouseError, match=r"lib>=1.*needed by app 1.0"):
        resolve(tmp_path, index=index)


def test_a_later_requirement_repicks_an_earlier_pick(tmp_path):
    # app takes tiny's newest (2.0) first; lib, found a round later, caps it below 2.
    index = {"app": {"1.0": ["tiny", "lib"]}, "lib": {"1.0": ["tiny<2"]}, "tiny": {"1.0": [], "2.0": []}}
    resolution = resolve(tmp_path, index=index)
    assert resolution.picks["tiny"].version == "1.0"
    assert [p.name for p in (tmp_path / "dest").glob("tiny-*")] == ["tiny-1.0-py3-none-any.whl"]


# --- size, manifest, build --------------------------------------------------------------


def test_the_size_check_fails_above_the_limit_only(tmp_path):
    big = {"app": {"1.0": ["lib"]}, "lib": {"1.0": []}}
    dest = tmp_path / "dest"
    dest.mkdir()
    resolution = wh.resolve([Requirement("app")], IMAGE, wh.marker_environment("3.12"), dest,
                            fake_index(big, size=600 * 1024))
    assert 1.1 < wh.mib(resolution.total) < 1.3
    wh.check_size(resolution, 1.3)
    with pytest.raises(wh.WheelhouseError, match=r"1\.2 MiB, above --max-mib 1"):
        wh.check_size(resolution, 1.0)


def test_the_manifest_lists_each_wheel_and_the_notes(tmp_path):
    resolution = resolve(tmp_path, prefer={"tiny": "1.0"})
    text = wh.manifest_text(resolution, "3.12")
    lines = text.splitlines()
    assert "CPython 3.12.3" in lines[0] and "--target /tmp/site" in lines[1]
    rows = [line.split(" ", 3) for line in lines if not line.startswith("#")]
    assert [row[:2] for row in rows] == [["app", "1.0"], ["helper", "1.0"], ["lib", "1.5"], ["speedup", "1.0"],
                                         ["tiny", "1.0"]]
    assert rows[0][3] == "requirements/upstream.txt: app==1.0"
    assert all(float(row[2]) > 0 for row in rows)
    assert "# left out mistral-common (needed by app 1.0): " + wh.LEFT_OUT["mistral-common"] in lines
    assert lines[-1].startswith("# total: 5 wheels, ")


def test_build_writes_the_bundle_and_leaves_out_alone_when_too_big(tmp_path, monkeypatch):
    index = {"speculators": {"0.9.0": ["pydantic>=2", "torch"]}, "pydantic": {"2.14.4": []}}
    out = tmp_path / "whl"
    wh.build(out, "3.12", with_nemo=False, max_mib=40, fetch=fake_index(index))
    assert sorted(p.name for p in out.iterdir()) == ["MANIFEST.txt", "pydantic-2.14.4-py3-none-any.whl",
                                                    "speculators-0.9.0-py3-none-any.whl"]
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    with pytest.raises(wh.WheelhouseError, match="--max-mib"):
        wh.build(out, "3.12", with_nemo=False, max_mib=0.5, fetch=fake_index(index, size=1 << 20))
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


def test_build_refuses_an_out_that_holds_other_files(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(wh.WheelhouseError, match=r"--out .* holds more than wheels \(notes.txt\)"):
        wh.build(tmp_path, "3.12", with_nemo=False, max_mib=40, fetch=fake_index({}))
    assert (tmp_path / "notes.txt").exists()


def test_check_refuses_two_versions_of_one_package(tmp_path):
    make_wheel(tmp_path, "pydantic", "2.14.4", [])
    make_wheel(tmp_path, "pydantic", "2.13.0", [])
    with pytest.raises(wh.WheelhouseError, match="--wheels .* two versions"):
        wh.read_bundle(tmp_path)


# --- one real download ------------------------------------------------------------------


def test_pip_download_fetches_a_cp312_wheel_and_its_requirements(tmp_path):
    try:
        wh.pip_download("3.12")(["hs-connectors==0.9.0"], tmp_path)
    except wh.WheelhouseError as error:
        pytest.skip(f"pip download of hs-connectors 0.9.0 failed (no network or no index?): {error}")
    (path,) = tmp_path.glob("*.whl")
    name, version, lines = wh.wheel_metadata(path)
    assert (name, version) == ("hs-connectors", "0.9.0")
    assert {"torch", "safetensors"} <= set(names(wh.active_requirements(lines, wh.marker_environment("3.12"))))
