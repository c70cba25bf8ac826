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
    p = subprocess.run(
        [sys.executable, "-m", "layouts", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
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
    for name in (
        "dropout_bias_bwd.sm90.bf16.gmem_dy",
        "dropout_bias_bwd.sm80.fp32.gmem_mask",
        "reference.rowmajor_8x8",
        "reference.sm80.mma_16x8x16.f16",
        "reference.sm80.ldmatrix_x4",
        "reference.smem.fp16_64x64.swizzle333",
        "reference.smem.fp16_64x64.unswizzled",
    ):
        assert name in listed
    assert run("list", "reference.smem").stdout.count("\n") == 2
    assert "layer_norm_bwd.sm90.bf16.n4096.smem_ring" in run("list", "layer_norm").stdout
    assert "attention_bwd_prepost.sm90.bf16.d128.postprocess.smem_dq" in run("list", "attention_bwd_prepost").stdout
    p = run("list", "xyz", ok=False)
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr.startswith("no entry matches 'xyz'; kernels: attention_bwd_prepost, attention_bwd_sm90,")


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


def test_conflicts():
    out = run("conflicts", "reference.smem.fp16_64x64.unswizzled").stdout
    assert re.search(r"ldmatrix_x4 on \S+unswizzled: .*32 wavefronts/instr \(ideal 4\), worst conflict 8-way", out)
    out = run("conflicts", "reference.smem.fp16_64x64.swizzle333").stdout
    assert out.count("conflict-free") >= 2 and "8-way" not in out
    out = run("conflicts", "dropout_bias_bwd.sm90.bf16.gmem_dy").stdout
    assert "512 bytes, 16 sectors each (ideal 16)" in out and "fully coalesced" in out
    out = run("conflicts", "reference.sm80.mma_16x8x16.f16").stdout
    assert out.strip() == "(register layout (MMA fragments): no shared-memory access)"
    p = run("conflicts", "no.such.layout", ok=False)
    assert p.returncode == 2 and "no layout" in p.stderr


def test_gallery(tmp_path):
    """Two small families (the whole catalogue takes minutes: ``python -m layouts gallery DIR``)."""
    for prefix in ("reference", "layer_norm_bwd_finalize"):
        out_dir = tmp_path / prefix
        run("gallery", str(out_dir), "--prefix", prefix)
        index = (out_dir / "index.html").read_text()
        for name in layouts.names(prefix):
            assert f"src='{name}.png'" in index
            assert png_size(out_dir / f"{name}.png")[:2] == draw.figure_pixels(layouts.get(name))
    assert "worst conflict 8-way" in (tmp_path / "reference" / "index.html").read_text()
    assert "fully coalesced" in (tmp_path / "layer_norm_bwd_finalize" / "index.html").read_text()
    p = run("gallery", str(tmp_path / "none"), "--prefix", "xyz", ok=False)
    assert p.returncode == 1 and "no entry starts with 'xyz'" in p.stderr


def test_png_into_a_missing_folder(tmp_path):
    png = tmp_path / "a" / "b" / "x.png"
    out = run("show", "reference.rowmajor_8x8", "--png", str(png)).stdout
    assert png.exists() and f"wrote {png}" in out
    blocked = tmp_path / "file"
    blocked.write_text("")
    p = run("show", "reference.rowmajor_8x8", "--png", str(blocked / "x.png"), ok=False)
    assert p.returncode != 0 and p.stderr.strip().startswith("cannot write") and "Traceback" not in p.stderr


def test_a_closed_pipe_ends_quietly():
    """``show X | head``: the reader leaves early; no BrokenPipeError traceback, exit 141."""
    import io

    from layouts.__main__ import run as cli_run

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before anything is written
    saved, saved_fd = sys.stdout, os.dup(1)
    try:
        sys.stdout = io.TextIOWrapper(open(write_end, "wb", closefd=False), write_through=False)
        code = cli_run(["show", "attention_bwd_sm90.sm90.bf16.d128.smem_k"])
    finally:
        sys.stdout = saved
        os.close(write_end)
        os.dup2(saved_fd, 1)
        os.close(saved_fd)
    assert code == 141
    p = subprocess.run(
        f"{sys.executable} -m layouts list | head -1", shell=True, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert p.stdout.count("\n") == 1 and "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr


def test_names_and_swizzles_read_one_way():
    p = run("conflicts", "dropout_bias_bwd.sm90.bf16.gmem_dyy", ok=False)
    assert p.returncode == 2 and "did you mean dropout_bias_bwd.sm90.bf16.gmem_dy, " in p.stderr and "[" not in p.stderr
    listing = run("list").stdout
    shown = run("show", "mem_eff_attention_bwd.sm90.bf16.k64.smem_q").stdout
    for out in (listing, shown):
        assert "Swizzle(" not in out and "Swizzle<" not in out
    assert "S<3,3,3>" in listing and "S<3,3,3> o 0 o" in shown


def test_readme_figure_is_drawn_by_the_current_code():
    """docs/dropout_bias_gmem_dy.png (README): the size ``show --png`` gives it now, and small."""
    path = ROOT / "docs" / "dropout_bias_gmem_dy.png"
    assert path.stat().st_size < 200 * 1024
    assert png_size(path)[:2] == draw.figure_pixels(layouts.get("dropout_bias_bwd.sm90.bf16.gmem_dy"))


def test_readme_lists_every_module_and_command():
    readme = (ROOT / "layouts" / "README.md").read_text()
    listed = set(re.findall(r"^\| `([\w.]+\.py)` \|", readme, re.M))
    assert listed == {p.name for p in (ROOT / "layouts").glob("*.py")}
    for command in ("list", "show", "conflicts", "gallery"):
        assert f"python -m layouts {command}" in readme
