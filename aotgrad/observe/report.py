"""``python -m aotgrad report``: one self-contained HTML page about a compile.

Timeline of stages, each graph as code with its inputs and outputs named,
the saved-activation table, guards, and a picture of the joint graph coloured
by partition. No network: styles, script and the SVG picture are inline.
"""
from __future__ import annotations

import html

from .facts import fmt_bytes, graph_sizes, guard_lines, name_of, saved_rows
from .printing import format_graph

_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:1200px;color:#222;padding:0 1em}
h1{font-size:1.6em}h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;margin:.5em 0}td,th{padding:2px 10px;border-bottom:1px solid #eee;text-align:left}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
pre{background:#f6f8fa;padding:.8em;overflow:auto;font-size:12px;border-radius:4px}
.bar{height:12px;background:#64b5f6;border-radius:2px;min-width:1px}
.why{color:#b71c1c}.muted{color:#777}details{margin:.4em 0}summary{cursor:pointer;font-weight:600}
#toc a{margin-right:1em}.picture svg{max-width:100%;height:auto}
"""

# Collects script errors into the page (a headless browser reads them back) and builds the contents line.
_HEAD_JS = """window.addEventListener('error',function(e){var d=document.documentElement;
d.setAttribute('data-script-errors',(d.getAttribute('data-script-errors')||'')+e.message+';');});"""
_TAIL_JS = """(function(){var toc=document.getElementById('toc');
document.querySelectorAll('h2[id]').forEach(function(h){var a=document.createElement('a');
a.href='#'+h.id;a.textContent=h.textContent;toc.appendChild(a);});
document.documentElement.setAttribute('data-rendered',
  String(document.querySelectorAll('section.entry').length));})();"""


def report_html(obj) -> str:
    """The page for a ``Jit`` (every entry), a ``Compiled``, or a callable's result."""
    entries, summary = obj.compiled_entries(), obj.summary()     # a Jit: every entry, and its summary
    if not entries:
        raise ValueError("this aotgrad.jit function has not been called yet, so nothing was compiled")
    name = name_of(entries[0][0])
    title = f"aotgrad report: jit({name})" if summary is not None else f"aotgrad report: {name}"
    intro = f"<pre>{_e(summary)}</pre>" if summary is not None else ""
    entries = [(c, reason, k) for k, (c, reason) in enumerate(entries)]
    body = [f"<h1>{_e(title)}</h1>", "<nav id='toc'></nav>", intro]
    body += [_entry(c, reason, k, open_=(k == len(entries) - 1)) for c, reason, k in entries]
    return (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{_e(title)}</title>"
            f"<style>{_CSS}</style><script>{_HEAD_JS}</script></head><body>{''.join(body)}"
            f"<script>{_TAIL_JS}</script></body></html>")


def write_report(obj, path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(report_html(obj))


def _e(text) -> str:
    return html.escape(str(text), quote=True)


def _entry(c, reason, k, open_) -> str:
    from .picture import joint_svg
    why = "first compile" if reason is None else f"recompiled because {reason}"
    parts = [f"<section class='entry'><h2 id='entry{k}'>Entry {k}: {_e(name_of(c))}</h2>",
             f"<p class='{'muted' if reason is None else 'why'}'>{_e(why)}</p>",
             "<h3>Stages</h3>", _timeline(c.history),
             "<h3>Graph sizes</h3>", _sizes(c),
             "<h3>Saved activations</h3>", _saved(c),
             "<h3>Joint graph, coloured by partition</h3>",
             f"<div class='picture'>{joint_svg(c)}</div>",
             "<h3>Graphs as code</h3>", _graphs(c, open_),
             "<h3>Guards</h3>", "<pre>" + _e("\n".join(guard_lines(c.captured))) + "</pre>",
             "</section>"]
    return "".join(parts)


def _timeline(history) -> str:
    total = sum(s.seconds for s in history) or 1.0
    rows, start = [], 0.0
    for s in history:
        facts = ", ".join(f"{k}={v}" for k, v in s.info.items())
        left, width = 100 * start / total, max(100 * s.seconds / total, 0.2)
        rows.append(f"<tr><td>{_e(s.name)}</td><td class='num'>{s.seconds * 1e3:.1f} ms</td>"
                    f"<td style='width:50%'><div class='bar' style='margin-left:{left:.2f}%;width:{width:.2f}%'>"
                    f"</div></td><td class='muted'>{_e(facts)}</td></tr>")
        start += s.seconds
    rows.append(f"<tr><th>total</th><th class='num'>{total * 1e3:.1f} ms</th><th></th><th></th></tr>")
    return "<table><tr><th>stage</th><th class='num'>time</th><th>timeline</th><th>facts</th></tr>" \
        + "".join(rows) + "</table>"


def _sizes(c) -> str:
    rows = "".join(f"<tr><td>{k}</td><td class='num'>{s['nodes']}</td><td class='num'>{s['ops']}</td>"
                   f"<td class='num'>{s['inputs']}</td><td class='num'>{s['outputs']}</td></tr>"
                   for k, s in graph_sizes(c).items() if s is not None)
    return ("<table><tr><th>graph</th><th class='num'>nodes</th><th class='num'>ops</th>"
            f"<th class='num'>inputs</th><th class='num'>outputs</th></tr>{rows}</table>")


def _saved(c) -> str:
    rows = saved_rows(c)
    if c.partition is None:
        return "<p class='muted'>inference graph: nothing is saved</p>"
    total = sum(r.nbytes or 0 for r in rows)
    body = "".join(f"<tr><td>{_e(r.name)}</td><td style='white-space:nowrap'>{_e(list(r.shape))}</td><td>{_e(r.dtype)}</td>"
                   f"<td class='num'>{_e(fmt_bytes(r.nbytes))}</td><td><code>{_e(r.source or '-')}</code></td></tr>"
                   for r in rows)
    return (f"<p>{len(c.partition.saved)} values, {_e(fmt_bytes(total))} "
            "<span class='muted'>(0 B: a view of a graph input, alive anyway)</span></p>"
            "<table><tr><th>name</th><th>shape</th><th>dtype</th><th class='num'>bytes</th><th>source</th></tr>"
            f"{body}</table>")


def _graphs(c, open_) -> str:
    cap = c.captured
    lay = cap.layout
    ins, outs = list(cap.input_descs), list(cap.output_descs)
    saved = [f"saved {s}" for s in (c.partition.saved if c.partition else ())]
    graphs = [("joint", cap.joint, ins, outs)]
    if c.backward_graph is None:
        graphs.append(("forward", c.forward_graph, ins, outs))
    else:
        graphs.append(("forward", c.forward_graph, ins[:lay.n_primals], outs[:lay.n_fw] + saved))
        graphs.append(("backward", c.backward_graph, saved + ins[lay.n_primals:], outs[lay.n_fw:]))
    return "".join(f"<details{' open' if open_ and name == 'joint' else ''}><summary>{name} graph</summary>"
                   f"{_io(gm, i, o)}<pre>{_e(format_graph(gm))}</pre></details>"
                   for name, gm, i, o in graphs)


def _io(gm, in_descs, out_descs) -> str:
    ph = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    res = gm.graph.output_node().args[0]
    res = [getattr(n, "name", repr(n)) for n in (res if isinstance(res, (tuple, list)) else [res])]
    rows = [f"<tr><td>in</td><td><code>{_e(n)}</code></td><td>{_e(d)}</td></tr>" for n, d in zip(ph, in_descs)]
    rows += [f"<tr><td>out</td><td><code>{_e(n)}</code></td><td>{_e(d)}</td></tr>" for n, d in zip(res, out_descs)]
    return "<table><tr><th></th><th>node</th><th>descriptor</th></tr>" + "".join(rows) + "</table>"
