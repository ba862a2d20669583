"""The Markdown blocks a bench report shows, shared by ``bench.md`` (run.py) and
``make report`` (report.py) so the two cannot drift apart."""

from __future__ import annotations

from tabulate import tabulate

from kit.bench import step_log
from kit.bench.ttft_stats import (
    control_lines,
    engine_lines,
    hop_lines,
    pooled_table,
    table,
    unpaused_lines,
)

# The library vLLM's CPU wheel imports without AVX-512: its GDN chunk kernel is
# ~50x slower there (kit/bundle.py), so a reader comparing bundles must know.
SLOW_KERNELS = "vllm._C_AVX2"


def kernels_line(report: dict) -> list[str]:
    """The CPU kernels the run's environment used (``bundle.cpu_kernels``), where known."""
    kernels = (report["run"].get("environment") or {}).get("cpu_kernels")
    if not isinstance(kernels, dict):
        return []
    line = f"CPU kernels: torch {kernels['torch_capability']}, {kernels['vllm_library']}"
    if kernels.get("amx"):  # absent from bundles made before the kit recorded it
        line += ", AMX"
    if kernels["vllm_library"] == SLOW_KERNELS:
        line += (
            " (no AVX-512: vLLM's CPU GDN kernel is ~50x slower here, every TTFT scales "
            "with it; compare ratios only with bundles of the same library)"
        )
    return [line + ".", ""]


def result_blocks(report: dict, pooled_caption: str) -> list[str]:
    """The per-request table, the pooled table under ``pooled_caption``, and the
    notes that follow them (cached B against its control, unpaused rows, vLLM's own
    times, engine steps)."""
    headers, body = table(report["summary"])
    pooled_headers, pooled_body = pooled_table(report["pooled_ratios"])
    return [
        tabulate(body, headers=headers, tablefmt="github"),
        "",
        pooled_caption,
        "",
        tabulate(pooled_body, headers=pooled_headers, tablefmt="github"),
        "",
        *control_lines(report["summary"]),
        *unpaused_lines(report),
        *engine_lines(report),
        *hop_lines(report.get("hop_gap")),
        *step_log.lines(report.get("engine_steps")),
        *step_log.fence_lines(report.get("fence")),
    ]


def retention_text(geo: dict) -> str:
    """The servers' prefix-cache retention as a bundle's geometry records it (older
    bundles and servers that do not export it: not recorded)."""
    if "retention" not in geo:
        return "retention not recorded"
    value = geo["retention"]
    return "retention dense" if value is None else f"retention {value}"
