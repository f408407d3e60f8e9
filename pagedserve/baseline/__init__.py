"""Deliberately naive baselines ("before" pictures) behind pagedserve's own HTTP API."""
