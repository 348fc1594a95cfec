"""A picture of what questions found: one self-contained HTML page (`query --html`).

The page draws, per question, the subgraph the search used as inline SVG: the question, its
entry points (name matches and vector matches), and every context node with the path the walk
took to it (search/paths.py), in columns by the number of steps from the question. Nodes are
coloured by type; context nodes are filled, nodes met only on a path are hollow; structural
edges are solid, similarity edges dashed. Beside it, the context in the order the answer reads
it. Hovering a node shows its text; clicking it (or a context line) shows its text, documents and
path. Only the context and the paths to it are drawn, never every node the walk touched, so a
large result stays readable. Scripts and styles are inline and nothing is fetched: the page
works from the file, offline.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

from .files import write_output
from .node_types import BY_LETTER, CODE_ORDER
from .search import paths
from .search.results import Retrieval, RetrievedNode

TYPE_COLOURS = {t: BY_LETTER[t].colour for t in CODE_ORDER}  # in the legend's order
TYPE_NAMES = {t: BY_LETTER[t].name for t in CODE_ORDER}
COLUMN_WIDTH, ROW_HEIGHT, LEFT, TOP, LABEL_CHARS = 250, 26, 30, 40, 30
QUESTION = "question"
_BIDI = re.compile("[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
"""Characters that reorder the text shown after them (U+202E shows what follows reversed): shown as
their code instead, so a document or a question cannot make the page show other text than it holds."""


def _visible(text: str) -> str:
    return _BIDI.sub(lambda m: f"\u2039U+{ord(m.group()):04X}\u203a", text)


def _escape(text: str) -> str:
    """Text as HTML: escaped, and its reordering characters visible (`_BIDI`)."""
    return html.escape(_visible(text))


def _script_json(value) -> str:
    """JSON to put inside a <script> element: no "<", ">" or "&" as such, so no text in it ("</script>",
    "<!--<script>") can end the element or turn the parser's state; strings' reordering characters visible."""
    def shown(item):
        if isinstance(item, str):
            return _visible(item)
        if isinstance(item, dict):
            return {key: shown(v) for key, v in item.items()}
        if isinstance(item, list):
            return [shown(v) for v in item]
        return item

    text = json.dumps(shown(value), ensure_ascii=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _layout(result: Retrieval) -> tuple[dict[str, dict], list[tuple[str, str, str]]]:
    """Nodes with their column (steps from the question) and row, and the edges (from, to, kind)."""
    nodes: dict[str, dict] = {QUESTION: {"id": QUESTION, "type": "Q", "text": result.question, "via": "", "column": 0,
                                         "kept": True}}
    edges: dict[tuple[str, str], str] = {}
    known = {n.id: n for n in [*result.nodes, *result.path_nodes]}

    def place(node: RetrievedNode, column: int, kept: bool) -> None:
        shown = nodes.setdefault(node.id, {**_shown(node), "column": column, "kept": kept})
        shown["column"] = min(shown["column"], column)
        shown["kept"] = shown["kept"] or kept

    for number, node in enumerate(result.nodes, 1):
        if node.path:  # explained: from an entry point (column 1) along the walk's path
            path, first = node.path, 1
        else:  # an entry point, or (not explained) a node the search reached some other way
            path, first = [node.id], 1 if node.via in ("exact", "vector") else 2
        start = known.get(path[0])
        if start is not None:
            edges.setdefault((QUESTION, path[0]), start.via if start.via in ("exact", "vector") else node.via or "walk")
        for step, node_id in enumerate(path):
            if node_id in known:
                place(known[node_id], first + step, node_id == node.id)
        for a, b in zip(path, path[1:], strict=False):
            edges[(a, b)] = paths.edge_kind(a[0], b[0])
        nodes[node.id]["number"] = number
    by_column: dict[int, list[dict]] = {}
    for shown in nodes.values():
        by_column.setdefault(shown["column"], []).append(shown)
    type_order = "QNOHASRT"
    for column in by_column.values():
        column.sort(key=lambda n: (type_order.index(n["type"]), -n.get("score", 0.0), n["id"]))
        for row, shown in enumerate(column):
            shown["row"] = row
    return nodes, [(a, b, kind) for (a, b), kind in edges.items() if a in nodes and b in nodes]


def _shown(node: RetrievedNode) -> dict:
    return {"id": node.id, "type": node.type, "text": node.text, "via": node.via, "score": node.score,
            "sources": node.sources, "path": node.path}


def _sources(node: RetrievedNode) -> str:
    return f' <span class="source">({_escape(", ".join(node.sources))})</span>' if node.sources else ""


def _xy(node: dict) -> tuple[int, int]:
    return LEFT + node["column"] * COLUMN_WIDTH, TOP + node["row"] * ROW_HEIGHT


def _svg(nodes: dict[str, dict], edges: list[tuple[str, str, str]], index: int) -> str:
    rows = max((n["row"] for n in nodes.values()), default=0) + 1
    columns = max((n["column"] for n in nodes.values()), default=0) + 1
    width, height = LEFT + columns * COLUMN_WIDTH, TOP + rows * ROW_HEIGHT + 10
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="the subgraph question {index + 1} used">']
    for column in range(columns):
        label = "question" if column == 0 else "entry points" if column == 1 else f"step {column - 1}"
        parts.append(f'<text class="column" x="{LEFT + column * COLUMN_WIDTH - 8}" y="16">{label}</text>')
    for a, b, kind in edges:
        (x1, y1), (x2, y2) = _xy(nodes[a]), _xy(nodes[b])
        dashes = ' stroke-dasharray="5 4"' if kind in ("vector", "similarity") else ""
        parts.append(f'<line class="edge {_escape(kind)}" x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}"{dashes}>'
                     f'<title>{_escape(kind)}</title></line>')
    for node in nodes.values():
        x, y = _xy(node)
        colour = TYPE_COLOURS.get(node["type"], "#000000")
        fill = colour if node["kept"] else "#ffffff"
        label = node["text"] if len(node["text"]) <= LABEL_CHARS else node["text"][:LABEL_CHARS - 1] + "…"
        number = f'[{node["number"]}] ' if "number" in node else ""
        parts.append(
            f'<g class="node" data-id="{_escape(node["id"])}" tabindex="0">'
            f'<title>{_escape(node["text"])}</title>'
            f'<circle cx="{x}" cy="{y}" r="{9 if node["type"] == "Q" else 7}" fill="{fill}" stroke="{colour}" '
            f'stroke-width="2"/>'
            f'<text x="{x + 12}" y="{y + 4}">{_escape(number + label)}</text></g>')
    parts.append("</svg>")
    return "".join(parts)


def _section(result: Retrieval, index: int) -> str:
    nodes, edges = _layout(result)
    entities = ", ".join(_escape(e) for e in result.query_entities) or "none"
    context = "".join(
        f'<li data-id="{_escape(n.id)}"><span class="type" style="color:{TYPE_COLOURS.get(n.type, "#000")}">'
        f'{n.type}</span> <span class="via">{_escape(n.via)}</span> {_escape(n.text)}{_sources(n)}</li>'
        for n in result.nodes)
    answer = f'<p class="answer"><b>Answer:</b> {_escape(result.answer)}</p>' if result.answer else ""
    data = _script_json({"nodes": {k: {key: v[key] for key in ("id", "type", "text", "via", "sources", "path") if key in v}
                                   for k, v in nodes.items()}})
    return (f'<section id="q{index + 1}" class="question" data-index="{index}">'
            f'<h2>{index + 1}. {_escape(result.question)}</h2>'
            f'<p class="entities"><b>Question entities:</b> {entities}. '
            f'<b>Context:</b> {len(result.nodes)} nodes, {result.context_tokens} tokens.</p>{answer}'
            f'<div class="panes"><div class="graph">{_svg(nodes, edges, index)}</div>'
            f'<div class="side"><div class="details" aria-live="polite">Click a node or a context line.</div>'
            f'<h3>Context, in order</h3><ol class="context">{context}</ol></div></div>'
            f'<script type="application/json" class="data">{data}</script></section>')


_LEGEND = "".join(f'<span><svg width="14" height="14"><circle cx="7" cy="7" r="6" fill="{c}"/></svg> '
                  f'{t} {TYPE_NAMES[t]}</span>' for t, c in TYPE_COLOURS.items())

_LEGEND += "".join(f'<span><svg width="30" height="10"><line x1="0" y1="5" x2="30" y2="5" stroke="{colour}" '
                   f'stroke-width="2"{dashes}/></svg> {label}</span>'
                   for colour, dashes, label in (("#d62728", "", "name match"),
                                                 ("#1f77b4", ' stroke-dasharray="5 4"', "vector match"),
                                                 ("#999", "", "structural edge"),
                                                 ("#999", ' stroke-dasharray="5 4"', "similarity edge")))

_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:16px;color:#222}
h1{font-size:20px} h2{font-size:16px;margin-top:28px} h3{font-size:14px;margin:12px 0 4px}
.legend span{margin-right:14px;white-space:nowrap}
.panes{display:flex;gap:16px;align-items:flex-start}
.graph{overflow:auto;max-height:80vh;border:1px solid #ddd;flex:1 1 60%}
.side{flex:1 1 40%;max-height:80vh;overflow:auto}
.edge{stroke:#999;stroke-width:1.5} .edge.exact{stroke:#d62728} .edge.vector{stroke:#1f77b4}
.node{cursor:pointer} .node text{font-size:12px} .node.selected circle{stroke-width:4}
text.column{font-size:11px;fill:#777}
.context li{margin-bottom:4px;cursor:pointer} .context li.selected{background:#ffe9a8}
.type{font-weight:bold} .via{font-size:11px;color:#777} .source{color:#777;font-size:12px}
.details{background:#f6f6f6;padding:8px;border-radius:4px;white-space:pre-wrap}
"""

_SCRIPT = """
document.querySelectorAll('section.question').forEach(function (section) {
  var data = JSON.parse(section.querySelector('script.data').textContent);
  var details = section.querySelector('.details');
  function show(id) {
    var node = data.nodes[id];
    if (!node) { return; }
    section.querySelectorAll('.selected').forEach(function (e) { e.classList.remove('selected'); });
    section.querySelectorAll('[data-id="' + CSS.escape(id) + '"]').forEach(function (e) { e.classList.add('selected'); });
    var lines = [node.type + ' ' + node.id + (node.via ? ' (' + node.via + ')' : ''), node.text];
    if (node.sources && node.sources.length) { lines.push('from: ' + node.sources.join(', ')); }
    if (node.path && node.path.length > 1) { lines.push('path: ' + node.path.join(' > ')); }
    details.textContent = lines.join('\\n');
  }
  section.querySelectorAll('[data-id]').forEach(function (element) {
    element.addEventListener('click', function () { show(element.getAttribute('data-id')); });
    element.addEventListener('keydown', function (event) {
      if (event.key === 'Enter') { show(element.getAttribute('data-id')); }
    });
  });
});
"""


def render(results: list[Retrieval], title: str) -> str:
    """The page for `results` (one section per question, with a list of them when there are several)."""
    listing = "" if len(results) < 2 else "<ol>" + "".join(
        f'<li><a href="#q{i + 1}">{_escape(r.question)}</a></li>' for i, r in enumerate(results)) + "</ol>"
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; "
            "style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:\">"
            f"<title>{_escape(title)}</title><style>{_STYLE}</style></head><body>"
            f"<h1>{_escape(title)}</h1><p class=\"legend\">{_LEGEND}</p>{listing}"
            + "".join(_section(r, i) for i, r in enumerate(results))
            + f"<script>{_SCRIPT}</script></body></html>")


def write(results: list[Retrieval], target: Path, title: str) -> None:
    """The page written to `target` (`files.write_output`: a regular file replaced atomically, a
    special file written through, a link or a missing folder refused)."""
    data = render(results, title).encode("utf-8")
    write_output(target, lambda handle: handle.write(data), "--html")
