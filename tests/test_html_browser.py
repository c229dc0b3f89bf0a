"""The HTML report in a real browser: headless Chromium loads each page from a file, offline.

How it reads the page: ``--dump-dom`` prints the DOM after the page's scripts ran, and
``--enable-logging=stderr`` makes Chromium print every console message (errors included) on
stderr as ``CONSOLE`` lines. A page has rendered without errors when its root element has no
``data-errors`` attribute (the page's own recorder writes uncaught errors there) and stderr
has no console line for the page. ``--screenshot`` saves a PNG, decoded here by a small
reader of the PNG format to check that the page is not blank.

Without a browser the tests skip, unless ``CI`` is set: then a missing browser fails them
(``.ci/run`` installs Debian's ``chromium``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import tempfile
import zlib
from html.parser import HTMLParser
from pathlib import Path

import pytest
from typer.testing import CliRunner

from attn_ledger.cli import app

ROOT = Path(__file__).parent.parent
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--enable-logging=stderr", "--v=0")
CONSOLE = re.compile(r"CONSOLE[:(]")
runner = CliRunner()


@pytest.fixture(scope="module")
def browser() -> str:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    if os.environ.get("CI"):
        pytest.fail("no Chromium found (looked for " + ", ".join(BROWSERS) + "); under CI the browser test must run")
    pytest.skip("no Chromium here (the test runs where CI is set; .ci/run installs it)")


def _chromium(browser: str, page: Path, *args: str) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="attn-ledger-chromium-") as profile:
        return subprocess.run([browser, *FLAGS, f"--user-data-dir={profile}", *args, page.resolve().as_uri()],
                              capture_output=True, text=True, timeout=120)


class _Dom(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.elements: list[tuple[str, dict[str, str]]] = []

    def handle_starttag(self, tag, attrs):
        self.elements.append((tag, {k: v or "" for k, v in attrs}))

    def with_class(self, cls: str) -> list[dict[str, str]]:
        return [a for _, a in self.elements if cls in a.get("class", "").split()]

    def having(self, attr: str) -> list[dict[str, str]]:
        return [a for _, a in self.elements if attr in a]


def render_in_browser(browser: str, page: Path) -> _Dom:
    """The DOM Chromium built from the page, asserting that nothing went wrong on the way."""
    done = _chromium(browser, page, "--dump-dom")
    assert done.returncode == 0, done.stderr[-2000:]
    console = [ln for ln in done.stderr.splitlines() if CONSOLE.search(ln)]
    assert console == [], console  # no console message of any kind, errors included
    dom = _Dom()
    dom.feed(done.stdout)
    roots = [a for t, a in dom.elements if t == "html"]
    assert roots and "data-errors" not in roots[0], roots  # the page's recorder saw no script error
    assert dom.having("data-verdict"), "the page did not render"
    return dom


def screenshot(browser: str, page: Path, png: Path) -> tuple[int, int, int, float]:
    """Save a screenshot; its width, height, number of distinct colours and share of pixels that are not white."""
    import numpy as np

    done = _chromium(browser, page, "--window-size=1000,1000", "--hide-scrollbars", f"--screenshot={png}")
    assert done.returncode == 0 and png.exists(), done.stderr[-2000:]
    pixels = read_png(png.read_bytes())  # [H, W, 3 or 4]
    rgb = pixels[..., :3].astype(np.uint32)
    packed = (rgb[..., 0] << 16) | (rgb[..., 1] << 8) | rgb[..., 2]  # [H, W]
    return pixels.shape[1], pixels.shape[0], len(np.unique(packed)), float((packed != 0xFFFFFF).mean())


def read_png(data: bytes) -> "np.ndarray":
    """Decode an 8-bit RGB or RGBA, non-interlaced PNG (what Chromium writes): uint8 ``[H, W, 3 or 4]``."""
    import numpy as np

    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat = 8, b""
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        pos += 12 + n
        if kind == b"IHDR":
            width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and colour in (2, 6) and interlace == 0, (depth, colour, interlace)
        elif kind == b"IDAT":
            idat += body
    bpp = 3 if colour == 2 else 4
    stride = width * bpp
    raw = np.frombuffer(zlib.decompress(idat), dtype=np.uint8).reshape(height, stride + 1)
    out = np.zeros((height, stride), dtype=np.uint8)
    prev = np.zeros(stride, dtype=np.uint8)
    for y in range(height):
        out[y] = _unfilter(int(raw[y, 0]), raw[y, 1:], prev, bpp)
        prev = out[y]
    return out.reshape(height, width, bpp)


def _unfilter(kind: int, line: "np.ndarray", prev: "np.ndarray", bpp: int) -> "np.ndarray":
    """Undo one scanline's PNG filter (0 none, 1 sub, 2 up, 3 average, 4 Paeth)."""
    import numpy as np

    if kind == 0:
        return line
    if kind == 2:
        return line + prev  # uint8 arithmetic wraps modulo 256, as the format wants
    if kind == 1:  # each byte adds the reconstructed byte bpp to its left: a running sum per channel
        return (np.cumsum(line.reshape(-1, bpp).astype(np.uint32), axis=0) & 0xFF).astype(np.uint8).reshape(-1)
    cur, up = bytearray(line.tobytes()), prev.tobytes()
    for x in range(len(cur)):  # average and Paeth depend on the byte just reconstructed: one at a time
        a = cur[x - bpp] if x >= bpp else 0
        b = up[x]
        if kind == 3:
            cur[x] = (cur[x] + ((a + b) >> 1)) & 0xFF
            continue
        c = up[x - bpp] if x >= bpp else 0
        p = a + b - c
        pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
        cur[x] = (cur[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
    return np.frombuffer(bytes(cur), dtype=np.uint8)


def _cli(*args: str) -> tuple[int, str]:
    r = runner.invoke(app, list(args), env={"COLUMNS": "100"})
    return r.exit_code, r.output


@pytest.fixture(scope="module")
def pages(tmp_path_factory) -> dict[str, Path]:
    """``run --fault mask-polarity --html`` and ``check <a failing kernel> --html``, written by the CLI."""
    out = tmp_path_factory.mktemp("html")
    run_page, check_page = out / "report.html", out / "r.html"
    code, text = _cli("run", "--fault", "mask-polarity", "--html", str(run_page))
    assert code == 1, text
    kernel = str(ROOT / "fixtures/kernels/sdpa_is_causal.py") + ":attention"
    code, text = _cli("check", kernel, "--case", "b2-h4kv2-tq5tk5-dh8dv8-causal-flag-rand-f32",
                      "--case", "b3-h2kv2-tq1tk6-dh8dv8-causal-flag-rand-f32", "--html", str(check_page))
    assert code == 1, text
    return {"run": run_page, "check": check_page}


def test_run_page_in_chromium(browser, pages):
    dom = render_in_browser(browser, pages["run"])
    nh, tq, tk = 3, 5, 5  # the default config: B=2, T=5, Nh=3
    assert len(dom.with_class("wcell")) == nh * tq * tk
    assert len(dom.with_class("mcell")) == nh * tq * tk
    figures = [a for t, a in dom.elements if t == "figure"]
    assert [a["data-head"] for a in figures] == ["0", "1", "2"] * 2
    code, text = _cli("run", "--fault", "mask-polarity", "--format", "json")
    diverging = json.loads(text)["first_finding"]["row"]
    first = dom.having("data-first-finding")
    assert [a["data-row"] for a in first] == [diverging] == ["masked_scores"]
    rows = [a for a in dom.having("data-row")]
    assert [a["data-status"] for a in rows if a["data-row"] == diverging] == ["fail"]
    assert all(a["data-status"] == "pass" for a in rows[:rows.index(first[0])])  # every stage before it passes
    leaked = [a for a in dom.with_class("mcell") if "masked_scores.forbidden_excluded" in a.get("data-marks", "")]
    assert len(leaked) == nh * tq * (tk - 1) // 2


def test_check_page_in_chromium(browser, pages):
    dom = render_in_browser(browser, pages["check"])
    failing = [a["data-case"] for a in dom.having("data-case")]
    assert failing == ["b3-h2kv2-tq1tk6-dh8dv8-causal-flag-rand-f32"]
    assert [a["data-row"] for a in dom.having("data-first-finding")] == failing
    assert dom.with_class("repro-cli") and dom.with_class("repro-python")


def test_run_page_screenshot_is_not_blank(browser, pages):
    png = pages["run"].parent / "report.png"
    width, height, colours, inked = screenshot(browser, pages["run"], png)
    print(f"screenshot of {pages['run'].name}: {png} ({width} x {height}, {colours} colours, {inked:.0%} not white)")
    assert (width, height) == (1000, 1000)
    assert colours >= 50  # text, status colours and the heatmaps' scale, antialiased
    assert inked > 0.03


def test_png_reader_undoes_every_filter():
    import numpy as np

    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, size=(5, 4, 3), dtype=np.uint8)  # [H, W, RGB]
    rows, prev = [], np.zeros(12, dtype=np.int64)
    for y, kind in enumerate((0, 1, 2, 3, 4)):  # filter each row with its own kind, as an encoder would
        cur = image[y].reshape(-1).astype(np.int64)
        left = np.concatenate([np.zeros(3, dtype=np.int64), cur[:-3]])
        upleft = np.concatenate([np.zeros(3, dtype=np.int64), prev[:-3]])
        p = left + prev - upleft
        paeth = np.where((abs(p - left) <= abs(p - prev)) & (abs(p - left) <= abs(p - upleft)), left,
                         np.where(abs(p - prev) <= abs(p - upleft), prev, upleft))
        pred = [np.zeros_like(cur), left, prev, (left + prev) // 2, paeth][kind]
        rows.append(bytes([kind]) + bytes(((cur - pred) % 256).astype(np.uint8)))
        prev = cur
    ihdr = struct.pack(">IIBBBBB", 4, 5, 8, 2, 0, 0, 0)
    png = b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"".join(rows))) + _chunk(b"IEND", b"")
    assert (read_png(png) == image).all()


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def test_scan_page_is_a_strip_of_calls_each_opening_onto_its_stage_ledger(browser, tmp_path):
    page = tmp_path / "scan.html"
    model = str(ROOT / "fixtures/models/own.py") + ":stack_one_not_causal"
    code, text = _cli("scan", model, "--causal", "--keep-going", "--html", str(page))
    assert code == 1, text
    dom = render_in_browser(browser, page)
    strip = [(a["data-call"], a["data-status"]) for a in dom.with_class("layer")]
    assert strip == [("0", "pass"), ("1", "pass"), ("2", "fail"), ("3", "pass")]  # coloured by status
    calls = [a for t, a in dom.elements if t == "details"]
    assert [a["data-call"] for a in calls] == ["0", "1", "2", "3"]
    assert ["open" in a for a in calls] == [False, False, True, False]  # the first wrong call is open
    assert [a["data-ledger"] for a in dom.having("data-ledger")] == ["0", "1", "2", "3"]  # each its own ledger
    assert [a["data-picture"] for a in dom.having("data-picture")] == ["mask"] * 4  # and its mask picture
    with tempfile.TemporaryDirectory(prefix="attn-ledger-chromium-") as profile:  # the address opens a call too
        done = subprocess.run([browser, *FLAGS, f"--user-data-dir={profile}", "--dump-dom",
                               page.resolve().as_uri() + "#call-3"], capture_output=True, text=True, timeout=120)
    opened = _Dom()
    opened.feed(done.stdout)
    assert ["open" in a for t, a in opened.elements if t == "details"] == [False, False, True, True]


def _opened_at(browser: str, page: Path, anchor: str) -> list[bool]:
    """Which ``details`` are open once the page is loaded at ``#anchor`` (as a click on a link to it leaves it)."""
    with tempfile.TemporaryDirectory(prefix="attn-ledger-chromium-") as profile:
        done = subprocess.run([browser, *FLAGS, f"--user-data-dir={profile}", "--dump-dom",
                               page.resolve().as_uri() + "#" + anchor], capture_output=True, text=True, timeout=120)
    opened = _Dom()
    opened.feed(done.stdout)
    return ["open" in a for t, a in opened.elements if t == "details" and "data-block" in a]


def test_compare_page_plots_each_block_and_opens_the_first_adder_onto_its_stage_ledgers(browser, tmp_path):
    pytest.importorskip("transformers")
    page = tmp_path / "compare.html"
    code, text = _cli("compare", "--transformers", "llama", "--set", "num_hidden_layers=3", "--vary",
                      "attn-implementation=eager,tiled", "--register", f"{ROOT / 'fixtures/interface/custom.py'}:kv_tiled",
                      "--html", str(page))
    assert code == 1, text
    dom = render_in_browser(browser, page)
    for series in ("total", "added", "bound"):  # one mark per block, each series
        assert [a["data-layer"] for a in dom.having("data-series") if a["data-series"] == series] == ["0", "1", "2"]
    assert [a["data-layer"] for a in dom.with_class("first-adder")] == ["0"]  # kv heads act from block 0 on
    assert [a["data-layer"] for a in dom.with_class("pt") if "first" in a["class"].split()] == ["0"] * 3
    links = [a["href"] for a in dom.with_class("plot-layer")]
    blocks = [a for t, a in dom.elements if t == "details" and "data-block" in a]
    assert links == ["#layer-0", "#layer-1", "#layer-2"] == ["#" + a["id"] for a in blocks]
    assert ["open" in a for a in blocks] == [True, False, False]  # the first adder is open
    assert [a["data-ledger"] for a in dom.having("data-ledger")] == ["A: model.layers.0.self_attn",
                                                                     "B: model.layers.0.self_attn"]
    assert len(dom.with_class("no-ledger")) == 2  # blocks 1 and 2 say they have none
    assert _opened_at(browser, page, "layer-2") == [True, False, True]  # a block's link opens its section


def test_a_passing_compare_page_has_its_plot_and_no_adder(browser, tmp_path):
    pytest.importorskip("transformers")
    page = tmp_path / "compare.html"
    code, text = _cli("compare", "--transformers", "llama", "--vary", "attn-implementation=eager,sdpa", "--html",
                      str(page))
    assert code == 0, text
    dom = render_in_browser(browser, page)
    assert [a["data-verdict"] for t, a in dom.elements if t == "html"] == ["pass"]
    assert [a["data-layer"] for a in dom.having("data-series")] == ["0", "1"] * 3
    assert not dom.with_class("first-adder") and not dom.having("data-first-finding")
    assert not [a for a in dom.with_class("pt") if "first" in a["class"].split()]
    assert _opened_at(browser, page, "layer-1") == [False, True]
