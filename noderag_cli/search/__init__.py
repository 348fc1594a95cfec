"""Graph search: entry points, shallow PPR, cross nodes and the budgeted context (retriever.py)."""


from ..errors import QueryError

__all__ = ["QueryError"]
