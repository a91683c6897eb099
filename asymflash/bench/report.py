"""The reporting part of `asymflash bench`: markdown tables, the JSON record, PNG charts."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import importlib.metadata
import json
import math
import platform
import re
import subprocess
from collections import OrderedDict
from pathlib import Path

import torch

from .core import MODES, OK, Case, Result

# --------------------------------------------------------------------------------------------
# Grouping results


def provider_order(results: list) -> list:
    """Provider names in first-seen order (the runner's order: peers, then asymflash)."""
    return list(OrderedDict.fromkeys(r.provider for r in results))


def cases_in_order(results: list) -> list:
    return list(OrderedDict.fromkeys(r.case for r in results))


def modes_in_order(results: list) -> list:
    seen = {r.mode for r in results}
    return [m for m in MODES if m in seen]


def index(results: list) -> dict:
    return {(r.case, r.mode, r.provider): r for r in results}


@dataclasses.dataclass
class Ratio:
    """asymflash (its headline provider) over the best peer in one cell (only checked, timed
    results count)."""

    value: float | None
    asymflash: str | None
    peer: str | None


def ratio(cell_results: list, asymflash_names: set, headline: str | None = None) -> Ratio:
    """asymflash over the best peer. `headline` names the asymflash provider that counts
    (what flash_attn_func runs by default: opt-in variants and other backends must not pick
    the cell's best for us); without one, the best asymflash result counts."""
    ok = [r for r in cell_results if r.status == OK and r.tflops is not None]
    mine = [r for r in ok if r.provider in asymflash_names and
            (headline is None or r.provider == headline)]
    ours = max(mine, key=lambda r: r.tflops, default=None)
    peer = max((r for r in ok if r.provider not in asymflash_names), key=lambda r: r.tflops,
               default=None)
    value = ours.tflops / peer.tflops if ours and peer and peer.tflops > 0 else None
    return Ratio(value, ours.provider if ours else None, peer.provider if peer else None)


# --------------------------------------------------------------------------------------------
# Markdown


def cell_text(r: Result | None) -> str:
    if r is None:
        return "-"
    if r.status == OK:
        return f"{r.tflops:.0f}" if r.tflops >= 10 else f"{r.tflops:.3g}"
    return r.status


def _ratio_text(rt: Ratio) -> str:
    if rt.value is None:
        return "-"
    return f"{rt.value:.2f} vs {rt.peer}"


def _row_head(case: Case, varying: dict) -> list:
    cells = [str(case.hdim), str(int(case.causal)), str(case.seqlen_q)]
    return cells + [str(getattr(case, name)) for name in varying]


def _extra_columns(cases: list) -> dict:
    """Columns beyond hdim/causal/seqlen: batch and heads always, the rest when they vary."""
    extra = {"batch": "batch", "nheads": "nheads"}
    if any(c.seqlen_k != c.seqlen_q for c in cases):
        extra["seqlen_k"] = "seqlen_k"
    if any(c.nheads_kv != c.nheads for c in cases):
        extra["nheads_kv"] = "kv heads"
    if any(c.hdim_v != c.hdim for c in cases):
        extra["hdim_v"] = "hdim_v"
    if len({c.dtype for c in cases}) > 1:
        extra["dtype"] = "dtype"
    return extra


def is_model_case(case) -> bool:
    """A case of the models suite (named, with a model), not a grid cell."""
    return bool(getattr(case, "name", ""))


def model_shape(case) -> str:
    """The models suite's shape column: heads, head dims, tokens, and what the kind adds."""
    dims = f"d{case.hdim}" + (f"/{case.hdim_v}" if case.hdim_v != case.hdim else "")
    heads = f"{case.nheads}:{case.nheads_kv}"
    if case.kind == "varlen":
        tokens = f"{len(case.doc_lens)} docs in {case.seqlen_q}"
    elif case.kind == "decode":
        tokens = f"b{case.batch} cache {case.seqlen_k}" + \
            (f" paged {case.page_size}" if case.page_size else "")
    else:
        tokens = f"b{case.batch} x {case.seqlen_q}"
    more = [f"window {case.window[0]}" if case.window[0] >= 0 else "",
            f"softcap {case.softcap:g}" if case.softcap else "",
            f"{case.local_per_global} local + 1 global" if case.kind == "hybrid" else "",
            "causal" if case.causal and case.kind != "decode" else ""]
    return ", ".join([heads, dims, tokens] + [m for m in more if m])


def markdown_table(results: list, mode: str, asymflash_names: set,
                   headline: str | None = None) -> str:
    """One row per case, one column per provider (TFLOP/s or status), then the ratio."""
    providers = provider_order(results)
    cases = cases_in_order(results)
    by_key = index(results)
    models = all(is_model_case(c) for c in cases)
    extra = {} if models else _extra_columns(cases)
    first = ["case", "shape"] if models else ["hdim", "causal", "seqlen", *extra.values()]
    head = [*first, *providers, "asymflash / best peer"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for case in cases:
        cells = [by_key.get((case, mode, p)) for p in providers]
        rt = ratio([c for c in cells if c is not None], asymflash_names, headline)
        row_head = [case.name, model_shape(case)] if models else _row_head(case, extra)
        row = row_head + [cell_text(c) for c in cells] + [_ratio_text(rt)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _where(cells: list, total: int) -> str:
    if len(cells) == total:
        return "all cells"
    shown = ", ".join(f"{r.case.label} {r.mode}" for r in cells[:3])
    return shown + (f" and {len(cells) - 3} more" if len(cells) > 3 else "")


HOST_BOUND = 0.9


def host_bound_notes(results: list) -> list:
    """One line per provider whose host issue time reached HOST_BOUND of a cell's time."""
    groups: OrderedDict = OrderedDict()
    for r in results:
        if r.status == OK and r.host_us is not None and r.ms and \
                r.host_us >= HOST_BOUND * r.ms * 1e3:
            groups.setdefault(r.provider, []).append(r)
    return [f"- {provider}: " + ", ".join(
        f"{r.case.label} {r.mode} ({r.host_us:.0f} of {r.ms * 1e3:.0f} us)" for r in cells)
        for provider, cells in groups.items()]


def problem_notes(results: list) -> list:
    """Each distinct (provider, status, reason) once, with the cells it covers."""
    groups: OrderedDict = OrderedDict()
    for r in results:
        if r.status != OK:
            groups.setdefault((r.provider, r.status, r.reason), []).append(r)
    notes = []
    for (provider, status, reason), cells in groups.items():
        total = sum(1 for x in results if x.provider == provider)
        notes.append(f"- {provider}: {status} ({reason or 'no reason given'}) -- "
                     f"{_where(cells, total)}")
    return notes


def markdown_report(results: list, asymflash_names: set, title: str = "",
                    headline: str | None = None) -> str:
    parts = [f"## {title}"] if title else []
    for mode in modes_in_order(results):
        parts.append(f"### {mode} (TFLOP/s)")
        parts.append(markdown_table([r for r in results if r.mode == mode], mode,
                                    asymflash_names, headline))
    notes = problem_notes(results)
    if notes:
        parts.append("Cells not measured (n/a: cannot run; error: raised; "
                     "WRONG: disagrees with the fp32 reference, not timed):")
        parts.append("\n".join(notes))
    bound = host_bound_notes(results)
    if bound:
        parts.append(f"Host-bound cells (issuing one call took >= {HOST_BOUND:.0%} of its "
                     "measured time, so the time is the host's, not the kernel's):")
        parts.append("\n".join(bound))
    return "\n\n".join(parts) + "\n"


# --------------------------------------------------------------------------------------------
# Environment and JSON


def _dist_versions(modules: tuple) -> dict:
    """Installed distributions that provide the given top-level modules, with versions."""
    owners = importlib.metadata.packages_distributions()
    found = {}
    for module in modules:
        for dist in owners.get(module, []):
            try:
                found[dist] = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                pass
    return found


def _git_commit() -> str | None:
    """HEAD's short hash, with "+modified" when the package's files differ from it (a copy
    of a working tree whose .git is older than its files, as on the device machine: then
    only `source_digest` identifies the code)."""
    here = Path(__file__).parent
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             check=False, text=True, timeout=5, cwd=here)
        if out.returncode != 0 or not out.stdout.strip():
            return None
        status = subprocess.run(["git", "status", "--porcelain", "--", "."],
                                capture_output=True, check=False, text=True, timeout=5,
                                cwd=here)
    except (OSError, subprocess.SubprocessError):
        return None
    modified = status.returncode != 0 or bool(status.stdout.strip())
    return out.stdout.strip() + ("+modified" if modified else "")


def source_digest() -> str:
    """sha256 (12 hex digits) of the package's .py files: identifies the code that ran where
    git is stale or absent (the device tool's checkout copy keeps an older .git).
    Check locally: `python -c "from asymflash.bench.report import source_digest;
    print(source_digest())"` at a commit gives the same digest."""
    h = hashlib.sha256()
    root = Path(__file__).parent
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def collect_env(device: str, command: str) -> dict:
    cuda = device.startswith("cuda") and torch.cuda.is_available()
    triton_version = None
    with contextlib.suppress(ImportError):
        import triton

        triton_version = triton.__version__
    env = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "capability": ".".join(map(str, torch.cuda.get_device_capability(device)))
        if cuda else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "triton": triton_version,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "asymflash_commit": _git_commit(),
        "asymflash_source_sha256": source_digest(),
        "flash_attn": _dist_versions(("flash_attn", "flash_attn_interface", "flash_attn_3")),
    }
    return env


def device_slug(name: str) -> str:
    """'NVIDIA H200' -> 'h200', for result folder names."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower().replace("nvidia", "")).strip("-")
    return slug or "unknown"


def _finite(x):
    """JSON has no inf/NaN; a wrong-shape or NaN error is kept as text instead."""
    return x if x is None or math.isfinite(x) else str(x)


def result_record(r: Result, flops: float) -> dict:
    rec = dataclasses.asdict(r.case)
    rec.update(mode=r.mode, provider=r.provider, status=r.status, ms=r.ms, tflops=r.tflops,
               flops=flops, reason=r.reason, host_us=r.host_us,
               errors={k: {"max_abs_err": _finite(e), "bound": _finite(b)}
                       for k, (e, b) in r.errors.items()})
    kv_bytes = r.case.kv_bytes() if hasattr(r.case, "kv_bytes") else None
    if kv_bytes and r.ms:  # decode's figure of merit: the cache read per second
        rec["kv_gb_per_s"] = kv_bytes / (r.ms * 1e-3) / 1e9
    return rec


def json_record(results: list, env: dict, providers: list, unavailable: dict,
                asymflash_names: set, extra: dict, headline: str | None = None) -> dict:
    from .core import attention_flops

    ratios = []
    by_key = index(results)
    names = provider_order(results)
    for case in cases_in_order(results):
        for mode in modes_in_order(results):
            cells = [by_key[k] for k in ((case, mode, p) for p in names) if k in by_key]
            rt = ratio(cells, asymflash_names, headline)
            ratios.append({**dataclasses.asdict(case), "mode": mode, "ratio": rt.value,
                           "asymflash": rt.asymflash, "best_peer": rt.peer})
    return {
        "env": env,
        **extra,
        "providers": [{"name": p.name, "description": p.description,
                       "asymflash": p.is_asymflash, "headline": p.headline,
                       "unavailable": unavailable.get(p.name)}
                      for p in providers],
        "results": [result_record(r, attention_flops(r.case, r.mode)) for r in results],
        "ratios": ratios,
    }


def write_json(path: Path, record: dict) -> None:
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")


# --------------------------------------------------------------------------------------------
# Charts


# Fixed colours per provider so the same peer looks the same in every chart of a run.
_PALETTE = ("#4C72B0", "#DD8452", "#55A868", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C",
            "#CCB974", "#64B5CD", "#C44E52", "#2F4F4F", "#B8860B")
_MODE_TITLE = {"fwd": "Forward", "bwd": "Backward", "fwdbwd": "Forward + backward"}


def chart_groups(results: list) -> dict:
    """(mode, hdim, causal) -> results: one chart each, seqlen on the x axis. Models-suite
    results: (mode, None, None) -> results, one chart per mode, a case per x position."""
    groups: OrderedDict = OrderedDict()
    for r in results:
        key = (r.mode, None, None) if is_model_case(r.case) else \
            (r.mode, r.case.hdim, r.case.causal)
        groups.setdefault(key, []).append(r)
    return groups


def _x_of(r: Result):
    return r.case.name if is_model_case(r.case) else r.case.seqlen_q


def _bar_label(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:.2g}"


def _seqlen_label(s: int) -> str:
    return f"{s // 1024}k" if s >= 1024 and s % 1024 == 0 else str(s)


def _draw_bars(ax, results: list, providers: list, colours: dict, top: float,
               floor: float = 0.0) -> list:
    """One group of bars per sequence length; returns the sequence lengths in x order."""
    seqlens = list(OrderedDict.fromkeys(_x_of(r) for r in results))
    if not is_model_case(results[0].case):
        seqlens.sort()
    by_key = {(_x_of(r), r.provider): r for r in results}
    width = 0.8 / max(1, len(providers))
    for i, provider in enumerate(providers):
        for j, s in enumerate(seqlens):
            x = j + (i - (len(providers) - 1) / 2) * width
            r = by_key.get((s, provider))
            if r is not None and r.status == OK:
                ax.bar(x, r.tflops, width, color=colours[provider])
                ax.text(x, r.tflops * 1.05 if floor else r.tflops + top * 0.01,
                        _bar_label(r.tflops), ha="center",
                        va="bottom", fontsize=6, rotation=90 if len(providers) > 4 else 0)
            elif r is not None:  # the empty slot says why, instead of looking like zero
                ax.text(x, floor * 1.1 or top * 0.01, r.status, ha="center", va="bottom",
                        fontsize=5,
                        rotation=90, color="#aa0000")
    return seqlens


def plot_chart(path: Path, results: list, mode: str, hdim: int, causal: bool,
               device_name: str, colours: dict) -> None:
    """Grouped bars per sequence length, one colour per provider, TFLOP/s on each bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    # A provider with nothing measured in this chart would be a row of empty slots; it is
    # named in a footnote instead (the table and the JSON say why, cell by cell).
    names = provider_order(results)
    providers = [p for p in names if any(r.provider == p and r.status == OK for r in results)]
    absent = [p for p in names if p not in providers]
    n_seqlens = len({_x_of(r) for r in results})
    fig, ax = plt.subplots(figsize=(min(14.0, max(7.0, 0.3 * n_seqlens * len(providers))), 4.5))
    top = max((r.tflops for r in results if r.status == OK), default=1.0)
    models = hdim is None
    # Decode runs at a few TFLOP/s, prefill at hundreds: one chart needs a log axis.
    floor = min((r.tflops for r in results if r.status == OK), default=1.0) / 4 if models else 0
    if models:
        ax.set_yscale("log")
    seqlens = _draw_bars(ax, results, providers, colours, top, floor)

    ax.set_xticks(range(len(seqlens)))
    ax.set_xticklabels([s if models else _seqlen_label(s) for s in seqlens],
                       rotation=30 if models else 0, ha="right" if models else "center",
                       fontsize=6 if models else None)
    ax.set_xlabel("Model workload" if models else "Sequence length")
    ax.set_ylabel("Speed (TFLOP/s)")
    # headroom for the labels and the legend
    ax.set_ylim(floor, top * 8) if models else ax.set_ylim(0, top * 1.35)
    what = "models suite" if models else \
        f"head dim {hdim}, {'causal' if causal else 'non-causal'}"
    ax.set_title(f"{_MODE_TITLE[mode]}, {what} ({device_name}, {results[0].case.dtype})")
    handles = [Patch(color=colours[p], label=p) for p in providers]
    ax.legend(handles=handles, fontsize=7, ncol=min(6, max(1, len(providers))),
              loc="upper left", frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    if absent:
        fig.text(0.01, 0.01, "not measured: " + ", ".join(absent), fontsize=7, color="#555555")
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def write_charts(out_dir: Path, results: list, device_name: str) -> list:
    names = provider_order(results)
    colours = {p: _PALETTE[i % len(_PALETTE)] for i, p in enumerate(names)}
    paths = []
    for (mode, hdim, causal), group in chart_groups(results).items():
        path = out_dir / (f"{mode}_models.png" if hdim is None
                          else f"{mode}_hdim{hdim}_causal{int(causal)}.png")
        plot_chart(path, group, mode, hdim, causal, device_name, colours)
        paths.append(path)
    return paths
