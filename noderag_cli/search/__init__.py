"""Graph search: entry points, shallow PPR, cross nodes and the budgeted context (retriever.py)."""


class QueryError(ValueError):
    """A question that cannot be searched (empty, too long)."""
