"""The pictures of the documentation site, written into docs/images/.

    .venv/bin/python tools/make_doc_images.py                       # all three
    .venv/bin/python tools/make_doc_images.py --only layers         # one of tensorboard | layers | overhead
    .venv/bin/python tools/make_doc_images.py --only overhead --run-peers /tmp/peers/bin/python

tensorboard.png  a real run of examples/trainer_digits.py, shown by TensorBoard in headless Chromium
                 (needs the `tensorboard` script next to this Python, selenium, chromium and chromedriver).
layers.svg       the layer diagram, drawn here as plain SVG.
overhead.svg     time per step and calls per step of fabric_lite and its peers, next to a raw PyTorch loop,
                 drawn from the JSON that benchmarks/peers.py writes (docs/images/peers.json, kept next to the
                 chart as its data). `--run-peers PYTHON` runs peers.py with that interpreter first (an
                 environment with accelerate and lightning: see benchmarks/README.md); without it the chart
                 is redrawn from the JSON that is there.

The SVGs use system fonts only and carry their own white background, so they read the same on a dark page.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from html import escape
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "docs" / "images"
FONT = "-apple-system, 'Segoe UI', Helvetica, Arial, 'Liberation Sans', 'DejaVu Sans', sans-serif"
MONO = "ui-monospace, 'SFMono-Regular', Menlo, Consolas, 'Liberation Mono', 'DejaVu Sans Mono', monospace"


# -- SVG helpers ------------------------------------------------------------------------------------

# Advance widths (1/1000 em) of DejaVu Sans and DejaVu Sans Bold for " " .. "~" and "·×→–": the widest of the
# fonts above, so a line measured with them fits its box in any of them. Used to check, before the picture
# is written, that no text leaves its box or runs into another.
_GLYPHS = "".join(chr(c) for c in range(32, 127)) + "·×→–"
_REGULAR = (
    "318 401 460 838 636 950 780 275 390 390 500 838 318 361 318 337 636 636 636 636 636 636 636 636 636 636 337 "
    "337 838 838 838 531 1000 684 686 698 770 632 575 775 752 295 295 656 557 863 748 787 603 787 695 635 611 732 "
    "684 989 685 611 685 390 337 390 838 500 500 613 635 550 635 615 352 635 634 278 278 579 278 974 634 612 635 "
    "635 411 521 392 634 592 818 592 592 525 636 337 636 838 318 838 838 500")
_BOLD = (
    "348 456 521 838 696 1002 872 306 457 457 523 838 380 415 380 365 696 696 696 696 696 696 696 696 696 696 400 "
    "400 838 838 838 580 1000 774 762 734 830 683 683 821 837 372 372 775 637 995 837 850 733 850 770 720 682 812 "
    "774 1103 771 724 725 457 365 457 838 500 500 675 716 593 716 678 435 716 712 343 343 665 343 1042 712 687 716 "
    "716 493 595 478 712 652 924 645 652 582 712 365 712 838 380 838 838 500")
_WIDTHS = {False: dict(zip(_GLYPHS, map(int, _REGULAR.split()))), True: dict(zip(_GLYPHS, map(int, _BOLD.split())))}


def text_width(text: str, size: float, bold: bool = False, mono: bool = False) -> float:
    if mono:
        return len(text) * size * 0.602
    table = _WIDTHS[bold]
    return sum(table.get(ch, 1000) for ch in text) * size / 1000


class Svg:
    def __init__(self, width: int, height: int, title: str):
        self.width, self.height, self.title = width, height, title  # height may grow until write()
        self.parts: List[str] = []
        self.boxes: List[Tuple[str, float, float, float, float]] = []  # text extents, for the overlap check

    def add(self, element: str) -> None:
        self.parts.append(element)

    def rect(self, x, y, w, h, fill, stroke="none", rx=8, width=1.0, dash: str = "") -> None:
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        self.add(f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" rx="{rx}" fill="{fill}" '
                 f'stroke="{stroke}" stroke-width="{width}"{dash_attr}/>')

    def line(self, x1, y1, x2, y2, stroke="#555", width=1.0, dash: str = "", marker: str = "") -> None:
        extra = (f' stroke-dasharray="{dash}"' if dash else "") + (f' marker-end="url(#{marker})"' if marker else "")
        self.add(f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="{stroke}" '
                 f'stroke-width="{width}"{extra}/>')

    def text(self, x, y, s: str, size=14.0, fill="#1f2328", bold=False, anchor="start", mono=False,
             max_width: Optional[float] = None, italic=False, halo=False) -> float:
        """Writes one line (y = baseline); returns its estimated width. Raises if it exceeds max_width."""
        w = text_width(s, size, bold, mono)
        if max_width is not None and w > max_width:
            raise ValueError(f"text too wide ({w:.0f} > {max_width:.0f} px): {s!r}")
        left = {"start": x, "middle": x - w / 2, "end": x - w}[anchor]
        self.boxes.append((s, left, y - size * 0.8, w, size))
        attrs = [f'x="{x:.1f}"', f'y="{y:.1f}"', f'font-size="{size}"', f'fill="{fill}"']
        if bold:
            attrs.append('font-weight="600"')
        if italic:
            attrs.append('font-style="italic"')
        if anchor != "start":
            attrs.append(f'text-anchor="{anchor}"')
        if mono:
            attrs.append(f'font-family="{MONO}"')
        if halo:  # a white outline under the glyphs: readable across grid and reference lines
            attrs.append('stroke="#ffffff" stroke-width="4" stroke-linejoin="round" paint-order="stroke"')
        self.add(f"<text {' '.join(attrs)}>{escape(s)}</text>")
        return w

    def check_text_overlaps(self) -> None:
        for i, (a, ax, ay, aw, ah) in enumerate(self.boxes):
            if ax < 0 or ax + aw > self.width or ay < 0 or ay + ah > self.height:
                raise ValueError(f"text outside the picture: {a!r}")
            for b, bx, by, bw, bh in self.boxes[i + 1:]:
                if ax < bx + bw and bx < ax + aw and ay < by + bh and by < ay + ah:
                    raise ValueError(f"texts overlap: {a!r} and {b!r}")

    def write(self, path: Path) -> None:
        self.check_text_overlaps()
        path.parent.mkdir(parents=True, exist_ok=True)
        w, h, title = self.width, self.height, escape(self.title)
        head = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {h}" width="{w}" height="{h}" '
                f'font-family="{FONT}" role="img" aria-label="{title}">', f"<title>{title}</title>",
                # Its own background: the picture looks the same on a light and on a dark page.
                f'<rect x="0" y="0" width="{w}" height="{h}" fill="#ffffff"/>']
        path.write_text("\n".join(head + self.parts + ["</svg>"]) + "\n", encoding="utf-8")
        print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")


def arrow_marker(svg: Svg, name: str, color: str) -> None:
    svg.add(f'<defs><marker id="{name}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
            f'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="{color}"/></marker></defs>')


# -- layers.svg -------------------------------------------------------------------------------------

INK, SOFT = "#1f2328", "#57606a"
DOOR = ("#ddf4ff", "#0969da")       # fill, stroke
ENGINE = ("#fff8c5", "#9a6700")
DATA = ("#fbefff", "#8250df")
STRAT = ("#dafbe1", "#1a7f37")
SIDE = ("#f6f8fa", "#6e7781")


def titled_box(svg: Svg, x, y, w, h, colors, title: str, subtitle: str = "", lines: Sequence[str] = (),
               size=14.0, line_gap=19.5, title_size=17.0, sub_below: bool = False) -> float:
    """A box with a bold title, its package in monospace (on the title line where it fits, else under it) and
    lines of text (sub_below: the package always under the title). Returns the baseline of the last line."""
    fill, stroke = colors
    svg.rect(x, y, w, h, fill, stroke, rx=10, width=1.6)
    pad = 14
    inner = w - 2 * pad
    yy = y + 27
    tw = svg.text(x + pad, yy, title, size=title_size, bold=True, fill=INK, max_width=inner)
    if subtitle:
        sub_w = text_width(subtitle, 13, mono=True)
        if not sub_below and tw + 12 + sub_w <= inner:
            svg.text(x + w - pad, yy, subtitle, size=13, fill=SOFT, mono=True, anchor="end")
        else:
            yy += 18
            svg.text(x + pad, yy, subtitle, size=13, fill=SOFT, mono=True, max_width=inner)
    yy += 6
    for line in lines:
        yy += line_gap
        svg.text(x + pad, yy, line, size=size, fill=INK, max_width=inner)
    if yy + 10 > y + h:
        raise ValueError(f"box {title!r} is too short for its lines")
    return yy


def pill(svg: Svg, x, y, label: str, colors, size=13.5, h=28.0) -> float:
    w = text_width(label, size) + 20
    svg.rect(x, y, w, h, "#ffffff", colors[1], rx=h / 2, width=1.2)
    svg.text(x + w / 2, y + h / 2 + size * 0.36, label, size=size, fill=INK, anchor="middle")
    return w


def pill_chain(svg: Svg, x, y, labels: Sequence[str], colors, max_right: float, gap=24.0) -> None:
    for i, label in enumerate(labels):
        w = pill(svg, x, y, label, colors)
        if x + w > max_right:
            raise ValueError(f"step pills overflow at {label!r}")
        if i < len(labels) - 1:
            svg.line(x + w + 3, y + 14, x + w + gap - 3, y + 14, stroke=colors[1], width=1.4, marker="arrow-engine")
        x += w + gap


def make_layers(path: Path) -> None:
    W = 960
    svg = Svg(W, 0, "fabric_lite layers: two doors over one step engine and swappable strategies")
    arrow_marker(svg, "arrow", SOFT)
    arrow_marker(svg, "arrow-engine", ENGINE[1])
    arrow_marker(svg, "arrow-door", DOOR[1])

    svg.text(20, 36, "fabric_lite: two doors, one step engine, swappable strategies", size=21, bold=True)
    svg.text(20, 60, "One package per layer; imports only point downwards.", size=15, fill=SOFT)

    mx, mw = 20, 640            # main column
    sx, sw = mx + mw + 20, 260  # side column
    gap = 36                    # between rows: room for the arrows

    # Row 1: the two doors.
    y1, h1 = 80, 200
    dg = 24
    dw = (mw - dg) / 2
    tx = mx + dw + dg
    titled_box(svg, mx, y1, dw, h1, DOOR, "Accelerator", "accelerator/", [
        "the raw door: you write the loop",
        "prepare · backward · accumulate",
        "clip_grad_norm_ · autocast",
        "gather_for_metrics",
        "save_state · load_state",
        "Accelerate's names and flags",
    ], sub_below=True)
    titled_box(svg, tx, y1, dw, h1, DOOR, "Trainer + TrainModule", "trainer/", [
        "the trainer door: loop written for you",
        "fit · validate · test · predict",
        "callbacks: checkpoints,",
        "early stopping, progress, ...",
        "loggers: TensorBoard, CSV, ...",
    ], sub_below=True)
    # The Trainer is built on the Accelerator.
    ay = y1 + h1 - 16
    svg.line(tx + 70, ay - 4, mx + dw + 3, ay - 4, stroke=DOOR[1], width=1.4, marker="arrow-door")
    svg.text(tx + 78, ay, "built on the Accelerator", size=13, fill=DOOR[1], italic=True, max_width=dw - 90)

    # Row 2: the step engine.
    y2, h2 = y1 + h1 + gap, 140
    for cx in (mx + dw / 2, tx + dw / 2):
        svg.line(cx, y1 + h1 + 4, cx, y2 - 4, stroke=SOFT, width=1.4, marker="arrow")
    titled_box(svg, mx, y2, mw, h2, ENGINE, "One step engine, under both doors", "engine.py")
    pill_chain(svg, mx + 14, y2 + 46, ["accumulation window", "no-sync", "backward, loss scaled by the window"],
               ENGINE, mx + mw - 10)
    pill_chain(svg, mx + 14, y2 + 94, ["unscale", "clip", "optimizer step", "scheduler step", "zero_grad"],
               ENGINE, mx + mw - 10)

    # Row 3: data.
    y3, h3 = y2 + h2 + 16, 112
    titled_box(svg, mx, y3, mw, h3, DATA, "Data", "data/", [
        "shards the user's own batch order across ranks (sampler, generator)",
        "loader position in global samples: resumes at any number of processes",
        "device transfer, on a CUDA side stream",
    ])

    # Row 4: the strategy contract and its implementations.
    y4, h4 = y3 + h3 + gap, 214
    svg.line(mx + mw / 2, y3 + h3 + 4, mx + mw / 2, y4 - 4, stroke=SOFT, width=1.4, marker="arrow")
    titled_box(svg, mx, y4, mw, h4, STRAT, "Strategy contract", "strategies/base.py", [
        "setup_environment · setup · no_backward_sync · clip",
        "collectives · device feed · checkpoints · teardown",
    ])
    names = [("single", "one device"), ("ddp", "DDP"), ("fsdp", "FSDP2"), ("deepspeed", "ZeRO 1, 2, 3"),
             ("xla", "TPU, PJRT")]
    n, cg = len(names), 10
    cw = (mw - 28 - cg * (n - 1)) / n
    cy, ch = y4 + 100, 64
    for i, (name, note) in enumerate(names):
        cx = mx + 14 + i * (cw + cg)
        svg.rect(cx, cy, cw, ch, "#ffffff", STRAT[1], rx=8, width=1.3)
        svg.text(cx + cw / 2, cy + 27, name, size=16, bold=True, mono=True, anchor="middle", max_width=cw - 8)
        svg.text(cx + cw / 2, cy + 50, note, size=13.5, fill=SOFT, anchor="middle", max_width=cw - 8)
    svg.text(mx + mw / 2, y4 + h4 - 16, "under them: torch.distributed (c10d, torchrun), DeepSpeed, torch_xla",
             size=13.5, fill=SOFT, anchor="middle", italic=True, max_width=mw - 28)

    # Beside: precision, environments, checkpoints, launch.
    top, bottom = y1, y4 + h4
    side = [
        ("Precision", "strategies/precision.py", ["32-true · 16-mixed", "bf16-mixed · bf16-true",
                                                  "autocast · loss scaler", "unscale · overflow skip"]),
        ("Environments", "strategies/environments.py", ["rank and world, read once:",
                                                        "torchrun · SLURM · MPI", "Ray · SkyPilot · Kubeflow",
                                                        "connector: one strategy, set up"]),
        ("Checkpoints", "checkpoint/", ["any fsspec store", "staged + manifest, published", "atomically · async saver",
                                        "sharded state through DCP"]),
        ("Launch", "launch/", ["fabric-lite launch (torchrun)", "notebook_launcher", "XLA replicas",
                               "config file · preemption"]),
    ]
    sg = 14
    sh = (bottom - top - sg * (len(side) - 1)) / len(side)
    for i, (title, sub, lines) in enumerate(side):
        titled_box(svg, sx, top + i * (sh + sg), sw, sh, SIDE, title, sub, lines, size=14, line_gap=19.5,
                   sub_below=True)

    svg.height = int(bottom + 52)
    svg.text(20, svg.height - 18, "The Trainer owns the loop, the engine the step, a strategy placement, wrapping "
             "and collectives.", size=14, fill=SOFT, max_width=W - 40)
    svg.write(path)


# -- overhead.svg -----------------------------------------------------------------------------------

LOOP_LABELS = {  # peers.py's names -> (label, colour)
    "raw": ("raw PyTorch loop", "#8c959f"),
    "fabric_lite Accelerator": ("fabric_lite Accelerator", "#0969da"),
    "HF Accelerate Accelerator": ("Accelerate Accelerator", "#d4a72c"),
    "Lightning Fabric": ("Lightning Fabric", "#8250df"),
    "fabric_lite Trainer bare": ("fabric_lite Trainer", "#0550ae"),
    "Lightning Trainer bare": ("Lightning Trainer", "#6639ba"),
}


def nice_ceiling(value: float) -> Tuple[float, float]:
    """(axis maximum, tick step) for bars up to `value`."""
    for step in (0.25, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000):
        if value / step <= 6:
            top = step * (int(value / step) + 1)
            return top, step
    return value * 1.1, value / 5


def make_overhead(data: dict, path: Path, time_ratio: str = "min") -> None:
    """time_ratio "min": each loop's fastest repeat over the raw loop's fastest (steady from run to run on a
    busy machine); "median": the medians' ratio (swings by ±15 % between runs there, see benchmarks/README.md)."""
    loops: Dict[str, dict] = data["loops"]
    names = [n for n in LOOP_LABELS if n in loops] + [n for n in loops if n not in LOOP_LABELS]
    step_names = [n for n in names if loops[n]["kind"] == "step loop"]
    fit_names = [n for n in names if loops[n]["kind"] != "step loop"]

    W, margin, label_w, panel_gap = 960, 20, 196, 44
    px0 = margin + label_w
    pw = (W - px0 - margin - panel_gap - 40) / 2  # 40: room for the number after the longest bar
    panel_x = [px0, px0 + pw + panel_gap + 20]
    bar_h, row_gap, group_gap = 26, 10, 30
    top = 118
    rows: List[Tuple[str, float]] = []
    y = top + 26
    for group in (step_names, fit_names):
        if group:
            y += group_gap if rows else 0
            for n in group:
                rows.append((n, y))
                y += bar_h + row_gap
    plot_bottom = y - row_gap + 10

    svg = Svg(W, 0, "fabric_lite overhead next to a raw PyTorch loop and its peers")
    svg.text(margin, 36, "Overhead per training step, next to a raw PyTorch loop", size=21, bold=True)
    svg.text(margin, 60, f"The same {data.get('model', 'tiny')} MLP, data, AdamW and cross-entropy in every loop; "
             "one process on the CPU. Lower is better.", size=14.5, fill=SOFT, max_width=W - 2 * margin)
    if data.get("quick"):
        svg.text(W - margin, 84, "QUICK smoke run: not figures to quote", size=14, bold=True, fill="#cf222e",
                 anchor="end")

    panels = [
        ("time per step, ratio to the raw loop", f"ratio_{time_ratio}", lambda v: f"{v:.2f}×", 1.0),
        ("calls per step (cProfile)", "calls_per_step", lambda v: f"{v:,.0f}", None),
    ]
    for (title, key, fmt, ref), x0 in zip(panels, panel_x):
        values = [loops[n][key] for n, _ in rows]
        vmax, tick = nice_ceiling(max(values) * 1.02)
        scale = pw / vmax
        svg.text(x0, top - 12, title, size=15, bold=True, max_width=pw + 40)
        v = 0.0
        while v <= vmax + 1e-9:
            gx = x0 + v * scale
            svg.line(gx, top, gx, plot_bottom, stroke="#d8dee4", width=1)
            svg.text(gx, plot_bottom + 18, f"{v:g}" if key.startswith("ratio") else f"{v:,.0f}", size=12.5,
                     fill=SOFT, anchor="middle")
            v += tick
        if ref is not None:  # under the bars
            rx_ = x0 + ref * scale
            svg.line(rx_, top - 2, rx_, plot_bottom, stroke="#cf222e", width=1.4, dash="5 4")
        for n, ry in rows:
            value = loops[n][key]
            colour = LOOP_LABELS.get(n, (n, "#57606a"))[1]
            bw = max(value * scale, 1.5)
            svg.rect(x0, ry, bw, bar_h, colour, rx=3)
            svg.text(x0 + bw + 6, ry + bar_h / 2 + 5, fmt(value), size=13.5, bold=True, fill=INK,
                     max_width=pw + 34 - bw, halo=True)
        svg.line(x0, top, x0, plot_bottom, stroke="#6e7781", width=1.2)

    row_y = dict(rows)
    for group, heading in ((step_names, "step loops, built once"), (fit_names, "fresh fits, set-up included")):
        if group:
            svg.text(margin, row_y[group[0]] - 7, heading, size=12.5, fill=SOFT, italic=True)
    for n, ry in rows:
        svg.text(margin + 10, ry + bar_h / 2 + 5, LOOP_LABELS.get(n, (n, ""))[0], size=14, fill=INK,
                 max_width=label_w - 14)

    # Caption: how it was measured, where, with what, and the command.
    v = data.get("versions", {})
    machine = data.get("machine", {})
    threads = machine.get("threads")
    where = machine.get("cpu", "CPU") + (f", {threads} thread{'s' if threads != 1 else ''}" if threads else "")
    repeats = f"{data.get('repeats', '?')} interleaved repeats of {data.get('steps_per_repeat', '?')} steps"
    if time_ratio == "min":
        raw_ms = f" ({min(loops['raw']['seconds_per_step']) * 1e3:.2f} ms/step)" if "raw" in loops else ""
        timing = f"Time: the fastest of {repeats} over the raw loop's fastest{raw_ms}."
    else:
        raw_ms = f" ({loops['raw']['median'] * 1e3:.2f} ms/step)" if "raw" in loops else ""
        timing = f"Time: median of {repeats} over the raw loop's{raw_ms}."
    lines = [
        timing + " Calls: all functions cProfile counts.",
        "A fresh fit is a new Trainer and its fit in each repeat, set-up included in its time; its calls leave "
        "set-up out.",
        " · ".join([where, f"torch {v.get('torch', '?').split('+')[0]}", f"fabric_lite {v.get('fabric_lite', '?')}"]
                   + [f"{k} {v[k]}" for k in ("accelerate", "lightning") if v.get(k)]
                   + ([data["date"]] if data.get("date") else [])),
    ]
    cy = plot_bottom + 52
    svg.line(margin, cy - 20, W - margin, cy - 20, stroke="#d8dee4", width=1)
    for line in lines:
        svg.text(margin, cy, line, size=13.5, fill=SOFT, max_width=W - 2 * margin)
        cy += 20
    svg.text(margin, cy, f"$ {data.get('command', 'python benchmarks/peers.py')}", size=13.5, fill=INK, mono=True,
             max_width=W - 2 * margin)
    svg.height = int(cy + 18)
    svg.write(path)


def run_peers(python: str, json_path: Path, quick: bool) -> None:
    json_path.parent.mkdir(parents=True, exist_ok=True)
    shown = json_path.relative_to(ROOT) if json_path.is_relative_to(ROOT) else json_path
    cmd = [python, "benchmarks/peers.py", "--json", str(shown)] + (["--quick"] if quick else [])
    print("running " + " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


# -- tensorboard.png --------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float) -> None:
    end = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > end:
            raise TimeoutError(f"nothing answered at {url} within {timeout:.0f} s")
        time.sleep(0.5)


def train_digits(root: str, epochs: int) -> Path:
    """Runs examples/trainer_digits.py with `root` as its --root; returns its TensorBoard log folder."""
    print(f"training examples/trainer_digits.py for {epochs} epochs ...", flush=True)
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "trainer_digits.py"), "--root", root,
                           "--epochs", str(epochs)], cwd=root, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise SystemExit(f"examples/trainer_digits.py failed (exit {done.returncode})")
    if done.stdout.strip():
        print(done.stdout.strip().splitlines()[-1], flush=True)
    return Path(root) / "logs"


def make_tensorboard(path: Path, epochs: int, logdir: Optional[Path] = None, card_width: int = 500,
                     smoothing: float = 0.0) -> None:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    tensorboard = Path(sys.executable).parent / "tensorboard"
    if not tensorboard.exists():
        tensorboard = Path(shutil.which("tensorboard") or "tensorboard")
    driver_path = shutil.which("chromedriver")
    if driver_path is None:
        raise SystemExit("chromedriver is not on PATH (apt-get install chromium-driver)")

    with tempfile.TemporaryDirectory(prefix="fl-digits-") as root:
        if logdir is None:
            logdir = train_digits(root, epochs)
        port = free_port()
        server = subprocess.Popen([str(tensorboard), "--logdir", str(logdir), "--host", "127.0.0.1",
                                   "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        driver = None
        try:
            url = f"http://127.0.0.1:{port}/"
            wait_http(url, 60)
            options = webdriver.ChromeOptions()
            for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                        "--window-size=1400,900", "--hide-scrollbars"):
                options.add_argument(arg)
            driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
            # The page itself 1400x900 (the window size includes the browser's frame).
            inner = driver.execute_script("return [window.outerWidth - window.innerWidth, "
                                          "window.outerHeight - window.innerHeight]")
            driver.set_window_size(1400 + inner[0], 900 + inner[1])
            wait = WebDriverWait(driver, 60, poll_frequency=0.5)

            def cards(d):
                return len(d.find_elements(By.CSS_SELECTOR, "scalar-card"))

            # TensorBoard keeps its settings in the browser's local storage: whole curves (no outliers cut
            # off the axes), no step selector and data table under the charts, no settings pane, cards wide
            # enough for two a row. Set them, then load the page again.
            driver.get(url + "#timeseries")
            wait.until(lambda d: cards(d) >= 1)
            driver.execute_script(
                "const s = JSON.parse(localStorage.getItem('_tb_global_settings') || '{}');"
                "Object.assign(s, {ignoreOutliers: false, stepSelectorEnabled: false,"
                " timeSeriesSettingsPaneOpened: false, timeSeriesCardMinWidth: arguments[0],"
                " scalarSmoothing: arguments[1]});"
                "localStorage.setItem('_tb_global_settings', JSON.stringify(s));", card_width, smoothing)
            driver.refresh()
            wait.until(lambda d: cards(d) >= 2)
            time.sleep(2)
            # The same through the page, where a TensorBoard version did not take them from storage.
            for label in ("Enable step selection", "Ignore outliers in chart scaling"):
                for box in driver.find_elements(By.CSS_SELECTOR, "mat-checkbox"):
                    if label in box.text and "checked" in box.get_attribute("class"):
                        box.find_element(By.CSS_SELECTOR, "input").click()
                        time.sleep(1)
            for button in driver.find_elements(By.CSS_SELECTOR, "button[aria-label='Close side pane']"):
                button.click()
                time.sleep(1)
            # Every scalar of the run in one grid: filtering the tags shows the matching cards ungrouped.
            tag_filter = next(e for e in driver.find_elements(By.CSS_SELECTOR, "input")
                              if "tags" in (e.get_attribute("placeholder") or "").lower())
            tag_filter.click()
            tag_filter.send_keys("loss|acc|lr")
            tag_filter.send_keys(Keys.ESCAPE)
            wait.until(lambda d: cards(d) >= 4)
            wait.until(lambda d: d.execute_script(
                "return document.querySelectorAll('scalar-card canvas, scalar-card svg path').length") >= 4)
            driver.execute_script("document.activeElement && document.activeElement.blur()")
            time.sleep(5)  # the line charts draw after the data arrives
            path.parent.mkdir(parents=True, exist_ok=True)
            driver.save_screenshot(str(path))
            print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
        finally:
            if driver is not None:
                driver.quit()
            server.terminate()
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.kill()


# -- command line -----------------------------------------------------------------------------------

def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", choices=["tensorboard", "layers", "overhead"],
                        help="make only this picture (may be repeated; default: all three)")
    parser.add_argument("--out", type=Path, default=IMAGES, help="where the pictures go (default docs/images)")
    parser.add_argument("--peers-json", type=Path, help="the peers.py --json file the chart is drawn from "
                        "(default docs/images/peers.json)")
    parser.add_argument("--run-peers", metavar="PYTHON", help="first run benchmarks/peers.py with this interpreter "
                        "(one with accelerate and lightning) and write its JSON to --peers-json")
    parser.add_argument("--time-ratio", choices=["min", "median"], default="min",
                        help="overhead.svg's time bars: fastest repeat over raw's fastest (default; steady on a busy "
                        "machine) or median over raw's median")
    parser.add_argument("--quick", action="store_true", help="with --run-peers: a smoke run of peers.py")
    parser.add_argument("--epochs", type=int, default=10, help="epochs of the digits run behind tensorboard.png")
    parser.add_argument("--tb-logdir", type=Path, help="show these TensorBoard logs instead of a fresh digits run")
    args = parser.parse_args(argv)

    out = args.out.resolve()
    only = set(args.only or ["tensorboard", "layers", "overhead"])
    if "layers" in only:
        make_layers(out / "layers.svg")
    if "overhead" in only:
        peers_json = (args.peers_json or IMAGES / "peers.json").resolve()
        if args.run_peers:
            run_peers(args.run_peers, peers_json, args.quick)
        if not peers_json.exists():
            raise SystemExit(f"{peers_json} does not exist: pass --run-peers PYTHON to make it")
        make_overhead(json.loads(peers_json.read_text()), out / "overhead.svg", args.time_ratio)
    if "tensorboard" in only:
        make_tensorboard(out / "tensorboard.png", args.epochs, args.tb_logdir.resolve() if args.tb_logdir else None)


if __name__ == "__main__":
    os.chdir(ROOT)
    main()
