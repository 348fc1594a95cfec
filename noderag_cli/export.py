"""`noderag export`: the current build's graph as GraphML (networkx, Gephi, yEd) or as the two CSV
files of Neo4j's bulk import (`neo4j-admin database import full --nodes nodes.csv --relationships
edges.csv --multiline-fields=true`).

Both carry every node (id, type, name, text, its documents' paths, where in them it came from
(`locations`: "q3.pdf pp. 12-13", "deck.pptx slide 4", the chunks' pages, slides, sheets or
sections), community, tokens) and every edge (kind, weight, and whether the pair is also a
similarity edge). Edges are undirected in the
graph; Neo4j stores them from `source` to `target` (the smaller id first). XML 1.0 cannot hold most
control characters, so in GraphML they become U+FFFD; the CSV files keep the text as it is.
"""

from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path
from typing import BinaryIO
from xml.sax.saxutils import escape, quoteattr

import pyarrow as pa

from .errors import InputError
from .files import write_output
from .generation import Generation
from .index.chunk import place_of
from .node_types import TYPES
from .search.results import place_label

FORMATS = ("graphml", "csv")

TYPE_LABELS = {t.letter: t.label for t in TYPES}
"""The node types by the paper's names: the CSV's `:LABEL` (GraphML keeps the letter in `type`)."""

NODE_KEYS = (("type", "string"), ("label", "string"), ("name", "string"), ("text", "string"),
             ("documents", "string"), ("locations", "string"), ("community", "int"), ("tokens", "int"))
EDGE_KEYS = (("kind", "string"), ("weight", "double"), ("similarity", "boolean"))
DOCUMENT_SEPARATOR = ";"  # a node's document paths in one GraphML string; Neo4j's array delimiter

_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def _nodes(generation: Generation) -> tuple[pa.Table, list[str], list[str]]:
    """The node table, and each row's document paths and places, each joined by DOCUMENT_SEPARATOR."""
    nodes = generation.table("nodes", ["id", "type", "name", "text", "doc_ids", "community", "tokens"])
    documents = generation.table("documents", ["doc_id", "path"])
    path_of = dict(zip(documents["doc_id"].to_pylist(), documents["path"].to_pylist(), strict=True))
    paths = [DOCUMENT_SEPARATOR.join(path_of.get(d, d) for d in ids) for ids in nodes["doc_ids"].to_pylist()]
    return nodes, paths, _locations(generation, nodes.num_rows)


def _locations(generation: Generation, count: int) -> list[str]:
    """Each node's places (`search/prepare.places`) as an answer names them, joined."""
    indptr, rows = generation.array("place_indptr"), generation.array("place_rows")
    labels = [place_label({**place, **place_of(place["marks"], 0, 1 << 62)})
              for place in map(json.loads, generation.arrow("places")["place"].to_pylist())]
    return [DOCUMENT_SEPARATOR.join(dict.fromkeys(labels[r] for r in rows[a:b].tolist()))
            for a, b in zip(indptr[:-1].tolist(), indptr[1:].tolist(), strict=True)]


def _rows(table: pa.Table, columns: tuple[str, ...]):
    return zip(*(table[c].to_pylist() for c in columns), strict=True)


def _xml(text: str) -> str:
    return escape(_NOT_XML.sub("\ufffd", text))


def write_graphml(generation: Generation, path: Path) -> dict[str, int]:
    nodes, paths, places = _nodes(generation)
    edges = generation.table("edges")

    def write(handle: BinaryIO) -> None:
        with io.TextIOWrapper(handle, encoding="utf-8", newline="\n") as out:
            out.write('<?xml version="1.0" encoding="UTF-8"?>\n'
                      '<graphml xmlns="http://graphml.graphdrawing.org/xmlns" '
                      'xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance" '
                      'xsi:schemaLocation="http://graphml.graphdrawing.org/xmlns '
                      'http://graphml.graphdrawing.org/xmlns/1.0/graphml.xsd">\n')
            for domain, keys in (("node", NODE_KEYS), ("edge", EDGE_KEYS)):
                for name, kind in keys:
                    out.write(f'  <key id="{name}" for="{domain}" attr.name="{name}" attr.type="{kind}"/>\n')
            out.write('  <graph id="noderag" edgedefault="undirected">\n')
            columns = ("id", "type", "name", "text", "community", "tokens")
            for (node_id, node_type, name, text, community, tokens), documents, locations in zip(
                    _rows(nodes, columns), paths, places, strict=True):
                out.write(f"    <node id={quoteattr(node_id)}>"
                          f'<data key="type">{node_type}</data>'
                          f'<data key="label">{TYPE_LABELS.get(node_type, node_type)}</data>'
                          f'<data key="name">{_xml(name)}</data>'
                          f'<data key="text">{_xml(text)}</data>'
                          f'<data key="documents">{_xml(documents)}</data>'
                          f'<data key="locations">{_xml(locations)}</data>'
                          f'<data key="community">{community}</data>'
                          f'<data key="tokens">{tokens}</data></node>\n')
            for source, target, kind, weight, similarity in _rows(edges, ("source", "target", "kind", "weight", "hnsw")):
                out.write(f"    <edge source={quoteattr(source)} target={quoteattr(target)}>"
                          f'<data key="kind">{kind}</data><data key="weight">{weight!r}</data>'
                          f'<data key="similarity">{"true" if similarity else "false"}</data></edge>\n')
            out.write("  </graph>\n</graphml>\n")

    write_output(path, write, "--out")
    return {"nodes": nodes.num_rows, "edges": edges.num_rows}


def write_csv(generation: Generation, folder: Path) -> dict[str, int]:
    """`nodes.csv` and `edges.csv` in FOLDER (made if missing, inside an existing folder), headers in
    Neo4j's bulk-import format."""
    nodes, paths, places = _nodes(generation)
    edges = generation.table("edges")

    def write_nodes(handle: BinaryIO) -> None:
        with io.TextIOWrapper(handle, encoding="utf-8", newline="") as out:
            writer = csv.writer(out, lineterminator="\n")
            writer.writerow(["id:ID", ":LABEL", "type", "name", "text", "documents:string[]", "locations:string[]",
                             "community:int", "tokens:int"])
            columns = ("id", "type", "name", "text", "community", "tokens")
            for (node_id, node_type, name, text, community, tokens), documents, locations in zip(
                    _rows(nodes, columns), paths, places, strict=True):
                writer.writerow([node_id, TYPE_LABELS.get(node_type, node_type), node_type, name, text, documents,
                                 locations, community, tokens])

    def write_edges(handle: BinaryIO) -> None:
        with io.TextIOWrapper(handle, encoding="utf-8", newline="") as out:
            writer = csv.writer(out, lineterminator="\n")
            writer.writerow([":START_ID", ":END_ID", ":TYPE", "weight:float", "similarity:boolean"])
            for source, target, kind, weight, similarity in _rows(edges, ("source", "target", "kind", "weight", "hnsw")):
                writer.writerow([source, target, kind, repr(weight), "true" if similarity else "false"])

    if not folder.parent.is_dir():
        raise InputError(f"--out {folder}: folder {folder.parent} does not exist (outputs never create folders "
                         "but their own)")
    folder.mkdir(exist_ok=True)
    write_output(folder / "nodes.csv", write_nodes, "--out")
    write_output(folder / "edges.csv", write_edges, "--out")
    return {"nodes": nodes.num_rows, "edges": edges.num_rows}
