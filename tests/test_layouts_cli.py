"""``python -m layouts``: list, show (text, PNG, SVG), conflicts, gallery."""

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np

import layouts
from layouts import draw

ROOT = Path(__file__).resolve().parents[1]


def run(*args, ok=True, timeout=300):
    env = dict(os.environ, MPLBACKEND="Agg")
    p = subprocess.run([sys.executable, "-m", "layouts", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout)
    if ok:
        assert p.returncode == 0, p.stderr
    return p


def png_size(path):
    img = mpimg.imread(path)
    return img.shape[1], img.shape[0], img


def test_list():
    out = run("list").stdout
    listed = [line.split()[0] for line in out.splitlines()]
    assert listed == layouts.names()
    for name in ("dropout_bias_bwd.sm90.bf16.gmem_dy", "dropout_bias_bwd.sm80.fp32.gmem_mask",
                 "reference.rowmajor_8x8", "reference.sm80.mma_16x8x16.f16", "reference.sm80.ldmatrix_x4",
                 "reference.smem.fp16_64x64.swizzle333", "reference.smem.fp16_64x64.unswizzled"):
        assert name in listed
    assert run("list", "reference.smem").stdout.count("\n") == 2


def test_show_text_png_svg(tmp_path):
    png, svg = tmp_path / "rm.png", tmp_path / "rm.svg"
    out = run("show", "reference.rowmajor_8x8", "--png", str(png), "--svg", str(svg)).stdout
    assert "(8,8):(8,1)" in out
    assert re.search(r"^\s+7\s+56 57 58 59 60 61 62 63$", out, re.M)  # the last row of indices
    w, h, img = png_size(png)
    assert (w, h) == draw.figure_pixels(layouts.get("reference.rowmajor_8x8"))
    assert len(np.unique(img[..., :3].reshape(-1, 3), axis=0)) > 16  # coloured, not blank
    assert ET.parse(svg).getroot().tag.endswith("svg")


def test_show_mma(tmp_path):
    png = tmp_path / "mma.png"
    out = run("show", "reference.sm80.mma_16x8x16.f16", "--png", str(png)).stdout
    assert "((4,8),(2,2)):((32,1),(16,8))" in out  # C's TV layout
    c_block = out.split("C (M x N):")[1]
    row8 = [line for line in c_block.splitlines() if re.match(r"^\s+8 ", line)][0]
    assert row8.split()[1:3] == ["T0v2", "T0v3"]  # thread 0 holds C[8,0], C[8,1]
    w, h, _ = png_size(png)
    assert (w, h) == draw.figure_pixels(layouts.get("reference.sm80.mma_16x8x16.f16"))
    assert w > h  # three panels side by side


def test_conflicts():
    out = run("conflicts", "reference.smem.fp16_64x64.unswizzled").stdout
    assert re.search(r"ldmatrix_x4 on \S+unswizzled: .*32 wavefronts/instr \(ideal 4\), worst conflict 8-way", out)
    out = run("conflicts", "reference.smem.fp16_64x64.swizzle333").stdout
    assert out.count("conflict-free") >= 2 and "8-way" not in out
    out = run("conflicts", "dropout_bias_bwd.sm90.bf16.gmem_dy").stdout
    assert "512 bytes, 16 sectors each (ideal 16)" in out and "fully coalesced" in out
    out = run("conflicts", "reference.sm80.mma_16x8x16.f16").stdout
    assert "no memory access" in out
    p = run("conflicts", "no.such.layout", ok=False)
    assert p.returncode == 2 and "no layout" in p.stderr


def test_gallery(tmp_path):
    out_dir = tmp_path / "gallery"
    run("gallery", str(out_dir), timeout=600)  # every entry drawn: ~105 s on 2 CPU cores
    index = (out_dir / "index.html").read_text()
    for name in layouts.names():
        assert f"src='{name}.png'" in index
        w, h, _ = png_size(out_dir / f"{name}.png")
        assert w >= 400 and h >= 150
    assert "worst conflict 8-way" in index and "fully coalesced" in index
    w, h, _ = png_size(out_dir / "reference.smem.fp16_64x64.swizzle333.png")
    assert (w, h) == draw.figure_pixels(layouts.get("reference.smem.fp16_64x64.swizzle333"))
