"""`make report` over the committed CPU bundle, alone and side by side."""

from __future__ import annotations

from pathlib import Path

import pytest

from kit import bundle as bundle_module
from kit.bench import report

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[2]
BUNDLES = sorted(p.parent for p in (ROOT / "results").glob("*-cpu-*/bench.json"))


@pytest.fixture()
def bundle() -> Path:
    if not BUNDLES:
        pytest.fail("no committed CPU results bundle under results/")
    return BUNDLES[-1]


def test_single_bundle(bundle: Path) -> None:
    text = report.render([bundle])
    assert "cached_B" in text and "fix-eagle-fine-prefix" in text
    assert "Oracle" in text


def test_two_bundles_side_by_side(bundle: Path, tmp_path: Path) -> None:
    other = tmp_path / "copy-of-bundle"
    other.mkdir()
    (other / "bench.json").write_text((bundle / "bench.json").read_text())
    text = report.render([bundle, other])
    assert "## Side by side: cached follow-up" in text
    assert text.count("cached_B") >= 2


def test_two_bundles_with_the_control_compare_it_side_by_side(tmp_path: Path) -> None:
    """Bundles with the control show its patched ratio per S beside each other; one
    from before it leaves the columns out."""
    with_control = [b for b in BUNDLES if "control_B" in (b / "raw.json").read_text()]
    without = [b for b in BUNDLES if b not in with_control]
    assert with_control and without
    other = tmp_path / "copy"
    other.mkdir()
    (other / "bench.json").write_text((with_control[-1] / "bench.json").read_text())
    text = report.render([with_control[-1], other])
    side = text[text.index("## Side by side: cached follow-up") :]
    assert "patched B/control" in side
    older = report.render([without[-1], other])
    assert "patched B/control" in older[older.index("## Side by side: cached follow-up") :]
    alone = tmp_path / "old"
    alone.mkdir()
    (alone / "bench.json").write_text((without[-1] / "bench.json").read_text())
    oldest = report.render([without[-1], alone])
    assert "patched B/control" not in oldest[oldest.index("## Side by side: cached follow-up") :]


def test_not_a_bundle(tmp_path: Path) -> None:
    with pytest.raises(bundle_module.BundleError, match="no bench.json"):
        report.render([tmp_path])
    assert report.main([str(tmp_path)]) == 2


FLOW_BUNDLES = sorted(p.parent for p in (ROOT / "results").glob("*/manifest.json"))


def test_a_container_flow_bundle_renders_its_manifest() -> None:
    if not FLOW_BUNDLES:
        pytest.fail("no committed bundle from the container flow under results/")
    text = report.render([FLOW_BUNDLES[-1]])
    assert "target cpu, engine buildah" in text
    assert "patched image sha256:" in text and "fix-eagle-fine-prefix" in text
    assert "regression_table" in text and "upstream_suite" in text
    # A first run on a GPU box reports its host check with the numbers.
    assert "host check ok: free disk:" in text and "mem_total_gib" in text


def test_a_container_flow_bundle_names_what_ran() -> None:
    # The client runs in an image without git or the servers' packages: the
    # orchestrator fills in the kit commit and both images' mods records.
    if not FLOW_BUNDLES:
        pytest.fail("no committed bundle from the container flow under results/")
    run = bundle_module.read_json(FLOW_BUNDLES[-1] / bundle_module.BENCH)
    assert run["model"]["weights_sha256"]
    assert run["run"]["host"]["kit_commit"]
    records = run["run"]["trees"]
    assert set(records) == {"unpatched", "patched"}
    patched_mods = {m["name"] for m in records["patched"]["mods"]}
    unpatched_mods = {m["name"] for m in records["unpatched"]["mods"]}
    assert "fix-eagle-fine-prefix" in patched_mods - unpatched_mods


@pytest.mark.parametrize(
    "content,message",
    [
        ('{"summary": []}', "no schema field: written by a kit older"),
        ("{}", "no schema field"),
        ('{"schema": {"name": "bench", "version": 99}}', "update the kit"),
        ('{"schema": {"name": "bench", "version": 0}}', "re-run the job with this kit"),
        ('{"schema": {"name": "manifest", "version": 1}}', "a 'manifest' file, not 'bench'"),
        # Version 1: before the checkpoint path and the ratios' intervals.
        ('{"schema": {"name": "bench", "version": 1}}', "re-run the job with this kit"),
        ('{"schema": {"name": "bench", "version": 2}, "summary": []}', "incomplete bench record"),
        ("{not json", "not valid JSON"),
    ],
)
def test_an_older_empty_or_foreign_bench_record_says_what_to_do(
    tmp_path: Path, content: str, message: str, capsys
) -> None:
    (tmp_path / "bench.json").write_text(content)
    assert report.main([str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


def test_a_failed_run_is_not_taken_for_a_bundle(tmp_path: Path, capsys) -> None:
    bundle_module.write_failed(tmp_path, "stopped by SIGTERM", "interrupted")
    assert report.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "that bench run interrupted (stopped by SIGTERM)" in err and "logs" in err


def test_two_bundles_compare_as_a_figure(bundle: Path, tmp_path: Path) -> None:
    from PIL import Image

    figure = tmp_path / "compare.png"
    assert (
        report.main([str(bundle), str(bundle), "--figure", str(figure), "--out", "/dev/null"]) == 0
    )
    with Image.open(figure) as image:
        assert image.size == (900, 520)
        assert len(set(image.getdata())) > 10  # drawn, not blank


def test_the_bench_figures_from_a_committed_bundle(bundle: Path, tmp_path: Path) -> None:
    import json

    from PIL import Image

    from kit import plot

    made = plot.bench_figures(
        json.loads((bundle / "bench.json").read_text()),
        json.loads((bundle / "raw.json").read_text()),
        tmp_path,
    )
    assert sorted(p.name for p in made) == sorted(bundle_module.FIGURES)
    for path in made:
        with Image.open(path) as image:
            assert len(set(image.getdata())) > 10


def test_figures_cover_the_range(tmp_path: Path) -> None:
    from kit.plot import nice_ticks

    assert nice_ticks(0, 2159) == [0, 500, 1000, 1500, 2000, 2500]
    assert nice_ticks(0, 0.47)[-1] >= 0.47


def test_redraw_draws_a_bundles_figures_from_its_records(bundle: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / bundle.name
    copy.mkdir()
    for name in ("bench.json", "raw.json"):
        shutil.copy(bundle / name, copy / name)
    assert report.main([str(copy), "--redraw"]) == 0
    first = {name: (copy / name).read_bytes() for name in bundle_module.FIGURES}
    assert report.main([str(copy), "--redraw"]) == 0
    # Drawn from the records alone: the same bytes every time.
    assert first == {name: (copy / name).read_bytes() for name in bundle_module.FIGURES}


def test_redraw_without_the_requests_says_what_is_missing(
    bundle: Path, tmp_path: Path, capsys
) -> None:
    import shutil

    shutil.copy(bundle / "bench.json", tmp_path / "bench.json")
    assert report.main([str(tmp_path), "--redraw"]) == 2
    assert "raw.json" in capsys.readouterr().err


def test_figure_titles_name_the_path_and_the_interval() -> None:
    from kit.plot import path_label, spread

    ratio = {"median": 1.0, "ci95": [0.97, 1.04], "min": 0.8, "max": 1.3}
    assert spread(ratio) == "[95% CI 0.97-1.04]"
    assert spread({k: v for k, v in ratio.items() if k != "ci95"}) == "(min-max 0.80-1.30)"
    assert path_label("internal") == ", internal checkpoints" and path_label(None) == ""


def test_bench_md_and_the_report_show_the_same_result_blocks(bundle: Path) -> None:
    # Both writers take their tables and notes from md_blocks; a block added to
    # one shows up in the other.
    from kit.bench import md_blocks
    from kit.bench import run as bench

    loaded = bundle_module.load(bundle)
    written, rendered = bench.markdown(loaded), report.render([bundle])
    for line in md_blocks.result_blocks(loaded, "caption") + md_blocks.kernels_line(loaded):
        if line and line != "caption":
            assert line in written and line in rendered, line


def _with_kernels(kernels: object) -> dict:
    return {"run": {"environment": {"cpu_kernels": kernels}}}


def test_the_kernels_line_warns_only_for_the_slow_library() -> None:
    from kit.bench.md_blocks import kernels_line

    slow = kernels_line(_with_kernels({"torch_capability": "AVX2", "vllm_library": "vllm._C_AVX2"}))
    assert "torch AVX2, vllm._C_AVX2" in slow[0] and "~50x slower" in slow[0]
    fast = kernels_line(
        _with_kernels({"torch_capability": "AVX512", "vllm_library": "vllm._C_AVX512"})
    )
    assert "vllm._C_AVX512" in fast[0] and "slower" not in fast[0] and "AMX" not in fast[0]
    amx = kernels_line(
        _with_kernels({"torch_capability": "AVX512", "vllm_library": "vllm._C", "amx": True})
    )
    assert "torch AVX512, vllm._C, AMX." in amx[0]
    assert kernels_line(_with_kernels("not recorded: exit 1")) == []
    assert kernels_line({"run": {}}) == []
