"""``python -m layouts``: list, show, analyse and draw the layout catalogue (CPU only).

    python -m layouts list [PREFIX]
    python -m layouts show NAME [--png FILE] [--svg FILE]
    python -m layouts conflicts NAME
    python -m layouts gallery DIR
"""

from __future__ import annotations

import argparse
import html
import os
import sys

from . import analysis, catalogue, text


def _figures(entry) -> list:
    reports = analysis.analyse(entry)
    if not reports:
        return ["(no memory access to analyse)"]
    return [r.summary() for r in reports]


def cmd_list(args) -> int:
    for name in catalogue.names(args.prefix):
        e = catalogue.get(name)
        print(f"{name:50s} {e.kind:9s} {e.description}")
    return 0


def cmd_show(args) -> int:
    entry = catalogue.get(args.name)
    print(text.describe(entry))
    if args.png or args.svg:
        from . import draw

        draw.save(entry, png=args.png, svg=args.svg)
        for path in (args.png, args.svg):
            if path:
                print(f"wrote {path}")
    return 0


def cmd_conflicts(args) -> int:
    entry = catalogue.get(args.name)
    for line in _figures(entry):
        print(line)
    for rep in analysis.analyse(entry):
        if isinstance(rep, analysis.BankConflicts):
            worst = [i for i in rep.instructions if i.degree == rep.max_degree][:4]
            for i in worst:
                print(f"  instr at {i.origin} warp {i.warp}: {i.wavefronts} wavefronts (ideal {i.ideal}), "
                      f"{i.degree}-way")
    return 0


def cmd_gallery(args) -> int:
    from . import draw

    os.makedirs(args.dir, exist_ok=True)
    parts = ["<!doctype html><meta charset='utf-8'><title>layouts gallery</title>",
             "<style>body{font-family:sans-serif} img{max-width:100%;border:1px solid #ccc}</style>",
             "<h1>Layout catalogue</h1><ul>"]
    entries = catalogue.names(args.prefix)
    parts += [f"<li><a href='#{html.escape(n)}'>{html.escape(n)}</a></li>" for n in entries]
    parts.append("</ul>")
    for name in entries:
        entry = catalogue.get(name)
        png = f"{name}.png"
        draw.save(entry, png=os.path.join(args.dir, png))
        figs = "\n".join(_figures(entry))
        parts.append(f"<h2 id='{html.escape(name)}'>{html.escape(name)}</h2>"
                     f"<p>{html.escape(entry.description)}</p><pre>{html.escape(figs)}</pre>"
                     f"<img src='{html.escape(png)}' alt='{html.escape(name)}'>")
        print(f"drew {name}")
    with open(os.path.join(args.dir, "index.html"), "w") as f:
        f.write("\n".join(parts) + "\n")
    print(f"wrote {os.path.join(args.dir, 'index.html')}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m layouts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("list", help="names in the catalogue")
    s.add_argument("prefix", nargs="?")
    s.set_defaults(fn=cmd_list)
    s = sub.add_parser("show", help="print an entry, optionally draw it")
    s.add_argument("name")
    s.add_argument("--png")
    s.add_argument("--svg")
    s.set_defaults(fn=cmd_show)
    s = sub.add_parser("conflicts", help="bank conflicts / coalescing figures of an entry")
    s.add_argument("name")
    s.set_defaults(fn=cmd_conflicts)
    s = sub.add_parser("gallery", help="DIR/index.html with every entry's picture and figures")
    s.add_argument("dir")
    s.add_argument("--prefix", help="only names starting with this")
    s.set_defaults(fn=cmd_gallery)
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except KeyError as e:
        print(e.args[0], file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
