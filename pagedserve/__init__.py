"""pagedserve: fast, practical serving of small LLMs."""

__version__ = "0.1.0"
