"""The pages `report` and `diff --html` write: one self-contained HTML file each, drawn as inline SVG.

Self-contained means viewable offline and forever: no script, no font, no stylesheet or image fetched from
anywhere, no plotting library; the charts are SVG elements written here, with `<title>` children as their
tooltips. Every string that comes from a checkpoint (paths, tensor and layer names, metric names, reasons,
problems) is untrusted: it goes through `_text` (control characters shown escaped, then HTML-escaped with
quotes) before it reaches the page, in text and in attributes alike, so a name such as
`<script>alert(1)</script>` is shown, never run.

Elements carry classes a test (or a person's stylesheet) can count: `ckpt-mark` and `ckpt-row` (one per
checkpoint), `curve` (one per metric), `drift-row` (one per layer of a drift heatmap), `diff-row` (one per
layer of a diff page), each with `data-*` attributes naming what it shows.
"""

from __future__ import annotations

import html
import math
from collections import Counter
from collections.abc import Iterable, Sequence

from ckptctl.checkpoint import CheckpointState
from ckptctl.ops.diff import DiffReport
from ckptctl.ops.report_page import CheckpointRow, Curve, Drift, LayerChange, RunReport
from ckptctl.quoting import printable
from ckptctl.units import human_bytes

__all__ = ["render_diff", "render_run"]

STATE_COLOURS = {
    CheckpointState.COMPLETE.value: "#2e7d32",
    CheckpointState.SLIM.value: "#00838f",
    CheckpointState.IN_PROGRESS.value: "#f9a825",
    CheckpointState.BROKEN.value: "#c62828",
    CheckpointState.ABANDONED.value: "#8d6e63",
    CheckpointState.SUPERSEDED.value: "#9e9e9e",
    CheckpointState.UNKNOWN.value: "#6a1b9a",
}
PART_COLOURS = {"model": "#1565c0", "optimizer": "#ef6c00", "other": "#90a4ae", "unread": "#cfd8dc"}
#: A perceptually ordered ramp (viridis' stops) for the drift heatmap: low change dark, high change bright.
_RAMP = ((68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37))
_WIDTH = 960

_STYLE = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px auto;max-width:1000px;color:#212121;padding:0 12px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #e0e0e0;padding-bottom:4px}
h3{font-size:14px;margin:16px 0 6px}.muted{color:#757575}code{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12.5px}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin:14px 0}.card{border:1px solid #e0e0e0;border-radius:6px;padding:8px 12px;min-width:130px}
.card b{display:block;font-size:18px}.card span{color:#757575;font-size:12px}
table{border-collapse:collapse;width:100%;font-size:12.5px}th,td{padding:3px 6px;border-bottom:1px solid #eeeeee;text-align:left;vertical-align:top}
th{background:#fafafa;font-weight:600}td.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.badge{display:inline-block;padding:0 6px;border-radius:9px;color:#fff;font-size:11.5px;white-space:nowrap}
.legend span{display:inline-block;margin-right:14px;font-size:12px}.legend i{display:inline-block;width:10px;height:10px;margin-right:4px;border-radius:2px}
.curves{display:flex;flex-wrap:wrap;gap:12px}.curve{border:1px solid #eeeeee;border-radius:6px;padding:4px}
svg text{font-family:system-ui,sans-serif}.notes li{color:#6d4c41}
"""


# --------------------------------------------------------------------------------------------------
# Pieces.
# --------------------------------------------------------------------------------------------------


def _text(value: object) -> str:
    """A value from a checkpoint, safe in HTML text and in quoted attributes."""
    return html.escape(printable(str(value)), quote=True)


def _number(value: float) -> str:
    return f"{value:.3g}"


def _page(title: str, body: Iterable[str]) -> str:
    return "".join(
        [
            '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">',
            # No resource of any kind may load: the page is a file, viewed offline.
            "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'\">",
            '<meta name="viewport" content="width=device-width,initial-scale=1">',
            f"<title>{_text(title)}</title><style>{_STYLE}</style></head><body>\n",
            *body,
            "</body></html>\n",
        ]
    )


def _card(value: str, label: str) -> str:
    return f'<div class="card"><b>{value}</b><span>{label}</span></div>'


def _legend(colours: Iterable[tuple[str, str]]) -> str:
    items = "".join(f'<span><i style="background:{c}"></i>{_text(name)}</span>' for name, c in colours)
    return f'<div class="legend">{items}</div>'


def _badge(state: str) -> str:
    return f'<span class="badge" style="background:{STATE_COLOURS.get(state, "#616161")}">{_text(state)}</span>'


def _ramp(t: float) -> str:
    """The colour at `t` in [0, 1] along `_RAMP`."""
    t = min(1.0, max(0.0, t)) * (len(_RAMP) - 1)
    i = min(int(t), len(_RAMP) - 2)
    f = t - i
    rgb = (round(a + (b - a) * f) for a, b in zip(_RAMP[i], _RAMP[i + 1], strict=True))
    return "#{:02x}{:02x}{:02x}".format(*rgb)


def _folder(path: str) -> str:
    """The folder of a checkpoint's path relative to the run ("." for the run itself), as `Curve.folder` says it."""
    return path.rpartition("/")[0] or "."


def _titled(folder: str, what: str) -> str:
    return what if folder == "." else f"{folder}: {what}"


def _short(name: str, limit: int) -> str:
    return name if len(name) <= limit else "…" + name[-(limit - 1) :]


# --------------------------------------------------------------------------------------------------
# The run page.
# --------------------------------------------------------------------------------------------------


def render_run(report: RunReport) -> str:
    """The page about a run (see the module docstring)."""
    rows = report.checkpoints
    states = Counter(r.ref.state.value for r in rows)
    latest = [r.path for r in rows if r.ref.latest]
    resume = [r.path for r in rows if r.resume]
    body = [
        "<h1>ckptctl report</h1>",
        f'<div class="muted"><code>{_text(report.run)}</code> · made {_text(report.created.isoformat(timespec="seconds"))}</div>',
        '<div class="cards">',
        _card(str(len(rows)), "checkpoints: " + _text(", ".join(f"{n} {s}" for s, n in sorted(states.items())))),
        _card(_text(human_bytes(report.total_bytes)), "on disk"),
        _card(_text(", ".join(latest) or "none"), "named by a latest pointer"),
        _card(_text(", ".join(resume) or "nothing resumable"), "a resume would load"),
        _card(_text(human_bytes(report.prune_frees)), "prune would free"),
        _card(_text(human_bytes(report.slim_frees)), "slim would free"),
        "</div>",
        "<h2>Checkpoints</h2>",
        _checkpoint_chart(rows),
        _checkpoint_table(rows),
        "<h2>Where the bytes are</h2>",
        _bytes_section(report),
        "<h2>Curves</h2>",
        _curves_section(report.curves, rows),
        "<h2>Weight drift</h2>",
        _drift_section(report),
    ]
    if report.notes:
        body.append(
            '<h2>Notes</h2><ul class="notes">' + "".join(f"<li>{_text(n)}</li>" for n in report.notes) + "</ul>"
        )
    return _page(f"ckptctl report: {report.run}", body)


def _checkpoint_chart(rows: Sequence[CheckpointRow]) -> str:
    """One stacked bar per checkpoint (model / optimizer / other bytes), its state as a square below, a star
    for the one a latest pointer names and a triangle for what a resume would load."""
    if not rows:
        return '<p class="muted">No checkpoints found.</p>'
    height, top, base = 264, 26, 194
    slot = (_WIDTH - 60) / len(rows)
    bar = max(1.0, min(36.0, slot * 0.7))
    largest = max((r.ref.size_bytes for r in rows), default=0) or 1
    label_every = max(1, math.ceil(len(rows) / 40))
    parts = [
        f'<svg class="ckpt-chart" viewBox="0 0 {_WIDTH} {height}" width="100%" role="img" aria-label="checkpoints by step">',
        f'<text x="4" y="{top + 8}" font-size="11" fill="#757575">{_text(human_bytes(largest))}</text>',
        f'<line x1="56" y1="{base}" x2="{_WIDTH}" y2="{base}" stroke="#bdbdbd"/>',
    ]
    folder = None
    for i, row in enumerate(rows):
        x = 60 + i * slot + (slot - bar) / 2
        state = row.ref.state.value
        if _folder(row.path) != folder:
            folder = _folder(row.path)
            edge = 60 + i * slot
            parts.append(
                f'<line x1="{edge:.1f}" y1="{top}" x2="{edge:.1f}" y2="{base}" stroke="#bdbdbd" stroke-dasharray="3 3"/>'
                f'<text x="{edge + 3:.1f}" y="{top - 6}" font-size="10" fill="#757575">{_text(_short(folder, max(4, int(slot / 6))))}</text>'
            )
        title = f"{row.path} · step {row.ref.step if row.ref.step is not None else '-'} · {state} · {human_bytes(row.ref.size_bytes)}"
        if row.ref.latest:
            title += " · named by latest"
        if row.resume:
            title += " · a resume would load it"
        parts.append(
            f'<g class="ckpt-mark" data-path="{_text(row.path)}" data-state="{_text(state)}"><title>{_text(title)}</title>'
        )
        y = float(base)
        pieces = row.bytes_by_part or {"unread": row.ref.size_bytes}
        for part in ("model", "optimizer", "other", "unread"):
            n = pieces.get(part, 0)
            if n <= 0:
                continue
            h = (base - top) * n / largest
            y -= h
            parts.append(
                f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar:.1f}" height="{h:.1f}" fill="{PART_COLOURS[part]}"/>'
            )
        colour = STATE_COLOURS.get(state, "#616161")
        parts.append(f'<rect x="{x:.1f}" y="{base + 4}" width="{bar:.1f}" height="8" fill="{colour}"/>')
        centre = x + bar / 2
        if i % label_every == 0:
            label = str(row.ref.step) if row.ref.step is not None else "-"
            parts.append(
                f'<text x="{centre:.1f}" y="{base + 25}" font-size="10" text-anchor="middle" fill="#616161">{label}</text>'
            )
        if row.ref.latest:
            parts.append(
                f'<text x="{centre:.1f}" y="{base + 42}" font-size="13" text-anchor="middle" fill="#f57f17">★</text>'
            )
        if row.resume:
            parts.append(
                f'<text x="{centre:.1f}" y="{base + 58}" font-size="12" text-anchor="middle" fill="#1b5e20">▲</text>'
            )
        parts.append("</g>")
    parts.append("</svg>")
    legend = _legend([*((p, PART_COLOURS[p]) for p in ("model", "optimizer", "other")), *sorted(STATE_COLOURS.items())])
    return (
        "".join(parts)
        + legend
        + '<p class="muted">★ named by a latest pointer · ▲ what a resume would load · x: step</p>'
    )


def _checkpoint_table(rows: Sequence[CheckpointRow]) -> str:
    verified = any(r.verified is not None for r in rows)
    head = [
        "path",
        "step",
        "state",
        "layout",
        "size",
        "model",
        "optimizer",
        "other",
        "latest",
        "resume",
        "prune",
        "slim frees",
    ]
    if verified:
        head.append("verify")
    head.append("note")
    out = ["<table><thead><tr>", *(f"<th>{h}</th>" for h in head), "</tr></thead><tbody>"]
    for row in rows:
        ref = row.ref
        parts = row.bytes_by_part
        cells = [
            f"<td><code>{_text(row.path)}</code></td>",
            f'<td class="n">{"-" if ref.step is None else ref.step}</td>',
            f"<td>{_badge(ref.state.value)}</td>",
            f"<td>{_text(ref.layout)}</td>",
            f'<td class="n">{_text(human_bytes(ref.size_bytes))}</td>',
            *(
                f'<td class="n">{_text(human_bytes(parts[p])) if p in parts else "-"}</td>'
                for p in ("model", "optimizer", "other")
            ),
            f"<td>{'★' if ref.latest else ''}</td>",
            f"<td>{'▲' if row.resume else ''}</td>",
            f'<td title="{_text("; ".join(row.prune_reasons))}">{_text(row.prune or "-")}'
            + (f" ({_text(human_bytes(row.prune_frees))})" if row.prune_frees else "")
            + "</td>",
            f'<td class="n">{_text(human_bytes(row.slim_frees)) if row.slim_frees else "-"}</td>',
        ]
        if verified:
            if row.verified is None:
                cells.append("<td>-</td>")
            else:
                cells.append(f'<td title="{_text("; ".join(row.problems))}">{"ok" if row.verified else "FAILED"}</td>')
        cells.append(f"<td>{_text(row.error or row.ref.note)}</td>")
        out.append(f'<tr class="ckpt-row" data-path="{_text(row.path)}" data-state="{_text(ref.state.value)}">')
        out.extend(cells)
        out.append("</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _bytes_section(report: RunReport) -> str:
    totals = report.bytes_by_part()
    whole = sum(totals.values()) or 1
    parts = [f'<svg viewBox="0 0 {_WIDTH} 28" width="100%" role="img" aria-label="bytes by component">']
    x = 0.0
    for part in ("model", "optimizer", "other", "unread"):
        n = totals.get(part, 0)
        if n <= 0:
            continue
        w = _WIDTH * n / whole
        parts.append(
            f'<rect class="bytes-part" data-part="{part}" x="{x:.1f}" y="0" width="{w:.1f}" height="28" fill="{PART_COLOURS[part]}">'
            f"<title>{part}: {_text(human_bytes(n))} ({100 * n / whole:.1f}%)</title></rect>"
        )
        x += w
    parts.append("</svg>")
    shown = ", ".join(f"{p} {human_bytes(n)}" for p, n in totals.items() if n)
    deleted = sum(1 for r in report.checkpoints if r.prune == "delete")
    slimmed = sum(1 for r in report.checkpoints if r.prune == "slim")
    parts.append(_legend((p, PART_COLOURS[p]) for p in totals if totals[p]))
    parts.append(f"<p>Over all checkpoints: {_text(shown or 'nothing')}.</p><ul>")
    parts.append(
        f"<li><b>prune</b> under <code>{_text(report.policy)}</code> would delete {deleted} and slim {slimmed} "
        f"checkpoint(s), freeing <b>{_text(human_bytes(report.prune_frees))}</b>.</li>"
    )
    parts.append(
        f"<li><b>slim</b> under <code>{_text(report.slim_policy)}</code> would free "
        f"<b>{_text(human_bytes(report.slim_frees))}</b>.</li></ul>"
    )
    return "".join(parts)


def _curves_section(curves: Sequence[Curve], rows: Sequence[CheckpointRow]) -> str:
    if not curves:
        return '<p class="muted">No checkpoint records metrics.</p>'
    out = ['<div class="curves">']
    for curve in curves:
        steps = [r.ref.step for r in rows if r.ref.step is not None and _folder(r.path) == curve.folder]
        out.append(_curve(curve, steps))
    out.append("</div>")
    return "".join(out)


def _curve(curve: Curve, checkpoint_steps: Sequence[int]) -> str:
    """A small line chart; light vertical lines at the folder's checkpoint steps."""
    width, height, left, right, top, bottom = 300, 170, 52, 10, 24, 22
    xs = [p[0] for p in curve.points]
    ys = [p[1] for p in curve.points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        y0, y1 = y0 - (abs(y0) or 1) * 0.05, y1 + (abs(y1) or 1) * 0.05

    def px(x: float) -> float:
        return left + (width - left - right) * (x - x0) / (x1 - x0)

    def py(y: float) -> float:
        return top + (height - top - bottom) * (1 - (y - y0) / (y1 - y0))

    title = _titled(curve.folder, curve.metric)
    out = [
        f'<svg class="curve" data-metric="{_text(curve.metric)}" data-folder="{_text(curve.folder)}" '
        f'viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" aria-label="{_text(title)}">',
        f"<title>{_text(title)} ({len(curve.points)} points, from the {_text(curve.source)})</title>",
        f'<text x="4" y="14" font-size="12" font-weight="600">{_text(_short(title, 42))}</text>',
    ]
    for step in checkpoint_steps:
        if x0 <= step <= x1:
            out.append(
                f'<line x1="{px(step):.1f}" y1="{top}" x2="{px(step):.1f}" y2="{height - bottom}" stroke="#e0e0e0"/>'
            )
    out.append(
        f'<line x1="{left}" y1="{height - bottom}" x2="{width - right}" y2="{height - bottom}" stroke="#9e9e9e"/>'
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}" stroke="#9e9e9e"/>'
        f'<text x="{left - 4}" y="{top + 4}" font-size="10" text-anchor="end">{_number(y1)}</text>'
        f'<text x="{left - 4}" y="{height - bottom}" font-size="10" text-anchor="end">{_number(y0)}</text>'
        f'<text x="{left}" y="{height - 6}" font-size="10">{min(xs)}</text>'
        f'<text x="{width - right}" y="{height - 6}" font-size="10" text-anchor="end">step {max(xs)}</text>'
    )
    path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in curve.points)
    out.append(f'<polyline points="{path}" fill="none" stroke="#1565c0" stroke-width="1.6"/>')
    if len(curve.points) <= 60:
        out.extend(
            f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.4" fill="#1565c0"><title>step {x}: {_number(y)}</title></circle>'
            for x, y in curve.points
        )
    out.append("</svg>")
    return "".join(out)


def _drift_section(report: RunReport) -> str:
    if not report.drift_computed:
        return '<p class="muted">Not computed (--no-drift).</p>'
    if not report.drift:
        return '<p class="muted">No folder holds two whole checkpoints with steps to compare.</p>'
    values = [
        v
        for drift in report.drift
        for layer in drift.layers
        for pair in drift.pairs
        if (v := drift.value(layer, pair)) is not None and v > 0
    ]
    low, high = (math.log10(min(values)), math.log10(max(values))) if values else (0.0, 0.0)
    out = [
        '<p class="muted">Each cell: how much a layer\'s weights moved between two consecutive checkpoints, the '
        "relative L2 difference ||a−b|| / max(||a||, ||b||) of its tensors (root mean square weighted by size), "
        "on a log colour scale. Rows: layers; columns: pairs of checkpoints, by the later step.</p>",
        _scale(low, high),
    ]
    for drift in report.drift:
        out.append(f"<h3><code>{_text(drift.folder if drift.folder != '.' else 'the run folder')}</code></h3>")
        if drift.skipped:
            out.append(f'<p class="muted">{drift.skipped} older pair(s) left out (--last).</p>')
        out.append(_heatmap(drift, low, high))
        errors = [p for p in drift.pairs if p.error]
        if errors:
            out.append(
                '<ul class="notes">'
                + "".join(f"<li>{_text(p.a)} → {_text(p.b)}: {_text(p.error)}</li>" for p in errors)
                + "</ul>"
            )
    return "".join(out)


def _scale(low: float, high: float) -> str:
    stops = "".join(f'<stop offset="{i / 10:.1f}" stop-color="{_ramp(i / 10)}"/>' for i in range(11))
    return (
        f'<svg viewBox="0 0 {_WIDTH} 30" width="100%" role="img" aria-label="colour scale">'
        f'<defs><linearGradient id="ramp">{stops}</linearGradient></defs>'
        f'<rect x="180" y="4" width="400" height="12" fill="url(#ramp)"/>'
        f'<text x="174" y="14" font-size="11" text-anchor="end">{_number(10**low) if high > low or low else "0"}</text>'
        f'<text x="586" y="14" font-size="11">{_number(10**high)}</text>'
        f'<rect x="680" y="4" width="12" height="12" fill="#eeeeee" stroke="#bdbdbd"/>'
        f'<text x="698" y="14" font-size="11">unchanged / not compared</text></svg>'
    )


def _heatmap(drift: Drift, low: float, high: float) -> str:
    label_w, cell_h = 190, 16
    columns = len(drift.pairs)
    cell_w = max(4.0, min(60.0, (_WIDTH - label_w - 10) / max(columns, 1)))
    height = 24 + cell_h * len(drift.layers)
    width = label_w + cell_w * columns + 10
    label_every = max(1, math.ceil(columns * 28 / (width - label_w)))
    out = [
        f'<svg class="drift" data-folder="{_text(drift.folder)}" viewBox="0 0 {width:.0f} {height}" '
        f'width="{width:.0f}" role="img" aria-label="weight drift">'
    ]
    for j, pair in enumerate(drift.pairs):
        if j % label_every == 0:
            x = label_w + (j + 0.5) * cell_w
            out.append(f'<text x="{x:.1f}" y="14" font-size="10" text-anchor="middle">{pair.b_step}</text>')
    for i, layer in enumerate(drift.layers):
        y = 20 + i * cell_h
        out.append(
            f'<g class="drift-row" data-layer="{_text(layer)}"><text x="{label_w - 6}" y="{y + 12}" font-size="11" '
            f'text-anchor="end"><title>{_text(layer)}</title>{_text(_short(layer, 30))}</text>'
        )
        for j, pair in enumerate(drift.pairs):
            value = drift.value(layer, pair)
            if value is None or value <= 0:
                colour = "#eeeeee"
                shown = "not compared" if value is None else "unchanged"
            else:
                colour = _ramp(0.5 if high == low else (math.log10(value) - low) / (high - low))
                shown = _number(value)
            x = label_w + j * cell_w
            out.append(
                f'<rect x="{x:.1f}" y="{y}" width="{cell_w - 1:.1f}" height="{cell_h - 1}" fill="{colour}">'
                f"<title>{_text(layer)}: step {pair.a_step} → {pair.b_step}: {shown}</title></rect>"
            )
        out.append("</g>")
    out.append("</svg>")
    return "".join(out)


# --------------------------------------------------------------------------------------------------
# The diff page.
# --------------------------------------------------------------------------------------------------


def render_diff(report: DiffReport, layers: Sequence[LayerChange]) -> str:
    """The page of `diff A B --html`: one bar per layer, as long as the layer's relative L2 difference."""
    top = max((c.rel_l2 for c in layers), default=0.0)
    label_w, bar_h = 260, 18
    height = 10 + bar_h * len(layers)
    chart = [
        f'<svg class="diff-chart" viewBox="0 0 {_WIDTH} {height}" width="100%" role="img" aria-label="relative L2 difference per layer">'
    ]
    for i, change in enumerate(layers):
        y = 5 + i * bar_h
        width = 0.0 if top <= 0 else (_WIDTH - label_w - 90) * change.rel_l2 / top
        colour = "#c62828" if change.rel_l2 > 0 else "#9e9e9e"
        chart.append(
            f'<g class="diff-row" data-layer="{_text(change.layer)}"><title>{_text(change.layer)}: relative L2 '
            f"{_number(change.rel_l2)} (largest tensor {_number(change.max_rel_l2)}, {change.tensors} tensor(s))</title>"
            f'<text x="{label_w - 6}" y="{y + 13}" font-size="11" text-anchor="end">{_text(_short(change.layer, 38))}</text>'
            f'<rect x="{label_w}" y="{y + 2}" width="{max(width, 1.0):.1f}" height="{bar_h - 4}" fill="{colour}"/>'
            f'<text x="{label_w + width + 6:.1f}" y="{y + 13}" font-size="11">{_number(change.rel_l2)}</text></g>'
        )
    chart.append("</svg>")
    verdict = "equal" if report.equal else "different"
    facts = [
        ("A", f"{report.a} ({report.a_layout})"),
        ("B", f"{report.b} ({report.b_layout})"),
        (
            "compared",
            f"{report.compared} {report.component.value} tensor(s): {report.equal_count} equal, "
            f"{len(report.changed)} changed, {len(report.only_in_a)} only in A, {len(report.only_in_b)} only in B",
        ),
        (
            "tolerance",
            "exact" if report.atol == 0 and report.rtol == 0 else f"atol={report.atol:g}, rtol={report.rtol:g}",
        ),
    ]
    table = "<table>" + "".join(f"<tr><th>{k}</th><td><code>{_text(v)}</code></td></tr>" for k, v in facts) + "</table>"
    body = [
        f"<h1>ckptctl diff: {verdict}</h1>",
        table,
        "<h2>Relative L2 difference per layer</h2>",
        '<p class="muted">||a−b|| / max(||a||, ||b||) of each layer\'s tensors (root mean square weighted by size); '
        "a layer's tensors are those whose names share the part up to the first number.</p>",
        "".join(chart) if layers else '<p class="muted">No tensor pair whose values could be compared.</p>',
    ]
    return _page(f"ckptctl diff: {report.a} vs {report.b}", body)
