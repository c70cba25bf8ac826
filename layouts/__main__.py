"""``python -m layouts``: list, show, analyse and draw the layout catalogue (CPU only).

python -m layouts list [FILTER]                   names containing FILTER, kind, description
python -m layouts show NAME [--png F] [--svg F]   the layout as text; optionally a picture
python -m layouts conflicts NAME                  bank conflicts (shared) or coalescing (global)
python -m layouts gallery DIR [--prefix P]        DIR/index.html and one PNG per entry
"""

from __future__ import annotations

import argparse
import html
import os
import sys

from . import analysis, catalogue, text

WORST_SHOWN = 4  # per conflicted access: its first instructions of the worst degree


def _figures(entry) -> list:
    reports = analysis.analyse(entry)
    if not reports:
        return [f"({analysis.no_access_reason(entry)})"]
    return [r.summary() for r in reports]


def _kernels() -> list:
    return sorted({n.split(".")[0] for n in catalogue.names()})


def cmd_list(args) -> int:
    names = [n for n in catalogue.names() if args.filter is None or args.filter in n]
    if not names:
        print(f"no entry matches {args.filter!r}; kernels: {', '.join(_kernels())}", file=sys.stderr)
        return 1
    width = max(len(n) for n in names)
    for name in names:
        e = catalogue.get(name)
        print(f"{name:{width}s}  {e.kind:8s}  {e.description}")
    return 0


def _output_path(path: str) -> str:
    """``path`` with its folder created; SystemExit with one line if that is impossible."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"cannot write {path}: {e.strerror}") from None
    return path


def cmd_show(args) -> int:
    entry = catalogue.get(args.name)
    print(text.describe(entry))
    if args.png or args.svg:
        from . import draw

        png = args.png and _output_path(args.png)
        svg = args.svg and _output_path(args.svg)
        draw.save(entry, png=png, svg=svg)
        for path in (png, svg):
            if path:
                print(f"wrote {path}")
    return 0


def conflict_lines(entry) -> list:
    """The figures of every access, each conflicted one followed by its worst instructions,
    labelled with the access they belong to."""
    reports = analysis.analyse(entry)
    if not reports:
        return [f"({analysis.no_access_reason(entry)})"]
    lines = []
    for rep in reports:
        lines.append(rep.summary())
        if isinstance(rep, analysis.BankConflicts):
            for i in rep.worst(WORST_SHOWN):
                lines.append(
                    f"  {rep.name}: instruction {i.where(rep.kind)}: {i.wavefronts} wavefronts "
                    f"(ideal {i.ideal}), {i.degree}-way"
                )
    return lines


def cmd_conflicts(args) -> int:
    for line in conflict_lines(catalogue.get(args.name)):
        print(line)
    return 0


def cmd_gallery(args) -> int:
    from . import draw

    entries = [n for n in catalogue.names() if args.prefix is None or n.startswith(args.prefix)]
    if not entries:
        print(f"no entry starts with {args.prefix!r}; kernels: {', '.join(_kernels())}", file=sys.stderr)
        return 1
    _output_path(os.path.join(args.dir, "index.html"))
    parts = [
        "<!doctype html><meta charset='utf-8'><title>layouts gallery</title>",
        "<style>body{font-family:sans-serif} img{max-width:100%;border:1px solid #ccc}</style>",
        "<h1>Layout catalogue</h1><ul>",
    ]
    parts += [f"<li><a href='#{html.escape(n)}'>{html.escape(n)}</a></li>" for n in entries]
    parts.append("</ul>")
    for name in entries:
        entry = catalogue.get(name)
        png = f"{name}.png"
        draw.save(entry, png=os.path.join(args.dir, png))
        figs = "\n".join(conflict_lines(entry))
        parts.append(
            f"<h2 id='{html.escape(name)}'>{html.escape(name)}</h2>"
            f"<p>{html.escape(entry.description)}</p><pre>{html.escape(figs)}</pre>"
            f"<img src='{html.escape(png)}' alt='{html.escape(name)}'>"
        )
        print(f"drew {name}")
    with open(os.path.join(args.dir, "index.html"), "w") as f:
        f.write("\n".join(parts) + "\n")
    print(f"wrote {os.path.join(args.dir, 'index.html')}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m layouts", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("list", help="names in the catalogue (those containing FILTER)")
    s.add_argument("filter", nargs="?")
    s.set_defaults(fn=cmd_list)
    s = sub.add_parser("show", help="print an entry, optionally draw it (folders are created)")
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
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.fn(args)
    except KeyError as e:
        print(e.args[0], file=sys.stderr)
        return 2


def run(argv=None) -> int:
    """``main`` for a shell: a reader that stops early (``| head``) ends the output quietly."""
    try:
        code = main(argv)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # stdout is gone: point it at /dev/null so the interpreter's own flush at exit is quiet
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports a command killed by it


if __name__ == "__main__":
    sys.exit(run())
